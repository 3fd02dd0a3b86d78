"""The prefix cache of CompressedPagedKVCache (torch_zipkv/page_pool.py): chained page keys, sequences that start from
cached pages, reference counts, eviction of cached pages nobody holds, and the promises around them.

A token's K/V here is a pure function of the token ids up to it (as a model's are), so a sequence that reads a page
another sequence wrote reads its own tokens' K/V, and any mix-up shows as wrong bits. The state machine plays random
sequences over a few shared prefixes on a tight arena: starts (from the longest cached prefix), prefills, decode
steps, finishes (their pages cached) and aborts, compression, growth to the budget; after every rule each running
sequence's K/V are its own, bit for bit, in every layer, no live streams overlap, and the pool keeps every promise."""

from __future__ import annotations

import functools
import zlib

import numpy as np
import pytest
import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from torch_zipkv import CacheFullError, CompressedPagedKVCache
from torch_zipkv import format as fmt
from torch_zipkv.page_pool import page_hashes

from cache_oracle import check_layout
from conftest import bits

LAYERS, H, D, P = 2, 2, 64, 16
PAGE_BYTES = 2 * P * H * D * 2


@functools.lru_cache(maxsize=None)
def _row(seed: int) -> torch.Tensor:
    return torch.randn(LAYERS, 2, H, D, generator=torch.Generator().manual_seed(seed)).bfloat16()


