"""Decode steps over padded, static input buffers: one set per (batch bucket, page-table width), replayed as a CUDA
Graph captured on first use, or run through the compiled forward directly (a compiled engine without graphs, as on
CPU).

A graph is a capture of the model's decode forward (eager, or ``torch.compile``d) over static input buffers: token
ids, positions and a static ``DecodeStep`` of the cache (``CompressedPagedKVCache.static_step``: ``page_ids``,
``slots``, ``kv_indptr``, ``kv_indices``, ``kv_last_page_len``), which the forward reads through the cache's own
``step_append`` / ``step_decode``. Before each replay the step the cache prepared is checked (``check_step``: this
cache's, not stale) and copied into the buffers (device-to-device copies, no host sync).

Padding: a batch of B rows runs in the bucket's Bp >= B rows. A padded row appends its (garbage) K/V to the engine's
pad page (a page of a one-token sequence the engine keeps for this, so its slots 1.. are never anyone's tokens), each
padded row to its own slot, and reads nothing (``kv_indptr`` repeats the last real entry, ``kv_last_page_len`` 0), so
it neither writes into a real page nor is read back; its logits are dropped.

A step with a shared-prefix pass (``DecodeStep.shared``, laid out for the bucket's rows: the padded rows join the
rows that share nothing) runs in buffer sets of its own, keyed also by the length of its prefix table; its tables are
copied like the others. A compiled engine that may run the pass compiles both variants at its first decode step
(the one it meets first, and the other over the pad page): the shared variant is a dynamo graph of its own, and
compiling it when rows first share a prefix stalled a step in the middle of serving (90 s on the 8B model).

``kv_indices`` is sized to the next power of two of the step's table, so the decode kernel's launch plan (read from
the shapes) stays close to what the eager step would pick, with few captures.

Compiled: the batch and width dimensions of every buffer are marked dynamic, so one compilation serves every bucket
and width, and a new (bucket, width) costs a capture, never a recompile. Buckets then start at 2 rows: dynamo
specializes a dimension of size 1, so a batch-1 bucket would compile a second graph.
"""

from __future__ import annotations

import time

import torch

from ..shared_prefix import MIN_PAGES
from ..shared_prefix import TENSORS as SHARED_TENSORS
from ..shared_prefix import SharedTables


