"""Bad input gets a clear error naming the argument, of the type docs/api.md (Errors) gives its kind of mistake:
TypeError for a wrong Python type or dtype, ValueError for a wrong shape, device, layout or value (contents the CPU
kernels find included), RuntimeError for a full arena. Storage is left untouched."""

import re

import pytest
import torch

import torch_zipkv
from torch_zipkv import empty_storage, ops
from torch_zipkv import format as fmt

from conftest import bits, page_table, random_kv, store


@pytest.fixture
def setup(gen):
    kv = random_kv(4, 16, 2, 64, gen)
    ckv = torch_zipkv.compress(kv)
    indptr, indices, last = page_table([20, 30], 16, 4, gen)
    q = torch.randn(2, 4, 64, generator=gen).to(torch.bfloat16)
    return kv, ckv, q, indptr, indices, last


def decode(q, ckv, indptr, indices, last, **kw):
    return torch_zipkv.paged_decode(q, ckv, indptr, indices, last, **kw)


def test_compress_rejects_bad_kv(setup):
    kv = setup[0]
    with pytest.raises(TypeError, match="compress: kv must be torch.bfloat16, got torch.float32"):
        torch_zipkv.compress(kv.float())
    with pytest.raises(ValueError, match=r"kv must be \[num_pages, 2"):
        torch_zipkv.compress(kv[:, 0])
    with pytest.raises(ValueError, match="kv must be contiguous"):
        torch_zipkv.compress(kv.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match=re.escape(f"head_dim must be one of {fmt.HEAD_DIMS}, got 96")):
        torch_zipkv.compress(torch.zeros(1, 2, 16, 1, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="page_size must be a multiple of 16"):
        torch_zipkv.compress(torch.zeros(1, 2, 8, 1, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="kv must be a torch.Tensor"):
        torch_zipkv.compress([1, 2])


def test_compress_pages_rejects_bad_ids_cursor_and_full_arena(setup):
    kv = setup[0]
    data, meta, cursor = empty_storage(4, 16, 2, 64)  # kv's pages
    ids = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"page_ids\[2\] = 9 is out of range \[0, 4\)"):
        ops.compress_pages(kv, torch.tensor([0, 1, 9, 3], dtype=torch.int32), data, meta, cursor)
    with pytest.raises(ValueError, match="page_ids holds page 1 twice"):
        ops.compress_pages(kv, torch.tensor([0, 1, 1, 3], dtype=torch.int32), data, meta, cursor)
    with pytest.raises(TypeError, match="page_ids must be torch.int32, got torch.int64"):
        ops.compress_pages(kv, ids.long(), data, meta, cursor)
    with pytest.raises(ValueError, match="page_ids must have 4 entries"):
        ops.compress_pages(kv, ids[:3], data, meta, cursor)
    with pytest.raises(ValueError, match="cursor must hold"):
        ops.compress_pages(kv, ids, data, meta, torch.tensor([100, 200]))
    with pytest.raises(ValueError, match=r"meta must have shape \[num_pages, 2, 2, 3\]"):
        ops.compress_pages(kv, ids, data, meta[..., :1].contiguous(), cursor)
    with pytest.raises(TypeError, match="data must be torch.uint8, got torch.int32"):
        ops.compress_pages(kv, ids, data.view(torch.int32), meta, cursor)
    with pytest.raises(TypeError, match="zipkv.compress_pages: allow_compress must be a bool, got str"):
        ops.compress_pages(kv, ids, data, meta, cursor, allow_compress="yes")
    small_data, meta2, small_cursor = empty_storage(4, 16, 2, 64, capacity=4096)
    with pytest.raises(RuntimeError, match="data is full"):  # a state, not a bad value: RuntimeError
        ops.compress_pages(kv, ids, small_data, meta2, small_cursor)
    fresh = empty_storage(4, 16, 2, 64, capacity=4096)[1]
    assert torch.equal(meta2, fresh) and small_cursor.tolist() == [0, 4096]  # nothing written, cursor unchanged
    assert torch.equal(meta, empty_storage(4, 16, 2, 64)[1]) and cursor[0] == 0


def test_decode_rejects_bad_page_table(setup):
    kv, ckv, q, indptr, indices, last = setup
    with pytest.raises(ValueError, match=r"kv_indices\[1\] = 4 is out of range \[0, 4\)"):
        decode(q, ckv, indptr, torch.tensor([0, 4, 1, 2], dtype=torch.int32)[: indices.numel()], last)
    with pytest.raises(ValueError, match=r"kv_indices\[0\] = -1 is out of range"):
        decode(q, ckv, indptr, torch.full_like(indices, -1), last)
    with pytest.raises(ValueError, match="kv_indptr must be non-decreasing"):
        decode(q, ckv, torch.tensor([0, 3, 2], dtype=torch.int32), indices[:2], last)
    with pytest.raises(ValueError, match=r"kv_indptr\[2\] = 5 exceeds kv_indices.numel\(\) = 4"):
        decode(q, ckv, torch.tensor([0, 2, 5], dtype=torch.int32), indices, last)
    with pytest.raises(ValueError, match=r"kv_indptr\[0\] must be 0"):
        decode(q, ckv, indptr + 1, indices, last)
    with pytest.raises(ValueError, match=r"kv_last_page_len\[1\] = 17 must be in \[1, page_size = 16\]"):
        decode(q, ckv, indptr, indices, torch.tensor([4, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_last_page_len must have 2 entries"):
        decode(q, ckv, indptr, indices, last[:1])
    with pytest.raises(TypeError, match="kv_indices must be torch.int32, got torch.int64"):
        decode(q, ckv, indptr, indices.long(), last)


def test_decode_rejects_bad_q_out_lse(setup):
    kv, ckv, q, indptr, indices, last = setup
    with pytest.raises(TypeError, match="q must be torch.bfloat16, got torch.float16"):
        decode(q.half(), ckv, indptr, indices, last)
    with pytest.raises(ValueError, match="q has 3 heads, not a multiple of meta's 2 kv heads"):
        decode(q[:, :3].contiguous(), ckv, indptr, indices, last)
    with pytest.raises(ValueError, match=r"q's GQA group size .* must be in \[1, 16\], got 17"):
        decode(torch.zeros(2, 34, 64, dtype=torch.bfloat16), ckv, indptr, indices, last)
    with pytest.raises(ValueError, match="q must be contiguous"):
        decode(q.transpose(0, 1).contiguous().transpose(0, 1), ckv, indptr, indices, last)
    with pytest.raises(ValueError, match=re.escape(f"head_dim must be one of {fmt.HEAD_DIMS}, got 32")):
        decode(q[..., :32].contiguous(), ckv, indptr, indices, last)
    with pytest.raises(ValueError, match="out must have q's shape"):
        decode(q, ckv, indptr, indices, last, out=torch.empty(2, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="lse must be"):
        decode(q, ckv, indptr, indices, last, lse=torch.empty(2, 3))
    odd = torch.empty(q.numel() + 1, dtype=torch.bfloat16)[1:].view(q.shape)  # contiguous, 2 bytes off
    with pytest.raises(ValueError, match="q must start at a 16-byte aligned address"):
        decode(odd.copy_(q), ckv, indptr, indices, last)
    with pytest.raises(ValueError, match="out must start at a 16-byte aligned address"):
        decode(q, ckv, indptr, indices, last, out=odd)
    with pytest.raises(ValueError, match="kv_indptr must be on cpu"):
        decode(q, ckv, indptr.to("meta"), indices, last)


def test_decode_plan_is_a_cuda_query(setup):
    """The CPU kernel has no launch plan: asking for one on CPU tensors names q and its device."""
    kv, ckv, q, indptr, indices, last = setup
    with pytest.raises(ValueError, match="decode_plan: q must be on a CUDA device .* got cpu"):
        torch_zipkv.decode_plan(q, ckv, indices)
    qo_indptr = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="prefill_plan: q must be on a CUDA device .* got cpu"):
        torch_zipkv.prefill_plan(q, qo_indptr, ckv, indices)
    with pytest.raises(TypeError, match="zipkv.prefill_plan: qo_indptr must be a torch.Tensor, got list"):
        torch_zipkv.prefill_plan(q, [0, 1, 2], ckv, indices)


@pytest.mark.parametrize("corrupt, message", [
    (lambda m: m[..., 0].fill_(-1), "holds no stream"),
    (lambda m: m[..., 0].fill_(10**6), "points past the end of data"),
    (lambda m: m[..., 2].fill_(0x000000FF), "has an invalid block descriptor"),
    (lambda m: m[..., 1].fill_(0x00000080), "is not a row of format version 5"),  # a version-3 row's word 1
])
def test_corrupted_meta_is_detected_everywhere(setup, corrupt, message):
    kv, ckv, q, indptr, indices, last = setup
    bad = torch_zipkv.CompressedKV(ckv.data, ckv.meta.clone(), ckv.page_size, ckv.head_dim)
    corrupt(bad.meta[2])
    with pytest.raises(ValueError, match=rf"meta\[2, K, head 0\] {message}"):
        bad.validate()
    with pytest.raises(ValueError, match=rf"zipkv.decompress_pages: meta\[2, K, head 0\] {message}"):
        torch_zipkv.decompress(bad)
    all_pages = torch.tensor([0, 4], dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        decode(q[:1], bad, all_pages[0][:2].clone(), all_pages[1], last[:1].clone().fill_(16))
    ckv.validate()  # the intact original passes


def test_append_rejects_bad_slots_and_pages(setup):
    kv = setup[0]
    ckv = store(kv, raw_pages=torch.ones(4, dtype=torch.bool))
    k = kv[:2, 0, 0].contiguous()
    ids = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"slots\[1\] = 16 is out of range \[0, 16\)"):
        ops.append_kv(k, k, ids, torch.tensor([0, 16], dtype=torch.int32), 16, ckv.data, ckv.meta)
    with pytest.raises(ValueError, match=r"page_ids\[0\] = 7 is out of range"):
        ops.append_kv(k, k, torch.tensor([7, 1], dtype=torch.int32), ids, 16, ckv.data, ckv.meta)
    with pytest.raises(ValueError, match="v must have the shape of k"):
        ops.append_kv(k, k[:1], ids, ids, 16, ckv.data, ckv.meta)
    with pytest.raises(ValueError, match="page_size must be a multiple of 16"):
        ops.append_kv(k, k, ids, ids, 24, ckv.data, ckv.meta)


def test_decode_rejects_bad_options(setup):
    kv, ckv, q, indptr, indices, last = setup
    for window_left in (-2, 2**31):
        with pytest.raises(ValueError, match=rf"window_left must be -1 \(no window\) or .* got {window_left}"):
            decode(q, ckv, indptr, indices, last, window_left=window_left)
    for cap in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="logits_soft_cap must be 0 \\(off\\) or a finite cap > 0"):
            decode(q, ckv, indptr, indices, last, logits_soft_cap=cap)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), 1e300, 3e38, 0.0, -0.125, 1e-50])
