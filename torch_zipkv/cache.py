"""CompressedPagedKVCache: a paged BF16 KV cache kept losslessly compressed in one byte arena on any device.

How it is put together:
- A page holds ``page_size`` tokens. A page id names the same token range of a sequence in every layer, so one page
  table serves all layers of a decode step. Each layer has its own meta tensor ``[max_pages, 2, H, W]`` (a view of one
  ``[layers, ...]`` tensor) whose rows point into the shared arena ``data``.
- This class keeps the rules (budgets, windows, what fits) and the accounting, and composes the parts that have
  state and rules of their own:

  - ``page_pool.py`` (:class:`~torch_zipkv.page_pool.PagePool`, host only): the sequences, their page ids and who
    holds each page; the prefix cache (full pages found by a chained key of their tokens, shared by reference
    count, kept until their room is needed).
  - ``arena.py`` (:class:`~torch_zipkv.arena.Arena`, host only): where every page's bytes live (chunks, slots,
    packed runs) and the promises that let an admitted sequence always grow to its budget.
  - ``page_store.py`` (:class:`~torch_zipkv.page_store.PageStore`): ``data`` and the meta rows on the device, and
    the writes that carry out the arena's decisions. Moving a page copies its bytes and rewrites word 0 of its meta
    rows, so page ids and page tables never change.
  - ``token_layout.py`` (:class:`~torch_zipkv.token_layout.TokenLayouts`): where an append's tokens go (page id,
    slot) and the page tables, built once per step and remembered across layers.
  - ``compression_rounds.py`` (:class:`~torch_zipkv.compression_rounds.CompressionRounds`): full pages waiting for
    compression, and the rounds that compress them without the host waiting for the device.
  - ``upload.py`` (:class:`~torch_zipkv.upload.Uploader`): host arrays to the device, one copy per call, pinned
    buffers reused, never waiting for the device.
  - Stateless: ``cache_sizing.py`` (how a byte budget divides into chunks and meta rows, and :meth:`raw_sizing`),
    ``cache_full.py`` (:class:`CacheFullError` and its descriptions), ``checks.py`` (argument checks),
    ``shared_prefix.py`` (the shared-prefix pass of a decode step).
- Open pages are raw slots that ``append_kv`` writes into. Full pages stay raw until ``compress_full_pages()``, called
  between decode steps (after the attention that read them), compresses them into packed chunks and frees the slots.
- Sequences are charged their token budget at raw size when added (the arena's promises), so a sequence admitted by
  ``add_sequence`` / ``capacity()`` can always grow to its budget; compression only ever gives bytes back.
- Sliding-window layers (``sliding_window``) keep only the window: ``compress_full_pages`` frees a layer's pages that
  lie wholly before its window (their ids stay in the shared page table; ``paged_decode``'s ``window_left`` never
  reads them). Their bytes return as headroom; promises stay charged at the full budget.
- Host work is batched, not per layer: :meth:`~CompressedPagedKVCache.prepare_step` prepares a decode step for every
  layer (token -> (page, slot), the page table, the pages it opens in every layer) and sends it all to the device in
  one copy; ``compress_full_pages`` compresses the full pages of every layer in rounds of up to 256 MiB, one
  decompress and one compress op call per round, on a view of all layers' meta rows (row ``layer * max_pages +
  page``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from . import format as fmt
from . import ops
from .arena import Arena
from .cache_full import CacheFullError, describe_free, describe_ids, opened_for
from .cache_sizing import arena_sizing, raw_sizing
from .checks import check_int, check_kv, check_layer, check_query, check_windows, is_int
from .compression_rounds import CompressionRounds
from .distributed import all_min, check_process_group
from .page_pool import PagePool
from .page_store import PageStore
from .shared_prefix import TENSORS as SHARED_TENSORS
from .shared_prefix import SharedTables, attend_shared, own_table, shared_prefix_tables
from .token_layout import AppendLayout, Batch, DecodeStep, PrefillStep, StepGeneration, TokenLayouts
from .upload import Uploader

_PREPARED_BY = {DecodeStep: "prepare_step", PrefillStep: "prepare_prefill"}
MOVE_BYTES = 64 << 20  # bytes one merged copy of the arena's moves carries at most (it holds them all at once)

__all__ = ["CacheFullError", "Capacity", "CompressedPagedKVCache", "DecodeStep", "PrefillStep"]


@dataclass(frozen=True)
class Capacity:
    """What still fits, charged at raw size, after keeping room for every running sequence's budget."""

    pages: int  # new pages every layer can take
    tokens: int  # pages * page_size: tokens one new sequence could hold
    requests: int  # sequences of the asked prompt_len + max_new_tokens that add_sequence would admit now


