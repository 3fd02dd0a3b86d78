"""Where every page of the cache lives in its byte arena: chunks, a shared pool, slots, packed runs, promises.

Host-only bookkeeping (numpy and lists, no tensors, no device syncs): the arena decides offsets, and
``torch_zipkv/cache.py`` moves the bytes. A page here is one page id of one layer: its K and V for all kv heads.

Layout (the paper's Fig. 2c). The arena is ``num_chunks`` chunks of ``chunk_bytes``. Free chunks sit in one shared
pool; a layer takes a chunk when it needs room and gives it back as soon as nothing in it is live, so freed room
serves any layer. A layer's chunk is one of two kinds:

- a **slot** chunk: ``slots_per_chunk`` slots of ``page_bytes`` (one page stored raw). Open pages live in slots,
  since they must accept writes in place; equal sizes make a freed slot reusable at once. A full page whose
  compression finds no packed room is compressed inside its own slot ("in place") and keeps the slot.
- a **packed** chunk: compressed pages appended back to back at a bump pointer (``used``). The layer appends into one
  destination chunk at a time. Freed pages leave holes that only compaction reclaims.

Promises. ``reserved[layer]`` raw pages of that layer are promised to running sequences (the cache charges every
sequence its token budget at raw size). The pool must be able to keep every promise at once:
``pool_need() <= len(pool)``, where a layer needs ``ceil((reserved - free slots) / slots_per_chunk)`` chunks from
the pool. Every method keeps that true: unpromised pages and new packed chunks are handed out only when it stays
true, and giving a chunk back frees as much as it removes. So a promised page can always be allocated.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from . import format as fmt

FREE, SLOTS, PACKED = 0, 1, 2  # chunk kinds


class Arena:
    """Chunks, slots and packed runs of one cache; ``offset``/``nbytes`` [layer, page] say where each page is."""

    def __init__(self, num_layers: int, max_pages: int, num_chunks: int, chunk_bytes: int, page_bytes: int):
        if page_bytes % fmt.STREAM_ALIGN or chunk_bytes % page_bytes:
            raise ValueError(f"chunk_bytes ({chunk_bytes}) must be a multiple of page_bytes ({page_bytes}), itself a "
                             f"multiple of {fmt.STREAM_ALIGN}")
        self.num_layers, self.num_chunks, self.chunk_bytes, self.page_bytes = num_layers, num_chunks, chunk_bytes, \
            page_bytes
        self.slots_per_chunk = chunk_bytes // page_bytes
        # Where page p of layer l is: byte offset (-1: nowhere) and stored bytes (page_bytes while raw).
        self.offset = np.full((num_layers, max_pages), -1, dtype=np.int64)
        self.nbytes = np.zeros((num_layers, max_pages), dtype=np.int64)
        self.pool = list(range(num_chunks - 1, -1, -1))  # a stack: low chunks are handed out first
        self.kind = [FREE] * num_chunks
        self.owner = [-1] * num_chunks
        self.live = [0] * num_chunks  # bytes held: page_bytes per occupied slot, or stored bytes of packed pages
        self.used = [0] * num_chunks  # packed chunks: bump pointer, bytes from the chunk start
        self.free_slots: dict[int, list[int]] = {}  # slot chunk -> free slot offsets
        self.slot_chunks: list[set[int]] = [set() for _ in range(num_layers)]
        self.packed_chunks: list[set[int]] = [set() for _ in range(num_layers)]
        self.dest: list[int | None] = [None] * num_layers  # packed chunk that compressed pages are appended to
        self.free_slot_count = [0] * num_layers
        self.reserved = [0] * num_layers  # raw pages promised per layer; the cache keeps this up to date
        self.dirty: list[tuple[int, int]] = []  # (offset, bytes) of slots freed or chunks made slots: to zero

    # ---- promises -------------------------------------------------------------------------------------------
    def pool_need(self, extra: np.ndarray | None = None) -> int:
        """Chunks the pool must supply to keep every promise, plus ``extra`` [layers] more raw pages."""
        short = np.asarray(self.reserved) - np.asarray(self.free_slot_count)
        if extra is not None:
            short = short + extra
        return int(np.maximum(0, -(-short // self.slots_per_chunk)).sum())

    def fits(self, layers: list[int], pages: int) -> bool:
        """Whether each of ``layers`` can take ``pages`` raw pages beyond its promises, all at once, without breaking
        any promise."""
        # Promised pages always fit; so do these where a layer's own free slots cover its promises and them.
        short = [layer for layer in layers if pages > self.free_slot_count[layer] - self.reserved[layer]]
        if pages <= 0 or not short:
            return True
        extra = np.zeros(self.num_layers, dtype=np.int64)
        extra[short] = pages
        return self.pool_need(extra) <= len(self.pool)

    def spare_pages(self, layer: int) -> int:
        """The most raw pages ``layer`` can take beyond its promises (the largest n with ``fits([layer], n)``)."""
        own = max(0, -(-(self.reserved[layer] - self.free_slot_count[layer]) // self.slots_per_chunk))
        chunks = len(self.pool) - (self.pool_need() - own)  # pool chunks the other layers' promises leave
        return max(0, self.free_slot_count[layer] + chunks * self.slots_per_chunk - self.reserved[layer])

    def max_new_pages(self, extra: np.ndarray) -> int:
        """Largest n such that every layer can take n raw pages on top of its promises and ``extra`` [layers]."""
        lo, hi = 0, len(self.pool) * self.slots_per_chunk + max(self.free_slot_count)
        if self.pool_need(extra) > len(self.pool):
            return 0
        while lo < hi:  # pool_need grows with n: binary search
            mid = (lo + hi + 1) // 2
            if self.pool_need(extra + mid) <= len(self.pool):
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- chunks ---------------------------------------------------------------------------------------------
    def _take_chunk(self, layer: int, kind: int) -> int:
        c = self.pool.pop()
        self.kind[c], self.owner[c], self.live[c], self.used[c] = kind, layer, 0, 0
        if kind == SLOTS:
            base = c * self.chunk_bytes
            self.free_slots[c] = [base + i * self.page_bytes for i in range(self.slots_per_chunk - 1, -1, -1)]
            self.dirty.append((base, self.chunk_bytes))
            self.slot_chunks[layer].add(c)
            self.free_slot_count[layer] += self.slots_per_chunk
        else:
            self.packed_chunks[layer].add(c)
        return c

    def _give_back(self, c: int) -> None:
        layer = self.owner[c]
        if self.kind[c] == SLOTS:
            del self.free_slots[c]
            self.slot_chunks[layer].discard(c)
            self.free_slot_count[layer] -= self.slots_per_chunk
        else:
            self.packed_chunks[layer].discard(c)
            if self.dest[layer] == c:
                self.dest[layer] = None
        self.kind[c], self.owner[c], self.live[c], self.used[c] = FREE, -1, 0, 0
        self.pool.append(c)

    # ---- slots ----------------------------------------------------------------------------------------------
    def place_raw(self, layers: list[int], pages: list[int]) -> list[int]:
        """Give each page a free slot in each of ``layers`` (the caller checked :meth:`fits` or holds promises);
        returns the offsets, layer by layer. Slots come from the fullest slot chunk, so sparse chunks drain and go
        back to the pool. The table is written once for all layers (a decode step opens pages in every layer)."""
        n, offsets = len(pages), []
        for layer in layers:
            chunks = self.slot_chunks[layer]
            if len(chunks) == 1 and n <= len(self.free_slots[next(iter(chunks))]):  # steady decoding: no choice
                c = next(iter(chunks))
                free = self.free_slots[c]
                offsets += free[-1: -n - 1: -1]  # the order pop() would give
                del free[len(free) - n:]
                self.free_slot_count[layer] -= n
                self.live[c] += n * self.page_bytes
                continue
            for _ in pages:
                chunks = self.slot_chunks[layer]
                c = min((c for c in chunks if self.free_slots[c]), default=None, key=lambda c: len(self.free_slots[c]))
                if c is None:
                    c = self._take_chunk(layer, SLOTS)
                offsets.append(self.free_slots[c].pop())
                self.free_slot_count[layer] -= 1
                self.live[c] += self.page_bytes
        if n:
            rows, cols = np.repeat(layers, n), np.tile(pages, len(layers))
            self.offset[rows, cols], self.nbytes[rows, cols] = offsets, self.page_bytes
        return offsets

    def _release(self, layer: int, p: int) -> None:
        off, size = int(self.offset[layer, p]), int(self.nbytes[layer, p])
        c = off // self.chunk_bytes
        if self.kind[c] == SLOTS:
            self.free_slots[c].append(off)
            self.dirty.append((off, self.page_bytes))
            self.free_slot_count[layer] += 1
            self.live[c] -= self.page_bytes
            if len(self.free_slots[c]) == self.slots_per_chunk:
                self._give_back(c)
        else:
            self.live[c] -= size
            if self.live[c] == 0:
                self._give_back(c)
        self.offset[layer, p], self.nbytes[layer, p] = -1, 0

    def remove(self, layer: int, pages) -> None:
        """Forget pages (freed sequences); chunks that empty go back to the pool."""
        for p in pages:
            if self.offset[layer, p] >= 0:
                self._release(layer, int(p))

    def take_dirty(self) -> list[tuple[int, int]]:
        """Byte ranges the cache must zero now so that every free slot reads as zeros (the unwritten tokens of an open
        page are then zeros, never stale compressed bytes that could decode as NaN): freed slots that are still free
        and chunks that became slot chunks (zeroed before any slot in them is written)."""
        out = []
        for off, n in self.dirty:
            c = off // self.chunk_bytes
            if self.kind[c] == SLOTS and (n == self.chunk_bytes or off in self.free_slots[c]):
                out.append((off, n))
        self.dirty = []
        return out

    # ---- packed runs ----------------------------------------------------------------------------------------
    def _alloc_packed(self, layer: int, size: int, take: bool = True) -> int | None:
        """Room for ``size`` bytes in a packed chunk of ``layer``: the destination's tail, another packed chunk's
        tail, or (if ``take``) a chunk from the pool if every promise still holds without it. None if none."""
        d = self.dest[layer]
        if d is None or self.used[d] + size > self.chunk_bytes:
            tails = [c for c in self.packed_chunks[layer] if self.used[c] + size <= self.chunk_bytes]
            if tails:
                d = max(tails, key=lambda c: self.chunk_bytes - self.used[c])
            elif take and self.pool and self.pool_need() <= len(self.pool) - 1:
                d = self._take_chunk(layer, PACKED)
            else:
                return None
            self.dest[layer] = d
        off = d * self.chunk_bytes + self.used[d]
        self.used[d] += size
        self.live[d] += size
        return off

    def repack(self, layer: int, pages: list[int], sizes: list[int]) -> list[int]:
        """Pages of ``layer`` now compressed to ``sizes`` bytes: move each into packed room, freeing its slot, or
        keep it in its own slot (in place) when there is none. Returns the new offsets."""
        out = []
        for p, size in zip(pages, sizes):
            off = self._alloc_packed(layer, size)
            if off is None:
                off = int(self.offset[layer, p])  # in place: the slot stays taken, the page is just smaller
            else:
                self._release(layer, p)
            self.offset[layer, p], self.nbytes[layer, p] = off, size
            out.append(off)
        return out

    # ---- compaction -----------------------------------------------------------------------------------------
    def _pages_in(self, layer: int, c: int) -> np.ndarray:
        """Pages of ``layer`` in chunk c, by offset."""
        off = self.offset[layer]
        pages = np.nonzero((off >= c * self.chunk_bytes) & (off < (c + 1) * self.chunk_bytes))[0]
        return pages[np.argsort(off[pages])]

    def compaction(self, layer: int) -> Iterator[list[tuple[int, int, int, int]]]:
        """Plan compaction of ``layer`` as batches of moves (page, old offset, new offset, nbytes), already entered
        in the tables. Copy each batch's bytes before asking for the next: the next may reuse room the batch vacated.
        Within a batch, read every source before writing (the batch may slide pages over their own old bytes).
        Each batch moves at most one chunk's worth of bytes. Never leaves the pool smaller.

        1. Slot chunks drain (:meth:`drain_slots`).
        2. Compressed pages kept in slots move to packed room, freeing their slots; then slots drain again.
        3. Packed chunks: each slides its pages to its start (closing holes); then the sparsest chunks move their
           pages into the others' tails, while they all fit, and go back to the pool.
        """
        yield from self.drain_slots(layer)
        yield from self._pack_in_place(layer)
        yield from self.drain_slots(layer)
        yield from self._close_packed(layer)

    def _pack_in_place(self, layer: int) -> Iterator[list[tuple[int, int, int, int]]]:
        """Pages compressed in place (smaller than a slot) into packed room. Chunks come from the pool only when the
        layer's chunk need cannot grow: all its in-place pages then fit in fewer new chunks than draining the slots
        they leave gives back (or a slot chunk holds nothing else)."""
        S, C = self.slots_per_chunk, self.chunk_bytes
        occupied = len(self.slot_chunks[layer]) * S - self.free_slot_count[layer]
        chunks = sorted(self.slot_chunks[layer])
        per_chunk = [self._pages_in(layer, c) for c in chunks]
        small = [p for pages in per_chunk for p in pages if self.nbytes[layer, p] < self.page_bytes]
        size = int(self.nbytes[layer, small].sum()) if small else 0
        gain = -(-occupied // S) - -(-(occupied - len(small)) // S) >= -(-size // C)
        for pages in per_chunk:
            take = gain or bool((self.nbytes[layer, pages] < self.page_bytes).all())
            batch = []
            for p in pages:
                size = int(self.nbytes[layer, p])
                if size < self.page_bytes and (off := self._alloc_packed(layer, size, take)) is not None:
                    old = int(self.offset[layer, p])
                    self._release(layer, int(p))
                    self.offset[layer, p], self.nbytes[layer, p] = off, size
                    batch.append((int(p), old, off, size))
            if batch:
                yield batch

    def drain_slots(self, layer: int, slack: int = 0) -> Iterator[list[tuple[int, int, int, int]]]:
        """Move pages of the sparsest slot chunks into free slots of the others until the layer holds at most
        ``slack`` more slot chunks than its pages need; the emptied chunks go back to the pool."""
        while True:
            chunks = sorted(self.slot_chunks[layer], key=lambda c: (-len(self.free_slots[c]), c))
            occupied = len(chunks) * self.slots_per_chunk - self.free_slot_count[layer]
            if len(chunks) <= max(1, -(-occupied // self.slots_per_chunk)) + slack:
                break
            src = chunks[0]
            batch = []
            for p in self._pages_in(layer, src):
                c = min((c for c in chunks[1:] if self.free_slots[c]), key=lambda c: len(self.free_slots[c]))
                new, old, size = self.free_slots[c].pop(), int(self.offset[layer, p]), int(self.nbytes[layer, p])
                self.free_slot_count[layer] -= 1
                self.live[c] += self.page_bytes
                self._release(layer, int(p))  # gives src back when its last page leaves
                self.offset[layer, p], self.nbytes[layer, p] = new, size
                batch.append((int(p), old, new, size))
            yield batch

    def _close_packed(self, layer: int) -> Iterator[list[tuple[int, int, int, int]]]:
        """Slide each packed chunk's pages to its start, then empty the sparsest into the others' tails."""
        for c in sorted(self.packed_chunks[layer]):
            if self.used[c] == self.live[c]:
                continue
            batch, at = [], c * self.chunk_bytes
            for p in self._pages_in(layer, c):
                size = int(self.nbytes[layer, p])
                if at != self.offset[layer, p]:
                    batch.append((int(p), int(self.offset[layer, p]), at, size))
                    self.offset[layer, p] = at
                at += size
            self.used[c] = self.live[c]
            yield batch
        while len(self.packed_chunks[layer]) > 1:
            src, *others = sorted(self.packed_chunks[layer], key=lambda c: (self.live[c], c))
            pages = self._pages_in(layer, src)
            room = {c: self.chunk_bytes - self.used[c] for c in others}
            targets = []
            for p in pages:
                size = int(self.nbytes[layer, p])
                c = next((c for c in others if room[c] >= size), None)
                if c is None:
                    break
                room[c] -= size
                targets.append(c)
            if len(targets) < len(pages):
                break
            batch = []
            for p, c in zip(pages, targets):
                size, old = int(self.nbytes[layer, p]), int(self.offset[layer, p])
                new = c * self.chunk_bytes + self.used[c]
                self.used[c] += size
                self.live[c] += size
                self._release(layer, int(p))
                self.offset[layer, p], self.nbytes[layer, p] = new, size
                batch.append((int(p), old, new, size))
            yield batch
        if self.dest[layer] is None and self.packed_chunks[layer]:
            self.dest[layer] = max(self.packed_chunks[layer], key=lambda c: self.chunk_bytes - self.used[c])
