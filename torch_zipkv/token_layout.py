"""Where appended tokens go and the page tables that read them: host-only bookkeeping for one call's batch of
sequences.

A page id names the same token range of a sequence in every layer, so an append from the same lengths puts its tokens
at the same (page id, slot) in every layer, and one page table serves every layer of a decode step. So each is built
once and remembered (:data:`MEMO` of each) while the layers of a step, or the steps of a batch, ask for it again.
A running sequence's pages only grow, so a batch's page table is updated in place of being rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from .shared_prefix import SharedTables
from .upload import Uploader

MEMO = 8  # batches, layouts and page tables remembered (a step needs one of each; a few spare for interleaved batches)
_INT = frozenset({int})  # the one type of the ids in a batch's key


class StepGeneration:
    """The decode steps a cache (``owner``) prepared since its sequences or pages last changed. When they change, the
    cache marks the generation ``stale`` and starts a new one, and refuses the steps of the old one, and of any other
    cache. A flag that is False for every step that runs, not a serial the step compares: a compiled step guards on
    what it reads, and this guard never changes (nor does the owner's identity), so the step never recompiles;
    checking it is a host read, no device sync."""

    __slots__ = ("stale", "owner")

    def __init__(self, owner):
        self.stale = False
        self.owner = owner


@dataclass(frozen=True, eq=False)
class DecodeStep:
    """One decode step prepared for every layer by :meth:`CompressedPagedKVCache.prepare_step`: where each
    sequence's new token goes (``page_ids``, ``slots``: int32 [B]) and the FlashInfer page table after it
    (``kv_indptr`` [B+1], ``kv_indices`` [nnz], ``kv_last_page_len`` [B]), all int32 on the cache's device.
    With ``shared`` (a :class:`~torch_zipkv.shared_prefix.SharedTables`), the table holds each row's pages after the
    prefix that ``shared`` attends to once for its rows. ``stale`` once the cache admitted or freed a sequence, or
    compressed or compacted pages, since it was prepared (:class:`StepGeneration`): the cache then refuses it, as it
    refuses a step of another cache."""

    page_ids: torch.Tensor
    slots: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    generation: StepGeneration = field(repr=False)
    shared: SharedTables | None = field(default=None, repr=False)

    @property
    def stale(self) -> bool:
        return self.generation.stale


@dataclass(frozen=True, eq=False)
class PrefillStep:
    """One prefill call prepared for every layer by :meth:`CompressedPagedKVCache.prepare_prefill`: several tokens of
    each sequence, one sequence after another. Where each new token goes (``page_ids``, ``slots``: int32 [n]), the
    query tokens of each sequence (``qo_indptr`` [B+1]) and the FlashInfer page table after the append
    (``kv_indptr`` [B+1], ``kv_indices`` [nnz], ``kv_last_page_len`` [B]), all int32 on the cache's device; ``stale``
    as a :class:`DecodeStep`'s."""

    page_ids: torch.Tensor
    slots: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    generation: StepGeneration = field(repr=False)

    @property
    def stale(self) -> bool:
        return self.generation.stale


@dataclass
class Batch:
    """The sequences of one call, in its order: the cache's sequence records (``pages``: their page ids in token
    order) and their rows in the cache's length tables."""

    key: tuple  # the sequence ids
    seqs: list
    rows: np.ndarray
    table: tuple | None = None  # (pages per sequence, kv_indptr, kv_indices) of the page table last built


@dataclass
class AppendLayout:
    """One append of a batch: ``n`` tokens to its one sequence, or one token to each of its sequences (a decode
    step). The same in every layer that starts at the same lengths."""

    start: np.ndarray  # lengths before the append
    n: int | None  # tokens appended to the batch's one sequence; None: one to each sequence (or a prefill step's)
    end: np.ndarray  # lengths after the append
    new: list  # (batch index, page index) of pages whose first token this append writes
    filled: list  # (batch index, page index) of pages this append completes
    page_ids: torch.Tensor | None = None  # each token's page and slot on the device, once the pages have ids
    slots: torch.Tensor | None = None


def _remember(memo: dict, key, value) -> None:
    if len(memo) >= MEMO:
        del memo[next(iter(memo))]
    memo[key] = value


def table_width(batch: Batch, nnz: int) -> int:
    """The length of a decode step's ``kv_indices`` for ``batch``: the pages of all its sequences' budgets, so that the
    page table keeps one shape (a compiled step one graph, a CUDA Graph one capture) while the batch runs; past the
    budgets, the next power of two. Entries past ``kv_indptr[-1]`` are never read."""
    budget = sum(s.budget for s in batch.seqs)
    return budget if nnz <= budget else 1 << (nnz - 1).bit_length()


class TokenLayouts:
    """Batches, append layouts and page tables of a cache's running sequences, built on demand and remembered.
    ``seq(seq_id)`` returns the record of a running sequence (or raises); :meth:`clear` when a sequence ends."""

    def __init__(self, page_size: int, upload: Uploader, seq: Callable):
        self.page_size, self._upload, self._seq = page_size, upload, seq
        self._batches: dict = {}
        self._layouts: dict = {}
        self._tables: dict = {}

    def clear(self) -> None:
        self._batches.clear()
        self._layouts.clear()
        self._tables.clear()

    def batch(self, seq_ids) -> Batch:
        """The batch of ``seq_ids``: one id, or several distinct ones (a sequence of ints or a tensor)."""
        key = self._key(seq_ids)
        batch = self._batches.get(key)
        if batch is None:
            seqs = [self._seq(s) for s in key]
            if len(set(key)) != len(key):
                raise ValueError(f"seq_ids repeats a sequence: {list(key)}")
            batch = Batch(key, seqs, np.array([s.row for s in seqs], dtype=np.int64))
            _remember(self._batches, key, batch)
        return batch

    def _key(self, seq_ids) -> tuple:
        """``seq_ids`` as a tuple of Python ints, the key batches are remembered by. An id of another type is checked
        (``seq``) first: True or 1.0 equal 1, so as a key they would find sequence 1's batch."""
        if isinstance(seq_ids, torch.Tensor):
            seq_ids = seq_ids.tolist()
        if isinstance(seq_ids, (int, np.integer)):
            seq_ids = (seq_ids,)
        try:
            key = tuple(seq_ids)
        except TypeError:
            raise TypeError(f"seq_ids must be an int or a sequence of ints, got {type(seq_ids).__name__} "
                            f"{seq_ids!r}") from None
        if not _INT.issuperset(map(type, key)):  # numpy ints, or a mistake
            for s in key:
                self._seq(s)
            key = tuple(map(int, key))
        return key

    def append(self, batch: Batch, start: np.ndarray, single: bool, n: int) -> AppendLayout:
        """Appending n tokens to ``batch`` (all to its one sequence if ``single``, else one each) from lengths
        ``start``: built once and remembered (the next layers at these lengths reuse it, with its device tensors)."""
        key = (batch.key, single, n, start.tobytes())
        layout = self._layouts.get(key)
        if layout is None:
            layout = self.layout(start, n if single else None)
            _remember(self._layouts, key, layout)
        return layout

    def layout(self, start: np.ndarray, n: int | None) -> AppendLayout:
        """Appending ``n`` tokens to the one sequence at length ``start`` [1], or with n None one token to each
        sequence at lengths ``start`` (a decode step)."""
        P = self.page_size
        if n is None:  # a token opens a page at slot 0 and fills it at slot P - 1
            end = start + 1
            slot, page = start % P, start // P
            opens, fills = (slot == 0).nonzero()[0], (slot == P - 1).nonzero()[0]
            new = list(zip(opens.tolist(), page[opens].tolist()))
            filled = list(zip(fills.tolist(), page[fills].tolist()))
        else:
            end = start + n
            a, b = int(start[0]), int(end[0])
            new = [(0, j) for j in range(-(-a // P), -(-b // P))]
            filled = [(0, j) for j in range(a // P, b // P)]
        return AppendLayout(start=start, n=n, end=end, new=new, filled=filled)

    def prefill_layout(self, start: np.ndarray, counts: np.ndarray) -> AppendLayout:
        """Appending ``counts[i]`` tokens to sequence i at length ``start[i]`` (a prefill step; its tokens are placed
        by :meth:`prefill_tables`)."""
        P, end = self.page_size, start + counts
        spans = list(zip(range(len(start)), start.tolist(), end.tolist()))
        new = [(i, j) for i, a, b in spans for j in range(-(-a // P), -(-b // P))]
        filled = [(i, j) for i, a, b in spans for j in range(a // P, b // P)]
        return AppendLayout(start=start, n=None, end=end, new=new, filled=filled)

    def prefill_tables(self, batch: Batch, start: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
        """A prefill step of ``batch`` from lengths ``start``, ``counts`` tokens each, once its pages have ids: each
        new token's page id and slot, ``qo_indptr``, and the page table after the step (``kv_indptr``,
        ``kv_last_page_len``, ``kv_indices``), int32, in this order."""
        P, end = self.page_size, start + counts
        indptr, indices = self.table(batch, -(-end // P))
        pos = np.concatenate([np.arange(a, b) for a, b in zip(start.tolist(), end.tolist())] + [np.empty(0, np.int64)])
        first_page = np.repeat(indptr[:-1].astype(np.int64), counts)  # each token's sequence's first table entry
        page_ids = indices[first_page + pos // P] if len(pos) else np.empty(0, dtype=np.int32)
        qo_indptr = np.zeros(len(counts) + 1, dtype=np.int32)
        counts.cumsum(out=qo_indptr[1:])
        last = np.minimum(end, (end - 1) % P + 1).astype(np.int32)  # 0 for a sequence with no tokens
        return [page_ids, (pos % P).astype(np.int32), qo_indptr, indptr, last, indices]

    def token_slots(self, batch: Batch, layout: AppendLayout) -> list[np.ndarray]:
        """Each token's page id and slot (int32 [n]), once every page of the layout has an id."""
        P = self.page_size
        if layout.n is None:
            pos = layout.start
            ids = np.fromiter((s.pages[p] for s, p in zip(batch.seqs, (pos // P).tolist())), dtype=np.int32,
                              count=len(pos))
        else:
            pos = layout.start[0] + np.arange(layout.n, dtype=layout.start.dtype)
            ids = batch.seqs[0].pages[pos // P]
        return [ids, (pos % P).astype(np.int32)]

    def filled_ids(self, batch: Batch, layout: AppendLayout) -> list[int]:
        """Page ids of the pages the append completes."""
        return [int(batch.seqs[i].pages[p]) for i, p in layout.filled]

    def table(self, batch: Batch, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """kv_indptr and kv_indices (int32) of ``batch`` with ``pages`` pages per sequence. A running sequence's pages
        only grow, so the table last built for the batch, unless it is ahead, gets the new pages inserted (a decode
        step adds a few) instead of being built anew."""
        indptr = np.zeros(len(pages) + 1, dtype=np.int32)
        pages.cumsum(out=indptr[1:])
        if batch.table is not None and (pages >= batch.table[0]).all():
            old, old_indptr, indices = batch.table
            grown = (pages != old).nonzero()[0].tolist()
            if grown:  # cut the old table after each grown sequence's pages and put its new pages there
                cuts = old_indptr[np.add(grown, 1)].tolist()
                parts = [indices[: cuts[0]]]
                for i, cut, end in zip(grown, cuts, cuts[1:] + [len(indices)]):
                    parts += [batch.seqs[i].pages[old[i]: pages[i]], indices[cut:end]]
                indices = np.concatenate(parts)
        else:
            indices = np.concatenate([s.pages[:p] for s, p in zip(batch.seqs, pages.tolist())] +
                                     [np.empty(0, dtype=np.int32)])
        batch.table = (pages, indptr, indices)
        return indptr, indices

    def page_table(self, batch: Batch, lens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The FlashInfer page table of ``batch`` at lengths ``lens`` on the device (``kv_indptr``, ``kv_indices``,
        ``kv_last_page_len``: 0 for a sequence with no tokens), remembered."""
        key = (batch.key, lens.tobytes())
        table = self._tables.get(key)
        if table is None:
            indptr, indices = self.table(batch, -(-lens // self.page_size))
            last = np.minimum(lens, (lens - 1) % self.page_size + 1).astype(np.int32)  # 0 for no tokens
            table = tuple(self._upload(indptr, indices, last))
            _remember(self._tables, key, table)
        return table

    def step_tables(self, batch: Batch, start: np.ndarray) -> list[np.ndarray]:
        """A decode step of ``batch`` from lengths ``start``, once its pages have ids: each new token's page id and
        slot, and the page table after the step (``kv_indptr``, ``kv_last_page_len``, ``kv_indices``, padded to
        :func:`table_width`), int32, in this order: the table-sized one last, so the others sit at the same place of
        an upload every step."""
        indptr, indices = self.table(batch, start // self.page_size + 1)  # the pages after the step
        page_ids = indices[indptr[1:] - 1]  # every sequence's new token goes to its last page
        slots = (start % self.page_size).astype(np.int32)
        last = slots + 1  # the new token is the last page's last
        return [page_ids, slots, indptr, last, np.pad(indices, (0, table_width(batch, len(indices)) - len(indices)))]