def test_decode_checks_sm_scale_as_the_float32_the_kernels_use(setup, scale):
    """sm_scale must be > 0 and finite after narrowing to float32 (1e-50 becomes 0.0f, 1e300 inf), and times log2(e)
    (the CUDA kernel's base-2 softmax: 3e38 fits float32, 3e38 * 1.44 does not). A negative or zero scale is
    refused too. Before these checks nan and 1e300 gave an all-NaN output with lse = -inf."""
    kv, ckv, q, indptr, indices, last = setup
    with pytest.raises(ValueError, match=r"zipkv.paged_decode: sm_scale must be > 0 and finite as a float32, .* got "
                                         + re.escape(f"{scale:g}")):
        decode(q, ckv, indptr, indices, last, sm_scale=scale)
    with pytest.raises(ValueError, match="sm_scale must be > 0"):  # the fake kernel makes the same check
        ops.paged_decode(*(t.to("meta") for t in (q, ckv.data, ckv.meta, indptr, indices, last)), 16, sm_scale=scale)


@pytest.mark.parametrize("scale, cap", [(0.125, 1e-300), (0.125, 1e-40), (0.125, 3e38), (1e10, 1e-30)])
def test_decode_checks_logits_soft_cap_as_the_float32_the_kernels_use(setup, scale, cap):
    """A cap that passes "> 0" as a double but is 0.0f as a float32 (1e-300) used to turn the cap silently off; one
    whose cap * log2(e) or sm_scale / cap overflows float32 (the CUDA kernel uses both) is refused too."""
    kv, ckv, q, indptr, indices, last = setup
    with pytest.raises(ValueError, match=r"zipkv.paged_decode: logits_soft_cap must be 0 \(off\) or a finite cap > 0 "
                                         r"as a float32, .* got " + re.escape(f"{cap:g}")):
        decode(q, ckv, indptr, indices, last, sm_scale=scale, logits_soft_cap=cap)
    with pytest.raises(ValueError, match="logits_soft_cap must be 0"):
        ops.paged_decode(*(t.to("meta") for t in (q, ckv.data, ckv.meta, indptr, indices, last)), 16,
                         sm_scale=scale, logits_soft_cap=cap)


