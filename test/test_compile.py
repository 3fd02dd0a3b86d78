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
                            for op in (*STORAGE_OPS, "paged_decode", "decode_plan"))
        self.assertExpectedInline(schemas, """\
zipkv::compress_pages(Tensor kv, Tensor page_ids, bool allow_compress, Tensor(a!) data, Tensor(b!) meta, Tensor(c!) cursor) -> ()
zipkv::decompress_pages(Tensor data, Tensor meta, Tensor page_ids, Tensor(a!) out) -> ()
zipkv::append_kv(Tensor k, Tensor v, Tensor page_ids, Tensor slots, int page_size, Tensor(a!) data, Tensor meta) -> ()
zipkv::paged_decode(Tensor q, Tensor data, Tensor meta, Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, int page_size, float sm_scale, Tensor(a!) out, Tensor(b!)? lse=None, int window_left=-1, float logits_soft_cap=0.) -> ()
zipkv::decode_plan(Tensor q, Tensor meta, int nnz_pages, int page_size, int window_left=-1) -> int[]""")


def test_cuda_kernels_registered():
    """CI builds with ZIPKV_WITH_CUDA=1 and sets ZIPKV_REQUIRE_CUDA_BUILD=1: the .cu files compiled and registered."""
    if os.environ.get("ZIPKV_REQUIRE_CUDA_BUILD") != "1":
        pytest.skip("CPU-only build allowed (set ZIPKV_REQUIRE_CUDA_BUILD=1 to require CUDA kernels)")
    for op in (*STORAGE_OPS, "paged_decode", "decode_plan"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"zipkv::{op}", "CUDA"), op


def decode_args(gen, device="cpu"):
    kv = random_kv(6, 16, 2, 64, gen)
    ckv = store(kv, raw_pages=torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.bool))
    indptr, indices, last = page_table([40, 1], 16, 6, gen)
    q = torch.randn(2, 8, 64, generator=gen).to(torch.bfloat16)
    return kv, ckv, q, indptr, indices, last


def test_opcheck_every_op(gen):
    kv, ckv, q, indptr, indices, last = decode_args(gen)
    n = kv.shape[0]
    cap = n * 2 * 2 * fmt.blocks_per_stream(16, 64) * 1024
    data = torch.zeros(cap, dtype=torch.uint8)
    meta = torch.full((n, 2, 2, fmt.meta_words(16, 64)), -1, dtype=torch.int32)
    ids = torch.arange(n, dtype=torch.int32)
    z = torch.ops.zipkv
    torch.library.opcheck(z.compress_pages.default, (kv, ids, True, data, meta, torch.tensor([0, cap])))
    out = torch.empty_like(kv)
    torch.library.opcheck(z.decompress_pages.default, (ckv.data, ckv.meta, ids, out))
    tok = kv[:2, 0, 3].contiguous()
    torch.library.opcheck(z.append_kv.default, (tok, tok, torch.tensor([1, 4], dtype=torch.int32),
                                                torch.tensor([3, 5], dtype=torch.int32), 16, ckv.data, ckv.meta))
    for lse in (None, torch.empty(2, 8)):
        torch.library.opcheck(z.paged_decode.default, (q, ckv.data, ckv.meta, indptr, indices, last, 16, 0.125,
                                                       torch.empty_like(q), lse))


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
        with pytest.raises(Exception, match="num_qo_heads must be a multiple of num_kv_heads"):
            make_fx(lambda q: ops.paged_decode(q, data, meta, idx, idx, idx[:4], 16), tracing_mode="fake")(q)