def kv_of(token_ids: list[int], start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: k, v bf16 [len - start, H, D] of tokens ``start ..``, each token's a function of the ids up to it."""
    rows = [_row(zlib.crc32(np.asarray(token_ids[: i + 1], dtype=np.int64).tobytes()))
            for i in range(start, len(token_ids))]
    x = torch.stack(rows, 2) if rows else torch.empty(LAYERS, 2, 0, H, D, dtype=torch.bfloat16)
    return [(x[layer, 0], x[layer, 1]) for layer in range(LAYERS)]


def make(chunks: int = 64, chunk_pages: int = 2, max_pages: int = 256) -> CompressedPagedKVCache:
    id_bytes = LAYERS * 2 * H * fmt.meta_words(P, D) * 4
    return CompressedPagedKVCache(LAYERS, H, D, page_size=P, device="cpu", chunk_bytes=chunk_pages * PAGE_BYTES,
                                  max_bytes=chunks * chunk_pages * PAGE_BYTES + max_pages * id_bytes,
                                  max_pages=max_pages)


def start(cache, token_ids: list[int], max_new: int = 0, namespace: bytes = b"") -> tuple[int, int]:
    """A sequence of ``token_ids`` from its longest cached prefix (all but its last token at most), the rest appended;
    its pages cached. Returns (seq id, tokens found)."""
    keys = page_hashes(token_ids, P, namespace)
    prefix = cache.match_prefix(keys[: (len(token_ids) - 1) // P])
    sid = cache.add_sequence(len(token_ids), max_new, prefix=prefix)
    found = len(prefix) * P
    for layer, (k, v) in enumerate(kv_of(token_ids, found)):
        cache.append(layer, sid, k, v)
    cache.cache_pages(sid, keys)
    return sid, found


def assert_holds(cache, sid: int, token_ids: list[int]) -> None:
    for layer, (k, v) in enumerate(kv_of(token_ids)):
        gk, gv = cache.gather(layer, sid)
        assert torch.equal(bits(gk), bits(k)) and torch.equal(bits(gv), bits(v)), f"seq {sid} layer {layer}"


def test_page_keys_chain_the_tokens_before_and_the_namespace():
    a = list(range(48))
    keys = page_hashes(a, P)
    assert len(keys) == 3 and len(set(keys)) == 3 and all(len(k) == 16 for k in keys)
    assert page_hashes(a + [1, 2], P) == keys  # a partial page has no key
    assert page_hashes(a, P, previous=keys[:1]) == keys  # the chain goes on from keys given
    assert page_hashes(a[:16] * 3, P)[1:] != page_hashes(a[:16] * 3, P)[:2]  # the same tokens at another position
    assert page_hashes([9] + a[1:], P)[1:] != keys[1:]  # another token before changes every later key
    assert page_hashes(a, P, "adapter-1") != keys and page_hashes(a, P, b"adapter-1") == page_hashes(a, P, "adapter-1")
    with pytest.raises(TypeError, match="namespace must be bytes or str"):
        page_hashes(a, P, 3)


def test_a_sequence_starts_from_cached_pages_and_charges_only_its_own():
    cache = make()
    prompt = list(range(100, 150))  # 3 full pages and 2 tokens
    a, found = start(cache, prompt, 14)
    assert found == 0 and cache.stats()["cached_pages"] == 3
    before = cache.capacity().pages
    b, found = start(cache, prompt[:40] + [7] * 9, 15)  # 2 pages shared, then its own
    assert found == 32 and cache.seq_len(0, b) == 49
    assert before - cache.capacity().pages == 2  # ceil(64 / 16) - 2 shared: only its own pages are charged
    assert_holds(cache, a, prompt)
    assert_holds(cache, b, prompt[:40] + [7] * 9)
    s = cache.stats()
    assert s["shared_pages"] == 2 and s["shared_bytes"] > 0 and s["evictable_pages"] == 0
    # The whole prompt cached: still the last token (here a whole page) is the sequence's own.
    c, found = start(cache, prompt[:48], 0)
    assert found == 32
    cache.free_sequence(a)  # b and c still hold the shared pages; a's third page is cached, held by none
    assert cache.stats()["evictable_pages"] == 1
    assert_holds(cache, b, prompt[:40] + [7] * 9)
    for sid in (b, c):
        cache.free_sequence(sid)
    s = cache.stats()
    assert s["evictable_pages"] == s["cached_pages"] == 4 and s["evictable_bytes"] == s["cached_bytes"] > 0
    assert s["evictable_bytes"] == s["stored_bytes"]  # nothing else is left


def test_another_namespace_or_position_never_matches():
    cache = make()
    prompt = list(range(64))
    start(cache, prompt, namespace=b"model-a")
    assert cache.match_prefix(page_hashes(prompt, P, b"model-a")) != []
    assert cache.match_prefix(page_hashes(prompt, P, b"model-b")) == []
    assert cache.match_prefix(page_hashes(prompt[16:], P, b"model-a")) == []  # page 1's tokens at position 0


def test_evictable_pages_are_room_capacity_promises_and_admission_evicts_them():
    cache = make(chunks=32)  # 16 chunks, 32 pages, per layer
    empty = cache.capacity().pages
    sids = [start(cache, list(range(i * 1000, i * 1000 + 33)), 0)[0] for i in range(4)]
    for sid in sids:
        cache.free_sequence(sid)
    cache.compress_full_pages()
    s = cache.stats()
    assert s["evictable_pages"] == 8 and s["sequences"] == 0
    assert cache.capacity().pages == empty  # all of it can be promised
    big = cache.add_sequence(empty * P)  # needs every page: every cached page is evicted
    assert cache.stats()["cached_pages"] == 0
    for layer in range(LAYERS):  # and the promise holds
        cache.append(layer, big, *kv_of(list(range(empty * P)))[layer])
    cache.free_sequence(big)
    assert cache.capacity().pages == empty


def test_admission_evicts_least_recently_used_and_only_what_it_needs():
    cache = make(chunks=8)
    old, _ = start(cache, list(range(33)), 0)
    new, _ = start(cache, list(range(500, 533)), 0)
    cache.free_sequence(old)
    cache.free_sequence(new)
    room = cache.capacity().pages
    keys_old, keys_new = page_hashes(list(range(33)), P), page_hashes(list(range(500, 533)), P)
    sid = cache.add_sequence((room - 4) * P + 1)  # needs some of the room the cached pages hold, not all
    assert cache.match_prefix(keys_new) != []  # the newer chain is still found
    assert len(cache.match_prefix(keys_old)) < 2  # the old one lost its tail first
    cache.free_sequence(sid)


def test_a_refused_admission_evicts_nothing_and_a_held_prefix_is_never_evicted():
    from cache_oracle import snapshot

    cache = make(chunks=8)
    prompt = list(range(40))
    a, _ = start(cache, prompt, 0)
    cache.free_sequence(a)
    prefix = cache.match_prefix(page_hashes(prompt, P)[:2])
    assert len(prefix) == 2
    room = cache.capacity().pages
    before = snapshot(cache)
    with pytest.raises(CacheFullError):
        cache.add_sequence((room + 1) * P)
    with pytest.raises(CacheFullError, match="beyond a cached prefix of 2 pages"):
        cache.add_sequence((room + 3) * P, prefix=prefix)  # its own pages would need the prefix's room too
    assert snapshot(cache) == before
    b = cache.add_sequence(room * P, prefix=prefix)  # all the room but the prefix's own
    assert_holds(cache, b, prompt[:32])
    with pytest.raises(ValueError, match="is not a cached page"):
        cache.add_sequence(16, prefix=[999])
    with pytest.raises(ValueError, match="distinct cached pages"):
        cache.add_sequence(16, prefix=prefix)  # more than its budget


PREFIXES = [list(range(1, 41)), list(range(1, 17)) + list(range(300, 324)), list(range(700, 733))]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Sequences over PREFIXES on an arena of 24 chunks of 2 pages (12 per layer): admissions must evict."""

    def __init__(self):
        super().__init__()
        self.cache = make(chunks=24, chunk_pages=2, max_pages=64)
        self.ids = {}  # running seq -> its token ids
        self.budget = {}  # seq -> tokens promised
        self.serial = 0

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.sampled_from([40, 32, 17, 16, 5, 0]),
          own=st.integers(0, 20), new=st.integers(0, 40))
    def add(self, prefix, cut, own, new):
        self.serial += 1
        token_ids = PREFIXES[prefix][:cut] + [1000 + self.serial] * own or [5]
        keys = page_hashes(token_ids, P)
        prefix_pages = self.cache.match_prefix(keys[: (len(token_ids) - 1) // P])
        found = len(prefix_pages) * P
        held = all(p not in self.cache._pool.evictable for p in prefix_pages)
        cap = self.cache.capacity(len(token_ids) - found, new).requests
        cached = self.cache.stats()["cached_pages"]
        try:
            sid = self.cache.add_sequence(len(token_ids), new, prefix=prefix_pages)
        except CacheFullError:
            assert not (cap and held), "capacity() admitted what add_sequence refused"
            event("admission refused")
            return
        assert cap, "add_sequence admitted what capacity() refused"
        if found:
            event("started from a cached prefix")
        if self.cache.stats()["cached_pages"] < cached:
            event("admission evicted cached pages")
        for layer, (k, v) in enumerate(kv_of(token_ids, found)):
            self.cache.append(layer, sid, k, v)
        self.cache.cache_pages(sid, keys)
        self.ids[sid], self.budget[sid] = token_ids, len(token_ids) + new

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), steps=st.integers(1, 4))
    def decode(self, data, steps):
        sids = data.draw(st.lists(st.sampled_from(sorted(self.ids)), min_size=1, unique=True))
        for _ in range(steps):
            sids = [s for s in sids if len(self.ids[s]) < self.budget[s]]  # within budgets: never refused
            if not sids:
                return
            step = self.cache.prepare_step(sids)
            for s in sids:
                self.serial += 1
                self.ids[s] = self.ids[s] + [2000 + self.serial]
            rows = [kv_of(self.ids[s], len(self.ids[s]) - 1) for s in sids]
            for layer in range(LAYERS):
                k = torch.cat([r[layer][0] for r in rows])
                v = torch.cat([r[layer][1] for r in rows])
                self.cache.step_append(layer, step, k, v)

    @precondition(lambda self: self.ids)
    @rule(data=st.data(), keep=st.booleans())
    def end(self, data, keep):
        """A finish (its full pages cached) or an abort (nothing more cached)."""
        sid = data.draw(st.sampled_from(sorted(self.ids)))
        if keep:
            self.cache.cache_pages(sid, page_hashes(self.ids[sid], P))
        self.cache.free_sequence(sid)
        del self.ids[sid], self.budget[sid]

    @rule(wait=st.booleans())
    def compress(self, wait):
        self.cache.compress_full_pages(wait=wait)

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def grow(self, data):
        """A sequence grows to its whole budget: a promise eviction never breaks."""
        sid = data.draw(st.sampled_from(sorted(self.ids)))
        n = self.budget[sid] - len(self.ids[sid])
        if n:
            self.ids[sid] = self.ids[sid] + [3000 + i for i in range(n)]
            for layer, (k, v) in enumerate(kv_of(self.ids[sid], len(self.ids[sid]) - n)):
                self.cache.append(layer, sid, k, v)

    @invariant()
    def each_holds_its_own_tokens(self):
        for sid, token_ids in self.ids.items():
            assert_holds(self.cache, sid, token_ids)
        kept = {(sid, layer): kv for sid, ids in self.ids.items() for layer, kv in enumerate(kv_of(ids))}
        check_layout(self.cache, kept)  # no live streams overlap; each page's in a chunk its layer owns
        arena, pool = self.cache._arena, self.cache._pool
        assert arena.pool_need() <= len(arena.pool), "the pool can no longer keep the promises"
        assert len(pool.free_ids) >= pool.reserved_ids
        held = np.concatenate([self.cache._seq(s).pages[: self.cache._seq(s).num_ids] for s in self.ids] +
                              [np.empty(0, dtype=np.int32)])
        assert not set(held.tolist()) & (set(pool.free_ids) | set(pool.evictable)), "a held page was freed"
        for p in pool.evictable:  # cached pages keep their bytes in every layer
            assert (arena.offset[:, p] >= 0).all()


PrefixCacheMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=40, deadline=None,
                                                derandomize=True)
test_prefix_cache_programs = PrefixCacheMachine.TestCase
