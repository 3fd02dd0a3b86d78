"""Random workloads against CompressedPagedKVCache (hypothesis, stateful): add / append (prefill chunks and decode
steps, any layer, any subset of sequences) / prepared decode steps of every layer / compress (waiting, or placed a call
later) / decode / free / compact, with the checks of cache_oracle after every step: contents bit-exact, no overlapping
pages, accounting that adds up, promises that hold. The last layer slides over a 10-token window: it attends to the
window and frees the pages before it.

Adversarial too, on small budgets (a tight arena; few page ids): calls the cache must refuse (too big, stale decode
steps, bad arguments) raise the documented error (CacheFullError with requested > free, RuntimeError, TypeError,
ValueError) and change nothing: the arena's bytes, the meta rows, stats(), capacity(), every sequence's lengths and
gather() bits are compared. Derandomized: every run plays the same programs; a failure names its steps."""

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from torch_zipkv import CacheFullError, CompressedPagedKVCache
from torch_zipkv import format as fmt

from cache_oracle import check_accounting, check_contents, check_layout, decode_reference, snapshot, tokens
from conftest import bits, rel_err

LAYERS, HEADS, HEAD_DIM, PAGE = 3, 2, 64, 16
WINDOW = 10  # of layer LAYERS - 1: pages fall out of it from 26 tokens on
PAGE_BYTES = 2 * PAGE * HEADS * HEAD_DIM * 2
ID_BYTES = LAYERS * 2 * HEADS * fmt.meta_words(PAGE, HEAD_DIM) * 4  # the meta rows of one page id
UNITS = {"pages", "pages per layer", "page ids"}
OLD_STEPS = 4  # decode steps remembered to try again once stale


def check_full(e: CacheFullError) -> None:
    """A CacheFullError a scheduler can act on: requested and free in one unit it names, requested > free."""
    assert e.unit in UNITS and 0 <= e.free < e.requested, (e.unit, e.requested, e.free, str(e))


