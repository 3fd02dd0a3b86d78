"""The ops as PyTorch sees them: schemas, opcheck, fake kernels, torch.compile and make_fx (all without a GPU)."""

import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.common_utils import TestCase

import torch_zipkv
from torch_zipkv import format as fmt
from torch_zipkv import ops

from conftest import page_table, random_kv, store

STORAGE_OPS = ("compress_pages", "decompress_pages", "append_kv")


class TestSchemas(TestCase):
    def test_schema_snapshot(self):
        """The schemas are public API: changing one must be deliberate (EXPECTTEST_ACCEPT=1 to update)."""
        schemas = "\n".join(str(getattr(torch.ops.zipkv, op).default._schema)
                            for op in (*STORAGE_OPS, "paged_decode", "decode_plan", "paged_prefill", "prefill_plan"))
        self.assertExpectedInline(schemas, """\
zipkv::compress_pages(Tensor kv, Tensor page_ids, bool allow_compress, Tensor(a!) data, Tensor(b!) meta, Tensor(c!) cursor) -> ()
zipkv::decompress_pages(Tensor data, Tensor meta, Tensor page_ids, Tensor(a!) out) -> ()
zipkv::append_kv(Tensor k, Tensor v, Tensor page_ids, Tensor slots, int page_size, Tensor(a!) data, Tensor meta) -> ()
zipkv::paged_decode(Tensor q, Tensor data, Tensor meta, Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, int page_size, float sm_scale, Tensor(a!) out, Tensor(b!)? lse=None, int window_left=-1, float logits_soft_cap=0.) -> ()
zipkv::decode_plan(Tensor q, Tensor meta, int nnz_pages, int page_size, int window_left=-1) -> int[]
zipkv::paged_prefill(Tensor q, Tensor qo_indptr, Tensor data, Tensor meta, Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, int page_size, float sm_scale, Tensor(a!) out, Tensor(b!)? lse=None, bool causal=True, int window_left=-1, float logits_soft_cap=0.) -> ()
zipkv::prefill_plan(Tensor q, Tensor qo_indptr, Tensor meta, int nnz_pages, int page_size, int window_left=-1) -> int[]""")


def test_cuda_kernels_registered():
    """CI builds with ZIPKV_WITH_CUDA=1 and sets ZIPKV_REQUIRE_CUDA_BUILD=1: the .cu files compiled and registered."""
    if os.environ.get("ZIPKV_REQUIRE_CUDA_BUILD") != "1":
        pytest.skip("CPU-only build allowed (set ZIPKV_REQUIRE_CUDA_BUILD=1 to require CUDA kernels)")
    for op in (*STORAGE_OPS, "paged_decode", "decode_plan", "paged_prefill", "prefill_plan"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"zipkv::{op}", "CUDA"), op


def decode_args(gen, device="cpu"):
    kv = random_kv(6, 16, 2, 64, gen)
    ckv = store(kv, raw_pages=torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.bool))
    indptr, indices, last = page_table([40, 1], 16, 6, gen)
    q = torch.randn(2, 8, 64, generator=gen).to(torch.bfloat16)
    return kv, ckv, q, indptr, indices, last


def prefill_q(gen):
    """Queries for decode_args' two requests (40 and 1 tokens): 11 and 1 query tokens."""
    return torch.randn(12, 8, 64, generator=gen).to(torch.bfloat16), torch.tensor([0, 11, 12], dtype=torch.int32)


def test_opcheck_every_op(gen):
    kv, ckv, q, indptr, indices, last = decode_args(gen)
    n = kv.shape[0]
    data, meta, cursor = torch_zipkv.empty_storage(n, 16, 2, 64)
    ids = torch.arange(n, dtype=torch.int32)
    z = torch.ops.zipkv
    torch.library.opcheck(z.compress_pages.default, (kv, ids, True, data, meta, cursor))
    out = torch.empty_like(kv)
    torch.library.opcheck(z.decompress_pages.default, (ckv.data, ckv.meta, ids, out))
    tok = kv[:2, 0, 3].contiguous()
    torch.library.opcheck(z.append_kv.default, (tok, tok, torch.tensor([1, 4], dtype=torch.int32),
                                                torch.tensor([3, 5], dtype=torch.int32), 16, ckv.data, ckv.meta))
    for lse in (None, torch.empty(2, 8)):
        torch.library.opcheck(z.paged_decode.default, (q, ckv.data, ckv.meta, indptr, indices, last, 16, 0.125,
                                                       torch.empty_like(q), lse))
    qp, qo = prefill_q(gen)
    for lse, causal in ((None, True), (torch.empty(12, 8), False)):
        torch.library.opcheck(z.paged_prefill.default, (qp, qo, ckv.data, ckv.meta, indptr, indices, last, 16, 0.125,
                                                        torch.empty_like(qp), lse, causal, 20, 0.0))