def test_decode_takes_extreme_but_valid_scale_and_cap(setup):
    """The smallest positive float32 scale and a tiny cap that keeps sm_scale / cap finite are taken, and the cap
    still caps: every logit becomes +-cap, so lse <= log(tokens) + cap."""
    kv, ckv, q, indptr, indices, last = setup
    lse = torch.empty(2, 4)
    out = decode(q, ckv, indptr, indices, last, sm_scale=1.5e-45, lse=lse)
    assert out.isfinite().all()
    out = decode(q, ckv, indptr, indices, last, sm_scale=0.125, logits_soft_cap=1e-30, lse=lse)
    assert out.isfinite().all() and (lse <= torch.tensor([20.0, 30.0]).log()[:, None] + 1e-6).all()


def test_decode_refuses_a_q_without_dims_and_ints_past_int64(setup):
    """A 0-dim q is a ValueError naming q (it was an IndexError of the wrapper); an int past int64 a ValueError naming
    the argument (torch.ops said "expected int, found int"); a bool is not an int."""
    kv, ckv, q, indptr, indices, last = setup
    for q0 in (torch.tensor(1.0, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16)):
        with pytest.raises(ValueError, match=r"zipkv.paged_decode: q must have 3 dims, got shape \[(4)?\]"):
            decode(q0, ckv, indptr, indices, last)
        with pytest.raises(ValueError, match=r"zipkv.paged_decode: q must have 3 dims"):
            ops.paged_decode(q0, ckv.data, ckv.meta, indptr, indices, last, 16)
    with pytest.raises(ValueError, match=f"zipkv.paged_decode: window_left must fit in an int64, got {2**70}"):
        decode(q, ckv, indptr, indices, last, window_left=2**70)
    with pytest.raises(ValueError, match="zipkv.paged_decode: page_size must fit in an int64"):
        ops.paged_decode(q, ckv.data, ckv.meta, indptr, indices, last, -2**63 - 1)
    with pytest.raises(ValueError, match="zipkv.paged_decode: sm_scale must fit in a float64"):
        decode(q, ckv, indptr, indices, last, sm_scale=10**400)
    with pytest.raises(TypeError, match="zipkv.paged_decode: window_left must be an int, got bool"):
        decode(q, ckv, indptr, indices, last, window_left=True)
    with pytest.raises(ValueError, match="zipkv.decompress_pages: head_dim must fit in an int64"):
        ops.decompress_pages(ckv.data, ckv.meta, indices, 16, 2**64)
    with pytest.raises(ValueError, match="zipkv.decode_plan: nnz_pages must fit in an int64"):
        ops.decode_plan(q, ckv.meta, 2**63, 16)
    with pytest.raises(ValueError, match=r"decode_plan: kv_indices must have 1 dims, got shape \[\]"):
        torch_zipkv.decode_plan(q, ckv, indices[0])
    with pytest.raises(ValueError, match=r"prefill_plan: kv_indices must have 1 dims, got shape \[\]"):
        torch_zipkv.prefill_plan(q, torch.tensor([0, 1, 2], dtype=torch.int32), ckv, indices[0])
    with pytest.raises(ValueError, match="empty_storage: num_kv_heads must fit in an int64"):
        empty_storage(4, 16, 2**70, 64)
    with pytest.raises(ValueError, match=r"empty_storage: capacity \(num_pages x raw page bytes\) must fit in an "
                                         "int64"):
        empty_storage(2**60, 16, 2, 64)


