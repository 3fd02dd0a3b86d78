"""append_kv: tokens written into open (raw) pages come back from decompress in their slots."""

import pytest
import torch

import torch_zipkv
from torch_zipkv import format as fmt
from torch_zipkv import ops

from conftest import random_kv, store


@pytest.mark.parametrize("page_size, head_dim", list(zip((16, 32, 16), fmt.HEAD_DIMS)))
def test_append_fills_open_pages_token_by_token(gen, page_size, head_dim):
    heads = 2
    kv = random_kv(3, page_size, heads, head_dim, gen)
    ckv = store(torch.zeros_like(kv), raw_pages=torch.ones(3, dtype=torch.bool))  # three open pages
    # Decode-style: one token per request per step, requests on pages 2 and 0.
    for slot in range(page_size):
        k = kv[[2, 0], 0, slot]
        v = kv[[2, 0], 1, slot]
        ids = torch.tensor([2, 0], dtype=torch.int32)
        ops.append_kv(k, v, ids, torch.full((2,), slot, dtype=torch.int32), page_size, ckv.data, ckv.meta)
    out = torch_zipkv.decompress(ckv)
    assert torch.equal(out[[0, 2]].view(torch.int16), kv[[0, 2]].view(torch.int16))
    assert torch.equal(out[1].view(torch.int16), torch.zeros_like(out[1]).view(torch.int16))


def test_append_then_compress_the_full_page(gen):
    """The cache's life cycle: append into an open page until full, then store it compressed elsewhere."""
    kv = random_kv(1, 16, 1, 64, gen)
    ckv = store(torch.zeros_like(kv), raw_pages=torch.ones(1, dtype=torch.bool))
    ids = torch.zeros(16, dtype=torch.int32)
    ops.append_kv(kv[0, 0], kv[0, 1], ids, torch.arange(16, dtype=torch.int32), 16, ckv.data, ckv.meta)
    full = torch_zipkv.decompress(ckv)
    assert torch.equal(full.view(torch.int16), kv.view(torch.int16))
    assert torch_zipkv.compress(full).compressed_block_fraction == 1.0


def test_append_into_compressed_page_is_refused_and_writes_nothing(gen):
    kv = random_kv(2, 16, 1, 64, gen)
    ckv = store(kv, raw_pages=torch.tensor([True, False]))
    before = ckv.data.clone()
    k, v = torch.randn(2, 2, 1, 64, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([0, 1], dtype=torch.int32)  # page 0 is open, page 1 compressed
    with pytest.raises(ValueError, match=r"page 1 \(page_ids\[1\]\) is compressed"):
        ops.append_kv(k, v, ids, torch.tensor([3, 3], dtype=torch.int32), 16, ckv.data, ckv.meta)
    assert torch.equal(ckv.data, before)


def test_two_tokens_for_one_slot_are_refused_and_nothing_is_written(gen):
    """Duplicate (page, slot) targets in one call would race (which token lands was unspecified): the CPU kernel
    refuses them, naming both tokens, before writing anything. The same slot of another page, or another slot of the
    same page, is fine. (The CUDA kernel cannot check without a sync: docs/api.md.)"""
    kv = random_kv(3, 16, 2, 64, gen)
    ckv = store(torch.zeros_like(kv), raw_pages=torch.ones(3, dtype=torch.bool))
    before = ckv.data.clone()
    k, v = kv[0, 0, :4], kv[0, 1, :4]
    ids = torch.tensor([2, 0, 1, 0], dtype=torch.int32)
    slots = torch.tensor([5, 5, 5, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"zipkv.append_kv: page_ids\[1\], slots\[1\] and page_ids\[3\], "
                                         r"slots\[3\] both target page 0, slot 5; each \(page, slot\) may be "
                                         r"written once per call"):
        ops.append_kv(k, v, ids, slots, 16, ckv.data, ckv.meta)
    assert torch.equal(ckv.data, before)
    slots = torch.tensor([5, 5, 5, 6], dtype=torch.int32)
    ops.append_kv(k, v, ids, slots, 16, ckv.data, ckv.meta)
    out = torch_zipkv.decompress(ckv)
    for i, (page, slot) in enumerate(zip(ids.tolist(), slots.tolist())):
        assert torch.equal(out[page, 0, slot].view(torch.int16), k[i].view(torch.int16))
        assert torch.equal(out[page, 1, slot].view(torch.int16), v[i].view(torch.int16))
