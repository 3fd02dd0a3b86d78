"""Random workloads against CompressedPagedKVCache (hypothesis, stateful): add / append (prefill chunks and decode
steps, any layer, any subset of sequences) / prepared decode steps of every layer / compress (waiting, or placed a call
later) / decode / free / compact, with the checks of cache_oracle after every step: contents bit-exact, no overlapping
pages, accounting that adds up, promises that hold. The last layer slides over a 10-token window: it attends to the
window and frees the pages before it."""

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from torch_zipkv import CacheFullError, CompressedPagedKVCache

from cache_oracle import check_accounting, check_contents, check_layout, decode_reference, tokens
from conftest import bits, rel_err

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 64, 16
WINDOW = 10  # of layer LAYERS - 1: pages fall out of it from 26 tokens on
PAGE_BYTES = 2 * PAGE * HEADS * HEAD_DIM * 2


class CacheMachine(RuleBasedStateMachine):
    chunk_pages = 4  # chunk size in raw pages
    chunks = 16

    def __init__(self):
        super().__init__()
        self.cache = CompressedPagedKVCache(
            LAYERS, HEADS, HEAD_DIM, page_size=PAGE, device="cpu", chunk_bytes=self.chunk_pages * PAGE_BYTES,
            max_bytes=self.chunks * self.chunk_pages * PAGE_BYTES + 8192,
            sliding_window=[None] * (LAYERS - 1) + [WINDOW])
        assert self.cache._arena.num_chunks == self.chunks
        self.kept = {}  # (seq, layer) -> (k, v) appended so far
        self.budget = {}  # seq -> tokens promised
        self.wild = set()  # (seq, layer) holding random bit patterns: NaN, Inf, 1e38; no attention oracle there

    def live(self) -> list[int]:
        return sorted(self.budget)

    def length(self, sid: int, layer: int) -> int:
        """Tokens appended (kept holds those a sliding window has not freed)."""
        return self.cache.seq_len(layer, sid)

    def attended(self, sid: int, layer: int):
        """The (k, v) decode attends to: all kept tokens, or the window's in the sliding layer."""
        k, v = self.kept[(sid, layer)]
        return (k[-WINDOW:], v[-WINDOW:]) if layer == LAYERS - 1 else (k, v)

    def trim(self) -> None:
        """After a compression: the sliding layer keeps what it has not freed, never a token of the window."""
        for sid in self.live():
            n, first = self.length(sid, LAYERS - 1), self.cache.kept_from(LAYERS - 1, sid)
            assert first % PAGE == 0 and first <= max(0, n - WINDOW), (first, n)
            k, v = self.kept[(sid, LAYERS - 1)]
            cut = first - (n - k.shape[0])
            if cut:
                event("a sliding window freed pages")
            self.kept[(sid, LAYERS - 1)] = (k[cut:], v[cut:])

    def snapshot(self):
        return self.cache.stats(), self.cache.capacity(16, 16)

    @initialize(budgets=st.lists(st.integers(0, 48), min_size=1, max_size=4))
    def start(self, budgets):
        for b in budgets:
            self.add(b, 0)

    @rule(prompt=st.integers(0, 40), new=st.integers(0, 24))
    def add(self, prompt, new):
        cap = self.cache.capacity(prompt, new)
        before = self.snapshot()
        try:
            sid = self.cache.add_sequence(prompt, new)
        except CacheFullError as e:
            assert cap.requests == 0 and e.requested > e.free, "capacity() admitted a request add_sequence refused"
            assert self.snapshot() == before
            event("add refused")
            return
        assert cap.requests >= 1 or prompt + new == 0, "add_sequence admitted a request capacity() refused"
        self.budget[sid] = prompt + new
        empty = torch.empty(0, HEADS, HEAD_DIM, dtype=torch.bfloat16)
        for layer in range(LAYERS):
            self.kept[(sid, layer)] = (empty, empty)

    @precondition(lambda self: self.budget)
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), seed=st.integers(0, 2**31), kind=st.integers(0, 2),
          prefill=st.booleans())
    def append(self, data, layer, seed, kind, prefill):
        live = self.live()
        if prefill:
            sids = [data.draw(st.sampled_from(live))]
            counts = [data.draw(st.integers(1, 48))]
        else:
            sids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
            counts = [1] * len(sids)
        k, v = tokens(seed, sum(counts), HEADS, HEAD_DIM, kind)
        within = all(self.length(s, layer) + c <= self.budget[s] for s, c in zip(sids, counts))
        before = self.snapshot()
        try:
            self.cache.append(layer, sids[0] if prefill else sids, k, v)
        except CacheFullError:
            event("append refused")
            assert not within, "an append within the sequences' budgets ran out of memory"
            assert self.snapshot() == before, "a refused append changed the cache"
            return
        at = 0
        for s, c in zip(sids, counts):
            if kind == 2:
                self.wild.add((s, layer))
            old_k, old_v = self.kept[(s, layer)]
            self.kept[(s, layer)] = (torch.cat([old_k, k[at: at + c]]), torch.cat([old_v, v[at: at + c]]))
            at += c

    @precondition(lambda self: self.budget)
    @rule(data=st.data(), seed=st.integers(0, 2**31))
    def step(self, data, seed):
        """A decode step prepared once for every layer (prepare_step), each layer's token written with step_append,
        and one layer's attention through the step's page table."""
        in_sync = [s for s in self.live() if len({self.length(s, layer) for layer in range(LAYERS)}) == 1]
        if not in_sync:
            return
        sids = data.draw(st.lists(st.sampled_from(in_sync), min_size=1, max_size=len(in_sync), unique=True))
        within = all(self.length(s, 0) < self.budget[s] for s in sids)
        before = self.snapshot()
        try:
            step = self.cache.prepare_step(sids)
        except CacheFullError:
            event("step refused")
            assert not within, "a step within the sequences' budgets ran out of memory"
            assert self.snapshot() == before, "a refused step changed the cache"
            return
        for layer in range(LAYERS):
            k, v = tokens(seed + layer, len(sids), HEADS, HEAD_DIM)
            self.cache.step_append(layer, step, k, v)
            for i, s in enumerate(sids):
                old_k, old_v = self.kept[(s, layer)]
                self.kept[(s, layer)] = (torch.cat([old_k, k[i: i + 1]]), torch.cat([old_v, v[i: i + 1]]))
        layer = data.draw(st.integers(0, LAYERS - 1))
        finite = [i for i, s in enumerate(sids) if (s, layer) not in self.wild]
        q = torch.randn(len(sids), 2 * HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).bfloat16()
        out = self.cache.step_decode(layer, step, q)
        ref = decode_reference(q, [self.attended(s, layer) for s in sids], PAGE)
        for i in finite:
            assert rel_err(out[i], ref[i]) < 1e-2

    def waiting(self, layers=slice(None)) -> tuple[int, int]:
        """Full pages not yet compressed, and pages of compression rounds not yet placed (in ``layers``)."""
        layers = self.cache.stats()["layers"][layers]
        return sum(x["waiting_full_pages"] for x in layers), sum(x["compressing_pages"] for x in layers)

    @rule()
    def compress_later(self):
        """compress_full_pages(wait=False): places the rounds earlier calls started (still their pages: freed ones
        drop out), starts one for every full page, and leaves it in flight; those pages still read raw meanwhile."""
        full, in_flight = self.waiting()
        # Exactly the rounds in flight are placed, less what the sliding layer frees first.
        assert in_flight - self.waiting(slice(-1, None))[1] <= self.cache.compress_full_pages(wait=False) <= in_flight
        self.trim()
        assert self.waiting()[0] == 0 and self.waiting()[1] <= full  # <: the window freed some
        if full and in_flight:
            event("a round placed while the next starts")

    @rule()
    def compress(self):
        full, in_flight = self.waiting()
        slid = sum(self.waiting(slice(-1, None)))
        assert full + in_flight - slid <= self.cache.compress_full_pages() <= full + in_flight  # less what it frees
        self.trim()
        arena = self.cache._arena
        if any(0 < n < arena.page_bytes and arena.kind[o // arena.chunk_bytes] == 1
               for o, n in zip(arena.offset.flat, arena.nbytes.flat)):
            event("a page compressed in place")
        assert self.waiting() == (0, 0)

    @precondition(lambda self: self.budget)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        in_flight = self.waiting()[1]
        self.cache.free_sequence(sid)
        if self.waiting()[1] < in_flight:
            event("freed pages dropped out of a round in flight")
        del self.budget[sid]
        for layer in range(LAYERS):
            del self.kept[(sid, layer)]
            self.wild.discard((sid, layer))

    @rule()
    def compact(self):
        free_before = self.cache.stats()["free_chunks"]
        if self.cache.compact():
            event("compaction moved pages")
        assert self.cache.stats()["free_chunks"] >= free_before

    @precondition(lambda self: self.budget)
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), seed=st.integers(0, 2**31))
    def decode(self, data, layer, seed):
        """Attention through the cache matches float64 attention over what was appended (Gaussian data only)."""
        finite = [s for s in self.live() if (s, layer) not in self.wild]
        if not finite:
            return
        sids = data.draw(st.lists(st.sampled_from(finite), min_size=1, max_size=len(finite), unique=True))
        q = torch.randn(len(sids), 2 * HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).bfloat16()
        out = self.cache.decode(layer, q, sids)
        ref = decode_reference(q, [self.attended(s, layer) for s in sids], PAGE)
        for b, s in enumerate(sids):
            if self.kept[(s, layer)][0].shape[0] == 0:
                assert torch.equal(bits(out[b]), bits(torch.zeros_like(out[b])))
            else:
                assert rel_err(out[b], ref[b]) < 1e-2

    @invariant()
    def consistent(self):
        check_contents(self.cache, self.kept)
        streams = check_layout(self.cache, self.kept)
        check_accounting(self.cache, self.kept, streams)


class TightCacheMachine(CacheMachine):
    """Barely room for three layers: refusals, in-place compression and chunk reuse across layers are common."""

    chunk_pages = 2
    chunks = 9


TestCache = CacheMachine.TestCase
TestCache.settings = settings(max_examples=80, stateful_step_count=60, deadline=None)
TestTightCache = TightCacheMachine.TestCase
TestTightCache.settings = settings(max_examples=80, stateful_step_count=60, deadline=None)