def test_decompress_pages_wrapper_checks_what_it_allocates_from(setup):
    """decompress_pages allocates out from page_ids' length and the geometry given: a 0-dim page_ids, a bad page_size
    or an out of another geometry than page_size and head_dim say is a ValueError naming the argument."""
    kv, ckv = setup[:2]
    ids = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"zipkv.decompress_pages: page_ids must have 1 dims, got shape \[\]"):
        ops.decompress_pages(ckv.data, ckv.meta, ids[0], 16, 64)
    with pytest.raises(ValueError, match="zipkv.decompress_pages: page_size must be a multiple of 16"):
        ops.decompress_pages(ckv.data, ckv.meta, ids, -16, 64)
    with pytest.raises(ValueError, match=r"zipkv.decompress_pages: out must be \[n, 2, 32, num_kv_heads, 64\]"):
        ops.decompress_pages(ckv.data, ckv.meta, ids, 32, 64, out=torch.empty_like(kv))
    assert torch.equal(ops.decompress_pages(ckv.data, ckv.meta, ids, 16, 64, out=torch.empty_like(kv)), kv)


def test_decompress_pages_writes_k_and_v_apart_or_refuses_other_layouts(setup):
    """out may be the transpose(0, 1) of a contiguous [2, n, ...] buffer (every K, then every V: what a dense attention
    over the pages reads by views): the same bits land there. Any other non-contiguous out is refused, by the CPU
    kernel and, while tracing, by the fake kernel, with the same ValueError naming out."""
    kv, ckv = setup[:2]
    ids = torch.tensor([3, 0, 2], dtype=torch.int32)
    buf = torch.full((2, 3, 16, 2, 64), float("nan"), dtype=torch.bfloat16)
    ops.decompress_pages(ckv.data, ckv.meta, ids, 16, 64, out=buf.transpose(0, 1))
    assert torch.equal(bits(buf.transpose(0, 1)), bits(kv[ids.long()]))
    assert torch.equal(bits(buf[0]), bits(kv[ids.long(), 0])) and torch.equal(bits(buf[1]), bits(kv[ids.long(), 1]))
    other = torch.empty(3, 16, 2, 2, 64, dtype=torch.bfloat16).permute(0, 2, 1, 3, 4)  # K|V apart within each page
    with pytest.raises(ValueError, match=r"zipkv.decompress_pages: out must be contiguous, or the transpose\(0, 1\) "
                                         r"of a contiguous \[2, n, page_size, num_kv_heads, head_dim\] tensor") as real:
        ops.decompress_pages(ckv.data, ckv.meta, ids, 16, 64, out=other)
    with pytest.raises(ValueError) as fake:
        torch.ops.zipkv.decompress_pages(ckv.data.to("meta"), ckv.meta.to("meta"), ids.to("meta"), other.to("meta"))
    assert str(fake.value) == str(real.value).splitlines()[0]


