"""Compression of full pages in rounds that never make the host wait for the device.

A page fills while it is open (raw, in a slot of ``data``); full, it waits here until the cache's
``compress_full_pages``. Then the waiting pages of every layer are compressed in rounds of up to :data:`ROUND_BYTES`
of raw pages: one decompress and one compress op call per round, on the meta rows of all layers, into a scratch
buffer. To place a round the arena needs the pages' compressed sizes on the host, so a round is placed either at once
(waiting for the sizes: a device sync) or by a later call once its sizes have arrived. Until then its pages stay raw
and untouched in their slots, correct to read. At most :data:`MAX_ROUNDS` rounds are in flight (their scratch is the
memory compression borrows); a call that does not wait starts no more than that, and the pages past them wait for a
later call: placing a round to make room would wait for the device. (The engine's prefill fills several rounds'
worth between two calls; on the H100 a serving step that ran such a call took ~36 ms more than one that did not.)
A page freed meanwhile (its sequence ended, or it left a sliding window) is skipped when its round is placed, even
if its id was reused.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from . import format as fmt
from . import ops
from .arena import Arena
from .page_store import PageStore

ROUND_BYTES = 256 << 20  # raw bytes compressed per round: bounds the temporary pages and scratch
MAX_ROUNDS = 2  # rounds compressed and not yet placed


@dataclass
class _Round:
    """Pages compressed together into ``scratch`` and not yet placed in the arena (they still read raw from their
    slots, untouched): where each page's streams start in scratch and where the last ends (``ends``, bytes, a host
    tensor: pinned on CUDA, filled by a copy that ``done`` marks), and their meta rows relative to scratch."""

    serial: int
    layers: np.ndarray
    pids: np.ndarray
    scratch: torch.Tensor  # uint8, the compressed streams back to back
    meta: torch.Tensor  # int32 [n, 2, H, W]
    ends: torch.Tensor  # int64 [n + 1], bytes
    done: torch.cuda.Event | None


class CompressionRounds:
    """The full pages of every layer waiting for compression, and the rounds compressed but not yet placed. Placing
    a page moves its compressed bytes where the arena says and points its meta rows there."""

    def __init__(self, store: PageStore, arena: Arena, num_layers: int, max_pages: int):
        self._store, self._arena = store, arena
        self._layers = np.arange(num_layers)
        self._full: list[dict[int, None]] = [{} for _ in range(num_layers)]  # full raw pages, in fill order
        # Rounds not placed yet, oldest first, and per (layer, page) the serial of the round it is in (-1: none).
        # Forgetting a page resets its entry, so its round skips it even if the id is reused meanwhile.
        self._rounds: collections.deque[_Round] = collections.deque()
        self._round_of = np.full((num_layers, max_pages), -1, dtype=np.int64)
        self._next_serial = 0

    def add_full(self, layers: slice, pids: list[int]) -> None:
        """Pages ``pids`` of each of ``layers`` are full: they wait for :meth:`compress`."""
        pids = dict.fromkeys(pids)
        for full in self._full[layers]:
            full.update(pids)

    def forget(self, layer: int, pages: np.ndarray) -> None:
        """Pages of ``layer`` freed: no longer waiting, and skipped by the round they are in."""
        for p in pages.tolist():
            self._full[layer].pop(p, None)
        self._round_of[layer, pages] = -1

    def waiting(self, layer: int) -> int:
        """Full pages of ``layer`` not compressed yet."""
        return len(self._full[layer])

    def compressing(self, layer: int) -> int:
        """Pages of ``layer`` compressed, not placed yet."""
        return int((self._round_of[layer] >= 0).sum())

    def compress(self, wait: bool) -> int:
        """Place the rounds whose sizes have arrived (all of them if ``wait``), then compress the waiting pages in
        rounds: every one, placed now, if ``wait``; else while fewer than MAX_ROUNDS are in flight, placed by a later
        call, the rest left waiting. Returns the pages placed."""
        placed = self._finish(wait)
        layers = self._layers.repeat([len(full) for full in self._full])
        pids = np.fromiter(itertools.chain.from_iterable(self._full), dtype=np.int64, count=len(layers))
        limit = max(1, ROUND_BYTES // self._store.page_bytes)
        started = 0
        for at in range(0, len(pids), limit):
            if len(self._rounds) >= MAX_ROUNDS:
                if not wait:
                    break
                placed += self._place(self._rounds.popleft())
            self._start(layers[at: at + limit], pids[at: at + limit])
            started = min(at + limit, len(pids))
        # The started pages are the first `started` in layer order: drop them from the layers' waiting pages.
        for full in self._full:
            if started >= len(full):
                started -= len(full)
                full.clear()
            else:
                for p in list(itertools.islice(full, started)):
                    del full[p]
                break
        if wait:
            placed += self._finish(wait=True)
        return placed

    def backlog(self) -> int:
        """Full pages, of all layers, waiting for a round."""
        return sum(len(full) for full in self._full)

    def _start(self, layers: np.ndarray, pids: np.ndarray) -> None:
        """Compress pages (layers[i], pids[i]) of any layers (layers ascending) with one decompress and one compress
        call on the meta rows of all layers, into a scratch buffer (room for all of them raw, so it cannot overflow)
        and scratch meta rows; start copying where each page's streams start to the host. Nothing waits."""
        s, n = self._store, len(pids)
        scratch = torch.empty(n * s.page_bytes, dtype=torch.uint8, device=s.device)
        meta = torch.empty((n, *s.meta_rows.shape[1:]), dtype=torch.int32, device=s.device)
        ids, local, cursor = s.upload(s.rows(layers, pids).astype(np.int32), np.arange(n, dtype=np.int32),
                                      np.array([0, scratch.numel()], dtype=np.int64))
        kv = ops.decompress_pages(s.data, s.meta_rows, ids, s.page_size, s.head_dim)
        ops.compress_pages(kv, local, scratch, meta, cursor)
        # Pages lie back to back, in order: each starts at word 0 of its (K, head 0) stream (in STREAM_ALIGN units),
        # the last ends at the cursor.
        ends = torch.cat([meta[:, 0, 0, 0].long() * fmt.STREAM_ALIGN, cursor[:1]])
        done = None
        if s.device.type == "cuda":
            host = torch.empty(n + 1, dtype=torch.int64, pin_memory=True)
            ends, done = host.copy_(ends, non_blocking=True), torch.cuda.Event()
            done.record(torch.cuda.current_stream(s.device))
        self._round_of[layers, pids] = self._next_serial
        self._rounds.append(_Round(self._next_serial, layers, pids, scratch, meta, ends, done))
        self._next_serial += 1

    def _finish(self, wait: bool) -> int:
        """Place the rounds in flight, oldest first: all of them (waiting for their sizes) if ``wait``, else those
        whose sizes have arrived. Returns the pages placed."""
        placed = 0
        while self._rounds and (wait or self._rounds[0].done is None or self._rounds[0].done.query()):
            placed += self._place(self._rounds.popleft())
        return placed

    def _place(self, r: _Round) -> int:
        """Put a round's pages that are still its own (not forgotten since) where the arena says: their scratch meta
        rows replace the raw ones, then their bytes are copied there, the rows shifted to match, and the slots they
        left zeroed. Returns how many."""
        if r.done is not None:
            r.done.synchronize()  # no-op once it has run; only compress(wait=True) gets here earlier
        ends = r.ends.numpy()
        mine = (self._round_of[r.layers, r.pids] == r.serial).nonzero()[0]
        if not len(mine):
            return 0
        layers, pids = r.layers[mine], r.pids[mine]
        self._round_of[layers, pids] = -1
        sizes = ends[mine + 1] - ends[mine]
        offsets = self._arena.repack(layers, pids, sizes)
        s = self._store
        rows = s.rows(layers, pids)
        rows_t, mine_t = s.upload(rows, mine)
        s.meta_rows[rows_t] = r.meta[mine_t]  # relative to scratch until the move shifts them
        s.move(rows, offsets, ends[mine], sizes, r.scratch, self._arena.take_dirty())  # zero the slots they left
        return len(mine)