def test_compiled_decode_step_has_no_graph_breaks(gen):
    """A decode step (append this token's K/V, attend) compiles as one graph and matches eager."""
    kv, ckv, q, indptr, indices, last = decode_args(gen)
    open_page = indices[indptr[1] - 1 : indptr[1]]  # request 0's last page: 8 of 16 slots used (40 tokens)
    new_k, new_v = torch.randn(2, 1, 2, 64, generator=gen).to(torch.bfloat16)

    def step(q, new_k, new_v, data, meta, slot, last):
        ops.append_kv(new_k, new_v, open_page, slot, 16, data, meta)
        return ops.paged_decode(q, data, meta, indptr, indices, last + torch.tensor([1, 0], dtype=torch.int32), 16)

    slot = last[:1].clone()
    eager_data = ckv.data.clone()
    expected = step(q, new_k, new_v, eager_data, ckv.meta, slot, last)
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    data = ckv.data.clone()
    got = compiled(q, new_k, new_v, data, ckv.meta, slot, last)
    assert torch.equal(got, expected) and torch.equal(data, eager_data)
    assert not torch.equal(data, ckv.data)  # the append really wrote into the compiled graph's data


def test_make_fx_traces_cuda_path_without_gpu(gen):
    """Fake CUDA tensors go through the fake kernels: the CUDA path traces on a machine with no GPU."""
    with FakeTensorMode():
        q = torch.empty(4, 8, 128, dtype=torch.bfloat16, device="cuda")
        data = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        meta = torch.empty(64, 2, 2, fmt.meta_words(16, 128), dtype=torch.int32, device="cuda")
        indptr = torch.empty(5, dtype=torch.int32, device="cuda")
        indices = torch.empty(20, dtype=torch.int32, device="cuda")
        last = torch.empty(4, dtype=torch.int32, device="cuda")
        kv = torch.empty(3, 2, 16, 2, 128, dtype=torch.bfloat16, device="cuda")
        ids = torch.empty(3, dtype=torch.int32, device="cuda")
        cursor = torch.empty(2, dtype=torch.int64, device="cuda")

        def fn(q, data, meta, indptr, indices, last, kv, ids, cursor):
            ops.compress_pages(kv, ids, data, meta, cursor)
            pages = ops.decompress_pages(data, meta, ids, 16, 128)
            return ops.paged_decode(q, data, meta, indptr, indices, last, 16), pages

        gm = make_fx(fn, tracing_mode="fake")(q, data, meta, indptr, indices, last, kv, ids, cursor)
    code = gm.code
    for op in (*STORAGE_OPS[:2], "paged_decode"):
        assert f"zipkv.{op}" in code
    out_node = [n for n in gm.graph.nodes if n.op == "output"][0]
    shapes = [tuple(a.meta["val"].shape) for a in out_node.args[0]]
    assert shapes == [(4, 8, 128), (3, 2, 16, 2, 128)]


def test_fake_kernels_reject_bad_shapes_while_tracing():
    with FakeTensorMode():
        q = torch.empty(4, 8, 128, dtype=torch.bfloat16, device="cuda")
        data = torch.empty(1024, dtype=torch.uint8, device="cuda")
        meta = torch.empty(8, 2, 3, fmt.meta_words(16, 128), dtype=torch.int32, device="cuda")  # 3 kv heads
        idx = torch.empty(5, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match="q has 8 heads, not a multiple of meta's 3 kv heads"):
            make_fx(lambda q: ops.paged_decode(q, data, meta, idx, idx, idx[:4], 16), tracing_mode="fake")(q)


