"""Bad input gets a clear error naming the argument, and leaves storage untouched."""

import pytest
import torch

import torch_zipkv
from torch_zipkv import format as fmt
from torch_zipkv import ops

from conftest import page_table, random_kv, store


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
    with pytest.raises(RuntimeError, match="kv must be BFloat16"):
        torch_zipkv.compress(kv.float())
    with pytest.raises(ValueError, match=r"kv must be \[num_pages, 2"):
        torch_zipkv.compress(kv[:, 0])
    with pytest.raises(RuntimeError, match="kv must be contiguous"):
        torch_zipkv.compress(kv.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="head_dim must be one of"):
        torch_zipkv.compress(torch.zeros(1, 2, 16, 1, 96, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="page_size must be a multiple of 16"):
        torch_zipkv.compress(torch.zeros(1, 2, 8, 1, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="kv must be a torch.Tensor"):
        torch_zipkv.compress([1, 2])


def arena(kv, capacity=None):
    n, _, P, H, D = kv.shape
    capacity = capacity or n * 2 * H * fmt.blocks_per_stream(P, D) * 1024
    return (torch.zeros(capacity, dtype=torch.uint8), torch.full((n, 2, H, fmt.meta_words(P, D)), -1,
            dtype=torch.int32), torch.tensor([0, capacity]))


def test_compress_pages_rejects_bad_ids_cursor_and_full_arena(setup):
    kv = setup[0]
    data, meta, cursor = arena(kv)
    ids = torch.arange(4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"page_ids\[2\] = 9 is out of range \[0, 4\)"):
        ops.compress_pages(kv, torch.tensor([0, 1, 9, 3], dtype=torch.int32), data, meta, cursor)
    with pytest.raises(RuntimeError, match="page_ids holds page 1 twice"):
        ops.compress_pages(kv, torch.tensor([0, 1, 1, 3], dtype=torch.int32), data, meta, cursor)
    with pytest.raises(RuntimeError, match="page_ids must be Int"):
        ops.compress_pages(kv, ids.long(), data, meta, cursor)
    with pytest.raises(RuntimeError, match="page_ids must have 4 entries"):
        ops.compress_pages(kv, ids[:3], data, meta, cursor)
    with pytest.raises(RuntimeError, match="cursor must hold"):
        ops.compress_pages(kv, ids, data, meta, torch.tensor([100, 200]))
    with pytest.raises(RuntimeError, match=r"meta must have shape \[num_pages, 2, 2, 2\]"):
        ops.compress_pages(kv, ids, data, meta[..., :1].contiguous(), cursor)
    with pytest.raises(RuntimeError, match="data must be Byte"):
        ops.compress_pages(kv, ids, data.view(torch.int32), meta, cursor)
    small_data, meta2, small_cursor = arena(kv, capacity=4096)
    with pytest.raises(RuntimeError, match="data is full"):
        ops.compress_pages(kv, ids, small_data, meta2, small_cursor)
    assert (meta2 == -1).all() and small_cursor.tolist() == [0, 4096]  # nothing written, cursor unchanged
    assert (meta == -1).all() and cursor[0] == 0


def test_decode_rejects_bad_page_table(setup):
    kv, ckv, q, indptr, indices, last = setup
    with pytest.raises(RuntimeError, match=r"kv_indices\[1\] = 4 is out of range \[0, 4\)"):
        decode(q, ckv, indptr, torch.tensor([0, 4, 1, 2], dtype=torch.int32)[: indices.numel()], last)
    with pytest.raises(RuntimeError, match=r"kv_indices\[0\] = -1 is out of range"):
        decode(q, ckv, indptr, torch.full_like(indices, -1), last)
    with pytest.raises(RuntimeError, match="kv_indptr must be non-decreasing"):
        decode(q, ckv, torch.tensor([0, 3, 2], dtype=torch.int32), indices[:2], last)
    with pytest.raises(RuntimeError, match=r"kv_indptr\[2\] = 5 must equal kv_indices.numel\(\)"):
        decode(q, ckv, torch.tensor([0, 2, 5], dtype=torch.int32), indices, last)
    with pytest.raises(RuntimeError, match=r"kv_indptr\[0\] must be 0"):
        decode(q, ckv, indptr + 1, indices, last)
    with pytest.raises(RuntimeError, match=r"kv_last_page_len\[1\] = 17 must be in \[1, page_size = 16\]"):
        decode(q, ckv, indptr, indices, torch.tensor([4, 17], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="kv_last_page_len must have 2 entries"):
        decode(q, ckv, indptr, indices, last[:1])
    with pytest.raises(RuntimeError, match="kv_indices must be Int"):
        decode(q, ckv, indptr, indices.long(), last)


def test_decode_rejects_bad_q_out_lse(setup):
    kv, ckv, q, indptr, indices, last = setup
    with pytest.raises(RuntimeError, match="q must be BFloat16"):
        decode(q.half(), ckv, indptr, indices, last)
    with pytest.raises(RuntimeError, match="q has 3 heads, not a multiple of meta's 2 kv heads"):
        decode(q[:, :3].contiguous(), ckv, indptr, indices, last)
    with pytest.raises(RuntimeError, match=r"GQA group size .* must be in \[1, 16\], got 17"):
        decode(torch.zeros(2, 34, 64, dtype=torch.bfloat16), ckv, indptr, indices, last)
    with pytest.raises(RuntimeError, match="q must be contiguous"):
        decode(q.transpose(0, 1).contiguous().transpose(0, 1), ckv, indptr, indices, last)
    with pytest.raises(RuntimeError, match="head_dim must be 64, 128 or 256, got 32"):
        decode(q[..., :32].contiguous(), ckv, indptr, indices, last)
    with pytest.raises(RuntimeError, match="out must have q's shape"):
        decode(q, ckv, indptr, indices, last, out=torch.empty(2, 4, 32, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="lse must be"):
        decode(q, ckv, indptr, indices, last, lse=torch.empty(2, 3))
    odd = torch.empty(q.numel() + 1, dtype=torch.bfloat16)[1:].view(q.shape)  # contiguous, 2 bytes off
    with pytest.raises(RuntimeError, match="q must start at a 16-byte aligned address"):
        decode(odd.copy_(q), ckv, indptr, indices, last)
    with pytest.raises(RuntimeError, match="out must start at a 16-byte aligned address"):
        decode(q, ckv, indptr, indices, last, out=odd)
    with pytest.raises(RuntimeError, match="kv_indptr must be on cpu"):
        decode(q, ckv, indptr.to("meta"), indices, last)


def test_decode_plan_is_a_cuda_query(setup):
    """The CPU kernel has no launch plan: asking for one on CPU tensors names q and its device."""
    kv, ckv, q, indptr, indices, last = setup
    with pytest.raises(ValueError, match="decode_plan: q must be on a CUDA device .* got cpu"):
        torch_zipkv.decode_plan(q, ckv, indices)


@pytest.mark.parametrize("corrupt, message", [
    (lambda m: m[..., 0].fill_(-1), "holds no stream"),
    (lambda m: m[..., 0].fill_(10**6), "points past the end of data"),
    (lambda m: m[..., 1].fill_(0x000000FF), "has an invalid block descriptor"),
])
def test_corrupted_meta_is_detected_everywhere(setup, corrupt, message):
    kv, ckv, q, indptr, indices, last = setup
    bad = torch_zipkv.CompressedKV(ckv.data, ckv.meta.clone(), ckv.page_size, ckv.head_dim)
    corrupt(bad.meta[2])
    with pytest.raises(ValueError, match=rf"meta\[2, K, head 0\] {message}"):
        bad.validate()
    with pytest.raises(RuntimeError, match=rf"meta\[2, K, head 0\] {message}"):
        torch_zipkv.decompress(bad)
    all_pages = torch.tensor([0, 4], dtype=torch.int32), torch.arange(4, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=message):
        decode(q[:1], bad, all_pages[0][:2].clone(), all_pages[1], last[:1].clone().fill_(16))
    ckv.validate()  # the intact original passes


def test_append_rejects_bad_slots_and_pages(setup):
    kv = setup[0]
    ckv = store(kv, raw_pages=torch.ones(4, dtype=torch.bool))
    k = kv[:2, 0, 0].contiguous()
    ids = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"slots\[1\] = 16 is out of range \[0, 16\)"):
        ops.append_kv(k, k, ids, torch.tensor([0, 16], dtype=torch.int32), 16, ckv.data, ckv.meta)
    with pytest.raises(RuntimeError, match=r"page_ids\[0\] = 7 is out of range"):
        ops.append_kv(k, k, torch.tensor([7, 1], dtype=torch.int32), ids, 16, ckv.data, ckv.meta)
    with pytest.raises(RuntimeError, match="v must have the shape of k"):
        ops.append_kv(k, k[:1], ids, ids, 16, ckv.data, ckv.meta)
    with pytest.raises(RuntimeError, match="page_size must be a multiple of 16"):
        ops.append_kv(k, k, ids, ids, 24, ckv.data, ckv.meta)