def bucket_sizes(max_batch: int, smallest: int = 1) -> list[int]:
    """``smallest`` (1 or 2), 2, 4, 8, then every 16, then ``max_batch``: a bucket pads at most 15 rows (one page's
    slots besides the pad token, so every padded row writes its own slot)."""
    sizes = [b for b in (1, 2, 4, 8) if smallest <= b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sizes + [max(max_batch, smallest)]


class _Buffers:
    """The static inputs of one (bucket, width), their DecodeStep, and (captured) its graph and output."""

    def __init__(self, kv, batch: int, width: int, pad_page: int, dynamic: bool, shared: tuple | None):
        device, page_size = kv.device, kv.page_size
        i32 = dict(dtype=torch.int32, device=device)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.pad_page_ids = torch.full((batch,), pad_page, **i32)
        # row r pads into slot 1 + r % (page_size - 1): distinct for the <= 15 padded rows of a bucket
        self.pad_slots = 1 + torch.arange(batch, **i32) % (page_size - 1)
        self.page_ids = self.pad_page_ids.clone()
        self.slots = self.pad_slots.clone()
        self.indptr = torch.zeros(batch + 1, **i32)
        self.indices = torch.zeros(width, **i32)
        self.last = torch.zeros(batch, **i32)
        if dynamic:
            for t in (self.ids, self.pos, self.page_ids, self.slots, self.indptr, self.indices, self.last):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        self.shared = None
        if shared is not None:  # (prefix pages,): a SharedTables over buffers, copied whole each step
            # The pad page until a step's ids are copied in: a written page, so the capture's rebuild reads real bytes
            ids = torch.full(shared, pad_page, **i32)
            self.shared = SharedTables(ids, torch.zeros(batch, **i32), rows=batch, sharing_rows=0, shared_pages=0)
            if dynamic:  # one compilation for every bucket and prefix length
                for t in (ids, self.shared.sharing):
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        self.step = kv.static_step(self.page_ids, self.slots, self.indptr, self.indices, self.last, self.shared)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None


class DecodeGraphs:
    """Runs the decode steps of the paged cache ``kv`` over padded static buffers. ``forward(ids [Bp, 1], pos [Bp, 1],
    step) -> logits [Bp, vocab]`` runs the model once (the engine's decode forward) on a DecodeStep of ``kv``.
    ``capture``: replay CUDA Graphs (else call ``forward`` on the buffers); ``compiled``: ``forward`` is
    ``torch.compile``d (dynamic buffers, buckets from 2); ``shared_prefix``: steps may carry a shared-prefix pass
    (a compiled forward then compiles both variants at the first step)."""

    def __init__(self, forward, kv, *, max_batch: int, pad_page: int, capture: bool, compiled: bool,
                 shared_prefix: bool = False):
        self.forward, self.kv, self.pad_page, self.device = forward, kv, pad_page, kv.device
        self.capture, self.compiled = capture, compiled
        self._compile_both = compiled and shared_prefix
        self.buckets = bucket_sizes(max_batch, 2 if compiled else 1)
        self.buffers: dict[tuple[int, int], _Buffers] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.setup_s = 0.0  # host seconds spent making buffer sets: the compilation and the captures


    @property
    def graphs(self) -> int:
        """CUDA Graphs captured so far."""
        return sum(b.graph is not None for b in self.buffers.values())

    def bucket(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} exceeds the largest bucket {self.buckets[-1]}")

    def _make(self, batch: int, width: int, shared: tuple | None, run: bool = False) -> _Buffers:
        """A buffer set, captured (``capture``) or, with ``run``, its forward run once on padded rows (compiling it)."""
        g = _Buffers(self.kv, batch, width, self.pad_page, self.compiled, shared)
        if not self.capture:
            if run:
                self.forward(g.ids, g.pos, g.step)
            return g
        # Every row is a padded row while capturing: the warm-up run writes only into the pad page.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.forward(g.ids, g.pos, g.step)
        torch.cuda.current_stream(self.device).wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.logits = self.forward(g.ids, g.pos, g.step)
        return g

    def run(self, ids: torch.Tensor, pos: torch.Tensor, step) -> torch.Tensor:
        """Run the decode step of B rows (``ids``, ``pos`` int64 [B]; ``step`` a DecodeStep); returns the logits
        [B, vocab] (captured: a view of the graph's output, valid until the next replay)."""
        self.kv.check_step(step, "decode graph")
        b = ids.shape[0]
        bp = self.bucket(b)
        n = step.kv_indices.shape[0]
        width = max(16, 1 << (n - 1).bit_length())
        sh = step.shared
        if sh is not None and sh.rows != bp:
            raise ValueError(f"decode graph: the step's shared-prefix pass is laid out for {sh.rows} rows, the bucket "
                             f"of {b} rows has {bp}")
        shared = None if sh is None else tuple(sh.prefix_ids.shape)
        g = self.buffers.get((bp, width, shared))
        if g is None:
            t = time.perf_counter()
            g = self.buffers[(bp, width, shared)] = self._make(bp, width, shared)
            if self._compile_both:  # the other variant now, not when it first comes in the middle of serving
                other = (MIN_PAGES,) if shared is None else None
                if (bp, width, other) not in self.buffers:
                    self.buffers[(bp, width, other)] = self._make(bp, width, other, run=True)
                self._compile_both = False
            self.setup_s += time.perf_counter() - t
        g.ids[:b, 0].copy_(ids)
        g.pos[:b, 0].copy_(pos)
        g.page_ids[:b].copy_(step.page_ids)
        g.slots[:b].copy_(step.slots)
        g.indptr[: b + 1].copy_(step.kv_indptr)
        g.last[:b].copy_(step.kv_last_page_len)
        g.indices[:n].copy_(step.kv_indices)
        if sh is not None:
            for name in SHARED_TENSORS:
                getattr(g.shared, name).copy_(getattr(sh, name))
        if bp > b:  # rows a larger batch used before are padded rows again
            g.page_ids[b:].copy_(g.pad_page_ids[b:])
            g.slots[b:].copy_(g.pad_slots[b:])
            g.indptr[b + 1:].copy_(step.kv_indptr[b:].expand(bp - b))
            g.last[b:].zero_()
            g.ids[b:].zero_()
            g.pos[b:].zero_()
        if g.graph is None:
            return self.forward(g.ids, g.pos, g.step)[:b]
        g.graph.replay()
        return g.logits[:b]
