"""CompressedPagedKVCache on CPU: decode vs the float64 reference, real KV, errors, full cache, in-place compression,
compaction, and admission by capacity(). Random interleavings of all of these: test_cache_stateful.py."""

import math

import numpy as np
import pytest
import torch

import torch_zipkv
from torch_zipkv import CacheFullError, CompressedPagedKVCache, compression_rounds, ops
from torch_zipkv import format as fmt
from torch_zipkv.arena import Arena
from torch_zipkv.upload import Uploader

from cache_oracle import (check_accounting, check_contents, check_layout, decode_reference, live_streams,
                          snapshot, tokens)
from conftest import bits, rel_err, requires_cuda

H, D, P = 2, 64, 16
PAGE_BYTES = fmt.raw_page_bytes(P, H, D)


def make(layers=2, chunks=16, chunk_pages=4, max_pages=256, device="cpu", **kw):
    """A cache of exactly ``chunks`` chunks of ``chunk_pages`` raw pages each."""
    id_bytes = layers * 2 * H * fmt.meta_words(P, D) * 4
    cache = CompressedPagedKVCache(layers, H, D, page_size=P, device=device, chunk_bytes=chunk_pages * PAGE_BYTES,
                                   max_bytes=chunks * chunk_pages * PAGE_BYTES + max_pages * id_bytes,
                                   max_pages=max_pages, **kw)
    assert cache._arena.num_chunks == chunks
    return cache


def fill(cache, kept, layer, sid, n, seed, kind=0):
    k, v = tokens(seed, n, cache.num_kv_heads, cache.head_dim, kind)
    cache.append(layer, sid, k, v)
    old = kept.get((sid, layer))
    kept[(sid, layer)] = (k, v) if old is None else (torch.cat([old[0], k]), torch.cat([old[1], v]))


def append_step(cache, kept, layer, sids, seed):
    """One decode token for each of ``sids`` in ``layer`` (cache.append), recorded in ``kept``."""
    k, v = tokens(seed, len(sids), H, D)
    cache.append(layer, sids, k, v)
    for b, sid in enumerate(sids):
        old = kept[(sid, layer)]
        kept[(sid, layer)] = (torch.cat([old[0], k[b: b + 1]]), torch.cat([old[1], v[b: b + 1]]))


def check_all(cache, kept):
    check_contents(cache, kept)
    check_accounting(cache, kept, check_layout(cache, kept))


def test_prefill_and_decode_steps_match_float64_reference(gen):
    """Several sequences, GQA group 3, prefill then decode steps with compression between steps: every step's
    attention (mixing compressed pages, full raw pages and open pages) matches float64 attention."""
    cache = make(layers=2, chunks=32)
    lens = [1, 16, 37, 70]
    sids = [cache.add_sequence(n, 20) for n in lens]
    kept = {}
    for layer in range(2):
        for i, (sid, n) in enumerate(zip(sids, lens)):
            fill(cache, kept, layer, sid, n, seed=100 * layer + i)
    compressed = 0
    for step in range(20):
        for layer in range(2):
            append_step(cache, kept, layer, sids, seed=1000 + 10 * step + layer)
            q = torch.randn(len(sids), 3 * H, D, generator=gen).bfloat16()
            lse = torch.empty(len(sids), 3 * H)
            out = cache.decode(layer, q, sids, lse=lse)
            ref = decode_reference(q, [kept[(s, layer)] for s in sids], P)
            assert rel_err(out, ref) < 1e-2, f"step {step}, layer {layer}"
        if step % 3 == 2:
            compressed += cache.compress_full_pages()
    assert compressed > 8
    st = cache.stats()
    assert 0.74 < st["ratio"] < 0.9  # Gaussian data: nearly every block compresses, open pages stay raw
    check_all(cache, kept)


