"""Where every page of the cache lives in its byte arena: chunks, a shared pool, slots, packed runs, promises.

Host-only bookkeeping (numpy and lists, no tensors, no device syncs): the arena decides offsets, and
``torch_zipkv/page_store.py`` moves the bytes. A page here is one page id of one layer: its K and V for all kv heads.

Layout (Fig. 2c of the ZipFusion paper: lossless KV compression fused with FlashInfer-style decode attention).
The arena is ``num_chunks`` chunks of ``chunk_bytes``. Free chunks sit in one shared pool; a layer takes a chunk
when it needs room and gives it back as soon as nothing in it is live, so freed room serves any layer. A layer's
chunk is one of two kinds:

- a **slot** chunk: ``slots_per_chunk`` slots of ``page_bytes`` (one page stored raw). Open pages live in slots,
  since they must accept writes in place; equal sizes make a freed slot reusable at once. A full page whose
  compression finds no packed room is compressed inside its own slot ("in place") and keeps the slot.
- a **packed** chunk: compressed pages appended back to back at a bump pointer (``used``). The layer appends into one
  destination chunk at a time; when a page does not fit, the destination closes and the next is a tail that holds
  any page, or a chunk from the pool. The room a closed chunk keeps at its end (a crumb, less than a page) and the
  holes freed pages leave are reclaimed by compaction only.

Promises. ``reserved[layer]`` raw pages of that layer are promised to running sequences (the cache charges every
sequence its token budget at raw size). The pool must be able to keep every promise at once:
``pool_need() <= len(pool)``, where a layer needs ``ceil((reserved - free slots) / slots_per_chunk)`` chunks from
the pool. Every method keeps that true: unpromised pages and new packed chunks are handed out only when it stays
true, and giving a chunk back frees as much as it removes. So a promised page can always be allocated.

Speed. A decode step opens and fills a few pages in every layer, so the per-chunk and per-layer state is in numpy
arrays and the methods a step calls (:meth:`Arena.place_raw`, :meth:`Arena.repack`, :meth:`Arena.release`) work on
all layers' pages at once. Their results are, by construction, those of taking the pages one at a time.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from . import format as fmt

FREE, SLOTS, PACKED = 0, 1, 2  # chunk kinds


def _run_starts(a: np.ndarray) -> np.ndarray:
    """Where each run of equal values of ``a`` begins."""
    return np.concatenate(([True], a[1:] != a[:-1])).nonzero()[0] if len(a) else np.empty(0, dtype=np.int64)


class Arena:
    """Chunks, slots and packed runs of one cache; ``offset``/``nbytes`` [layer, page] say where each page is."""

    def __init__(self, num_layers: int, max_pages: int, num_chunks: int, chunk_bytes: int, page_bytes: int):
        if page_bytes % fmt.STREAM_ALIGN or chunk_bytes % page_bytes:
            raise ValueError(f"chunk_bytes ({chunk_bytes}) must be a multiple of page_bytes ({page_bytes}), itself a "
                             f"multiple of {fmt.STREAM_ALIGN}")
        self.num_layers, self.num_chunks, self.chunk_bytes, self.page_bytes = num_layers, num_chunks, chunk_bytes, \
            page_bytes
        S = self.slots_per_chunk = chunk_bytes // page_bytes
        self._page_bytes = np.int64(page_bytes)  # slot numbers (int32) times this: byte offsets (int64)
        self._from_top = np.arange(1, S + 1)  # stack positions below the top, nearest first
        # Where page p of layer l is: byte offset (-1: nowhere) and stored bytes (page_bytes while raw).
        self.offset = np.full((num_layers, max_pages), -1, dtype=np.int64)
        self.nbytes = np.zeros((num_layers, max_pages), dtype=np.int64)
        self.pool = list(range(num_chunks - 1, -1, -1))  # a stack: low chunks are handed out first
        # Per chunk: kind, owning layer (-1: none), bytes held (page_bytes per occupied slot, or stored bytes of
        # packed pages), and for packed chunks the bump pointer (bytes from the chunk start).
        self.kind = np.full(num_chunks, FREE, dtype=np.int8)
        self.owner = np.full(num_chunks, -1, dtype=np.int64)
        self.live = np.zeros(num_chunks, dtype=np.int64)
        self.used = np.zeros(num_chunks, dtype=np.int64)
        # Free slots of slot chunk c: a stack of slot numbers (slot s is at byte s * page_bytes),
        # free_stack[c, :free_top[c]], whose last entry is handed out next; slot_free[s] says whether s is on one.
        self.free_stack = np.zeros((num_chunks, S), dtype=np.int32)
        self.free_top = np.zeros(num_chunks, dtype=np.int64)
        self.slot_free = np.zeros(num_chunks * S, dtype=bool)
        # Per layer.
        self.slot_chunks: list[set[int]] = [set() for _ in range(num_layers)]
        self.packed_chunks: list[set[int]] = [set() for _ in range(num_layers)]
        self._packed_ids: list[np.ndarray | None] = [None] * num_layers  # packed_chunks as arrays (:meth:`_packed`)
        self.slot_chunk_count = np.zeros(num_layers, dtype=np.int64)
        self.sole_slot_chunk = np.full(num_layers, -1, dtype=np.int64)  # the slot chunk while there is exactly one
        self.dest = np.full(num_layers, -1, dtype=np.int64)  # packed chunk compressed pages go to (-1: none yet)
        self.free_slot_count = np.zeros(num_layers, dtype=np.int64)
        self.reserved = np.zeros(num_layers, dtype=np.int64)  # raw pages promised; the cache keeps this up to date
        # To zero (take_dirty): slots freed, and chunks made slot chunks.
        self.dirty_slots: list[int] = []
        self.dirty_chunks: list[int] = []

    # ---- promises -------------------------------------------------------------------------------------------
    def pool_need(self, extra: np.ndarray | None = None, free_slots: np.ndarray | None = None) -> int:
        """Chunks the pool must supply to keep every promise, plus ``extra`` [layers] more raw pages (with
        ``free_slots`` [layers] free slots, default the layers' own)."""
        short = self.reserved - (self.free_slot_count if free_slots is None else free_slots)
        if extra is not None:
            short = short + extra
        return int(np.maximum(0, -(-short // self.slots_per_chunk)).sum())

    def fits(self, layers: slice, pages: int) -> bool:
        """Whether each of ``layers`` can take ``pages`` raw pages beyond its promises, all at once, without breaking
        any promise."""
        if pages <= 0:
            return True
        # Promised pages always fit; so do these where a layer's own free slots cover its promises and them.
        short = pages > self.free_slot_count[layers] - self.reserved[layers]
        if not short.any():
            return True
        extra = np.zeros(self.num_layers, dtype=np.int64)
        extra[layers] = short * pages
        return self.pool_need(extra) <= len(self.pool)

    def _layer_need(self, layer: int, frees: np.ndarray | int = 0) -> np.ndarray:
        """Chunks the pool must supply to keep ``layer``'s promises once ``frees`` more of its slots are free
        (elementwise): its term of :meth:`pool_need`."""
        short = self.reserved[layer] - self.free_slot_count[layer] - frees
        return np.maximum(0, -(-short // self.slots_per_chunk))

    def spare_pages(self, layer: int) -> int:
        """The most raw pages ``layer`` can take beyond its promises (the largest n with ``fits([layer], n)``)."""
        own = int(self._layer_need(layer))
        chunks = len(self.pool) - (self.pool_need() - own)  # pool chunks the other layers' promises leave
        return max(0, int(self.free_slot_count[layer]) + chunks * self.slots_per_chunk - int(self.reserved[layer]))

    def max_new_pages(self, extra: np.ndarray, free_slots: np.ndarray | None = None, pool: int | None = None) -> int:
        """Largest n such that every layer can take n raw pages on top of its promises and ``extra`` [layers]; with
        ``free_slots`` [layers] and ``pool`` chunks in the pool, what :meth:`after_release` says, if given."""
        if free_slots is None:
            free_slots, pool = self.free_slot_count, len(self.pool)
        lo, hi = 0, pool * self.slots_per_chunk + int(free_slots.max())
        if self.pool_need(extra, free_slots) > pool:
            return 0
        while lo < hi:  # pool_need grows with n: binary search
            mid = (lo + hi + 1) // 2
            if self.pool_need(extra + mid, free_slots) <= pool:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- chunks ---------------------------------------------------------------------------------------------
    def _take_chunk(self, layer: int, kind: int) -> int:
        c = self.pool.pop()
        self.kind[c], self.owner[c], self.live[c], self.used[c] = kind, layer, 0, 0
        if kind == SLOTS:
            S = self.slots_per_chunk
            self.free_stack[c] = np.arange((c + 1) * S - 1, c * S - 1, -1)  # the lowest slot is handed out first
            self.free_top[c] = S
            self.slot_free[c * S: (c + 1) * S] = True
            self.dirty_chunks.append(c)
            self.slot_chunks[layer].add(c)
            self._slot_chunks_changed(layer)
            self.free_slot_count[layer] += S
        else:
            self.packed_chunks[layer].add(c)
            self._packed_ids[layer] = None
        return c

    def _give_back(self, c: int) -> None:
        layer = int(self.owner[c])
        if self.kind[c] == SLOTS:
            S = self.slots_per_chunk
            self.free_top[c] = 0
            self.slot_free[c * S: (c + 1) * S] = False
            self.slot_chunks[layer].discard(c)
            self._slot_chunks_changed(layer)
            self.free_slot_count[layer] -= S
        else:
            self.packed_chunks[layer].discard(c)
            self._packed_ids[layer] = None
            if self.dest[layer] == c:
                self.dest[layer] = -1
        self.kind[c], self.owner[c], self.live[c], self.used[c] = FREE, -1, 0, 0
        self.pool.append(c)

    def _slot_chunks_changed(self, layer: int) -> None:
        chunks = self.slot_chunks[layer]
        self.slot_chunk_count[layer] = len(chunks)
        self.sole_slot_chunk[layer] = next(iter(chunks)) if len(chunks) == 1 else -1

    # ---- slots ----------------------------------------------------------------------------------------------
    def place_raw(self, layers: slice, pages: np.ndarray) -> np.ndarray:
        """Give each page a free slot in each of ``layers`` (the caller checked :meth:`fits` or holds promises);
        returns the slot numbers [layers, pages] (slot s is at byte s * page_bytes). Slots come from the fullest slot
        chunk, so sparse chunks drain and go back to the pool. A decode step opens pages in every layer: while each
        layer has one slot chunk with room (steady decoding), all layers take their slots at once."""
        n = len(pages)
        sole = self.sole_slot_chunk[layers]
        if sole.min() >= 0 and self.free_top[sole].min() >= n:
            slots = self._pop_slots(sole, n)
        else:
            slots = np.stack([self._take_fullest(self.slot_chunks[layer], n, layer)
                              for layer in range(self.num_layers)[layers]])
        self.free_slot_count[layers] -= n
        self.offset[layers, pages], self.nbytes[layers, pages] = slots * self._page_bytes, self.page_bytes
        return slots

    def _take_fullest(self, chunks, n: int, layer: int | None = None) -> np.ndarray:
        """n free slots, each from the fullest of ``chunks`` that has one (ties: the first), or, when none has, from a
        chunk taken from the pool for ``layer``. Taking slots from a chunk keeps it the fullest, so this pops runs of
        slots, chunk by chunk, exactly as one pop at a time would."""
        out = [np.empty(0, dtype=np.int32)]
        while n:
            c = min((c for c in chunks if self.free_top[c]), default=None, key=lambda c: self.free_top[c])
            if c is None:
                c = self._take_chunk(layer, SLOTS)
            k = min(n, int(self.free_top[c]))
            out.append(self._pop_slots(np.array([c]), k)[0])
            n -= k
        return np.concatenate(out)

    def _pop_slots(self, chunks: np.ndarray, k: int) -> np.ndarray:
        """The next k free slots [len(chunks), k] of each of ``chunks`` (distinct slot chunks, each with k free
        slots), in the order single pops give. The caller counts them off its layers' ``free_slot_count``."""
        top = self.free_top[chunks]
        slots = self.free_stack[chunks[:, None], top[:, None] - self._from_top[:k]]
        self.free_top[chunks] = top - k
        self.slot_free[slots] = False
        self.live[chunks] += k * self.page_bytes
        return slots

    def _push_slots(self, slots: np.ndarray) -> None:
        """Put free slots (slot numbers) on their chunks' stacks, in this order."""
        if not len(slots):
            return
        chunks = slots // self.slots_per_chunk
        order = np.argsort(chunks, kind="stable")
        chunks, slots = chunks[order], slots[order]
        rank = np.arange(len(chunks)) - np.searchsorted(chunks, chunks)  # pushes to the same chunk before this one
        self.free_stack[chunks, self.free_top[chunks] + rank] = slots
        np.add.at(self.free_top, chunks, 1)
        self.slot_free[slots] = True

    def release(self, layers: np.ndarray, pages: np.ndarray) -> None:
        """Forget where pages ``(layers[i], pages[i])`` are, in this order: their slots become free (to be zeroed),
        their packed bytes holes. Chunks left empty go back to the pool in the order they empty."""
        off = self.offset[layers, pages]
        chunks = off // self.chunk_bytes
        in_slot = self.kind[chunks] == SLOTS
        slots = off[in_slot] // self.page_bytes
        self._push_slots(slots)
        self.dirty_slots.extend(slots.tolist())
        np.add.at(self.free_slot_count, layers[in_slot], 1)
        np.subtract.at(self.live, chunks, np.where(in_slot, self.page_bytes, self.nbytes[layers, pages]))
        self.offset[layers, pages], self.nbytes[layers, pages] = -1, 0
        emptied = chunks[self.live[chunks] == 0][::-1]  # chunks left empty, once per page, from the last page
        if len(emptied):
            last = np.sort(np.unique(emptied, return_index=True)[1])  # each chunk's last page, from the end
            for c in emptied[last][::-1].tolist():  # in the order they emptied
                self._give_back(c)

    def after_release(self, layers: np.ndarray, pages: np.ndarray) -> tuple[np.ndarray, int]:
        """Each layer's free slots [layers] and the pool's chunks if pages ``(layers[i], pages[i])`` (distinct, each
        with bytes) were released (:meth:`release`), which this does not do: what their room would be."""
        chunks = self.offset[layers, pages] // self.chunk_bytes
        in_slot = self.kind[chunks] == SLOTS
        live = self.live.copy()
        np.subtract.at(live, chunks, np.where(in_slot, self.page_bytes, self.nbytes[layers, pages]))
        free_slots = self.free_slot_count.copy()
        np.add.at(free_slots, layers[in_slot], 1)
        emptied = np.unique(chunks[live[chunks] == 0])
        slots = emptied[self.kind[emptied] == SLOTS]  # a slot chunk that empties takes its free slots to the pool
        np.subtract.at(free_slots, self.owner[slots], self.slots_per_chunk)
        return free_slots, len(self.pool) + len(emptied)

    def remove(self, layer: int, pages: np.ndarray) -> None:
        """Forget pages (freed sequences); chunks that empty go back to the pool."""
        pages = pages[self.offset[layer, pages] >= 0]
        self.release(np.full(len(pages), layer), pages)

    def take_dirty(self) -> np.ndarray:
        """Slot numbers (slot s is at byte s * page_bytes) the cache must zero now so that every free slot reads as
        zeros (the unwritten tokens of an open page are then zeros, never stale compressed bytes that could decode as
        NaN): freed slots that are still free (a free slot is in a slot chunk) and every slot of chunks that became
        slot chunks and still are (zeroed before any slot in them is written)."""
        if not self.dirty_slots and not self.dirty_chunks:
            return np.empty(0, dtype=np.int64)
        slots = np.array(self.dirty_slots, dtype=np.int64)
        chunks = np.array(self.dirty_chunks, dtype=np.int64)
        self.dirty_slots, self.dirty_chunks = [], []
        slots = slots[self.slot_free[slots]]
        if len(chunks):
            S = self.slots_per_chunk
            chunks = chunks[self.kind[chunks] == SLOTS]
            slots = np.concatenate([slots, (chunks[:, None] * S + np.arange(S)).ravel()])
        return slots

    # ---- packed runs ----------------------------------------------------------------------------------------
    def _packed(self, layer: int) -> np.ndarray:
        """The packed chunks of ``layer``, ascending: an array kept until one is taken or given back (a serving
        load's layers hold ~100, searched for room at every destination change)."""
        ids = self._packed_ids[layer]
        if ids is None:
            ids = self._packed_ids[layer] = np.array(sorted(self.packed_chunks[layer]), dtype=np.int64)
        return ids

    def _open_tail(self, layer: int) -> int:
        """The packed chunk of ``layer`` with the most room at its tail (ties: the lowest) if that room holds a raw
        page (so any page), else -1. Less room is a crumb that no page is sent to: each packed chunk ends in one
        (the room a page did not fit), and filling a layer's ~100 crumbs one page each cost a Python step a page for
        ~1% of a chunk; compaction, not placement, reclaims it."""
        ids = self._packed(layer)
        if not len(ids):
            return -1
        c = int(ids[self.used[ids].argmin()])
        return c if self.used[c] + self.page_bytes <= self.chunk_bytes else -1

    def _alloc_packed(self, layer: int, size: int, take: bool = True, frees: int = 0) -> int | None:
        """Room for ``size`` bytes in a packed chunk of ``layer``: the destination's tail if it fits, else (the
        destination closes: its room, less than a page, is a crumb) the open tail with the most room
        (:meth:`_open_tail`), or (if ``take``) a chunk from the pool if every promise still holds without it once
        ``frees`` more slots of ``layer`` are free (the slots of the pages the caller is about to put in that
        chunk); what it finds becomes the destination. None if none (no destination then)."""
        d = int(self.dest[layer])
        if d < 0 or self.used[d] + size > self.chunk_bytes:
            d = self._open_tail(layer)
            if d < 0:
                if take and self.pool and self._spares_a_chunk(layer, frees):
                    d = self._take_chunk(layer, PACKED)
                else:
                    self.dest[layer] = -1
                    return None
            self.dest[layer] = d
        off = d * self.chunk_bytes + int(self.used[d])
        self.used[d] += size
        self.live[d] += size
        return off

    def _spares_a_chunk(self, layer: int, frees: np.ndarray | int) -> np.ndarray:
        """Whether the pool can give a chunk and still keep every promise once ``frees`` more slots of ``layer`` are
        free (elementwise)."""
        others = self.pool_need() - self._layer_need(layer)
        return others + self._layer_need(layer, frees) <= len(self.pool) - 1

    def repack(self, layers: np.ndarray, pages: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Raw pages ``(layers[i], pages[i])`` (layers ascending) now compressed to ``sizes[i]`` bytes, in this order:
        move each into packed room of its layer, freeing its slot, or keep it in its own slot (in place) when there
        is none. Returns the new offsets. Layers whose destination chunk takes all their pages (the common case) are
        placed together; the others one page at a time."""
        starts = _run_starts(layers)  # each layer's first page
        dest = self.dest[layers[starts]]
        fits = (dest >= 0) & (self.used[dest] + np.add.reduceat(sizes, starts) <= self.chunk_bytes)
        # Runs of layers that all fit, or all do not, in order: the order decides what the pool holds for the next.
        change = _run_starts(fits)
        bounds = starts[change].tolist() + [len(pages)]
        offsets = np.empty(len(pages), dtype=np.int64)
        for a, b, fit in zip(bounds, bounds[1:], fits[change].tolist()):
            place = self._append_packed if fit else self._repack_each
            offsets[a:b] = place(layers[a:b], pages[a:b], sizes[a:b])
        self.offset[layers, pages], self.nbytes[layers, pages] = offsets, sizes
        return offsets

    def _append_packed(self, layers: np.ndarray, pages: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Pages (layers ascending) whose destination chunks have room for all of them: appended there in order,
        slots freed."""
        dest = self.dest[layers]
        before = np.cumsum(sizes) - sizes  # bytes of the pages before each
        first = np.searchsorted(layers, layers)  # each page's layer's first page
        offsets = dest * self.chunk_bytes + self.used[dest] + before - before[first]
        np.add.at(self.used, dest, sizes)
        np.add.at(self.live, dest, sizes)
        self.release(layers, pages)
        return offsets

    def _repack_each(self, layers: np.ndarray, pages: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """Pages (layers ascending) placed as if one at a time, in order: into the layer's destination chunk while
        they fit; a page that does not goes where :meth:`_alloc_packed` says (an open tail, a chunk from the pool,
        or its own slot, in place), and the pages after it follow the new destination. Each run of pages that fits
        the destination is placed at once, and so is each run of pages kept in place (:meth:`_kept_in_place`); the
        room the placed pages leave is released only before the pool is asked for a chunk (it counts there) and at
        the end, in placement order, as one call: nothing else reads it. So this is the page-at-a-time result at a
        cost per destination change, not per page: a destination takes a page at least (an open tail holds any
        page), and crumbs, never destinations, cannot make each page a change of its own."""
        out = np.empty(len(pages), dtype=np.int64)
        run_end = np.searchsorted(layers, layers, side="right")  # the end of each page's layer run
        placed: list[np.ndarray] = []  # indices of pages placed in packed room whose old room is not released yet

        def release_placed() -> None:
            if placed:
                at = np.concatenate(placed)
                self.release(layers[at], pages[at])
                placed.clear()

        i = 0
        while i < len(pages):
            layer, d = int(layers[i]), int(self.dest[layers[i]])
            if d >= 0:  # the leading pages that fit the destination's tail
                before = np.cumsum(sizes[i: run_end[i]])
                k = int(np.searchsorted(before, self.chunk_bytes - self.used[d], side="right"))
                if k:
                    out[i: i + k] = d * self.chunk_bytes + self.used[d] + before[:k] - sizes[i: i + k]
                    self.used[d] += before[k - 1]
                    self.live[d] += before[k - 1]
                    placed.append(np.arange(i, i + k))
                    i += k
                    continue
            t = self._open_tail(layer)  # the destination closes; an open tail takes the page and the run goes on
            self.dest[layer] = t
            if t >= 0:
                continue
            release_placed()  # the pool is asked next: the slots the placed pages leave count there
            rest = slice(i, int(run_end[i]))
            frees = self._paying_back(layer, pages[rest], sizes[rest])
            kept = self._kept_in_place(layer, sizes[rest], frees)
            out[i: i + kept] = self.offset[layer, pages[i: i + kept]]
            i += kept
            if i == rest.stop:
                continue
            off = self._alloc_packed(layer, int(sizes[i]), frees=int(frees[kept]))
            if off is None:
                off = int(self.offset[layer, pages[i]])  # in place: the slot stays taken, the page is just smaller
            else:
                placed.append(np.array([i]))
            out[i] = off
            i += 1
        release_placed()
        return out

    def _paying_back(self, layer: int, pages: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """For each of ``layer``'s pages (in placement order), the slots that a chunk taken from the pool for it
        would pay back: the slots held by it and the pages after it that fit the chunk with it. Counting them keeps a
        cache whose pool is all promised (a serving load admits until it is) from compressing every page in place,
        where it saves nothing; so a call that places more pages at once may pack what smaller ones keep in place.
        (At most 4 chunks' slots ahead: fewer counted only makes the rule stricter.)"""
        ends = np.cumsum(sizes)
        n = len(pages)
        fit_end = np.minimum(np.searchsorted(ends, ends - sizes + self.chunk_bytes, side="right"),
                             np.arange(n) + 4 * self.slots_per_chunk)
        held = np.concatenate(([0], np.cumsum(self.kind[self.offset[layer, pages] // self.chunk_bytes] == SLOTS)))
        return held[fit_end] - held[:n]

    def _kept_in_place(self, layer: int, sizes: np.ndarray, frees: np.ndarray | int, take: bool = True) -> int:
        """How many leading pages of ``layer`` (compressed to ``sizes``, placed in this order) one call each of
        :meth:`_alloc_packed` (``frees``, ``take``) would find no room for, each then kept in place: the first does
        not fit the destination (which then closes, as that call would close it), no tail is open, and the pool
        cannot spare a chunk. Keeping a page in place changes none of that (its slot stays taken, no chunk moves),
        so they are found at once, not one Python step each: in a serving load whose pool is promised, most pages
        of a call can stay so."""
        d = int(self.dest[layer])
        if d >= 0:
            if self.used[d] + sizes[0] <= self.chunk_bytes:
                return 0
            self.dest[layer] = -1
        if self._open_tail(layer) >= 0:
            return 0
        if not (take and self.pool):
            return len(sizes)
        placed = np.broadcast_to(self._spares_a_chunk(layer, frees), sizes.shape)
        return int(placed.argmax()) if placed.any() else len(sizes)

    # ---- compaction -----------------------------------------------------------------------------------------
    def _pages_in(self, layer: int, c: int) -> np.ndarray:
        """Pages of ``layer`` in chunk c, by offset."""
        off = self.offset[layer]
        pages = np.nonzero((off >= c * self.chunk_bytes) & (off < (c + 1) * self.chunk_bytes))[0]
        return pages[np.argsort(off[pages])]

    def compaction(self, layer: int) -> Iterator[list[tuple[int, int, int, int]]]:
        """Compaction of ``layer``, as batches of moves (page, old offset, new offset, nbytes), already entered
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

    def reclaim(self, layer: int, max_bytes: int, sparse: float) -> Iterator[list[tuple[int, int, int, int]]]:
        """A bounded compaction of ``layer``, for a cache whose pages come and go: pages compressed in place move to
        packed room where that frees slot chunks (as in :meth:`compaction`), slot chunks drain to one spare, and the
        packed chunks with at most ``sparse`` of their bytes live, sparsest first (never the destination), move
        their pages into packed room elsewhere (the destination's tail, an open tail, or a chunk from the pool
        while every promise holds, as compressed pages are placed) and go back to the pool, moving at most
        ``max_bytes`` of them. Freed pages leave holes in packed chunks that nothing else reclaims: in a serving load
        without this, a fifth of the packed bytes were holes that new requests could not use. A source some of whose
        pages find no room keeps them. Batches as :meth:`compaction`'s (the sources' moves in one)."""
        page_bytes, C = self.page_bytes, self.chunk_bytes
        sizes, offsets = self.nbytes[layer], self.offset[layer]
        live = offsets >= 0
        if ((sizes < page_bytes) & live & (self.kind[np.where(live, offsets // C, 0)] == SLOTS)).any():
            yield from self._pack_in_place(layer)
        yield from self.drain_slots(layer, slack=1)
        # The sources, sparsest first, while their live bytes fit max_bytes; their pages in that order, placed in one
        # call (one Python step per destination chunk, not per page or per source: a serving load runs this often).
        cands = self._packed(layer)
        cands = cands[(cands != self.dest[layer]) & (self.live[cands] <= sparse * C)]
        cands = cands[np.lexsort((cands, self.live[cands]))]
        cands = cands[np.cumsum(self.live[cands]) <= max_bytes]
        if not len(cands):
            return
        rank = np.full(self.num_chunks + 1, -1, dtype=np.int64)  # a source's place in the order; -1: not a source
        rank[cands] = np.arange(len(cands))
        chunk_of = np.where(live, offsets // C, self.num_chunks)
        pages = np.nonzero(rank[chunk_of] >= 0)[0]
        pages = pages[np.lexsort((offsets[pages], rank[chunk_of[pages]]))]
        old, sizes = offsets[pages], self.nbytes[layer, pages]
        used = self.used[cands]
        self.used[cands] = C  # a source's tail is never room for the pages
        new = self._repack_each(np.full(len(pages), layer), pages, sizes)
        self.offset[layer, pages], self.nbytes[layer, pages] = new, sizes
        go = new != old
        kept = np.unique(chunk_of[pages[~go]])  # sources some of whose pages found no room: still theirs
        self.used[kept] = used[rank[kept]]
        yield list(zip(pages[go].tolist(), old[go].tolist(), new[go].tolist(), sizes[go].tolist()))

    def _pack_in_place(self, layer: int) -> Iterator[list[tuple[int, int, int, int]]]:
        """Pages compressed in place (smaller than a slot) into packed room. Chunks come from the pool only when the
        layer's chunk need cannot grow: all its in-place pages then fit in fewer new chunks than draining the slots
        they leave gives back (or a slot chunk holds nothing else)."""
        S, C = self.slots_per_chunk, self.chunk_bytes
        occupied = int(self.slot_chunk_count[layer] * S - self.free_slot_count[layer])
        chunks = sorted(self.slot_chunks[layer])
        per_chunk = [self._pages_in(layer, c) for c in chunks]
        small = [p for pages in per_chunk for p in pages if self.nbytes[layer, p] < self.page_bytes]
        size = int(self.nbytes[layer, small].sum()) if small else 0
        gain = -(-occupied // S) - -(-(occupied - len(small)) // S) >= -(-size // C)
        for pages in per_chunk:
            take = gain or bool((self.nbytes[layer, pages] < self.page_bytes).all())
            pages = pages[self.nbytes[layer, pages] < self.page_bytes]
            batch, i = [], 0
            while i < len(pages):
                i += self._kept_in_place(layer, self.nbytes[layer, pages[i:]], 0, take)
                if i == len(pages):
                    break
                p, size = int(pages[i]), int(self.nbytes[layer, pages[i]])
                if (off := self._alloc_packed(layer, size, take)) is not None:
                    old = int(self.offset[layer, p])
                    self.release(np.array([layer]), np.array([p]))  # one at a time: it may give room to the next
                    self.offset[layer, p], self.nbytes[layer, p] = off, size
                    batch.append((p, old, off, size))
                i += 1
            if batch:
                yield batch

    def spare_slot_chunks(self, layers) -> np.ndarray:
        """Slot chunks each of ``layers`` holds beyond those its occupied slots need (it keeps one even when none
        is)."""
        chunks = self.slot_chunk_count[layers]
        occupied = chunks * self.slots_per_chunk - self.free_slot_count[layers]
        return chunks - np.maximum(1, -(-occupied // self.slots_per_chunk))

    def drain_slots(self, layer: int, slack: int = 0) -> Iterator[list[tuple[int, int, int, int]]]:
        """Move pages of the sparsest slot chunks into free slots of the others until the layer holds at most
        ``slack`` more slot chunks than its pages need; the emptied chunks go back to the pool."""
        while self.spare_slot_chunks(layer) > slack:
            src, *others = sorted(self.slot_chunks[layer], key=lambda c: (-self.free_top[c], c))
            pages = self._pages_in(layer, src)
            new = self._take_fullest(others, len(pages)) * self._page_bytes
            old, size = self.offset[layer, pages], self.nbytes[layer, pages]
            self.free_slot_count[layer] -= len(pages)
            self.release(np.full(len(pages), layer), pages)  # gives src back: its pages all leave
            self.offset[layer, pages], self.nbytes[layer, pages] = new, size
            yield list(zip(pages.tolist(), old.tolist(), new.tolist(), size.tolist()))

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
            room = {c: self.chunk_bytes - int(self.used[c]) for c in others}
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
            old, size = self.offset[layer, pages], self.nbytes[layer, pages]
            new = []
            for c, n in zip(targets, size.tolist()):
                new.append(c * self.chunk_bytes + int(self.used[c]))
                self.used[c] += n
                self.live[c] += n
            self.release(np.full(len(pages), layer), pages)  # gives src back: its pages all leave
            self.offset[layer, pages], self.nbytes[layer, pages] = new, size
            yield list(zip(pages.tolist(), old.tolist(), new, size.tolist()))
        if self.dest[layer] < 0 and self.packed_chunks[layer]:
            self.dest[layer] = max(self.packed_chunks[layer], key=lambda c: self.chunk_bytes - self.used[c])