def odd(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t that starts 2 bytes past a 16-byte boundary (an odd slice of a larger tensor)."""
    return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)


def noncontiguous(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def bad_calls(gen):
    """(op, args, argument index, bad value) for each check the C++ ops make on shapes, dtypes, layouts and
    scalars: each call breaks one thing of otherwise good arguments (CPU tensors)."""
    kv, ckv, q, indptr, indices, last = decode_args(gen)  # q [2, 8, 64] over 2 kv heads, page 16
    data, meta = ckv.data, ckv.meta
    out, lse = torch.empty_like(q), torch.empty(2, 8)
    decode = (q, data, meta, indptr, indices, last, 16, 0.125, out, lse, -1, 0.0)
    decode_bad = [
        (10, -2), (10, 2**31), (11, -1.0), (11, float("inf")),  # window_left, logits_soft_cap
        (11, 1e-300), (11, 3e38), (11, 1e-40),  # 0 as a float32; cap * log2(e) or sm_scale / cap overflow float32
        (7, float("nan")), (7, 1e300), (7, 3e38), (7, 0.0), (7, -0.125), (7, 1e-50),  # sm_scale
        (0, q.half()), (0, q[:, 0].contiguous()), (0, noncontiguous(q)), (0, odd(q)),
        (0, q[:, :3].contiguous()), (0, torch.zeros(2, 34, 64, dtype=torch.bfloat16)),  # GQA: 3 heads, group 17
        (0, torch.zeros(2, 64, 64, dtype=torch.bfloat16)), (2, meta[:, :, :0].contiguous()),  # group 32; 0 kv heads
        (0, q[..., :32].contiguous()), (6, 24),  # head_dim, page_size
        (1, data.view(torch.int8)), (1, data[:-16].view(-1, 16)), (1, data[1:]),
        (2, meta.long()), (2, meta[..., :1].contiguous()),
        (3, indptr.long()), (3, indptr[:2]), (4, indices[None]), (5, last[:1]),
        (8, out.float()), (8, out[:, :4].contiguous()), (8, odd(out)), (9, lse.double()), (9, lse[:, :4].contiguous()),
    ]
    qp, qo = prefill_q(gen)
    out_p, lse_p = torch.empty_like(qp), torch.empty(12, 8)
    prefill = (qp, qo, data, meta, indptr, indices, last, 16, 0.125, out_p, lse_p, True, -1, 0.0)
    prefill_bad = [
        (12, -2), (13, -1.0), (8, 0.0), (8, float("nan")),  # window_left, logits_soft_cap, sm_scale
        (0, qp.half()), (0, qp[:, 0].contiguous()), (0, noncontiguous(qp)), (0, odd(qp)),
        (0, qp[:, :3].contiguous()), (0, qp[..., :32].contiguous()), (7, 24), (3, meta[:, :, :0].contiguous()),
        (1, qo.long()), (1, qo[None]), (1, qo[:0]), (1, torch.zeros(3, 2, dtype=torch.int32)[:, 0]),
        (1, qo[:2]),  # batch 1: kv_indptr has 3 entries, not 2
        (2, data.view(torch.int8)), (4, indptr.long()), (5, indices[None]), (6, last[:1]),
        (9, out_p.float()), (9, out_p[:6].contiguous()), (9, odd(out_p)), (10, lse_p.double()), (10, lse_p[:11].clone()),
    ]
    ids = torch.arange(kv.shape[0], dtype=torch.int32)
    storage = torch_zipkv.empty_storage(kv.shape[0], 16, 2, 64)
    compress = (kv, ids, True, *storage)
    compress_bad = [
        (0, kv.float()), (0, kv[:, 0]), (0, kv[:, :1].contiguous()), (0, noncontiguous(kv)),
        (0, torch.zeros(6, 2, 8, 2, 64, dtype=torch.bfloat16)), (0, torch.zeros(6, 2, 16, 2, 96, dtype=torch.bfloat16)),
        (1, ids.long()), (1, ids[:3]), (3, storage[0].view(torch.int32)), (3, storage[0][16:-16].view(-1, 16)),
        (4, storage[1][:, :, :1].contiguous()), (5, storage[2].int()), (5, torch.zeros(3, dtype=torch.int64)),
    ]
    decompress = (data, meta, ids, torch.empty_like(kv))
    decompress_bad = [(3, torch.empty_like(kv).float()), (3, torch.empty(6, 2, 64, 2, 64, dtype=torch.bfloat16)),
                      (2, ids[:2]), (1, meta[:, :, :1].contiguous())]
    tok = kv[:2, 0, 3].contiguous()
    append = (tok, tok, ids[:2], ids[:2], 16, data, meta)
    append_bad = [(0, tok.float()), (1, tok[:1]), (1, tok.float()), (4, 24), (2, ids[:1]), (3, ids[:3].long()),
                  (6, meta[..., :1].contiguous())]
    for op, args, bad in (("paged_decode", decode, decode_bad), ("paged_prefill", prefill, prefill_bad),
                          ("compress_pages", compress, compress_bad),
                          ("decompress_pages", decompress, decompress_bad), ("append_kv", append, append_bad)):
        for i, value in bad:
            yield op, args, i, value


def error_of(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the test compares whatever each side raises)
        return e
    return None


def test_fake_kernels_refuse_what_the_kernels_refuse(gen):
    """Every check the C++ ops make on shapes, dtypes, layouts and scalars, the fake kernels make too, with the
    same error and message: a graph that would fail at run time fails while it is traced."""
    for op, args, i, value in bad_calls(gen):
        args = (*args[:i], value, *args[i + 1:])
        real = error_of(lambda: getattr(torch.ops.zipkv, op)(*args))
        assert isinstance(real, (TypeError, ValueError)), (op, i, real)
        with FakeTensorMode() as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = error_of(lambda: getattr(torch.ops.zipkv, op)(*fake_args))
        assert type(fake) is type(real) and str(fake) == str(real).splitlines()[0], (op, i, real, fake)


def test_compile_refuses_a_bad_decode_while_tracing(gen):
    """torch.compile(fullgraph=True) on CPU stops at the fake kernel's check: the graph is never built or run. (Dynamo
    wraps the fake kernel's ValueError in its own RuntimeError, which quotes it.)"""
    kv, ckv, q, indptr, indices, last = decode_args(gen)
    built = []

    def backend(gm, example_inputs):
        built.append(gm)
        return gm

    def step(q):
        return ops.paged_decode(q, ckv.data, ckv.meta, indptr, indices, last, 16, window_left=20)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True)
    with pytest.raises(Exception, match=r"q's GQA group size \(num_qo_heads / num_kv_heads\) must be in \[1, 16\], "
                                        "got 17") as caught:
        compiled(torch.zeros(2, 34, 64, dtype=torch.bfloat16))
    assert not built and "ValueError(" in str(caught.value)
    assert torch.equal(compiled(q), step(q)) and len(built) == 1
