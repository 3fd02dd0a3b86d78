"""Independent checks of a CompressedPagedKVCache, shared by test_cache.py and test_cache_stateful.py.

The oracle is what the test appended (kept on the side) and the device meta read as the format defines it, never the
cache's own bookkeeping."""

from __future__ import annotations

import math

import numpy as np
import torch

from torch_zipkv import format as fmt
from torch_zipkv import reference

from conftest import bits


def tokens(seed: int, n: int, heads: int, head_dim: int, kind: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v bf16 [n, heads, head_dim]: 0 Gaussian (compresses), 1 Gaussian with exact zeros (some blocks raw),
    2 random bit patterns (NaN, Inf, subnormals: mostly raw)."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, n, heads, head_dim)
    if kind == 2:
        x = torch.randint(-(2**15), 2**15, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)
    else:
        x = torch.randn(shape, generator=g).to(torch.bfloat16)
        if kind == 1:
            x[x.abs() < 0.05] = 0.0
    return x[0], x[1]


def check_contents(cache, kept: dict) -> None:
    """gather returns, bit for bit, what was appended: kept[(seq, layer)] = (k, v) of all tokens so far (of a
    sliding-window layer: those from kept_from on)."""
    for (sid, layer), (k, v) in kept.items():
        gk, gv = cache.gather(layer, sid)
        assert gk.shape == k.shape and torch.equal(bits(gk), bits(k)), f"K of seq {sid}, layer {layer}"
        assert torch.equal(bits(gv), bits(v)), f"V of seq {sid}, layer {layer}"
        assert cache.seq_len(layer, sid) == cache.kept_from(layer, sid) + k.shape[0]


def snapshot(cache) -> tuple:
    """Everything a refused call must leave as it was, comparable with ==: the arena's bytes, the meta rows, stats(),
    capacity(), and every running sequence's lengths and gather() bits in every layer."""
    seqs = [(s, layer, cache.seq_len(layer, s), cache.kept_from(layer, s),
             *(bits(x).cpu().numpy().tobytes() for x in cache.gather(layer, s)))
            for s in cache.seq_ids for layer in range(cache.num_layers)]
    return (cache.data.cpu().numpy().tobytes(), cache._store.meta.cpu().numpy().tobytes(), cache.stats(),
            cache.capacity(), cache.capacity(16, 16), seqs)


def live_streams(cache, kept: dict) -> list[tuple[int, int, int, int]]:
    """(start, end, layer, page) of every stream of every live page, read from the device meta."""
    meta = cache._store.meta.cpu()
    out = []
    for (sid, layer), (k, _) in kept.items():
        _, indices, _ = cache.page_table(layer, [sid])
        assert len(indices) == -(-cache.seq_len(layer, sid) // cache.page_size)
        for p in indices[cache.kept_from(layer, sid) // cache.page_size:].tolist():  # a sliding window's live pages
            rows = meta[layer, p]  # [2, H, W]
            desc = fmt.descriptors(rows, cache.page_size, cache.head_dim)
            assert (desc <= fmt.DESC_LAST).all(), f"page {p} of layer {layer} has an invalid descriptor"
            size = torch.where(desc == fmt.DESC_RAW, fmt.RAW_BLOCK_BYTES, fmt.COMP_BLOCK_BYTES).sum(-1)
            for start, n in zip(rows[..., 0].flatten().tolist(), size.flatten().tolist()):
                assert start >= 0, f"page {p} of layer {layer} has a stream missing"
                out.append((start * fmt.STREAM_ALIGN, start * fmt.STREAM_ALIGN + n, layer, p))
    return out


def check_layout(cache, kept: dict) -> list[tuple[int, int, int, int]]:
    """No two live streams overlap; each lies in data, in a chunk its layer owns; a page's streams are one run."""
    streams = sorted(set(live_streams(cache, kept)))  # a page shared by sequences (a cached prefix) is one page
    for (s0, e0, l0, p0), (s1, _, l1, p1) in zip(streams, streams[1:]):
        assert e0 <= s1, f"layer {l0} page {p0} [{s0}, {e0}) overlaps layer {l1} page {p1} at {s1}"
    arena = cache._arena
    spans: dict = {}
    for s, e, layer, p in streams:
        assert e <= cache.data.numel()
        assert arena.owner[s // cache.chunk_bytes] == layer and (e - 1) // cache.chunk_bytes == s // cache.chunk_bytes
        lo, hi, n = spans.get((layer, p), (s, e, 0))
        spans[(layer, p)] = (min(lo, s), max(hi, e), n + e - s)
    for (layer, p), (lo, hi, n) in spans.items():
        assert hi - lo == n, f"layer {layer} page {p}: streams are not contiguous"
        assert arena.offset[layer, p] == lo and arena.nbytes[layer, p] == n, "arena table disagrees with meta"
    return streams


def check_accounting(cache, kept: dict, streams) -> None:
    """stats() adds up against the meta, the chunks and what was appended; every promise can still be kept."""
    st = cache.stats()
    pages = {(layer, p) for _, _, layer, p in streams}
    assert st["stored_bytes"] == sum(e - s for s, e, _, _ in streams)
    assert st["raw_bytes"] == len(pages) * cache.page_bytes
    assert st["tokens"] == sum(k.shape[0] for k, _ in kept.values())
    assert sum(x["pages"] for x in st["layers"]) == len(pages)
    arena = cache._arena
    owned = sum(o >= 0 for o in arena.owner)
    assert owned + st["free_chunks"] == st["num_chunks"] and len(set(arena.pool)) == len(arena.pool)
    assert all(arena.owner[c] == -1 for c in arena.pool)
    for c in range(arena.num_chunks):
        if arena.owner[c] >= 0:
            assert arena.live[c] > 0, f"chunk {c} is owned but empty: it should be back in the pool"
    assert 0 <= st["fragmentation"] < 1 or owned == 0
    check_free_slots(cache)
    assert arena.pool_need() <= len(arena.pool), "the pool can no longer keep the promises"


def check_free_slots(cache) -> None:
    """The arena's free slots (a stack per slot chunk) agree with its per-slot flags and per-layer counts, and read
    as zeros, so open pages' unwritten tokens do too."""
    arena = cache._arena
    free = np.zeros_like(arena.slot_free)
    for c in range(arena.num_chunks):
        stack = arena.free_stack[c, : arena.free_top[c]]
        assert arena.kind[c] == 1 or not len(stack), f"chunk {c} holds free slots but is no slot chunk"
        assert (stack // arena.slots_per_chunk == c).all() and not free[stack].any(), f"chunk {c}'s free slots"
        free[stack] = True
        for s in stack.tolist():
            off = s * arena.page_bytes
            assert not cache.data[off: off + arena.page_bytes].any(), f"free slot at {off} is not zeroed"
    assert (free == arena.slot_free).all(), "free-slot flags disagree with the stacks"
    for layer, chunks in enumerate(arena.slot_chunks):
        assert arena.free_slot_count[layer] == sum(int(arena.free_top[c]) for c in chunks)
        assert arena.slot_chunk_count[layer] == len(chunks)
        assert arena.sole_slot_chunk[layer] == (next(iter(chunks)) if len(chunks) == 1 else -1)


def decode_reference(q: torch.Tensor, seqs: list[tuple[torch.Tensor, torch.Tensor]], page_size: int,
                     sm_scale: float | None = None) -> torch.Tensor:
    """float64 decode attention of q [B, Hq, D] over each sequence's (k, v) [L, H, D], via reference.py."""
    pages, counts, lens = [], [], []
    for k, v in seqs:
        n = -(-k.shape[0] // page_size)
        kv = torch.zeros(2, n * page_size, *k.shape[1:], dtype=torch.bfloat16)
        kv[0, : k.shape[0]], kv[1, : v.shape[0]] = k, v
        pages.append(kv.view(2, n, page_size, *k.shape[1:]).transpose(0, 1))
        counts.append(n)
        lens.append(k.shape[0])
    kv = torch.cat(pages)
    indptr = torch.tensor(np.cumsum([0] + counts), dtype=torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 if n else 0 for n in lens], dtype=torch.int32)
    indices = torch.arange(kv.shape[0], dtype=torch.int32)
    scale = sm_scale or 1 / math.sqrt(q.shape[-1])
    return reference.decode_attention(q, kv, indptr, indices, last, scale)[0]