class CompressedPagedKVCache:
    """A paged BF16 KV cache for ``num_layers`` layers of ``num_kv_heads`` x ``head_dim``, kept losslessly
    compressed (docs/FORMAT.md) within ``max_bytes`` (or ``memory_fraction`` of the free GPU memory).

    Typical use, per request and step::

        sid = cache.add_sequence(prompt_len=len(prompt), max_new_tokens=256)  # CacheFullError if it can't fit
        for layer in ...: cache.append(layer, sid, k, v)                # prefill: k, v bf16 [tokens, H, D]
        cache.compress_full_pages()                                      # between steps
        for layer in ...:                                                # decode step of a batch
            cache.append(layer, seq_ids, k, v)                           # one token per sequence: [batch, H, D]
            out = cache.decode(layer, q, seq_ids)                        # q bf16 [batch, Hq, D]
        cache.compress_full_pages()
        cache.free_sequence(sid)

    ``capacity(prompt_len, max_new_tokens)`` says how many such requests fit now. ``page_table(layer, seq_ids)``
    gives FlashInfer-style ``(kv_indptr, kv_indices, kv_last_page_len)`` for ``ops.paged_decode`` on ``data`` and
    ``meta(layer)``. The byte budget covers ``data`` and the meta tensor; compression and compaction also use
    short-lived temporaries outside it (at most ~2 x 256 MiB, or one chunk). :meth:`raw_sizing` gives the budget
    for a number of sequences of a given length stored raw.

    Methods that take a layer and a sequence take the layer first. The cache's argument checks raise TypeError (a
    wrong type or dtype) or ValueError (a wrong shape, size or device; an unknown layer or sequence; a value out of
    range), naming the argument; a call the cache's state does not allow raises RuntimeError, and
    :class:`CacheFullError` (a RuntimeError) says what does not fit. :meth:`step_append` and :meth:`step_decode`
    check the layer and the step (:meth:`check_step`: this cache's, not stale), and leave the tensors' checks to the
    ops.

    Args:
        page_size: tokens per page (a multiple of 16).
        chunk_bytes: arena chunk size (>= 1), rounded down to whole raw pages (at least one). Default: 4 MiB, or
            ``max_bytes / (32 * num_layers)`` if less, so small budgets lose little to partly used chunks.
        max_pages: page ids per layer (meta rows). Default: enough for the whole arena compressed.
        device: default CUDA if available, else CPU.
        sliding_window: tokens a sliding-window layer attends to (the newest included, transformers' and
            Mistral's ``sliding_window``): one int for every layer, or one entry per layer (None: full attention).
            Decoding such a layer attends to its last ``sliding_window`` tokens, and the pages before them are
            freed between steps; :meth:`gather` returns the tokens it still keeps.
        process_group: under tensor parallelism, the ``torch.distributed`` group of the ranks that each hold a share
            of the model's KV heads in a cache of their own. What fits is then the least over the group's ranks, so
            every rank admits the same requests: :meth:`capacity`, :meth:`add_sequence`, and an :meth:`append` or
            :meth:`prepare_step` that opens pages beyond the sequences' budgets are collectives, which every rank
            calls in the same order with the same arguments. Everything else (appends within budgets, decode,
            compression) stays on the rank. None, or a group of one rank: this cache decides alone.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, page_size: int = 16,
                 max_bytes: int | None = None, memory_fraction: float | None = None, device=None,
                 chunk_bytes: int | None = None, max_pages: int | None = None, sliding_window=None,
                 process_group=None):
        check_int("num_layers", num_layers, 1)
        check_int("num_kv_heads", num_kv_heads, 1)
        check_int("page_size", page_size)
        check_int("head_dim", head_dim)
        fmt.check_geometry(page_size, head_dim)
        self.sliding_window: list[int | None] = check_windows(sliding_window, num_layers)
        self.process_group = check_process_group(process_group)  # None unless there are other ranks to agree with
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if (max_bytes is None) == (memory_fraction is None):
            raise ValueError("give exactly one of max_bytes and memory_fraction")
        if memory_fraction is not None:
            if not isinstance(memory_fraction, (int, float)) or isinstance(memory_fraction, bool):
                raise TypeError(f"memory_fraction must be a float, got {type(memory_fraction).__name__} "
                                f"{memory_fraction!r}")
            if device.type != "cuda" or not 0 < memory_fraction <= 1:
                raise ValueError(f"memory_fraction must be in (0, 1] and needs a CUDA device, got {memory_fraction} "
                                 f"on {device}")
            max_bytes = int(torch.cuda.mem_get_info(device)[0] * memory_fraction)
        check_int("max_bytes", max_bytes, 1)
        check_int("chunk_bytes", chunk_bytes, 1, optional=True)
        if max_pages is not None:
            check_int("max_pages", max_pages, 1)

        self.num_layers, self.num_kv_heads, self.head_dim, self.page_size = num_layers, num_kv_heads, head_dim, \
            page_size
        self.device = device
        self.page_bytes = fmt.raw_page_bytes(page_size, num_kv_heads, head_dim)  # one page of one layer, raw
        self.chunk_bytes, max_pages, num_chunks = arena_sizing(num_layers, num_kv_heads, head_dim, page_size,
                                                               max_bytes, chunk_bytes, max_pages)

        self._upload = Uploader(device)
        self._store = PageStore(num_layers, num_kv_heads, head_dim, page_size, self.page_bytes, max_pages,
                                num_chunks * self.chunk_bytes, device, self._upload)
        self.data = self._store.data
        self._arena = Arena(num_layers, max_pages, num_chunks, self.chunk_bytes, self.page_bytes)
        self._compression = CompressionRounds(self._store, self._arena, num_layers, max_pages)
        self._pool = PagePool(num_layers, max_pages)  # sequences, page ids, who holds them, the prefix cache
        self._seq = self._pool.seq
        self._layouts = TokenLayouts(page_size, self._upload, self._seq)
        self._all_layers = np.arange(num_layers)
        windows = self.sliding_window
        self._window_left = [-1 if w is None else w - 1 for w in windows]  # paged_decode's argument, per layer
        self._windowed = np.array([w is not None for w in windows]).nonzero()[0]
        self._window_tokens = np.array([w or 0 for w in windows], dtype=np.int64)[self._windowed]
        self._generation = StepGeneration(self)  # the decode steps prepared since the sequences or pages last changed

    raw_sizing = staticmethod(raw_sizing)  # the budget that holds a batch raw: torch_zipkv/cache_sizing.py

    # ---- sequences --------------------------------------------------------------------------------------------
    def add_sequence(self, prompt_len: int = 0, max_new_tokens: int = 0, *, prefix=()) -> int:
        """Start a sequence and return its id. Its budget, ``prompt_len + max_new_tokens`` tokens, is reserved at raw
        size in every layer, so appends within it never fail; appends past it take free room if any. Raises
        CacheFullError if the budget does not fit now (see :meth:`capacity`), evicting no cached page then.

        ``prefix``: cached page ids (:meth:`match_prefix`) that hold the sequence's first ``len(prefix) *
        page_size`` tokens in every layer. The sequence holds them from now on and starts after them, and its budget
        charges only the pages after them. Cached pages that nobody holds are evicted (least recently used first)
        when the budget needs their room."""
        for name, value in (("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens)):
            check_int(name, value, 0)
        prompt_len, max_new_tokens = int(prompt_len), int(max_new_tokens)
        budget = -(-(prompt_len + max_new_tokens) // self.page_size)
        prefix = self._pool.check_prefix(prefix, budget)
        private = budget - len(prefix)
        pages, ids = self._room(evict=True, keep=prefix)
        if private > min(pages, ids):
            what = f"add_sequence: a budget of {prompt_len + max_new_tokens} tokens needs {private}"
            if len(prefix):
                what += f" (beyond a cached prefix of {len(prefix)} pages)"
            state = self._pool, self._arena, self.process_group
            if ids < pages:
                raise CacheFullError(f"{what} page ids, but only {ids} are free ({describe_ids(*state)})",
                                     requested=private, free=ids, unit="page ids")
            raise CacheFullError(f"{what} raw pages in every layer, but only {pages} can be promised now "
                                 f"({describe_free(*state)})", requested=private, free=pages, unit="pages per layer")
        self._evict_for(private, prefix)
        self._arena.reserved += private
        seq_id = self._pool.add(budget, prefix)
        self._pool.len[self._pool.seqs[seq_id].row] = len(prefix) * self.page_size
        self._end_steps()
        return seq_id

    def free_sequence(self, seq_id: int) -> None:
        """Drop a sequence and its unused budget. Its pages that no other sequence holds are freed, but cached ones
        (:meth:`cache_pages`), which stay until their room is needed. Chunks that empty go back to the shared pool
        at once (for any layer); room freed inside chunks that stay in use comes back with :meth:`compact`."""
        seq = self._seq(seq_id)
        self._arena.reserved -= np.maximum(0, seq.budget - -(-self._pool.len[seq.row] // self.page_size))
        self._forget_ids(self._pool.remove(seq_id))
        self._layouts.clear()
        self._end_steps()

    def _forget_ids(self, ids: np.ndarray) -> None:
        """Free page ``ids`` (no sequence holds them, none is cached) in every layer; stale ids then fail loudly."""
        for layer in range(self.num_layers):
            self._forget_pages(layer, ids)
        self._store.forget_ids(ids, self._arena.take_dirty())

    # ---- the prefix cache (torch_zipkv/page_pool.py) --------------------------------------------------------------
    def match_prefix(self, keys) -> list[int]:
        """The cached pages of the longest run of ``keys`` (:func:`~torch_zipkv.page_pool.page_hashes` of a
        sequence's tokens, page 0 first) found here: give them to :meth:`add_sequence` as its ``prefix``."""
        return self._pool.match(keys)

    def cache_pages(self, seq_id: int, keys) -> int:
        """Make pages of ``seq_id`` findable by :meth:`match_prefix`: page j under ``keys[j]``, the chained key of its
        tokens (:func:`~torch_zipkv.page_pool.page_hashes`, which the caller computes from the tokens it appended:
        a key that names other tokens would serve wrong K/V). Only pages full and present in every layer are
        cached (a sliding window may have freed one); pages cached already, or whose key another page holds, are
        skipped. Returns how many pages became cached. A cached page stays when its holders end, until its room is
        needed."""
        seq = self._seq(seq_id)
        pages = seq.pages[: min(seq.num_ids, int(self._pool.len[seq.row].min()) // self.page_size)]
        return self._pool.register(seq, keys, whole=(self._arena.offset[:, pages] >= 0).all(0))

    def _present(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(layers, pages) of page ``ids`` where they have bytes."""
        layers, at = (self._arena.offset[:, ids] >= 0).nonzero()
        return layers, ids[at]

    def _evict_for(self, pages: int, keep: np.ndarray) -> None:
        """Evict the fewest least recently used cached pages nobody holds (but ``keep``) that leave room to promise
        ``pages`` more pages and page ids (the caller checked that evicting all of them would). Every rank evicts
        the same pages: the most any rank needs (the order is the same everywhere: host state every rank replays)."""
        lru = self._pool.lru(keep.tolist())
        if not len(lru):
            return
        zero = np.zeros(self.num_layers, dtype=np.int64)
        k = self._pool.fewest_to_evict(lru, pages, lambda ids: self._arena.max_new_pages(
            zero, *self._arena.after_release(*self._present(ids))))  # this rank's room once ids are evicted
        if self.process_group is not None:
            k = -self._agree([-k])[0]
        if k:
            self._pool.evict(lru[:k])
            self._forget_ids(lru[:k])

    def _end_steps(self) -> None:
        """The sequences or pages changed: every decode step prepared so far is stale (:class:`StepGeneration`). A
        freed page id goes to the next sequence that needs one, and a page compressed before the step's token reached
        it would lose the token, so a step prepared before would write into or read what is no longer its own. One
        rule for all steps and all such changes (not only those that touch a step's pages): simple to state, and a
        decode loop makes these changes between steps anyway."""
        self._generation.stale = True
        self._generation = StepGeneration(self)

    @property
    def seq_ids(self) -> list[int]:
        """Ids of the running sequences."""
        return list(self._pool.seqs)

    def seq_len(self, layer: int, seq_id: int) -> int:
        """Tokens appended to ``seq_id`` in ``layer``."""
        check_layer(layer, self.num_layers)
        return int(self._pool.len[self._seq(seq_id).row, layer])

    # ---- append and decode --------------------------------------------------------------------------------------
    def append(self, layer: int, seq_ids, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append tokens to ``layer``: ``k``, ``v`` bf16 [n, num_kv_heads, head_dim] on the cache's device.

        ``seq_ids`` is one id (all n tokens go to that sequence, e.g. a prefill chunk) or n distinct ids (one token
        each, e.g. a decode step). New pages open raw; raises CacheFullError, changing nothing, if they don't fit.
        """
        check_layer(layer, self.num_layers)
        n = check_kv(k, v, self.num_kv_heads, self.head_dim, self.device)
        single = is_int(seq_ids)
        batch = self._layouts.batch(seq_ids)
        if not single and len(batch.seqs) != n:
            raise ValueError(f"seq_ids has {len(batch.seqs)} ids for {n} tokens: give one id per token, or a single "
                             "id for all")
        if n == 0:
            return
        layers = slice(layer, layer + 1)
        layout = self._layouts.append(batch, self._pool.len[batch.rows, layer], single, n)
        writes = self._open_pages(layers, batch, layout)
        tokens = self._layouts.token_slots(batch, layout) if layout.page_ids is None else []  # the layers share them
        sent = self._upload(*writes, *tokens)
        self._store.write_open_rows(*sent[: len(writes)])
        if tokens:
            layout.page_ids, layout.slots = sent[len(writes):]
        ops.append_kv(k.contiguous(), v.contiguous(), layout.page_ids, layout.slots, self.page_size, self.data,
                      self.meta(layer))
        self._pool.len[batch.rows, layer] = layout.end
        self._compression.add_full(layers, self._layouts.filled_ids(batch, layout))

    def page_table(self, layer: int, seq_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer page table of ``seq_ids`` in ``layer``: int32 ``kv_indptr [B+1]``, ``kv_indices [nnz]``,
        ``kv_last_page_len [B]`` (0 for a sequence with no tokens in the layer), on the cache's device."""
        check_layer(layer, self.num_layers)
        batch = self._layouts.batch(seq_ids)
        return self._layouts.page_table(batch, self._pool.len[batch.rows, layer])

    def decode(self, layer: int, q: torch.Tensor, seq_ids, *, sm_scale: float | None = None,
               out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
               logits_soft_cap: float = 0.0) -> torch.Tensor:
        """Decode attention of ``q`` (bf16 [B, num_qo_heads, head_dim], one query per sequence) over the tokens of
        ``seq_ids`` in ``layer`` (its last ``sliding_window`` tokens for a sliding-window layer); see
        :func:`torch_zipkv.ops.paged_decode`."""
        check_query(q, self.num_kv_heads, self.head_dim, self.device, "batch")
        indptr, indices, last = self.page_table(layer, seq_ids)
        if q.shape[0] != len(indptr) - 1:
            raise ValueError(f"q has {q.shape[0]} rows for {len(indptr) - 1} sequences")
        return ops.paged_decode(q, self.data, self.meta(layer), indptr, indices, last, self.page_size,
                                sm_scale=sm_scale, out=out, lse=lse, window_left=self._window_left[layer],
                                logits_soft_cap=logits_soft_cap)

    def prefill(self, layer: int, q: torch.Tensor, seq_ids, *, q_lens=None, sm_scale: float | None = None,
                out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                logits_soft_cap: float = 0.0) -> torch.Tensor:
        """Causal attention of ``q`` (bf16 [n, num_qo_heads, head_dim]), the queries of the last tokens of
        ``seq_ids`` in ``layer`` (appended before the call), over each sequence's pages as they are stored, compressed
        or raw (the layer's sliding window applied; nothing is decompressed into scratch); see
        :func:`torch_zipkv.ops.paged_prefill`. ``seq_ids``: one id (all n queries are its last n tokens), or a list
        with ``q_lens`` (the query tokens of each, in order, summing to n: several sequences' chunks in one call).
        Returns bf16 [n, num_qo_heads, head_dim]."""
        check_query(q, self.num_kv_heads, self.head_dim, self.device, "n")
        n = q.shape[0]
        if is_int(seq_ids):
            if q_lens is not None:
                raise ValueError("q_lens goes with a list of seq_ids; one seq_id takes all of q's rows")
            seq_ids, q_lens = [seq_ids], [n]
        elif q_lens is None or len(q_lens) != len(seq_ids):
            raise ValueError(f"q_lens must give the query tokens of each of the {len(seq_ids)} seq_ids, got {q_lens}")
        for m in q_lens:
            check_int("q_lens", m, 0)
        if sum(q_lens) != n:
            raise ValueError(f"q_lens {list(q_lens)} sum to {sum(q_lens)}, but q has {n} rows")
        for sid, m in zip(seq_ids, q_lens):
            if m > self.seq_len(layer, sid):
                raise ValueError(f"q has {m} query tokens for sequence {sid}, which holds {self.seq_len(layer, sid)} "
                                 f"in layer {layer}: append the tokens' K/V first")
        indptr, indices, last = self.page_table(layer, seq_ids)
        qo_indptr, = self._upload(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
        return ops.paged_prefill(q, qo_indptr, self.data, self.meta(layer), indptr, indices, last, self.page_size,
                                 sm_scale=sm_scale, out=out, lse=lse, window_left=self._window_left[layer],
                                 logits_soft_cap=logits_soft_cap)

    def prepare_step(self, seq_ids, *, shared_prefix: bool = False, rows: int | None = None) -> DecodeStep:
        """Prepare one decode step of ``seq_ids`` (one new token each) for every layer at once: new pages open in all
        layers together (one device copy), and the returned :class:`DecodeStep` holds the tensors every layer's
        append and attention use (page ids are shared by all layers, so one page table serves them all).

        Then, for each layer, :meth:`step_append` (or ``ops.append_kv`` with ``step.page_ids``, ``step.slots``)
        and :meth:`step_decode` (or ``ops.paged_decode`` with ``step.kv_indptr``, ...): the per-layer calls do no
        host bookkeeping, and the tensors can feed a captured CUDA Graph. The lengths count the new tokens from
        now on, so append them to every layer before anything else reads the cache. Needs every layer at the same
        length for these sequences (else RuntimeError); raises CacheFullError, changing nothing, if the new pages do
        not fit.

        A step serves until the cache's sequences or pages change: :meth:`add_sequence`, :meth:`free_sequence`,
        :meth:`compress_full_pages` and :meth:`compact` make every step prepared before them stale, and
        :meth:`step_append` and :meth:`step_decode` refuse a stale step (RuntimeError). So call those between steps,
        before this.

        ``shared_prefix``: attend to the leading pages that several of these sequences share (a cached prompt prefix)
        once for all of them (:mod:`torch_zipkv.shared_prefix`); False, or a cache with sliding-window layers, or no
        such pages: every row attends to all its pages. ``rows``: the row count a CUDA Graph pads the step to
        (``>= len(seq_ids)``), which that pass is laid out for."""
        batch = self._layouts.batch(seq_ids)
        if not isinstance(shared_prefix, bool):
            raise TypeError(f"shared_prefix must be a bool, got {type(shared_prefix).__name__}")
        rows = len(batch.seqs) if rows is None else rows
        check_int("rows", rows, len(batch.seqs))
        start = self._common_lengths(batch, "prepare_step")
        layout = self._layouts.layout(start, None)  # used once: not remembered
        writes = self._open_pages(slice(None), batch, layout)
        tables = self._layouts.step_tables(batch, start)
        shared = None
        if shared_prefix and all(w is None for w in self.sliding_window):
            shared = shared_prefix_tables([s.pages for s in batch.seqs], start // self.page_size, rows,
                                          self.num_kv_heads, self.page_size, self.head_dim)
        if shared is not None:  # the step's page table: each row's pages after the prefix the pass covers
            tables[2], tables[4] = own_table(tables[2], tables[4], shared.pop("skip"))
        extra = [] if shared is None else [shared[k] for k in SHARED_TENSORS]
        # The step's one host-to-device copy, the step's tensors first (see TokenLayouts.step_tables).
        page_ids, slots, indptr, last, indices, *rest = self._upload(*tables, *extra, *writes)
        self._store.write_open_rows(*rest[len(extra):])
        self._appended_to_all_layers(batch, layout)
        if shared is not None:
            shared = SharedTables(*rest[: len(extra)], rows=rows, sharing_rows=shared["sharing_rows"],
                                  shared_pages=shared["shared_pages"])
        return DecodeStep(page_ids, slots, indptr, indices, last, self._generation, shared)

    def prepare_prefill(self, seq_ids, q_lens) -> PrefillStep:
        """Prepare one prefill call of ``q_lens[i]`` new tokens of each of ``seq_ids`` for every layer at once, as
        :meth:`prepare_step` prepares a decode step: the new pages open in all layers together, and one device copy
        sends where each token goes, ``qo_indptr`` and the page table after the append. Then, for each layer,
        :meth:`step_append` (``k``, ``v`` [sum(q_lens), H, D], the sequences' tokens one after another) and
        :meth:`step_prefill`: the per-layer calls do no host bookkeeping. The lengths count the new tokens from now
        on. Needs every layer at the same length for these sequences (else RuntimeError); raises CacheFullError,
        changing nothing, if the new pages do not fit. Stale as a decode step is."""
        batch = self._layouts.batch(seq_ids)
        if isinstance(q_lens, (str, bytes)) or not hasattr(q_lens, "__len__") or len(q_lens) != len(batch.seqs):
            raise ValueError(f"q_lens must give the new tokens of each of the {len(batch.seqs)} seq_ids, got "
                             f"{q_lens!r}")
        for m in q_lens:
            check_int("q_lens", m, 0)
        counts = np.array([int(m) for m in q_lens], dtype=np.int64)
        start = self._common_lengths(batch, "prepare_prefill")
        layout = self._layouts.prefill_layout(start, counts)
        writes = self._open_pages(slice(None), batch, layout, prefill=True)
        tables = self._layouts.prefill_tables(batch, start, counts)
        page_ids, slots, qo_indptr, indptr, last, indices, *rest = self._upload(*tables, *writes)
        self._store.write_open_rows(*rest)
        self._appended_to_all_layers(batch, layout)
        return PrefillStep(page_ids, slots, qo_indptr, indptr, indices, last, self._generation)

    def check_step(self, step, fn: str = "check_step", kinds: tuple = (DecodeStep,)) -> None:
        """TypeError unless ``step`` is one of ``kinds`` (a DecodeStep; :meth:`step_append` also takes a
        PrefillStep); ValueError if another cache prepared it (its page ids and slots name that cache's pages);
        RuntimeError if it is stale (its page ids may name another sequence's pages now, or pages compressed since).
        :meth:`step_append`, :meth:`step_decode` and :meth:`step_prefill` call it before anything is written or read;
        whoever copies a step into a CUDA Graph's buffers (:meth:`static_step`) calls it first."""
        if not isinstance(step, kinds):
            names = " or ".join(f"a {k.__name__} from {_PREPARED_BY[k]}" for k in kinds)
            raise TypeError(f"{fn}: step must be {names}, got {type(step).__name__}")
        kind = type(step).__name__
        if step.generation.owner is not self:
            raise ValueError(f"{fn}: the {kind} was prepared by another cache; a step belongs to the cache whose "
                             f"{_PREPARED_BY[type(step)]} made it")
        if step.stale:
            raise RuntimeError(f"{fn}: the {kind} is stale: the cache admitted or freed a sequence, or compressed "
                               f"or compacted pages, after {_PREPARED_BY[type(step)]} made it (its pages may be "
                               "another sequence's now); do those between steps and prepare the step after them")

    def static_step(self, page_ids: torch.Tensor, slots: torch.Tensor, kv_indptr: torch.Tensor,
                    kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                    shared: SharedTables | None = None) -> DecodeStep:
        """A DecodeStep of this cache over caller-owned int32 buffers on its device, which a captured CUDA Graph
        reads: its replays run no Python, so the graph's step never goes stale; before each replay the caller checks
        the prepared step it copies into the buffers (:meth:`check_step`). ``shared``: a shared-prefix pass over
        buffers of the same kind. Used by the engine's decode graphs."""
        for name, t in (("page_ids", page_ids), ("slots", slots), ("kv_indptr", kv_indptr),
                        ("kv_indices", kv_indices), ("kv_last_page_len", kv_last_page_len)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.device != self.device:
                raise ValueError(f"static_step: {name} must be a 1-D int32 tensor on {self.device}, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        return DecodeStep(page_ids, slots, kv_indptr, kv_indices, kv_last_page_len, StepGeneration(self), shared)

    def step_append(self, layer: int, step: DecodeStep | PrefillStep, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer's tokens of a step prepared by :meth:`prepare_step` (``k``, ``v`` bf16 [B, H, D]) or
        :meth:`prepare_prefill` ([n, H, D]). Writes nothing if the step is stale or another cache's
        (:meth:`check_step`)."""
        self.check_step(step, "step_append", (DecodeStep, PrefillStep))
        ops.append_kv(k, v, step.page_ids, step.slots, self.page_size, self.data, self.meta(layer))

    def step_prefill(self, layer: int, step: PrefillStep, q: torch.Tensor, *, sm_scale: float | None = None,
                     out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                     logits_soft_cap: float = 0.0) -> torch.Tensor:
        """Causal attention of one layer in a step prepared by :meth:`prepare_prefill` (``q`` bf16 [n, Hq, D], the
        step's new tokens), after :meth:`step_append` of the layer, as :meth:`prefill` computes it. Refuses a stale
        step or another cache's (:meth:`check_step`)."""
        self.check_step(step, "step_prefill", (PrefillStep,))
        return ops.paged_prefill(q, step.qo_indptr, self.data, self.meta(layer), step.kv_indptr, step.kv_indices,
                                 step.kv_last_page_len, self.page_size, sm_scale=sm_scale, out=out, lse=lse,
                                 window_left=self._window_left[layer], logits_soft_cap=logits_soft_cap)

    def step_decode(self, layer: int, step: DecodeStep, q: torch.Tensor, *, sm_scale: float | None = None,
                    out: torch.Tensor | None = None, logits_soft_cap: float = 0.0) -> torch.Tensor:
        """Decode attention of one layer in a step prepared by :meth:`prepare_step` (``q`` bf16 [B, Hq, D]).
        Refuses a stale step or another cache's (:meth:`check_step`). A step with a shared-prefix pass attends to
        the prefix once for its rows (rebuilt once into BF16 scratch, one dense attention), to each row's own pages
        (``paged_decode``), and merges the two (:func:`torch_zipkv.shared_prefix.attend_shared`)."""
        self.check_step(step, "step_decode")
        sh, meta = step.shared, self.meta(layer)
        if sh is None:
            return ops.paged_decode(q, self.data, meta, step.kv_indptr, step.kv_indices, step.kv_last_page_len,
                                    self.page_size, sm_scale=sm_scale, out=out, window_left=self._window_left[layer],
                                    logits_soft_cap=logits_soft_cap)
        if not torch.compiler.is_compiling() and q.shape[0] != sh.rows:  # (a compiled step's graphs check it)
            raise ValueError(f"step_decode: q has {q.shape[0]} rows, the step's shared-prefix pass is laid out for "
                             f"{sh.rows}")
        merged = attend_shared(q, self.data, meta, self.page_size, sh, step.kv_indptr, step.kv_indices,
                               step.kv_last_page_len, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap)
        own = merged.shape[0]  # a step laid out for more rows than it has (padded by the caller): those are zero
        if out is None and own == q.shape[0]:
            return merged
        out = torch.zeros_like(q) if out is None else out
        out[:own].copy_(merged)
        out[own:].zero_()
        return out

    def gather(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens of ``seq_id`` in ``layer`` as bf16 ``k, v`` [tokens, num_kv_heads, head_dim], bit-identical
        to what was appended (for debugging, offload and tests). A sliding-window layer returns the tokens it still
        keeps: the last ones, from the first page not yet freed (:meth:`kept_from`)."""
        check_layer(layer, self.num_layers)
        seq = self._seq(seq_id)
        length, first = int(self._pool.len[seq.row, layer]), int(self._pool.dropped[seq.row, layer])
        n = -(-length // self.page_size) - first
        ids, = self._upload(seq.pages[first: first + n])
        pages = ops.decompress_pages(self.data, self.meta(layer), ids, self.page_size, self.head_dim)
        k, v = (pages[:, i].reshape(n * self.page_size, self.num_kv_heads, self.head_dim)[
            : length - first * self.page_size] for i in (0, 1))
        return k, v

    def kept_from(self, layer: int, seq_id: int) -> int:
        """The first token of ``seq_id`` that ``layer`` still stores (0 unless its sliding window freed pages)."""
        check_layer(layer, self.num_layers)
        return int(self._pool.dropped[self._seq(seq_id).row, layer]) * self.page_size

    def meta(self, layer: int) -> torch.Tensor:
        """Meta rows of ``layer``: int32 [max_pages, 2, num_kv_heads, W], for ops on ``data``."""
        if type(layer) is not int or not 0 <= layer < self.num_layers:  # one test on a decode step's path
            check_layer(layer, self.num_layers)
        return self._store.meta_views[layer]

    # ---- maintenance between steps ------------------------------------------------------------------------------
    def compress_full_pages(self, wait: bool = True) -> int:
        """Compress every full page still stored raw; returns how many pages took their compressed place in this
        call. Call it between decode steps (after the attention that read those pages). Pages go to packed chunks,
        freeing their slots; when no packed room can be taken without breaking a promise, a page is compressed in
        place in its own slot (after one huge compression, e.g. all layers of a long prefill at once, the last layers
        may end up so; :meth:`compact` packs them). Sliding-window layers first free their pages that lie wholly
        before the window (never compressed).

        A round of up to 256 MiB of pages, of any layers, is one decompress and one compress call; placing them
        needs their compressed sizes on the host. ``wait=True`` waits for them (a device sync) and places every
        page now. ``wait=False`` never waits: it places the rounds of earlier calls whose sizes have arrived and
        leaves this call's to a later call (on CPU: always the next); meanwhile those pages stay raw where they
        are, correct to read, and their bytes come back one call later. It starts at most two rounds (512 MiB of
        raw pages); the pages past them wait for the next call (:meth:`compression_backlog`). A decode loop calls
        it so.
        """
        self._end_steps()
        self._free_out_of_window()
        placed = self._compression.compress(wait)
        # Slots the pages left are scattered among open pages (after a prefill, one open page per chunk): drain
        # layers holding more than one spare slot chunk, so the room returns to the pool for any layer.
        spare = (self._arena.spare_slot_chunks(self._all_layers) > 1).nonzero()[0].tolist()
        if spare:
            self._move_pages(lambda layer: self._arena.drain_slots(layer, slack=1), spare)
        return placed

    def compression_backlog(self) -> int:
        """Full pages (of all layers) that :meth:`compress_full_pages` has not started compressing: more than a call
        without waiting takes on. A loop that sees some calls it again at its next step."""
        return self._compression.backlog()

    def _forget_pages(self, layer: int, pages: np.ndarray) -> None:
        """Free ``layer``'s ``pages`` in the arena and drop them from the full pages waiting for compression and from
        any round in flight (which then skips them, even if their ids are reused meanwhile)."""
        self._arena.remove(layer, pages)
        self._compression.forget(layer, pages)

    def _free_out_of_window(self) -> None:
        """Free, in every sliding-window layer, each sequence's pages that end before its window: the decode of this
        and every later step attends to the last ``window`` tokens only and skips them."""
        freed = self._pool.leave_windows(self._windowed, self._window_tokens, self.page_size)
        for layer, pages in freed:
            self._forget_pages(layer, pages)
        if freed:  # a freed page fails loudly if anything reads it
            layers, pids = (np.concatenate(x) for x in zip(*((np.full(len(p), layer), p) for layer, p in freed)))
            self._store.forget_rows(self._store.rows(layers, pids), self._arena.take_dirty())

    def compact(self, max_bytes: int | None = None, *, sparse: float = 0.5) -> int:
        """Gather scattered free room into whole chunks that return to the shared pool: compressed pages kept in
        slots move to packed room, sparse slot chunks drain into others, packed chunks close their holes and the
        sparsest empty into the others' tails. Returns the bytes moved. Between steps; no device sync.

        ``max_bytes``: a bounded compaction for a serving loop: pages compressed in place pack where that frees
        slot chunks, slot chunks drain, and each layer's packed chunks with at most ``sparse`` (0 to 1) of their
        bytes live, sparsest first, empty into packed room elsewhere and go back to the pool, moving at most
        ``max_bytes`` (split evenly over the layers) of those. Freed pages leave holes in packed chunks that nothing
        else reclaims, so a cache whose sequences come and go needs this to keep what compression saved."""
        if max_bytes is not None:
            check_int("max_bytes", max_bytes, 0)
            if not isinstance(sparse, (int, float)) or not 0 <= sparse <= 1:
                raise ValueError(f"sparse must be a number from 0 to 1, got {sparse!r}")
        self._end_steps()
        if max_bytes is None:
            return self._move_pages(self._arena.compaction, range(self.num_layers))
        per_layer = int(max_bytes) // self.num_layers
        return self._move_pages(lambda layer: self._arena.reclaim(layer, per_layer, float(sparse)),
                                range(self.num_layers))

    def _move_pages(self, moves: Callable[[int], Iterator[list]], layers: Iterable[int]) -> int:
        """Carry out the arena's moves ``moves(layer)`` (batches of (page, old offset, new offset, nbytes), each to be
        copied before the next is asked for) for each of ``layers``; returns the bytes moved.

        Batches are merged, across layers, into one copy of up to :data:`MOVE_BYTES`: a page moved twice goes from
        where it was to where it ends, every source is read before any destination is written, and no two pages end
        in the same place, so one copy leaves what copying batch after batch would. Draining slots after a
        compression call moves a batch in most layers; one copy each cost ~20 small kernels a layer."""
        moved = 0
        pending: dict[int, list[int]] = {}  # meta row -> [old offset, new offset, nbytes]
        bytes_pending = 0

        def flush() -> None:
            nonlocal pending, bytes_pending
            if pending:
                rows = np.fromiter(pending, dtype=np.int64, count=len(pending))
                old, new, size = np.array(list(pending.values()), dtype=np.int64).reshape(-1, 3).T
                keep = old != new  # moved and back again: nothing to copy
                empty = np.empty(0, dtype=np.int64)
                self._store.move(rows[keep], new[keep], old[keep], size[keep], self.data, empty)
            pending, bytes_pending = {}, 0

        for layer in layers:
            first_row = int(self._store.rows(layer, 0))
            for group in moves(layer):
                for page, old, new, size in group:
                    if (at := pending.get(first_row + page)) is not None:
                        at[1] = new
                    else:
                        pending[first_row + page] = [old, new, size]
                    bytes_pending += size
                    moved += size
                if bytes_pending >= MOVE_BYTES:
                    flush()
        flush()
        self._store.zero(self._arena.take_dirty())  # after all copies: a freed slot may have been a source
        return moved

    # ---- accounting ------------------------------------------------------------------------------------------
    def capacity(self, prompt_len: int = 0, max_new_tokens: int = 0, *, reserve: int = 0) -> Capacity:
        """What fits now, charging new pages at raw size (they must take writes before they compress) and keeping
        every running sequence's budget. ``requests`` counts sequences of ``prompt_len + max_new_tokens`` tokens
        that :meth:`add_sequence` would admit now, one after another. ``reserve`` keeps room for that many more
        tokens of every running sequence beyond its pages and budget (for sequences added without a budget).
        Bytes that compression will free later are never promised."""
        for name, value in (("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens), ("reserve", reserve)):
            check_int(name, value, 0)
        pages = min(self._room(*self._pool.growth(reserve, self.page_size), evict=True))
        per_request = -(-(prompt_len + max_new_tokens) // self.page_size)
        return Capacity(pages=pages, tokens=pages * self.page_size,
                        requests=pages // per_request if per_request else 0)

    def stats(self) -> dict:
        """Bytes and chunks: ``raw_bytes`` (live pages as plain BF16), ``stored_bytes`` (as stored), ``ratio``,
        ``meta_bytes``, ``tokens`` (stored), ``free_chunks`` / ``num_chunks`` / ``chunk_bytes``, ``fragmentation``
        (share of the bytes in layer-owned chunks that hold no live page: free slots, packed tails, holes, room left by
        pages compressed in place); the prefix cache's pages, all layers, as stored: ``cached_bytes`` (findable by
        :meth:`match_prefix`), ``shared_bytes`` (held by two sequences or more), ``evictable_bytes`` (cached, held by
        none: room :meth:`capacity` counts), with their page ids counted in ``cached_pages``, ``shared_pages``,
        ``evictable_pages``; and ``layers``, one dict per layer (``waiting_full_pages``: full pages not yet
        compressed; ``compressing_pages``: compressed by ``compress_full_pages(wait=False)``, not yet placed)."""
        a = self._arena
        tokens = self._pool.tokens(self.page_size)  # stored: a sliding window's freed pages are gone
        layers = []
        for layer in range(self.num_layers):
            live = a.offset[layer] >= 0
            pages, stored = int(live.sum()), int(a.nbytes[layer][live].sum())
            layers.append({
                "tokens": int(tokens[layer]), "pages": pages, "raw_bytes": pages * self.page_bytes,
                "stored_bytes": stored, "waiting_full_pages": self._compression.waiting(layer),
                "compressing_pages": self._compression.compressing(layer),
                "slot_chunks": len(a.slot_chunks[layer]), "packed_chunks": len(a.packed_chunks[layer]),
                "free_slots": int(a.free_slot_count[layer]), "promised_pages": int(a.reserved[layer])})
        raw = sum(x["raw_bytes"] for x in layers)
        stored = sum(x["stored_bytes"] for x in layers)
        owned = (a.num_chunks - len(a.pool)) * self.chunk_bytes
        return {
            "tokens": int(tokens.sum()), "raw_bytes": raw, "stored_bytes": stored,
            "ratio": stored / raw if raw else 1.0,
            "meta_bytes": self._store.meta.numel() * 4, "num_chunks": a.num_chunks, "free_chunks": len(a.pool),
            "chunk_bytes": self.chunk_bytes, "fragmentation": 1 - stored / owned if owned else 0.0,
            "sequences": len(self._pool.seqs), "free_page_ids": len(self._pool.free_ids),
            **{f"{what}_{unit}": int(a.nbytes[:, ids].sum()) if unit == "bytes" else len(ids)
               for what, ids in self._pool.prefix_pages().items() for unit in ("bytes", "pages")}, "layers": layers}

    def _room(self, extra: np.ndarray | None = None, extra_ids: int = 0, *, evict: bool = False,
              keep: np.ndarray = ()) -> tuple[int, int]:
        """Raw pages every layer can take beyond every promise and ``extra`` [layers] more pages, and page ids beyond
        those promised and ``extra_ids`` more: what a new sequence may be promised, in either unit. ``evict``: once
        every cached page nobody holds (but ``keep``) is evicted, room a promise may count on, since
        :meth:`add_sequence` evicts what it needs (the pages' slots and the chunks they alone fill; holes they leave
        in packed chunks are not counted)."""
        if extra is None:
            extra = np.zeros(self.num_layers, dtype=np.int64)
        lru = self._pool.lru(np.asarray(keep).tolist()) if evict else ()
        after = self._arena.after_release(*self._present(lru)) if len(lru) else ()
        ids = len(self._pool.free_ids) + len(lru) - self._pool.reserved_ids - extra_ids
        room = self._arena.max_new_pages(extra, *after), max(0, ids)
        return room if self.process_group is None else tuple(self._agree(list(room)))

    def _agree(self, values: list[int]) -> list[int]:
        """The least of each value over the process group's ranks (see ``process_group``): a collective."""
        return all_min(values, self.process_group, self.device)

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _common_lengths(self, batch: Batch, fn: str) -> np.ndarray:
        """The sequences' lengths [B], the same in every layer (else RuntimeError): a step prepared for all layers."""
        lens = self._pool.len[batch.rows]  # [B, layers]
        start = lens[:, 0]
        if (lens != start[:, None]).any():
            raise RuntimeError(f"{fn} needs every layer at the same length for these sequences; use append() per "
                               "layer otherwise")
        return start

    def _appended_to_all_layers(self, batch: Batch, layout: AppendLayout) -> None:
        """Count a prepared step's tokens in every layer; the pages it fills wait for compression."""
        self._pool.len[batch.rows] = layout.end[:, None]
        if layout.filled:
            self._compression.add_full(slice(None), self._layouts.filled_ids(batch, layout))

    def _open_pages(self, layers: slice, batch: Batch, layout: AppendLayout, prefill: bool = False) -> list[np.ndarray]:
        """Give the layout's new pages ids (first layer to reach them) and raw slots in each of ``layers`` (all of
        them for a decode step or a prefill, one for an append), or raise CacheFullError before changing anything
        (``prefill`` names the caller in its message). Returns the device writes that makes, for
        :meth:`PageStore.write_open_rows` after an upload: the pages' meta rows (int64 [k]), their values (int32
        [k, 2, H, W]) and the slots to zero (of slot chunks just taken from the pool); nothing if no page opens."""
        if not layout.new:
            return []
        new = [(batch.seqs[i], j) for i, j in layout.new]
        beyond = sum(j >= s.budget for s, j in new)  # pages outside their sequence's promise
        need_ids = [(s, j) for s, j in new if j >= s.num_ids]
        ids_beyond = sum(j >= s.budget for s, j in need_ids)
        ids_short = self._pool.ids_short(ids_beyond)
        fits = self._arena.fits(layers, beyond)
        # Within the budgets every rank fits (promises). Beyond them the ranks agree, which they reach together:
        # ``beyond`` and ``ids_beyond`` come from lengths and budgets, the same on every rank.
        if self.process_group is not None and (beyond or ids_beyond):
            ids_fit, fits = self._agree([int(not ids_short), int(fits)])
            ids_short = not ids_fit
        state = self._pool, self._arena, self.process_group
        if need_ids and ids_short:
            free = self._room()[1]
            raise CacheFullError(f"{opened_for(layers, batch, prefill)} needs {ids_beyond} page ids beyond the "
                                 f"sequences' budgets, but only {free} are free ({describe_ids(*state)})",
                                 requested=ids_beyond, free=free, unit="page ids")
        if not fits:
            if layers == slice(None):  # a decode step or a prefill: every layer takes them
                free, where, unit = self._room()[0], " in every layer", "pages per layer"
            else:
                free, where, unit = self._arena.spare_pages(layers.start), "", "pages"
                if self.process_group is not None:
                    free = self._agree([free])[0]
            raise CacheFullError(f"{opened_for(layers, batch, prefill)} needs {len(new)} new raw pages{where}, "
                                 f"{beyond} of them beyond the sequences' budgets, but only {free} can be taken{where} "
                                 f"without breaking promises ({describe_free(*state)})", requested=beyond, free=free,
                                 unit=unit)
        self._pool.give_ids(need_ids)
        pids = np.array([s.pages[j] for s, j in new], dtype=np.int32)
        self._arena.reserved[layers] -= len(new) - beyond
        slots = self._arena.place_raw(layers, pids)  # [layers, pages]
        rows = self._store.rows(self._all_layers[layers, None], pids).ravel()
        return [rows, self._store.open_rows(slots), self._arena.take_dirty()]