@pytest.mark.parametrize("num_kv_heads, num_qo_heads", [(0, 4), (0, 0), (1, 17), (1, 32), (2, 64)])
def test_fake_kernel_refuses_bad_groups_without_dividing_by_zero(setup, num_kv_heads, num_qo_heads):
    """meta with 0 kv heads, or GQA groups over 16, are refused by the CPU kernel and, while tracing, by the fake
    kernel: the same ValueError naming q, never a ZeroDivisionError."""
    data = setup[1].data
    meta = torch.full((4, 2, num_kv_heads, fmt.meta_words(16, 64)), -1, dtype=torch.int32)
    q = torch.zeros(1, num_qo_heads, 64, dtype=torch.bfloat16)
    table = torch.tensor([0, 0], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    args = (q, data, meta, *table)
    with pytest.raises(ValueError, match="zipkv.paged_decode: q") as real:
        ops.paged_decode(*args, 16)
    with pytest.raises(ValueError) as fake:
        ops.paged_decode(*(t.to("meta") for t in args), 16)
    assert str(fake.value) == str(real.value).splitlines()[0]


@pytest.mark.parametrize("op", ["compress_pages", "decompress_pages"])
def test_pages_with_no_kv_heads_are_refused(op):
    """Pages of 0 KV heads hold nothing to store or rebuild: the CPU kernel and, while tracing, the fake kernel refuse
    them with the same ValueError naming the pages' argument (compress_pages took them before)."""
    data = torch.zeros(4096, dtype=torch.uint8)
    meta = torch.zeros(2, 2, 0, fmt.meta_words(16, 64), dtype=torch.int32)
    kv = torch.zeros(2, 2, 16, 0, 64, dtype=torch.bfloat16)
    ids = torch.arange(2, dtype=torch.int32)
    if op == "compress_pages":
        name, args = "kv", (kv, ids, data, meta, torch.tensor([0, 4096]))
    else:
        name, args = "out", (data, meta, ids, 16, 64)

    def call(*a):
        if op == "compress_pages":
            return ops.compress_pages(*a)
        return ops.decompress_pages(*a[:3], 16, 64, out=kv.to(a[0].device))

    with pytest.raises(ValueError, match=f"zipkv.{op}: {name} must have num_kv_heads >= 1") as real:
        call(*args)
    with pytest.raises(ValueError) as fake:
        call(*(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args))
    assert str(fake.value) == str(real.value).splitlines()[0]


def test_wrappers_reject_wrong_python_types(setup):
    """torch.ops itself raises RuntimeError for an argument of the wrong Python type; the wrappers name it in a
    TypeError first."""
    kv, ckv, q, indptr, indices, last = setup
    with pytest.raises(TypeError, match="zipkv.paged_decode: page_size must be an int, got float"):
        ops.paged_decode(q, ckv.data, ckv.meta, indptr, indices, last, 16.0)
    with pytest.raises(TypeError, match="zipkv.paged_decode: kv_indices must be a torch.Tensor, got list"):
        ops.paged_decode(q, ckv.data, ckv.meta, indptr, [0, 1], last, 16)
    with pytest.raises(TypeError, match="zipkv.paged_decode: window_left must be an int, got str"):
        ops.paged_decode(q, ckv.data, ckv.meta, indptr, indices, last, 16, window_left="all")
    with pytest.raises(TypeError, match="zipkv.decompress_pages: out must be a torch.Tensor or None, got list"):
        ops.decompress_pages(ckv.data, ckv.meta, indices, 16, 64, out=[])
    with pytest.raises(TypeError, match="zipkv.append_kv: slots must be a torch.Tensor, got int"):
        ops.append_kv(q, q, indices, 3, 16, ckv.data, ckv.meta)
    with pytest.raises(TypeError, match="paged_decode: ckv must be a CompressedKV, got tuple"):
        decode(q, (ckv.data, ckv.meta), indptr, indices, last)
    with pytest.raises(TypeError, match="decompress: ckv must be a CompressedKV, got Tensor"):
        torch_zipkv.decompress(kv)
    with pytest.raises(TypeError, match="empty_storage: head_dim must be an int, got float"):
        empty_storage(4, 16, 2, 64.0)


def test_paged_decode_options_are_keywords(setup):
    """The options after page_size are keyword-only: passed by position they are refused, not misread."""
    kv, ckv, q, indptr, indices, last = setup
    args = (q, ckv.data, ckv.meta, indptr, indices, last, 16)
    with pytest.raises(TypeError, match="positional argument"):
        ops.paged_decode(*args, 0.3)


def test_compressed_kv_checks_its_fields(setup):
    ckv = setup[1]
    with pytest.raises(TypeError, match="CompressedKV: data must be torch.uint8, got torch.int32"):
        torch_zipkv.CompressedKV(ckv.meta.flatten(), ckv.meta, 16, 64)
    with pytest.raises(TypeError, match="CompressedKV: page_size must be an int, got str"):
        torch_zipkv.CompressedKV(ckv.data, ckv.meta, "16", 64)
    with pytest.raises(TypeError, match="CompressedKV: head_dim must be an int, got bool"):  # a bool is not an int
        torch_zipkv.CompressedKV(ckv.data, ckv.meta, 16, True)
    with pytest.raises(ValueError, match=r"CompressedKV: meta must be \[num_pages, 2, num_kv_heads, 4\] for page_size "
                                         r"64 and head_dim 64"):
        torch_zipkv.CompressedKV(ckv.data, ckv.meta, 64, 64)
    with pytest.raises(ValueError, match=re.escape(f"CompressedKV: head_dim must be one of {fmt.HEAD_DIMS}, got 96")):
        torch_zipkv.CompressedKV(ckv.data, ckv.meta, 16, 96)
    with pytest.raises(ValueError, match="CompressedKV: meta must be on data's device cpu, got meta"):
        torch_zipkv.CompressedKV(ckv.data, ckv.meta.to("meta"), 16, 64)


def test_empty_storage_sizes_for_the_worst_case(setup):
    """Its default capacity holds the pages stored all raw, the most they can take."""
    kv = setup[0]
    data, meta, cursor = empty_storage(4, 16, 2, 64)
    assert data.numel() == kv.numel() * 2 and not data.any() and meta.shape == (4, 2, 2, 3)
    assert (meta[..., 0] == -1).all()  # no stream in any row (test_meta_tag checks the tag in word 1)
    assert cursor.tolist() == [0, data.numel()] and cursor.dtype == torch.int64
    ops.compress_pages(kv, torch.arange(4, dtype=torch.int32), data, meta, cursor, allow_compress=False)
    assert cursor.tolist() == [data.numel(), data.numel()]
    with pytest.raises(ValueError, match="empty_storage: num_pages must be >= 0"):
        empty_storage(-1, 16, 2, 64)