class CacheMachine(RuleBasedStateMachine):
    chunk_pages = 4  # chunk size in raw pages
    chunks = 16
    max_pages = None  # page ids: the cache's default (enough for an arena of compressed pages)

    def __init__(self):
        super().__init__()
        ids = 8192 if self.max_pages is None else self.max_pages * ID_BYTES
        self.cache = CompressedPagedKVCache(
            LAYERS, HEADS, HEAD_DIM, page_size=PAGE, device="cpu", chunk_bytes=self.chunk_pages * PAGE_BYTES,
            max_bytes=self.chunks * self.chunk_pages * PAGE_BYTES + ids, max_pages=self.max_pages,
            sliding_window=[None] * (LAYERS - 1) + [WINDOW])
        assert self.cache._arena.num_chunks == self.chunks
        self.kept = {}  # (seq, layer) -> (k, v) appended so far
        self.budget = {}  # seq -> tokens promised
        self.wild = set()  # (seq, layer) holding random bit patterns: NaN, Inf, 1e38; no attention oracle there
        # Decode steps prepared, with the number of changes (admissions, frees, compressions, compactions) before
        # each: a step is stale exactly when a change came after it.
        self.changes = 0
        self.steps = []

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

    def refused(self, call, error, match: str | None = None) -> BaseException:
        """``call()`` raises ``error`` (whose message matches ``match``) and changes nothing."""
        before = snapshot(self.cache)
        try:
            call()
        except error as e:
            assert match is None or match in str(e), (match, str(e))
            assert snapshot(self.cache) == before, f"a refused call changed the cache: {e}"
            if isinstance(e, CacheFullError):
                check_full(e)
            return e
        raise AssertionError(f"no {error.__name__}")

    def changed(self) -> None:
        """An admission, a free, a compression or a compaction: every step prepared so far is stale now."""
        self.changes += 1

    @initialize(budgets=st.lists(st.integers(0, 48), min_size=1, max_size=4))
    def start(self, budgets):
        for b in budgets:
            self.add(b, 0)

    @rule(prompt=st.integers(0, 40), new=st.integers(0, 24))
    def add(self, prompt, new):
        cap = self.cache.capacity(prompt, new)
        before = snapshot(self.cache) if cap.requests == 0 else None  # a refusal capacity() admitted fails anyway
        try:
            sid = self.cache.add_sequence(prompt, new)
        except CacheFullError as e:
            assert cap.requests == 0, "capacity() admitted a request add_sequence refused"
            check_full(e)
            assert snapshot(self.cache) == before
            event(f"add refused: {e.unit}")
            return
        assert cap.requests >= 1 or prompt + new == 0, "add_sequence admitted a request capacity() refused"
        self.changed()
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
        before = None if within else snapshot(self.cache)  # a refusal within the budgets fails anyway
        try:
            self.cache.append(layer, sids[0] if prefill else sids, k, v)
        except CacheFullError as e:
            event(f"append refused: {e.unit}")
            check_full(e)
            assert not within, "an append within the sequences' budgets ran out of memory"
            assert snapshot(self.cache) == before, "a refused append changed the cache"
            return
        at = 0
        for s, c in zip(sids, counts):
            if kind == 2:
                self.wild.add((s, layer))
            old_k, old_v = self.kept[(s, layer)]
            self.kept[(s, layer)] = (torch.cat([old_k, k[at: at + c]]), torch.cat([old_v, v[at: at + c]]))
            at += c

    @precondition(lambda self: self.budget)
    @rule(data=st.data(), seed=st.integers(0, 2**31), count=st.integers(1, 6))
    def step(self, data, seed, count):
        """``count`` decode steps of some sequences, each prepared once for every layer (prepare_step) and each
        layer's token written with step_append, then one layer's attention through the last step's page table. Past
        their budgets, steps take free room while it lasts, then are refused."""
        in_sync = [s for s in self.live() if len({self.length(s, layer) for layer in range(LAYERS)}) == 1]
        if not in_sync:
            return
        sids = data.draw(st.lists(st.sampled_from(in_sync), min_size=1, max_size=len(in_sync), unique=True))
        for n in range(count):
            step = self.prepared_step(sids, seed + LAYERS * n)
            if step is None:
                return
        layer = data.draw(st.integers(0, LAYERS - 1))
        finite = [i for i, s in enumerate(sids) if (s, layer) not in self.wild]
        q = torch.randn(len(sids), 2 * HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).bfloat16()
        out = self.cache.step_decode(layer, step, q)
        ref = decode_reference(q, [self.attended(s, layer) for s in sids], PAGE)
        for i in finite:
            assert rel_err(out[i], ref[i]) < 1e-2

    def prepared_step(self, sids: list[int], seed: int):
        """One decode step of ``sids`` through prepare_step and step_append, recorded; None if it was refused (only
        past the budgets, changing nothing)."""
        within = all(self.length(s, 0) < self.budget[s] for s in sids)
        before = None if within else snapshot(self.cache)  # a refusal within the budgets fails anyway
        try:
            step = self.cache.prepare_step(sids)
        except CacheFullError as e:
            event(f"step refused: {e.unit}")
            check_full(e)
            assert not within, "a step within the sequences' budgets ran out of memory"
            assert snapshot(self.cache) == before, "a refused step changed the cache"
            return None
        self.steps = self.steps[1 - OLD_STEPS:] + [(step, self.changes, sids)]
        for layer in range(LAYERS):
            k, v = tokens(seed + layer, len(sids), HEADS, HEAD_DIM)
            self.cache.step_append(layer, step, k, v)
            for i, s in enumerate(sids):
                old_k, old_v = self.kept[(s, layer)]
                self.kept[(s, layer)] = (torch.cat([old_k, k[i: i + 1]]), torch.cat([old_v, v[i: i + 1]]))
        return step

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
        self.changed()
        self.trim()
        assert self.waiting()[0] == 0 and self.waiting()[1] <= full  # <: the window freed some
        if full and in_flight:
            event("a round placed while the next starts")

    @rule()
    def compress(self):
        full, in_flight = self.waiting()
        slid = sum(self.waiting(slice(-1, None)))
        assert full + in_flight - slid <= self.cache.compress_full_pages() <= full + in_flight  # less what it frees
        self.changed()
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
        self.changed()
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
        self.changed()
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

    @precondition(lambda self: self.steps)
    @rule(data=st.data(), layer=st.integers(-1, LAYERS - 1), seed=st.integers(0, 2**31))
    def old_step(self, data, layer, seed):
        """A step prepared before an admission, a free, a compression or a compaction (its page ids may be another
        sequence's now, its pages compressed) is refused by step_append and step_decode, writing nothing. A step
        still valid is refused at layer -1 (no layer, not Python's last)."""
        step, changes, sids = data.draw(st.sampled_from(self.steps))
        if changes < self.changes:
            error, match = RuntimeError, "DecodeStep is stale"
            event("a stale step refused")
        elif layer < 0:
            error, match = ValueError, "layer must be"
        else:
            return  # a valid use: the step rule's
        k, v = tokens(seed, len(sids), HEADS, HEAD_DIM)
        self.refused(lambda: self.cache.step_append(layer, step, k, v), error, match)
        q = torch.randn(len(sids), 2 * HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).bfloat16()
        self.refused(lambda: self.cache.step_decode(layer, step, q), error, match)

    @precondition(lambda self: self.budget)
    @rule(data=st.data(), which=st.integers(0, 13))
    def bad_call(self, data, which):
        """A call with a bad argument raises the error the docs name for it (docs/api.md, Errors) and changes
        nothing; a request larger than what is free raises CacheFullError."""
        c, live = self.cache, self.live()
        sid = data.draw(st.sampled_from(live))
        unknown = max(live) + 1000
        k, v = tokens(which, 2, HEADS, HEAD_DIM)
        q = torch.zeros(1, 2 * HEADS, HEAD_DIM, dtype=torch.bfloat16)
        calls = [
            (lambda: c.append(0, sid, k.float(), v), TypeError),  # wrong dtype
            (lambda: c.append(LAYERS, sid, k, v), ValueError),  # no such layer
            (lambda: c.append(True, sid, k, v), TypeError),  # a bool is no layer
            (lambda: c.append(0, unknown, k, v), ValueError),  # no such sequence
            (lambda: c.append(0, [sid, sid], k, v), ValueError),  # one sequence twice: two tokens to one place
            (lambda: c.append(0, sid, k, v[:1]), ValueError),  # k and v of different shapes
            (lambda: c.prepare_step([sid, sid]), ValueError),
            (lambda: c.decode(0, q[:, :3], [sid]), ValueError),  # a head count no GQA group gives
            (lambda: c.add_sequence(-1), ValueError),
            (lambda: c.add_sequence(True), TypeError),
            (lambda: c.capacity(-5, 0), ValueError),
            (lambda: c.free_sequence(unknown), ValueError),
            (lambda: c.gather(-1, sid), ValueError),
            (lambda: c.add_sequence((c.capacity().pages + 1) * PAGE), CacheFullError),  # one page too many
        ]
        self.refused(*calls[which])

    @precondition(lambda self: self.budget)
    @rule()
    def ragged_step(self):
        """prepare_step of a sequence whose layers differ in length: RuntimeError, nothing changed."""
        ragged = [s for s in self.live() if len({self.length(s, layer) for layer in range(LAYERS)}) > 1]
        if ragged:
            self.refused(lambda: self.cache.prepare_step(ragged[:1]), RuntimeError, "every layer at the same length")

    @invariant()
    def steps_are_stale_exactly_after_a_change(self):
        for step, changes, _ in self.steps:
            assert step.stale == (changes < self.changes)

    @invariant()
    def consistent(self):
        check_contents(self.cache, self.kept)
        streams = check_layout(self.cache, self.kept)
        check_accounting(self.cache, self.kept, streams)


class TightCacheMachine(CacheMachine):
    """Barely room for three layers: refusals, in-place compression and chunk reuse across layers are common."""

    chunk_pages = 2
    chunks = 9


class FewIdsCacheMachine(CacheMachine):
    """Room for many pages but 12 page ids: the ids run out first, for admissions, appends and steps alike."""

    max_pages = 12


SETTINGS = settings(max_examples=80, stateful_step_count=60, deadline=None, derandomize=True)
TestCache = CacheMachine.TestCase
TestCache.settings = SETTINGS
TestTightCache = TightCacheMachine.TestCase
TestTightCache.settings = SETTINGS
TestFewIdsCache = FewIdsCacheMachine.TestCase
TestFewIdsCache.settings = SETTINGS