def test_sliding_window_layer_attends_to_and_keeps_only_its_window(gen):
    """Layer 1 slides over 20 tokens, layer 0 attends to all: every step's decode of layer 1 matches float64
    attention over the last 20 tokens; between steps its pages wholly before the window are freed (fewer pages than
    layer 0, bytes back to the arena, their meta rows cleared), gather returns the kept tail bit for bit, the
    accounting adds up, and freeing the sequences returns every chunk."""
    W = 20
    cache = make(layers=2, chunks=32, sliding_window=[None, W])
    lens = [5, 37, 70]
    sids = [cache.add_sequence(n, 30) for n in lens]
    kept = {}
    for layer in range(2):
        for i, (sid, n) in enumerate(zip(sids, lens)):
            fill(cache, kept, layer, sid, n, seed=10 * layer + i)
    for step in range(30):
        for layer in range(2):
            append_step(cache, kept, layer, sids, seed=500 + 10 * step + layer)
            q = torch.randn(len(sids), 2 * H, D, generator=gen).bfloat16()
            out = cache.decode(layer, q, sids)
            seen = [kept[(s, layer)] for s in sids]
            if layer == 1:
                seen = [(k[-W:], v[-W:]) for k, v in seen]
            assert rel_err(out, decode_reference(q, seen, P)) < 1e-2, f"step {step}, layer {layer}"
        if step % 4 == 3:
            cache.compress_full_pages()
            for sid in sids:  # layer 1 keeps the tail from its first live page on
                k, v = kept[(sid, 1)]
                first = cache.kept_from(1, sid) - (cache.seq_len(1, sid) - k.shape[0])
                kept[(sid, 1)] = (k[first:], v[first:])
    for sid, n in zip(sids, lens):
        assert cache.kept_from(0, sid) == 0
        assert cache.kept_from(1, sid) == max(0, n + 28 - W) // P * P  # freed at the last compression (step 27)
    st = cache.stats()
    full, slid = st["layers"][0], st["layers"][1]
    assert slid["pages"] == sum(-(-(n + 30) // P) - max(0, n + 28 - W) // P for n in lens) < full["pages"]
    assert slid["stored_bytes"] < full["stored_bytes"] and slid["tokens"] < full["tokens"]
    check_all(cache, kept)
    for sid in sids:
        dropped = cache.page_table(1, [sid])[1][: cache.kept_from(1, sid) // P].long()
        assert (cache.meta(1)[dropped] == fmt.NO_STREAM).all() and (cache.meta(0)[dropped][..., 0] >= 0).all()
        cache.free_sequence(sid)
    assert cache.stats()["free_chunks"] == 32


def test_sliding_window_argument_is_checked():
    with pytest.raises(ValueError, match="sliding_window must be"):
        make(layers=2, sliding_window=[None])
    with pytest.raises(ValueError, match="sliding_window must be"):
        make(layers=2, sliding_window=0)
    with pytest.raises(TypeError, match="sliding_window must be .* got an entry float 2.5"):
        make(layers=2, sliding_window=[None, 2.5])
    with pytest.raises(TypeError, match="sliding_window must be .* got float"):
        make(layers=2, sliding_window=8.0)
    with pytest.raises(TypeError, match="sliding_window must be .* got bool True"):  # not a window of 1
        make(layers=2, sliding_window=True)
    with pytest.raises(TypeError, match="sliding_window must be .* got an entry bool False"):
        make(layers=2, sliding_window=[None, False])
    assert make(layers=3, sliding_window=8).sliding_window == [8, 8, 8]
    assert make(layers=2, sliding_window=[np.int64(8), None]).sliding_window == [8, None]


def test_page_table_drives_paged_decode_and_sm_scale(gen):
    cache = make()
    a, b = cache.add_sequence(), cache.add_sequence()
    kept = {}
    fill(cache, kept, 1, a, 50, 1)
    fill(cache, kept, 1, b, 16, 2)
    cache.compress_full_pages()
    indptr, indices, last = cache.page_table(1, [b, a])
    assert indptr.tolist() == [0, 1, 5] and last.tolist() == [16, 2] and indices.dtype == torch.int32
    q = torch.randn(2, 2, D, generator=gen).bfloat16()
    out = ops.paged_decode(q, cache.data, cache.meta(1), indptr, indices, last, P, sm_scale=0.3)
    assert torch.equal(bits(out), bits(cache.decode(1, q, [b, a], sm_scale=0.3)))
    ref = decode_reference(q, [kept[(b, 1)], kept[(a, 1)]], P, sm_scale=0.3)
    assert rel_err(out, ref) < 1e-2
    # Layer 0 holds nothing yet: no pages, and decode gives zeros (paged_decode's rule for empty requests).
    assert cache.page_table(0, [a])[1].numel() == 0
    assert torch.equal(cache.decode(0, q[:1], [a]), torch.zeros_like(q[:1]))


def test_real_kv_stored_bytes_match_compress(real_kv):
    """SmolLM2's KV through the cache: stored bytes equal torch_zipkv.compress on the same pages exactly (same
    encoder, every page full), so the cache keeps the ratio the format measures (~0.79); contents come back exact."""
    layers = [0, real_kv.shape[0] // 2, real_kv.shape[0] - 1]
    kv = real_kv[layers, :64]  # [3, 64 pages, 2, 16, 3, 64]: 1024 tokens per layer
    n, heads, head_dim = kv.shape[1], kv.shape[4], kv.shape[5]
    page_bytes = 2 * P * heads * head_dim * 2
    cache = CompressedPagedKVCache(3, heads, head_dim, device="cpu", max_bytes=3 * n * page_bytes + (4 << 20),
                                   chunk_bytes=16 * page_bytes)
    sid = cache.add_sequence(n * P)
    kept = {}
    for layer in range(3):
        k, v = (kv[layer, :, i].reshape(n * P, heads, head_dim) for i in (0, 1))
        for at in range(0, n * P, 300):  # prefill in chunks that straddle pages
            cache.append(layer, sid, k[at: at + 300], v[at: at + 300])
        kept[(sid, layer)] = (k, v)
    assert cache.compress_full_pages() == 3 * n
    st = cache.stats()
    for layer in range(3):
        ckv = torch_zipkv.compress(kv[layer])
        assert st["layers"][layer]["stored_bytes"] == ckv.data.numel()
    assert 0.76 < st["ratio"] < 0.82
    check_all(cache, kept)
    q = kv[1, :1, 0, 5].repeat_interleave(3, dim=1).contiguous()  # real queries: K rows, GQA group 3
    out = cache.decode(2, q, [sid])
    assert rel_err(out, decode_reference(q, [kept[(sid, 2)]], P)) < 1e-2


def test_bad_arguments_raise_clear_errors():
    cache = make()
    sid = cache.add_sequence()
    k, v = tokens(0, 3, H, D)
    with pytest.raises(TypeError, match="k must be bfloat16"):
        cache.append(0, sid, k.float(), v)
    with pytest.raises(TypeError, match="v must be a torch.Tensor"):
        cache.append(0, sid, k, v.tolist())
    with pytest.raises(ValueError, match=r"k must be \[n, 2, 64\]"):
        cache.append(0, sid, k[:, :1], v)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        cache.append(0, sid, k, v[:2])
    with pytest.raises(ValueError, match="k must be on cpu, got meta"):
        cache.append(0, sid, k.to("meta"), v)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        cache.append(2, sid, k, v)
    with pytest.raises(TypeError, match=r"layer must be an int in \[0, 2\), got float"):
        cache.append(1.0, sid, k, v)
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        cache.meta(2)
    with pytest.raises(TypeError, match="seq_id must be an int, got str"):
        cache.append(0, "a", k, v)
    with pytest.raises(ValueError, match="seq_id 99 is not a running sequence"):
        cache.append(0, 99, k, v)
    other = cache.add_sequence()
    with pytest.raises(ValueError, match="seq_ids has 2 ids for 3 tokens"):
        cache.append(0, [sid, other], k, v)
    with pytest.raises(ValueError, match="seq_ids repeats a sequence"):
        cache.append(0, [sid, other, sid], k, v)
    with pytest.raises(ValueError, match=r"q must be bf16 \[batch, k \* 2, 64\]"):
        cache.decode(0, torch.zeros(1, 3, D, dtype=torch.bfloat16), [sid])
    with pytest.raises(TypeError, match="q must be bfloat16, got torch.float32"):
        cache.decode(0, torch.zeros(1, 2, D), [sid])
    with pytest.raises(ValueError, match="q has 2 rows for 1 sequences"):
        cache.decode(0, torch.zeros(2, 2, D, dtype=torch.bfloat16), [sid])
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 0"):
        cache.add_sequence(4, -1)
    with pytest.raises(TypeError, match="prompt_len must be an int >= 0, got float"):
        cache.add_sequence(4.0)
    with pytest.raises(ValueError, match="reserve must be an int >= 0"):
        cache.capacity(reserve=-1)
    with pytest.raises(TypeError, match="num_layers must be an int >= 1, got float"):
        CompressedPagedKVCache(2.0, H, D, device="cpu", max_bytes=1 << 20)
    with pytest.raises(TypeError, match="max_bytes must be an int >= 1, got float"):
        CompressedPagedKVCache(1, H, D, device="cpu", max_bytes=1e6)
    with pytest.raises(ValueError, match="max_pages must be an int >= 1, got 0"):
        CompressedPagedKVCache(1, H, D, device="cpu", max_bytes=1 << 20, max_pages=0)
    with pytest.raises(ValueError, match="exactly one of max_bytes and memory_fraction"):
        CompressedPagedKVCache(1, H, D, device="cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        CompressedPagedKVCache(1, H, D, device="cpu", memory_fraction=0.5)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        CompressedPagedKVCache(1, H, 96, device="cpu", max_bytes=1 << 20)
    with pytest.raises(ValueError, match="chunk_bytes must be None or an int >= 1, got -5"):
        CompressedPagedKVCache(1, H, D, device="cpu", max_bytes=1 << 20, chunk_bytes=-5)
    with pytest.raises(TypeError, match="memory_fraction must be a float, got str"):
        CompressedPagedKVCache(1, H, D, device="cpu", memory_fraction="0.5")
    with pytest.raises(ValueError, match="prompt_len must be an int >= 0, got -5"):
        cache.capacity(-5, 0)
    with pytest.raises(TypeError, match="prompt_len must be an int >= 0, got bool"):  # bools are not ints here
        cache.add_sequence(True)
    with pytest.raises(TypeError, match="seq_id must be an int, got bool"):
        cache.seq_len(0, True)
    with pytest.raises(TypeError, match="layer must be an int in .* got bool"):
        cache.meta(True)
    step = cache.prepare_step([sid])
    for bad in (-1, 2):  # not Python's negative indexing: -1 would be the last layer
        with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\), got " + str(bad)):
            cache.step_append(bad, step, *tokens(0, 1, H, D))
        with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
            cache.step_decode(bad, step, torch.zeros(1, 2, D, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="seq_id 99 is not a running sequence"):
        cache.free_sequence(99)
    numpy_id = cache.add_sequence(np.int64(5), np.int32(3))  # numpy ints are ints
    assert cache.capacity(np.int64(5)).requests > 0 and cache.seq_len(np.int64(1), numpy_id) == 0
    cache.free_sequence(np.int64(numpy_id))
    cache.free_sequence(sid)
    with pytest.raises(ValueError, match="is not a running sequence"):
        cache.gather(0, sid)
    assert cache.seq_ids == [other]


def test_byte_budget_holds_arena_and_meta():
    for max_bytes in (1 << 20, 3 << 20, 10 << 20):
        cache = CompressedPagedKVCache(4, H, D, device="cpu", max_bytes=max_bytes, chunk_bytes=64 << 10)
        used = cache.data.numel() + cache.stats()["meta_bytes"]
        assert max_bytes - cache.chunk_bytes - cache._store.meta[:, 0].numel() * 4 < used <= max_bytes
        # Enough page ids for an arena of all-compressed pages spread over the layers.
        assert cache._store.meta.shape[1] * 4 * 3 / 4 * cache.page_bytes >= cache.data.numel()


@pytest.mark.parametrize("layers, heads, head_dim, batch, length", [(2, H, D, 3, 100), (3, H, D, 1, 1),
                                                                     (1, 8, 128, 4, 1100)])
def test_raw_sizing_holds_its_batch_raw_with_two_chunks_per_layer_to_spare(layers, heads, head_dim, batch, length):
    """A cache sized by raw_sizing(batch_size, max_length) spends its whole byte budget. Every layer holds batch_size
    sequences of max_length tokens stored raw (with budgets or without), and on top of their pages, in whole chunks,
    two chunks per layer; batch_size page ids are spare, and no more. The last case has more pages than fit the
    default 4 MiB chunks four times over."""
    sizing = CompressedPagedKVCache.raw_sizing(layers, heads, head_dim, batch_size=batch, max_length=length,
                                               page_size=P)
    cache = CompressedPagedKVCache(layers, heads, head_dim, page_size=P, device="cpu", **sizing)
    assert cache.data.numel() + cache.stats()["meta_bytes"] == sizing["max_bytes"]
    pages, per_chunk = batch * -(-length // P), cache.chunk_bytes // cache.page_bytes
    assert per_chunk == min((4 << 20) // cache.page_bytes, -(-pages // 4))
    assert cache.stats()["num_chunks"] == layers * (-(-pages // per_chunk) + 2)
    assert pages <= cache.capacity().pages <= pages + batch
    for budget in (length, 0):
        sids = [cache.add_sequence(budget) for _ in range(batch)]
        if budget:
            assert cache.capacity().pages <= batch  # the spare page ids
        for layer in range(layers):
            for sid in sids:
                cache.append(layer, sid, *tokens(sid, length, heads, head_dim))
        assert cache.stats()["raw_bytes"] == cache.stats()["stored_bytes"] == layers * pages * cache.page_bytes
        for sid in sids:
            cache.free_sequence(sid)
    with pytest.raises(ValueError, match="max_length must be an int >= 1"):
        CompressedPagedKVCache.raw_sizing(layers, heads, head_dim, batch_size=batch, max_length=0)


def check_capacity_is_kept_and_tight(cache, kept, reserve=0):
    """capacity().pages = n: a sequence of n pages can be admitted and filled in every layer, after which every
    running sequence can still grow by ``reserve`` tokens in every layer; a sequence of n + 1 pages is refused.
    requests: that many add_sequence calls succeed, one more fails. Undoes what it adds."""
    n = cache.capacity(reserve=reserve).pages
    if not reserve:
        with pytest.raises(CacheFullError):
            cache.add_sequence((n + 1) * P)
    probe = cache.add_sequence(n * P)
    probe_kept = {}
    running = [s for s, _ in kept if s != probe]
    for layer in range(cache.num_layers):
        fill(cache, probe_kept, layer, probe, n * P, layer)
        for sid in set(running):
            if reserve:
                fill(cache, kept, layer, sid, reserve, 7 * sid + layer)
    cache.free_sequence(probe)
    cap = cache.capacity(40, 9)  # 4 pages per request
    assert cap.requests == cap.pages // 4
    sids = [cache.add_sequence(40, 9) for _ in range(cap.requests)]
    with pytest.raises(CacheFullError):
        cache.add_sequence(40, 9)
    for sid in sids:
        cache.free_sequence(sid)


def test_capacity_counts_raw_pages_keeps_promises_and_is_tight():
    cache = make(layers=3, chunks=10, chunk_pages=4)  # 10 chunks over 3 layers: 3 chunks of 4 pages each
    assert cache.capacity(30, 2) == torch_zipkv.Capacity(pages=12, tokens=192, requests=6)
    kept = {}
    check_capacity_is_kept_and_tight(cache, kept)
    sid = cache.add_sequence(40, 0)  # promises 3 pages in every layer
    assert cache.capacity().pages == 9
    fill(cache, kept, 0, sid, 40, 0)  # uses layer 0's promise: nothing changes
    assert cache.capacity().pages == 9
    check_capacity_is_kept_and_tight(cache, kept)
    other = cache.add_sequence()
    fill(cache, kept, 1, other, 17, 1)  # 2 pages beyond any promise, in layer 1 only
    for reserve in (0, 20, 49):
        check_capacity_is_kept_and_tight(cache, kept, reserve)
    assert cache.capacity(reserve=1000).pages == 0
    check_all(cache, kept)
    cache.free_sequence(sid)
    cache.free_sequence(other)
    assert cache.capacity().pages == 12


def test_full_cache_error_is_recoverable_and_freed_room_serves_any_layer():
    cache = make(layers=2, chunks=6, chunk_pages=2)
    kept = {}
    a = cache.add_sequence()
    fill(cache, kept, 0, a, 6 * 2 * P, 0)  # every chunk, all in layer 0
    assert cache.stats()["free_chunks"] == 0
    b = cache.add_sequence()
    before = cache.stats()
    with pytest.raises(CacheFullError, match=r"append to layer 1: needs 1 new raw pages.*only 0 can be taken") as e:
        cache.append(1, b, *tokens(1, 1, H, D))
    assert (e.value.requested, e.value.free, e.value.unit) == (1, 0, "pages") and isinstance(e.value, RuntimeError)
    with pytest.raises(CacheFullError, match="a budget of 16 tokens needs 1 raw pages in every layer"):
        cache.add_sequence(16)
    assert cache.stats() == before
    check_all(cache, kept | {(b, 1): (torch.empty(0, H, D, dtype=torch.bfloat16),) * 2})
    cache.free_sequence(a)
    kept = {}
    fill(cache, kept, 1, b, 6 * 2 * P, 2)  # layer 1 now takes every chunk
    check_all(cache, kept)


def test_compression_takes_a_promised_chunk_that_the_slots_it_frees_pay_back(gen):
    """Promises hold every pool chunk, but the 4 full pages of a full slot chunk compress into one packed chunk and
    free their 4 slots, which keep the promises the chunk served: the compression takes it, the slot chunk goes back
    to the pool, and the promised sequence still fills its whole budget."""
    cache = make(layers=1, chunks=3, chunk_pages=4)
    kept = {}
    a = cache.add_sequence(4 * P)
    fill(cache, kept, 0, a, 4 * P, 0)  # one slot chunk, full
    hog = cache.add_sequence(8 * P)  # promises the other two chunks
    assert cache.stats()["free_chunks"] == 2 and cache.capacity().pages == 0
    assert cache.compress_full_pages() == 4
    layer = cache.stats()["layers"][0]
    assert layer["packed_chunks"] == 1 and layer["slot_chunks"] == 0 and cache.stats()["free_chunks"] == 2
    assert cache.capacity().pages == 0
    fill(cache, kept, 0, hog, 8 * P, 1)  # the promise holds: its 8 pages fit
    check_all(cache, kept)


def test_compression_in_place_when_no_packed_room_then_compaction_packs(gen):
    """Promises hold every pool chunk and the 3 pages that compress free too few slots to pay a chunk back (4 a
    chunk): they are compressed inside their own slots (meta rows rewritten there); once room frees up, compact()
    moves them into a packed chunk and the slots' chunk goes back to the pool."""
    cache = make(layers=1, chunks=3, chunk_pages=4)
    kept = {}
    a = cache.add_sequence(4 * P)
    fill(cache, kept, 0, a, 3 * P, 0)  # 3 full pages in a slot chunk
    hog = cache.add_sequence(8 * P)  # promises the other two chunks
    assert cache.stats()["free_chunks"] == 2 and cache.capacity().pages == 0
    assert cache.compress_full_pages() == 3
    layer = cache.stats()["layers"][0]
    assert layer["packed_chunks"] == 0 and layer["slot_chunks"] == 1 and layer["stored_bytes"] < 3 * PAGE_BYTES
    check_all(cache, kept)
    q = torch.randn(1, H, D, generator=gen).bfloat16()
    assert rel_err(cache.decode(0, q, [a]), decode_reference(q, [kept[(a, 0)]], P)) < 1e-2
    cache.free_sequence(hog)
    assert cache.compact() == layer["stored_bytes"]
    layer = cache.stats()["layers"][0]
    assert layer["packed_chunks"] == 1 and layer["slot_chunks"] == 0 and cache.stats()["free_chunks"] == 2
    check_all(cache, kept)


def fragmented(chunks: int, tokens) -> tuple:
    """A 2-layer cache of ``chunks`` chunks after 4 rounds of ``tokens(i)`` tokens for each of 8 sequences, compressed
    each round (so each packed chunk holds pages of several), then every other sequence freed; with its ``kept``."""
    cache = make(layers=2, chunks=chunks, chunk_pages=4)
    kept = {}
    sids = [cache.add_sequence() for _ in range(8)]
    for rnd in range(4):
        for layer in range(2):
            for i, sid in enumerate(sids):
                fill(cache, kept, layer, sid, tokens(i), 100 * rnd + 10 * layer + i)
        cache.compress_full_pages()
    for sid in sids[::2]:
        cache.free_sequence(sid)
        for layer in range(2):
            del kept[(sid, layer)]
    return cache, kept


@pytest.mark.parametrize("merged", [True, False])
def test_compaction_gathers_scattered_free_room_into_whole_chunks(merged, monkeypatch):
    """Also with the arena's batches of moves merged into one copy (the default; compaction here moves some pages
    twice, so the copy must take each from where it was to where it ends) against one copy per batch."""
    if not merged:
        monkeypatch.setattr(torch_zipkv.cache, "MOVE_BYTES", 1)
    cache, kept = fragmented(chunks=24, tokens=lambda i: P + 5 * (i % 3))
    before = cache.stats()
    assert before["fragmentation"] > 0.4
    copies, batches, store_move, compaction = [], [], cache._store.move, cache._arena.compaction
    monkeypatch.setattr(cache._store, "move", lambda rows, *a: (copies.append(rows.copy()), store_move(rows, *a)))
    monkeypatch.setattr(cache._arena, "compaction", lambda layer: (batches.append(b) or b for b in compaction(layer)))
    moved = cache.compact()
    if merged:  # one copy, in which pages moved twice by the arena appear once
        assert len(copies) == 1 and len(np.unique(copies[0])) == len(copies[0])
        assert sum(len(b) for b in batches) > len(copies[0])
    else:
        assert len(copies) == sum(1 for b in batches if b) > 1
    after = cache.stats()
    assert moved > 0 and after["free_chunks"] > before["free_chunks"]
    used = sum(math.ceil(x["stored_bytes"] / cache.chunk_bytes) for x in after["layers"])
    assert after["num_chunks"] - after["free_chunks"] <= used + 2 * 2  # at most one spare slot and packed chunk each
    assert after["fragmentation"] < before["fragmentation"]
    check_all(cache, kept)
    assert cache.compact() == 0  # nothing left to gain


def test_a_bounded_compaction_empties_sparse_packed_chunks_within_its_bytes(monkeypatch):
    """compact(max_bytes, sparse): only packed chunks at most ``sparse`` live move, sparsest first, never more than
    max_bytes (split over the layers) in all; each one emptied goes back to the pool; contents stay intact. Freeing
    every other sequence leaves each packed chunk about half live."""
    cache, kept = fragmented(chunks=40, tokens=lambda i: 2 * P)
    arena = cache._arena
    C = arena.chunk_bytes

    def packed_live():
        return sorted(int(arena.live[c]) for layer in range(2) for c in arena.packed_chunks[layer])

    before, stats = packed_live(), cache.stats()
    with pytest.raises(ValueError, match="sparse must be a number from 0 to 1"):
        cache.compact(C, sparse=1.5)
    with pytest.raises(ValueError, match="max_bytes"):
        cache.compact(-1)
    assert cache.compact(4 * C, sparse=0.0) == 0  # no chunk is empty
    assert packed_live() == before
    moves = []
    store_move = cache._store.move
    monkeypatch.setattr(cache._store, "move", lambda rows, new, old, size, *a: (moves.append(int(size.sum())),
                                                                                 store_move(rows, new, old, size, *a)))
    moved = cache.compact(2 * C, sparse=0.6)  # C a layer
    assert 0 < moved <= 2 * C and sum(moves) == moved
    after = cache.stats()
    assert after["free_chunks"] > stats["free_chunks"] and after["fragmentation"] < stats["fragmentation"]
    check_all(cache, kept)
    moved = cache.compact(64 * C, sparse=0.6)
    assert all(live > 0.6 * C for live in packed_live()[2:])  # all but (at most) the destinations are denser now
    check_all(cache, kept)


def run_scheduler(cache, gen, compress: bool, steps: int = 60) -> int:
    """A continuous-batching loop whose admission trusts capacity(): admit while a request fits, prefill it, decode
    the batch one token per step, free finished requests. Returns the most requests that ran at once. Any
    CacheFullError fails the test."""
    running, peak, kept = {}, 0, {}
    for step in range(steps):
        while True:
            prompt = int(torch.randint(20, 90, (1,), generator=gen))
            new = int(torch.randint(5, 40, (1,), generator=gen))
            if cache.capacity(prompt, new).requests < 1:
                break
            sid = cache.add_sequence(prompt, new)
            for layer in range(cache.num_layers):
                fill(cache, kept, layer, sid, prompt, int(torch.randint(0, 2**31, (1,), generator=gen)),
                     kind=step % 2)
            running[sid] = new
            if compress:
                cache.compress_full_pages()
        peak = max(peak, len(running))
        sids = list(running)
        for layer in range(cache.num_layers):
            k, v = tokens(step * 7 + layer, len(sids), H, D)
            cache.append(layer, sids, k, v)
            for b, sid in enumerate(sids):
                old = kept[(sid, layer)]
                kept[(sid, layer)] = (torch.cat([old[0], k[b: b + 1]]), torch.cat([old[1], v[b: b + 1]]))
        if compress:
            cache.compress_full_pages()
            if step % 10 == 9:
                cache.compact()
        for sid in sids:
            running[sid] -= 1
            if running[sid] == 0:
                del running[sid]
                cache.free_sequence(sid)
                for layer in range(cache.num_layers):
                    del kept[(sid, layer)]
    check_all(cache, kept)
    return peak


def test_admission_by_capacity_never_runs_out_and_compression_admits_more():
    seed = 1234
    peaks = [run_scheduler(make(layers=2, chunks=40, chunk_pages=4), torch.Generator().manual_seed(seed), c)
             for c in (False, True)]
    assert peaks[1] > peaks[0], f"compression did not turn saved bytes into more concurrent requests: {peaks}"


def test_prepared_steps_match_per_layer_appends_bit_for_bit(gen):
    """prepare_step opens every layer's pages at once; the result (contents, layout, accounting, attention) is the
    per-layer append path's, page for page."""
    layers, lens = 3, [5, 16, 31, 47]
    a, b = make(layers=layers, chunks=40), make(layers=layers, chunks=40)
    sids = {c: [c.add_sequence(n, 40) for n in lens] for c in (a, b)}
    kept = {}
    for layer in range(layers):
        for i, n in enumerate(lens):
            k, v = tokens(10 * layer + i, n, H, D)
            for c in (a, b):
                c.append(layer, sids[c][i], k, v)
            kept[(sids[a][i], layer)] = (k, v)
    compressed = 0
    for step in range(35):  # crosses page boundaries at different steps per sequence, with compressions between
        prepared = a.prepare_step(sids[a])
        assert prepared.page_ids.dtype == torch.int32 and prepared.kv_indptr.shape == (len(lens) + 1,)
        # One shape for the batch's life (a compiled step, one graph): room for every sequence's whole budget.
        assert prepared.kv_indices.shape == (sum(-(-(n + 40) // P) for n in lens),)
        for layer in range(layers):
            k, v = tokens(1000 + 10 * step + layer, len(lens), H, D)
            a.step_append(layer, prepared, k, v)
            b.append(layer, sids[b], k, v)
            for i, sid in enumerate(sids[a]):
                old = kept[(sid, layer)]
                kept[(sid, layer)] = (torch.cat([old[0], k[i: i + 1]]), torch.cat([old[1], v[i: i + 1]]))
            q = torch.randn(len(lens), 2 * H, D, generator=gen).bfloat16()
            out = a.step_decode(layer, prepared, q)
            assert torch.equal(bits(out), bits(b.decode(layer, q, sids[b])))
            assert rel_err(out, decode_reference(q, [kept[(s, layer)] for s in sids[a]], P)) < 1e-2
        if step % 4 == 3:
            n = a.compress_full_pages()
            assert n == b.compress_full_pages()
            compressed += n
    assert compressed >= layers * (len(lens) + 4)  # the prompts' full pages and those the steps filled
    assert torch.equal(a.data, b.data) and torch.equal(a._store.meta, b._store.meta)
    check_all(a, kept)


def test_prepared_step_tables_past_the_budgets_grow_by_powers_of_two(gen):
    """Past its sequences' budgets a step's page table grows to the next power of two of its pages, and attention on
    the padded table is the exact table's, bit for bit (entries past kv_indptr[-1] are never read)."""
    cache = make(layers=1, chunks=40)
    sids = [cache.add_sequence(3, 5), cache.add_sequence(20, 0)]  # budgets of 1 and 2 pages
    for sid, n in zip(sids, (3, 20)):
        cache.append(0, sid, *tokens(sid, n, H, D))
    widths = []
    for step in range(60):
        prepared = cache.prepare_step(sids)
        cache.step_append(0, prepared, *tokens(100 + step, 2, H, D))
        nnz = int(prepared.kv_indptr[-1])
        widths.append(prepared.kv_indices.numel())
        assert widths[-1] == (3 if nnz <= 3 else 1 << (nnz - 1).bit_length())
        q = torch.randn(2, 2 * H, D, generator=gen).bfloat16()
        assert torch.equal(bits(cache.step_decode(0, prepared, q)), bits(cache.decode(0, q, sids)))
    assert sorted(set(widths)) == [3, 4, 8, 16]  # 3 + 60 and 20 + 60 tokens: 4 + 5 = 9 pages at the end
    assert cache.stats()["tokens"] == 3 + 20 + 2 * 60


def test_prepare_step_refuses_ragged_layers_and_a_full_cache_without_changes():
    cache = make(layers=2, chunks=6, chunk_pages=2)  # 12 raw pages
    s = cache.add_sequence()
    cache.append(0, s, *tokens(0, 3, H, D))
    with pytest.raises(RuntimeError, match="every layer at the same length"):
        cache.prepare_step([s])
    cache.append(1, s, *tokens(1, 3, H, D))
    t = cache.add_sequence()
    for layer in range(2):
        cache.append(layer, t, *tokens(2 + layer, 4 * P, H, D))  # t's 4 pages per layer: one free slot per layer
    for layer in range(2):
        cache.append(layer, s, *tokens(5 + layer, P - 3, H, D))  # s's first page is full now
    before = snapshot(cache)
    with pytest.raises(CacheFullError, match=r"decode step of sequences \[0, 1\] needs 2 new raw pages in every layer"
                       r", 2 of them beyond the sequences' budgets, but only 1 can be taken in every layer") as e:
        cache.prepare_step([s, t])  # both need a second page in both layers, beyond any budget
    assert (e.value.requested, e.value.free, e.value.unit) == (2, 1, "pages per layer")
    assert snapshot(cache) == before


def test_prepared_prefills_match_per_layer_appends_bit_for_bit(gen):
    """prepare_prefill opens every layer's pages at once for several sequences' chunks; contents, layout, accounting
    and attention are the per-layer append and prefill path's, bit for bit, over chunks that start and end inside
    pages, cross several, or are empty, with compressions between calls."""
    layers, lens = 3, [0, 5, 16, 31]
    a, b = make(layers=layers, chunks=60), make(layers=layers, chunks=60)
    sids = {c: [c.add_sequence(n, 120) for n in lens] for c in (a, b)}
    kept = {(s, layer): tokens(0, 0, H, D) for s in sids[a] for layer in range(layers)}
    rounds = [[3, 1, 16, 40], [29, 0, 17, 1], [16, 33, 2, 0], [1, 15, 47, 9]]
    for r, q_lens in enumerate([lens] + rounds):
        prepared = a.prepare_prefill(sids[a], q_lens)
        assert prepared.qo_indptr.tolist() == np.concatenate([[0], np.cumsum(q_lens)]).tolist()
        assert prepared.page_ids.shape == prepared.slots.shape == (sum(q_lens),)
        for layer in range(layers):
            k, v = tokens(100 * r + layer, sum(q_lens), H, D, kind=r % 3)
            a.step_append(layer, prepared, k, v)
            at = 0
            for i, m in enumerate(q_lens):
                b.append(layer, sids[b][i], k[at: at + m], v[at: at + m])
                old = kept[(sids[a][i], layer)]
                kept[(sids[a][i], layer)] = (torch.cat([old[0], k[at: at + m]]), torch.cat([old[1], v[at: at + m]]))
                at += m
            q = torch.randn(sum(q_lens), 2 * H, D, generator=gen).bfloat16()
            out = a.step_prefill(layer, prepared, q)
            assert torch.equal(bits(out), bits(b.prefill(layer, q, sids[b], q_lens=q_lens)))
        assert a.compress_full_pages() == b.compress_full_pages() > 0
    assert torch.equal(a.data, b.data) and torch.equal(a._store.meta, b._store.meta)
    assert a.stats() == b.stats()
    check_all(a, kept)


def test_prepare_prefill_refuses_bad_calls_and_a_full_cache_without_changes():
    cache = make(layers=2, chunks=6, chunk_pages=2)  # 12 raw pages
    s, t = cache.add_sequence(), cache.add_sequence()
    cache.append(0, s, *tokens(0, 3, H, D))
    with pytest.raises(RuntimeError, match="prepare_prefill needs every layer at the same length"):
        cache.prepare_prefill([s, t], [1, 1])
    cache.append(1, s, *tokens(1, 3, H, D))
    for q_lens, match in (([1], r"q_lens must give the new tokens of each of the 2 seq_ids, got \[1\]"),
                          (3, "q_lens must give the new tokens of each of the 2 seq_ids, got 3"),
                          ([1, -1], "q_lens"), ([1, 2.5], "q_lens")):
        with pytest.raises((ValueError, TypeError), match=match):
            cache.prepare_prefill([s, t], q_lens)
    before = snapshot(cache)
    with pytest.raises(CacheFullError, match=r"prepare_prefill: a prefill of sequences \[0, 1\] needs 10 new raw "
                                             "pages in every layer"):
        cache.prepare_prefill([s, t], [4 * P, 6 * P])  # 4 + 6 new pages per layer, 6 raw pages a layer in all
    assert snapshot(cache) == before
    step = cache.prepare_prefill([s, t], [P, 2])
    with pytest.raises(TypeError, match="step_decode: step must be a DecodeStep from prepare_step, got PrefillStep"):
        cache.step_decode(0, step, torch.ones(2, H, D, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="step_prefill: step must be a PrefillStep from prepare_prefill, got "
                                        "DecodeStep"):
        cache.step_prefill(0, cache.prepare_step([s, t]), torch.ones(2, H, D, dtype=torch.bfloat16))
    k = torch.full((P + 2, H, D), 5.0, dtype=torch.bfloat16)
    cache.step_append(0, step, k, k)
    cache.free_sequence(t)
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="step_append: the PrefillStep is stale: .* after prepare_prefill made it"):
        cache.step_append(1, step, k, k)
    with pytest.raises(RuntimeError, match="step_prefill: the PrefillStep is stale"):
        cache.step_prefill(0, step, torch.ones(P + 2, 2 * H, D, dtype=torch.bfloat16))
    assert snapshot(cache) == before


def test_a_stale_step_is_refused_and_writes_nothing():
    """The issue's reproducer: a step planned for a, then a freed and b admitted, which takes a's page id. The old
    step must not write b's token 0, nor read b's pages: step_append and step_decode refuse it, and b holds exactly
    what was appended to it."""
    cache = make(layers=1)
    a = cache.add_sequence(0, 4)
    old = cache.prepare_step([a])
    cache.free_sequence(a)
    b = cache.add_sequence(0, 4)
    k = torch.full((3, H, D), 7.0, dtype=torch.bfloat16)
    cache.append(0, b, k, k)
    assert old.page_ids.tolist() == cache.page_table(0, [b])[1].tolist()  # b took a's page id
    before = snapshot(cache)
    bad = torch.full((1, H, D), -1.0, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="step_append: the DecodeStep is stale"):
        cache.step_append(0, old, bad, bad)
    with pytest.raises(RuntimeError, match="step_decode: the DecodeStep is stale"):
        cache.step_decode(0, old, torch.ones(1, H, D, dtype=torch.bfloat16))
    assert snapshot(cache) == before
    check_all(cache, {(b, 0): (k, k)})
    with pytest.raises(TypeError, match="step_append: step must be a DecodeStep from prepare_step or a PrefillStep "
                                        "from prepare_prefill, got NoneType"):
        cache.step_append(0, None, bad, bad)


def test_a_step_of_another_cache_is_refused_and_writes_nothing():
    """A step belongs to the cache that prepared it: B.step_append with A's step would write B's sequence [7, 7, 7]
    at A's page id and slot (B's first token became -1 before the check); B refuses it and keeps its tokens."""
    a_cache, b_cache = make(layers=1), make(layers=1)
    a = a_cache.add_sequence(0, 4)
    a_step = a_cache.prepare_step([a])
    b = b_cache.add_sequence(0, 4)
    k = torch.full((3, H, D), 7.0, dtype=torch.bfloat16)
    b_cache.append(0, b, k, k)
    before = snapshot(b_cache)
    bad = torch.full((1, H, D), -1.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="step_append: the DecodeStep was prepared by another cache"):
        b_cache.step_append(0, a_step, bad, bad)
    with pytest.raises(ValueError, match="step_decode: the DecodeStep was prepared by another cache"):
        b_cache.step_decode(0, a_step, torch.ones(1, H, D, dtype=torch.bfloat16))
    assert snapshot(b_cache) == before
    check_all(b_cache, {(b, 0): (k, k)})
    a_cache.step_append(0, a_step, bad, bad)  # its own cache takes it
    check_all(a_cache, {(a, 0): (bad, bad)})


def test_a_static_step_is_the_caches_and_never_stale():
    """static_step wraps caller-owned buffers (a CUDA Graph's) as a step of this cache: it survives the changes that
    make prepared steps stale, and another cache refuses it."""
    cache, other = make(layers=1), make(layers=1)
    bufs = [torch.zeros(n, dtype=torch.int32) for n in (1, 1, 2, 4, 1)]
    step = cache.static_step(*bufs)
    cache.add_sequence(0, 4)
    cache.check_step(step)
    with pytest.raises(ValueError, match="prepared by another cache"):
        other.check_step(step)
    with pytest.raises(ValueError, match="kv_indices must be a 1-D int32 tensor"):
        cache.static_step(*bufs[:3], bufs[3].long(), bufs[4])


def test_default_chunks_fit_a_small_budget():
    """Default chunks are sized from the budget: 256 MiB over 32 layers of 8 x 128 heads (64 KiB raw pages) admits
    five requests of 356 + 0 tokens, as many as its raw bytes hold less the meta and a chunk per layer of slack (with
    4 MiB chunks: 2), and 64 MiB admits one (with 4 MiB chunks: none)."""
    for budget, fits in ((256 << 20, 5), (64 << 20, 1)):
        cache = CompressedPagedKVCache(32, 8, 128, max_bytes=budget, device="cpu")
        raw = budget / (32 * 23 * (64 << 10))  # 23 raw pages of 64 KiB per layer and request
        assert cache.capacity(356, 0).requests == fits >= int(raw) - 1, (budget, raw)
        old = CompressedPagedKVCache(32, 8, 128, max_bytes=budget, device="cpu", chunk_bytes=4 << 20)
        assert old.capacity(356, 0).requests < fits


@pytest.mark.parametrize("change", ["add_sequence", "free_sequence", "compress_full_pages(wait=True)",
                                    "compress_full_pages(wait=False)", "compact"])
def test_a_change_of_sequences_or_pages_ends_every_step_prepared_before(change):
    """The rule: add_sequence, free_sequence, compress_full_pages and compact make every step prepared before them
    stale, whether or not they touch its pages (here they touch none of the step's); another prepare_step or an
    append does not. A step prepared after the change runs."""
    cache = make(layers=2)
    kept = {}
    sids = [cache.add_sequence(P - 1, 8) for _ in range(3)]
    for layer in range(2):
        for sid in sids:
            fill(cache, kept, layer, sid, P - 1, 10 * layer + sid)
    old = cache.prepare_step(sids[:1])  # fills sids[0]'s first page
    for layer in range(2):
        cache.step_append(layer, old, *tokens(50 + layer, 1, H, D))
    other = cache.prepare_step(sids[1:2])
    fill(cache, kept, 0, sids[2], 1, 60)
    assert not old.stale and not other.stale
    if change == "add_sequence":
        cache.add_sequence(4)
    elif change == "free_sequence":
        cache.free_sequence(sids[2])
    elif change == "compact":
        cache.compact()
    else:
        cache.compress_full_pages(wait=change.endswith("True)"))
    assert old.stale and other.stale
    for step in (old, other):
        with pytest.raises(RuntimeError, match="stale"):
            cache.step_append(0, step, *tokens(0, 1, H, D))
    fresh = cache.prepare_step(sids[:1])
    assert not fresh.stale
    for layer in range(2):
        cache.step_append(layer, fresh, *tokens(70 + layer, 1, H, D))
        cache.step_decode(layer, fresh, torch.ones(1, H, D, dtype=torch.bfloat16))


def test_a_compiled_step_never_recompiles_for_the_stale_flag_and_still_refuses_a_stale_step():
    """A compiled step guards on ``step.stale``, which is False for every step that runs: 24 steps, with
    compressions between them, compile once. A stale step fails the guard and is refused while it is traced
    (Dynamo's Unsupported, a RuntimeError, quotes the message), writing nothing."""
    cache = make(layers=2)
    sids = [cache.add_sequence(0, 32) for _ in range(2)]
    held = {}

    def step(k, v, q):
        for layer in range(2):
            cache.step_append(layer, held["step"], k, v)
            out = cache.step_decode(layer, held["step"], q)
        return out

    compiled = torch.compile(step, fullgraph=True)
    k, q = tokens(0, 2, H, D)[0], tokens(1, 2, 2 * H, D)[0]
    for t in range(24):
        if t % 8 == 7:
            cache.compress_full_pages(wait=False)
        held["step"] = cache.prepare_step(sids)
        with torch._dynamo.config.patch(error_on_recompile=t > 0):
            compiled(k, k, q)
    cache.compress_full_pages()
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="step_append: the DecodeStep is stale"):
        compiled(k, k, q)
    assert snapshot(cache) == before


def test_a_step_or_an_append_never_names_a_sequence_twice():
    """One token per sequence: a repeated id would write two tokens to one place. Ids equal to an int but of another
    type (True, 1.0) are refused, even where the int's batch is remembered; numpy ints and tensors are ids."""
    cache = make()
    s, t = cache.add_sequence(), cache.add_sequence()
    before = snapshot(cache)
    with pytest.raises(ValueError, match="seq_ids repeats a sequence"):
        cache.prepare_step([s, t, s])
    with pytest.raises(ValueError, match="seq_ids repeats a sequence"):
        cache.append(0, torch.tensor([t, t]), *tokens(0, 2, H, D))
    assert snapshot(cache) == before
    cache.page_table(0, [t])  # remembered: [True] and [1.0] equal its key
    for bad, kind in (([True], "bool"), ([1.0], "float"), (True, "bool")):
        with pytest.raises(TypeError, match=f"seq_id must be an int, got {kind}"):
            cache.page_table(0, bad)
    with pytest.raises(TypeError, match="seq_ids must be an int or a sequence of ints, got float 1.5"):
        cache.prepare_step(1.5)
    assert snapshot(cache) == before
    cache.append(0, [np.int64(s), np.int32(t)], *tokens(0, 2, H, D))
    cache.append(1, torch.tensor([s, t]), *tokens(1, 2, H, D))
    step = cache.prepare_step(np.array([t, s]))
    assert cache.seq_len(1, np.int64(t)) == 2 and step.page_ids.tolist() == cache.page_table(0, [t, s])[1].tolist()


def test_cache_full_errors_say_what_was_asked_in_one_unit_a_scheduler_can_compare():
    """requested > free, in the unit named: a decode step's pages in every layer (not layer 0's alone), page ids
    where they run out first, the one layer an append names."""
    # The reproducer: 2 layers, one chunk of 2 raw pages: each layer alone could take one, both cannot.
    id_bytes = 2 * 2 * 1 * fmt.meta_words(16, 64) * 4  # the meta rows of one page id: 2 layers, K|V, 1 kv head
    c = CompressedPagedKVCache(2, 1, 64, page_size=16, max_bytes=8192 + 8 * id_bytes, chunk_bytes=8192, max_pages=8,
                               device="cpu")
    s = c.add_sequence(0, 0)
    with pytest.raises(CacheFullError, match=r"prepare_step: a decode step of sequences \[0\] needs 1 new raw pages "
                                             r"in every layer.* only 0 can be taken in every layer") as e:
        c.prepare_step([s])
    assert (e.value.requested, e.value.free, e.value.unit) == (1, 0, "pages per layer")
    assert e.value.free == c.capacity().pages
    # Page ids run out first: 6 ids, 2 promised.
    cache = make(layers=2, max_pages=6)
    a = cache.add_sequence(2 * P)
    with pytest.raises(CacheFullError, match=r"add_sequence: a budget of 80 tokens needs 5 page ids, but only 4 are "
                                             r"free \(6 of 6 page ids free, 2 of them promised") as e:
        cache.add_sequence(5 * P)
    assert (e.value.requested, e.value.free, e.value.unit) == (5, 4, "page ids")
    with pytest.raises(CacheFullError, match=r"needs 16 raw pages in every layer, but only 8 can be promised") as e:
        make(layers=2, chunks=4).add_sequence(16 * P)
    assert (e.value.requested, e.value.free, e.value.unit) == (16, 8, "pages per layer")
    b = cache.add_sequence()
    cache.append(0, b, *tokens(0, 4 * P, H, D))  # the 4 free ids
    for layer in range(2):
        cache.append(layer, a, *tokens(layer, 2 * P, H, D))  # a's promised ids
    before = snapshot(cache)
    with pytest.raises(CacheFullError, match=r"append to layer 1: needs 1 page ids .* only 0 are free") as e:
        cache.append(1, a, *tokens(0, 1, H, D))
    assert (e.value.requested, e.value.free, e.value.unit) == (1, 0, "page ids")
    with pytest.raises(CacheFullError, match=r"prepare_step: a decode step of sequences \[0\] needs 1 page ids") as e:
        cache.prepare_step([a])
    assert (e.value.requested, e.value.free, e.value.unit) == (1, 0, "page ids")
    assert snapshot(cache) == before


def stored_bytes(cache, kept) -> torch.Tensor:
    """The bytes of every live stream (read from the meta), in arena order."""
    live = torch.zeros_like(cache.data, dtype=torch.bool)
    for start, end, _, _ in live_streams(cache, kept):
        live[start:end] = True
    return cache.data[live]


def arena_state(cache) -> tuple:
    """Everything the arena decided: the tables, chunk kinds and owners, the pool and the free-slot stacks."""
    a = cache._arena
    stacks = [a.free_stack[c, : a.free_top[c]].tolist() for c in range(a.num_chunks)]
    return (a.offset.tolist(), a.nbytes.tolist(), a.kind.tolist(), a.owner.tolist(), a.used.tolist(), list(a.pool),
            stacks, a.dest.tolist())


def test_compression_of_all_layers_at_once_equals_page_by_page(monkeypatch):
    """compress_full_pages() compresses the full pages of every layer with one decompress/compress call on the
    all-layer meta rows and places them together where it can; rounds of one page (one layer at a time) and rounds
    that split a layer give the same stored bytes and tables: with pages packed into destination chunks, and
    destination chunks filling up mid-round. (Bytes nothing reads may differ: a slot freed in an earlier round is
    zeroed then, one whose chunk goes back to the pool in the same round is not. Where every pool chunk is promised,
    a round may pack pages that smaller rounds compress in place: the two tests above.)"""
    rounds = [None, 3 * PAGE_BYTES, PAGE_BYTES]  # everything at once, 3 pages, 1 page per round
    caches = [make(layers=3, chunks=24, chunk_pages=4) for _ in rounds]
    lens = [37, 50, 21]
    sids = [[c.add_sequence(n, 30) for n in lens] for c in caches][0]  # the same ids in every cache
    kept = {}
    for layer in range(3):
        for sid, n in zip(sids, lens):
            fill_all = tokens(10 * layer + sid, n, H, D)
            for c in caches:
                c.append(layer, sid, *fill_all)
            kept[(sid, layer)] = fill_all
    one_at_a_time = []
    original = Arena._repack_each
    monkeypatch.setattr(Arena, "_repack_each", lambda self, *a: one_at_a_time.append(len(a[0])) or original(self, *a))

    def compress():
        layers_waiting = sum(x["waiting_full_pages"] > 0 for x in caches[0].stats()["layers"])
        for c, r in zip(caches, rounds):
            with monkeypatch.context() as m:
                if r is not None:
                    m.setattr(compression_rounds, "ROUND_BYTES", r)
                c.compress_full_pages()
        for c in caches[1:]:
            assert torch.equal(stored_bytes(c, kept), stored_bytes(caches[0], kept))
            assert torch.equal(c._store.meta, caches[0]._store.meta)
            assert arena_state(c) == arena_state(caches[0]) and c.stats() == caches[0].stats()
        return layers_waiting

    assert compress() == 3
    assert all(x["packed_chunks"] >= 1 and x["stored_bytes"] < x["raw_bytes"] for x in caches[0].stats()["layers"])
    for step in range(40):
        for c in caches:
            st = c.prepare_step(sids)
            for layer in range(3):
                c.step_append(layer, st, *tokens(1000 * step + layer, len(sids), H, D))
        for layer in range(3):
            k, v = tokens(1000 * step + layer, len(sids), H, D)
            for i, sid in enumerate(sids):
                old = kept[(sid, layer)]
                kept[(sid, layer)] = (torch.cat([old[0], k[i: i + 1]]), torch.cat([old[1], v[i: i + 1]]))
        if step % 5 == 4:
            compress()
    assert one_at_a_time, "no destination chunk filled up during a round"
    for c in caches:
        check_all(c, kept)


def placed_one_at_a_time(arena: Arena):
    """Arena._repack_each's rule taken literally: each page in order where ``_alloc_packed`` says, with the slots
    that a chunk taken for it would pay back (its own and those of the next pages of its layer that fill the chunk
    with it, at most 4 chunks' slots ahead), else kept in place; the room it leaves released at once."""
    def place(layers, pages, sizes):
        out = np.empty(len(pages), dtype=np.int64)
        for i, (layer, page, size) in enumerate(zip(layers.tolist(), pages.tolist(), sizes.tolist())):
            frees, total, j = 0, 0, i
            while (j < len(pages) and layers[j] == layer and j < i + 4 * arena.slots_per_chunk
                   and total + sizes[j] <= arena.chunk_bytes):
                total += int(sizes[j])
                frees += int(arena.kind[arena.offset[layer, pages[j]] // arena.chunk_bytes] == 1)  # in a slot
                j += 1
            off = arena._alloc_packed(layer, size, frees=frees)
            if off is None:
                off = arena.offset[layer, page]
            else:
                arena.release(np.array([layer]), np.array([page]))
            out[i] = off
        return out
    return place


def test_placement_in_runs_equals_one_page_at_a_time():
    """Arena.repack and the compactions place compressed pages in runs: the pages that fit a tail at once, those
    kept in place (no tail fits them and the pool cannot spare a chunk, even with the slots they would pay back) at
    once, and the room they leave released only before the pool is asked. Against the same arena placing one page at
    a time (the rule taken literally), over random states whose pool is all or partly promised, with holes and
    several layers per call: the same offsets, tables, chunk kinds, pool and free slots after every call and the
    same moves, with calls that keep some pages in place and pack others, and destinations that close on a page
    that does not fit them for an open tail (one that holds any page; crumbs are never destinations)."""
    rng = np.random.default_rng(0)
    page_bytes = 4 * fmt.STREAM_ALIGN
    mixed, skipped, tails = 0, [], []
    for _ in range(60):
        fast, slow = (Arena(3, 300, 14, 4 * page_bytes, page_bytes) for _ in range(2))
        slow._kept_in_place = lambda *a: 0
        slow._repack_each = placed_one_at_a_time(slow)
        shortcut, tail = fast._kept_in_place, fast._open_tail
        fast._kept_in_place = lambda *a, f=shortcut: skipped.append(f(*a)) or skipped[-1]
        fast._open_tail = lambda *a, f=tail: tails.append(f(*a)) or tails[-1]
        next_page = np.zeros(3, dtype=np.int64)

        def same():
            for a, b in ((fast.offset, slow.offset), (fast.nbytes, slow.nbytes), (fast.kind, slow.kind),
                         (fast.used, slow.used), (fast.live, slow.live), (fast.dest, slow.dest),
                         (fast.free_slot_count, slow.free_slot_count), (fast.free_top, slow.free_top)):
                assert np.array_equal(a, b)
            assert fast.pool == slow.pool

        for _ in range(8):
            for layer in range(3):
                n = int(rng.integers(0, 7))
                if fast.fits(slice(layer, layer + 1), n):
                    pages = np.arange(next_page[layer], next_page[layer] + n)
                    next_page[layer] += n
                    for a in (fast, slow):
                        a.place_raw(slice(layer, layer + 1), pages)
            reserved = rng.integers(0, 9, 3)
            while fast.pool_need() > len(fast.pool) or (reserved == 0).all():  # promise what the pool holds
                fast.reserved[:] = reserved
                if fast.pool_need() <= len(fast.pool):
                    break
                reserved = np.maximum(0, reserved - rng.integers(0, 2, 3))
            slow.reserved[:] = fast.reserved
            raw = np.argwhere(fast.nbytes == page_bytes)  # (layer, page), layers ascending
            pick = np.sort(rng.choice(len(raw), size=int(rng.integers(0, len(raw) + 1)), replace=False))
            layers, pages = raw[pick, 0], raw[pick, 1]
            sizes = rng.integers(1, 5, len(pick)) * fmt.STREAM_ALIGN
            out = [a.repack(layers, pages, sizes) for a in (fast, slow)]
            assert np.array_equal(out[0], out[1])
            same()
            in_slot = fast.kind[out[0] // fast.chunk_bytes] == 1
            mixed += bool(in_slot.any() and (~in_slot).any())
            live = np.argwhere(fast.offset >= 0)
            gone = live[rng.random(len(live)) < 0.2]  # holes in packed chunks, free slots
            for a in (fast, slow):
                a.release(gone[:, 0], gone[:, 1])
            layer = int(rng.integers(0, 3))
            if rng.random() < 0.5:
                max_bytes = int(rng.integers(0, 3 * fast.chunk_bytes))
                moves = [list(a.reclaim(layer, max_bytes, 0.9)) for a in (fast, slow)]
            else:
                moves = [list(a.compaction(layer)) for a in (fast, slow)]
            assert moves[0] == moves[1]
            same()
    assert mixed >= 10 and sum(n > 1 for n in skipped) >= 10 and sum(t >= 0 for t in tails) >= 10


def test_compression_without_waiting_starts_two_rounds_at_most_and_leaves_the_rest(monkeypatch):
    """compress_full_pages(wait=False) never places a round it started in the same call (on CUDA that waits for the
    device, which stalled each such engine step): with 8 full pages and rounds of 2, a call starts 2 rounds, places
    none and leaves 4 pages waiting (compression_backlog, the layers' waiting_full_pages); the next call places those
    rounds and starts the rest; the contents stay intact throughout."""
    monkeypatch.setattr(compression_rounds, "ROUND_BYTES", 2 * PAGE_BYTES)
    cache = make(layers=2, chunks=24, chunk_pages=4)
    kept = {}
    for sid, n in ((cache.add_sequence(40), 40), (cache.add_sequence(33), 33)):  # 2 full pages each, per layer
        for layer in range(2):
            kept[(sid, layer)] = tokens(10 * layer + sid, n, H, D)
            cache.append(layer, sid, *kept[(sid, layer)])
    assert cache.compression_backlog() == 8
    placed = [cache.compress_full_pages(wait=False)]
    assert placed == [0] and cache.compression_backlog() == 4
    layers = cache.stats()["layers"]
    assert sum(x["waiting_full_pages"] for x in layers) == 4 and sum(x["compressing_pages"] for x in layers) == 4
    check_all(cache, kept)
    placed.append(cache.compress_full_pages(wait=False))
    assert placed == [0, 4] and cache.compression_backlog() == 0
    check_all(cache, kept)
    placed.append(cache.compress_full_pages(wait=False))
    assert placed == [0, 4, 4] and all(x["stored_bytes"] < x["raw_bytes"] for x in cache.stats()["layers"])
    check_all(cache, kept)


def test_uploads_come_back_as_sent():
    """The cache's host-to-device copy: arrays of both index dtypes, any shape, empty ones too, as views of one
    buffer with their dtype and shape."""
    arrays = [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int64) - 2**40, np.empty(0, dtype=np.int64),
              np.arange(24, dtype=np.int32).reshape(2, 3, 4), np.empty(0, dtype=np.int32), np.array([7], np.int64)]
    upload = Uploader(torch.device("cpu"))
    for a, t in zip(arrays, upload(*arrays)):
        assert t.dtype == torch.from_numpy(a).dtype and t.shape == a.shape and np.array_equal(t.numpy(), a)
    assert upload() == []


@requires_cuda
def test_uploads_never_reuse_a_buffer_whose_copy_has_not_run():
    """While the stream is busy, every upload takes a fresh pinned buffer (the earlier copies have not run); once
    they have, buffers are reused. Every result is what was sent."""
    upload = Uploader(torch.device("cuda"))
    torch.cuda._sleep(200_000_000)  # keeps the stream busy while the host fills buffers
    sent = [np.full(1000 + i, i, dtype=np.int32) for i in range(20)]
    got = [upload(a, np.array([i], dtype=np.int64)) for i, a in enumerate(sent)]
    assert len(upload.ring) == 20
    torch.cuda.synchronize()
    for i, (a, (t, u)) in enumerate(zip(sent, got)):
        assert np.array_equal(t.cpu().numpy(), a) and u.item() == i
    upload(sent[0])
    assert len(upload.ring) == 20  # the oldest buffer was free again


@requires_cuda
@pytest.mark.parametrize("wait", [True, False])
def test_the_same_workload_on_cuda_gives_the_cpu_cache_byte_for_byte(gen, wait):
    """The cache's host logic drives the CUDA ops exactly as the CPU ones: same arena bytes and meta after prefill,
    prepared and per-layer decode steps, compression (waiting, or placed a call later) and compaction; gather is
    exact and attention agrees."""
    caches = [make(layers=2, chunks=40, device=d) for d in ("cpu", "cuda")]
    lens = [3, 16, 40, 75]
    sids = [[c.add_sequence(n, 40) for n in lens] for c in caches]
    for layer in range(2):
        for i, n in enumerate(lens):
            k, v = tokens(10 * layer + i, n, H, D, kind=1)
            for c, s in zip(caches, sids):
                c.append(layer, s[i], k.to(c.device), v.to(c.device))
    for step in range(30):
        q = torch.randn(len(lens), 2 * H, D, generator=gen).bfloat16()
        outs = []
        for c, s in zip(caches, sids):
            prepared = c.prepare_step(s) if step % 2 else None
            for layer in range(2):
                k, v = (x.to(c.device) for x in tokens(1000 + 10 * step + layer, len(lens), H, D, kind=1))
                if prepared is None:
                    c.append(layer, s, k, v)
                    outs.append(c.decode(layer, q.to(c.device), s).cpu())
                else:
                    c.step_append(layer, prepared, k, v)
                    outs.append(c.step_decode(layer, prepared, q.to(c.device)).cpu())
        assert all(rel_err(g, cpu.double()) < 1e-2 for cpu, g in zip(outs[:2], outs[2:]))
        if step % 5 == 4:
            assert caches[0].compress_full_pages(wait) == caches[1].compress_full_pages(wait)
        if step == 20:
            assert caches[0].compact() == caches[1].compact()
    cpu, cuda = caches
    assert torch.equal(cpu.data, cuda.data.cpu()) and torch.equal(cpu._store.meta, cuda._store.meta.cpu())
    for layer in range(2):
        for a, b in zip(sids[0], sids[1]):
            assert all(torch.equal(bits(x), bits(y.cpu())) for x, y in zip(cpu.gather(layer, a), cuda.gather(layer, b)))
