"""CompressedPagedKVCache: a paged BF16 KV cache kept losslessly compressed in one byte arena on any device.

How it is put together (DESIGN.md §3, memory manager):
- A page holds ``page_size`` tokens. A page id names the same token range of a sequence in every layer, so one page
  table serves all layers of a decode step. Each layer has its own meta tensor ``[max_pages, 2, H, W]`` (a view of one
  ``[layers, ...]`` tensor) whose rows point into the shared arena ``data``.
- Where a page's bytes live is the arena's business (``torch_zipkv/arena.py``, host only). Moving a page copies its
  bytes and rewrites word 0 of its meta rows, so page ids and page tables never change.
- Open pages are raw slots that ``append_kv`` writes into. Full pages stay raw until ``compress_full_pages()``, called
  between decode steps (after the attention that read them), compresses them into packed chunks and frees the slots.
- Sequences are charged their token budget at raw size when added (the arena's promises), so a sequence admitted by
  ``add_sequence`` / ``capacity()`` can always grow to its budget; compression only ever gives bytes back.
- Sliding-window layers (``sliding_window``) keep only the window: ``compress_full_pages`` frees a layer's pages that
  lie wholly before its window (their ids stay in the shared page table; ``paged_decode``'s ``window_left`` never
  reads them). Their bytes return as headroom; promises stay charged at the full budget.
- Host work is batched, not per layer: :meth:`~CompressedPagedKVCache.prepare_step` plans a decode step for every
  layer (token -> (page, slot), the page table, the pages it opens in every layer) and sends it all to the device in
  one copy; ``compress_full_pages`` compresses the full pages of every layer with one op pair on a view of all layers'
  meta rows (row ``layer * max_pages + page``). Host arrays reach the device through :class:`_Uploader` (one copy per
  call, pinned buffers reused, never waiting for the device).
"""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

from . import format as fmt
from . import ops
from .arena import Arena

_MiB = 1 << 20
_COMPRESS_ROUND_BYTES = 256 * _MiB  # raw bytes compressed per round: bounds the temporary pages and scratch
_MEMO = 8  # plans / page tables remembered (one step needs one of each; a few spare for interleaved batches)


class CacheFullError(RuntimeError):
    """The cache cannot hold what was asked, and nothing was changed. ``requested`` and ``free`` count ``unit``
    (raw pages of one layer, or page ids) so a scheduler can act on them."""

    def __init__(self, message: str, *, requested: int, free: int, unit: str):
        super().__init__(message)
        self.requested, self.free, self.unit = requested, free, unit


@dataclass(frozen=True)
class Capacity:
    """What still fits, charged at raw size, after keeping room for every running sequence's budget."""

    pages: int  # new pages every layer can take
    tokens: int  # pages * page_size: tokens one new sequence could hold
    requests: int  # sequences of the asked prompt_len + max_new_tokens that add_sequence would admit now


@dataclass(frozen=True)
class DecodeStep:
    """One decode step planned for every layer by :meth:`CompressedPagedKVCache.prepare_step`: where each
    sequence's new token goes (``page_ids``, ``slots``: int32 [B]) and the FlashInfer page table after it
    (``kv_indptr`` [B+1], ``kv_indices`` [nnz], ``kv_last_page_len`` [B]), all int32 on the cache's device."""

    page_ids: torch.Tensor
    slots: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


class _Seq:
    __slots__ = ("row", "pages", "num_ids", "budget")

    def __init__(self, row: int, budget: int):
        self.row, self.budget, self.num_ids = row, budget, 0  # budget: pages promised in every layer
        self.pages = np.empty(max(8, budget), dtype=np.int32)  # page ids in token order; grows by doubling

    def push(self, page: int) -> None:
        if self.num_ids == len(self.pages):
            self.pages = np.concatenate([self.pages, np.empty_like(self.pages)])
        self.pages[self.num_ids] = page
        self.num_ids += 1


@dataclass
class _Batch:
    key: tuple
    seqs: list
    rows: np.ndarray
    table: tuple | None = None  # (pages per sequence, kv_indptr, kv_indices) of the page table last built


@dataclass
class _Plan:
    """One append, the same for every layer that starts at the same lengths (so built once per step)."""

    start: np.ndarray  # lengths before the append
    counts: np.ndarray | None  # tokens appended to each sequence; None: one each
    end: np.ndarray  # lengths after the append
    new: list  # (batch index, page index) of pages whose first token this append writes
    filled: list  # (batch index, page index) of pages this append completes
    page_ids: torch.Tensor | None = None  # each token's page and slot on the device, once the pages have ids
    slots: torch.Tensor | None = None


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


def _remember(memo: dict, key, value) -> None:
    if len(memo) >= _MEMO:
        del memo[next(iter(memo))]
    memo[key] = value


def _table_width(batch: "_Batch", nnz: int) -> int:
    """The length of a decode step's ``kv_indices`` for ``batch``: the pages of all its sequences' budgets, so that the
    page table keeps one shape (a compiled step one graph, a CUDA Graph one capture) while the batch runs; past the
    budgets, the next power of two. Entries past ``kv_indptr[-1]`` are never read."""
    budget = sum(s.budget for s in batch.seqs)
    return budget if nnz <= budget else 1 << (nnz - 1).bit_length()


def _ranges(counts: np.ndarray, *starts: np.ndarray) -> list[np.ndarray]:
    """For each array of ``starts``: starts[i], starts[i] + 1, ..., starts[i] + counts[i] - 1 for every i,
    concatenated (dtype of counts)."""
    ends = np.cumsum(counts)
    within = np.arange(ends[-1] if len(ends) else 0, dtype=counts.dtype) - np.repeat(ends - counts, counts)
    return [np.repeat(s, counts) + within for s in starts]


_PAD = np.zeros(1, dtype=np.int32)
_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


class _Uploader:
    """int32 / int64 host arrays to a device in one copy per call, as views of one device buffer.

    On CUDA the arrays are packed into a pinned buffer and copied asynchronously. Buffers are reused, oldest first,
    once the copy that last read them has run (a CUDA event each, queried, never waited on); while none has, a new
    one is made. So nothing is pinned per call and the host never waits for the device. On CPU the tensors are views
    of a fresh host buffer."""

    def __init__(self, device: torch.device):
        self.device, self.on_cpu = device, device.type == "cpu"
        self.ring: collections.deque = collections.deque()  # (pinned int32 buffer, event of its last copy)

    def __call__(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        if not arrays:
            return []
        parts, sizes, index, at = [], [], [], 0  # int32 words to send, their sizes, which are the arrays, words so far
        for a in arrays:
            words = a.ravel()
            if a.dtype == np.int64:
                if at % 2:  # an int64 view needs an 8-byte aligned start
                    parts.append(_PAD)
                    sizes.append(1)
                    at += 1
                words = words.view(np.int32)
            index.append(len(parts))
            parts.append(words)
            sizes.append(len(words))
            at += len(words)
        parts.append(_PAD)  # never empty: views of an empty buffer cannot change dtype
        sizes.append(1)
        if self.on_cpu:
            dev = torch.from_numpy(np.concatenate(parts))
        else:
            host, done = self._pinned(at + 1)
            np.concatenate(parts, out=host.numpy()[: at + 1])
            dev = host[: at + 1].to(self.device, non_blocking=True)
            done.record(torch.cuda.current_stream(self.device))
            self.ring.append((host, done))
        pieces = dev.split_with_sizes(sizes)
        return [pieces[i] if a.dtype == np.int32 and a.ndim == 1 else
                pieces[i].view(_TORCH_DTYPES[a.dtype]).view(a.shape) for i, a in zip(index, arrays)]

    def _pinned(self, n: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The oldest buffer if its last copy has run, else a new one; grown to at least ``n`` words."""
        if self.ring and self.ring[0][1].query():
            host, done = self.ring.popleft()
        else:
            host, done = torch.empty(0, dtype=torch.int32), torch.cuda.Event()
        if host.numel() < n:
            host = torch.empty(max(n, 2 * host.numel(), 16 << 10), dtype=torch.int32, pin_memory=True)
        return host, done


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
    short-lived temporaries outside it (at most ~2 x 256 MiB, or one chunk).

    Args:
        page_size: tokens per page (a multiple of 16).
        chunk_bytes: arena chunk size, rounded down to whole raw pages (at least one).
        max_pages: page ids per layer (meta rows). Default: enough for the whole arena compressed.
        device: default CUDA if available, else CPU.
        sliding_window: tokens a sliding-window layer attends to (the newest included, transformers' and
            Mistral's ``sliding_window``): one int for every layer, or one entry per layer (None: full attention).
            Decoding such a layer attends to its last ``sliding_window`` tokens, and the pages before them are
            freed between steps; :meth:`gather` returns the tokens it still keeps.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, page_size: int = 16,
                 max_bytes: int | None = None, memory_fraction: float | None = None, device=None,
                 chunk_bytes: int = 4 * _MiB, max_pages: int | None = None, sliding_window=None):
        fmt.check_geometry(page_size, head_dim)
        if num_layers < 1 or num_kv_heads < 1:
            raise ValueError(f"num_layers and num_kv_heads must be >= 1, got {num_layers} and {num_kv_heads}")
        windows = [sliding_window] * num_layers if sliding_window is None or isinstance(sliding_window, int) \
            else list(sliding_window)
        if len(windows) != num_layers or any(w is not None and (not isinstance(w, int) or w < 1) for w in windows):
            raise ValueError(f"sliding_window must be None, an int >= 1, or one such entry per layer "
                             f"({num_layers}), got {sliding_window!r}")
        self.sliding_window: list[int | None] = windows
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if (max_bytes is None) == (memory_fraction is None):
            raise ValueError("give exactly one of max_bytes and memory_fraction")
        if memory_fraction is not None:
            if device.type != "cuda" or not 0 < memory_fraction <= 1:
                raise ValueError(f"memory_fraction must be in (0, 1] and needs a CUDA device, got {memory_fraction} "
                                 f"on {device}")
            max_bytes = int(torch.cuda.mem_get_info(device)[0] * memory_fraction)

        self.num_layers, self.num_kv_heads, self.head_dim, self.page_size = num_layers, num_kv_heads, head_dim, \
            page_size
        self.device = device
        self.page_bytes = 2 * page_size * num_kv_heads * head_dim * 2  # one page of one layer, raw
        self.chunk_bytes = max(1, chunk_bytes // self.page_bytes) * self.page_bytes
        W = fmt.meta_words(page_size, head_dim)
        id_bytes = num_layers * 2 * num_kv_heads * W * 4  # meta of one page id, all layers
        if max_pages is None:  # ids enough for a full arena of all-compressed pages (3/4 of raw, the least)
            per_byte = 1 / (num_layers * self.page_bytes * 3 / 4)
            num_chunks = int(max_bytes / (1 + id_bytes * per_byte)) // self.chunk_bytes
            max_pages = math.ceil(num_chunks * self.chunk_bytes * per_byte)
        num_chunks = (max_bytes - max_pages * id_bytes) // self.chunk_bytes
        if num_chunks < 1 or max_pages < 1:
            raise ValueError(f"max_bytes = {max_bytes} holds no chunk of {self.chunk_bytes} bytes plus the meta of "
                             f"{max_pages} pages ({id_bytes} bytes each)")
        if num_chunks * self.chunk_bytes >= fmt.STREAM_ALIGN << 31:
            raise ValueError("the arena would pass the format's 512 GiB offset limit")
        if num_layers * max_pages >= 1 << 31:
            raise ValueError(f"num_layers * max_pages = {num_layers * max_pages} meta rows: int32 row ids need < 2**31")

        self.data = torch.zeros(num_chunks * self.chunk_bytes, dtype=torch.uint8, device=device)
        self._meta = torch.full((num_layers, max_pages, 2, num_kv_heads, W), fmt.NO_STREAM, dtype=torch.int32,
                                device=device)
        self._meta_views = list(self._meta)  # meta(layer) without an indexing op per call
        # data in 256-byte units (moves) and raw-page units (zeroing), as int64 words: 8 bytes per indexed element
        self._units = self.data.view(torch.int64).view(-1, fmt.STREAM_ALIGN // 8)
        self._raw_pages = self.data.view(torch.int64).view(-1, self.page_bytes // 8)
        # Every layer's meta rows as one table (row layer * max_pages + page): one op call covers pages of all layers.
        self._meta_rows = self._meta.view(-1, 2, num_kv_heads, W)
        self._meta_starts = self._meta_rows[..., 0]  # word 0 of each stream: where it starts (in STREAM_ALIGN units)
        self._first_rows = np.arange(num_layers, dtype=np.int64) * max_pages  # each layer's row 0
        self._upload = _Uploader(device)
        self._all_layers = np.arange(num_layers)
        self._arena = Arena(num_layers, max_pages, num_chunks, self.chunk_bytes, self.page_bytes)
        # Meta rows of an open page at offset 0: stream (K|V, head) starts at (kv * H + head) * stream bytes.
        stream_units = page_size * head_dim * 2 // fmt.STREAM_ALIGN
        self._raw_rows = np.empty((2, num_kv_heads, W), dtype=np.int32)
        self._raw_rows[..., 1:] = fmt.raw_descriptor_words(page_size, head_dim)
        self._raw_rows[..., 0] = np.arange(2 * num_kv_heads).reshape(2, num_kv_heads) * stream_units
        # Per flat row position: the STREAM_ALIGN units of a slot at word 0, else 0. A slot number times this, plus
        # the template, gives the rows of a page open in that slot.
        word0 = (np.arange(self._raw_rows.size) % W == 0).astype(np.int32)
        self._slot_word0 = word0 * (self.page_bytes // fmt.STREAM_ALIGN)

        self._seqs: dict[int, _Seq] = {}
        self._next_seq_id = 0
        self._len = np.zeros((16, num_layers), dtype=np.int64)  # tokens per (sequence row, layer)
        self._dropped = np.zeros((16, num_layers), dtype=np.int64)  # leading pages freed (sliding windows)
        self._window_left = [-1 if w is None else w - 1 for w in windows]  # paged_decode's argument, per layer
        self._windowed = np.array([w is not None for w in windows]).nonzero()[0]
        self._window_tokens = np.array([w or 0 for w in windows], dtype=np.int64)[self._windowed]
        self._free_rows = list(range(15, -1, -1))
        self._free_ids = list(range(max_pages - 1, -1, -1))
        self._reserved_ids = 0  # page ids promised to running sequences
        self._full: list[dict[int, None]] = [{} for _ in range(num_layers)]  # full raw pages, in fill order
        # Compression rounds whose sizes have not been read back yet (compress_full_pages(wait=False)), oldest first,
        # and per (layer, page) the serial of the round it is in (-1: none). Freeing a page resets its entry, so its
        # round skips it even if the id is reused meanwhile.
        self._rounds: collections.deque[_Round] = collections.deque()
        self._round_of = np.full((num_layers, max_pages), -1, dtype=np.int64)
        self._next_round = 0
        self._batches: dict = {}
        self._plans: dict = {}
        self._tables: dict = {}

    # ---- sequences --------------------------------------------------------------------------------------------
    def add_sequence(self, prompt_len: int = 0, max_new_tokens: int = 0) -> int:
        """Start a sequence and return its id. Its budget, ``prompt_len + max_new_tokens`` tokens, is reserved at raw
        size in every layer, so appends within it never fail; appends past it take free room if any. Raises
        CacheFullError if the budget does not fit now (see :meth:`capacity`)."""
        for name, value in (("prompt_len", prompt_len), ("max_new_tokens", max_new_tokens)):
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        budget = -(-(prompt_len + max_new_tokens) // self.page_size)
        if budget:
            free = self.capacity().pages
            if budget > free:
                raise CacheFullError(
                    f"add_sequence: a budget of {prompt_len + max_new_tokens} tokens needs {budget} raw pages in "
                    f"every layer, but only {free} can be promised now ({self._describe_free()})",
                    requested=budget, free=free, unit="pages per layer")
        if not self._free_rows:
            old = len(self._len)
            self._len = np.concatenate([self._len, np.zeros_like(self._len)])
            self._dropped = np.concatenate([self._dropped, np.zeros_like(self._dropped)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        seq = _Seq(self._free_rows.pop(), budget)
        self._len[seq.row] = 0
        self._dropped[seq.row] = 0
        self._arena.reserved += budget
        self._reserved_ids += budget
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self._seqs[seq_id] = seq
        return seq_id

    def free_sequence(self, seq_id: int) -> None:
        """Drop a sequence and its unused budget. Chunks that empty go back to the shared pool at once (for any
        layer); room freed inside chunks that stay in use comes back with :meth:`compact`."""
        seq = self._seq(seq_id)
        for layer in range(self.num_layers):
            pages = -(-int(self._len[seq.row, layer]) // self.page_size)
            self._forget_pages(layer, seq.pages[:pages])
            self._arena.reserved[layer] -= max(0, seq.budget - pages)
        ids = seq.pages[: seq.num_ids]
        ids_t, zero = self._upload(ids, self._arena.take_dirty())
        self._meta[:, ids_t] = fmt.NO_STREAM  # stale ids now fail loudly
        self._zero_pages(zero)
        self._free_ids.extend(ids.tolist())
        self._reserved_ids -= max(0, seq.budget - seq.num_ids)
        self._free_rows.append(seq.row)
        del self._seqs[seq_id]
        self._batches.clear()
        self._plans.clear()
        self._tables.clear()

    @property
    def seq_ids(self) -> list[int]:
        """Ids of the running sequences."""
        return list(self._seqs)

    def seq_len(self, seq_id: int, layer: int = 0) -> int:
        """Tokens appended to ``seq_id`` in ``layer``."""
        self._check_layer(layer)
        return int(self._len[self._seq(seq_id).row, layer])

    # ---- append and decode --------------------------------------------------------------------------------------
    def append(self, layer: int, seq_ids, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append tokens to ``layer``: ``k``, ``v`` bf16 [n, num_kv_heads, head_dim] on the cache's device.

        ``seq_ids`` is one id (all n tokens go to that sequence, e.g. a prefill chunk) or n distinct ids (one token
        each, e.g. a decode step). New pages open raw; raises CacheFullError, changing nothing, if they don't fit.
        """
        self._check_layer(layer)
        n = self._check_tokens(k, v)
        single = isinstance(seq_ids, (int, np.integer))
        batch = self._batch(seq_ids)
        if not single and len(batch.seqs) != n:
            raise ValueError(f"seq_ids has {len(batch.seqs)} ids for {n} tokens: give one id per token, or a single "
                             "id for all")
        if n == 0:
            return
        start = self._len[batch.rows, layer]
        plan = self._plan(batch, start, single, n)
        writes = self._open_pages(slice(layer, layer + 1), batch, plan)
        tokens = self._token_slots(batch, plan) if plan.page_ids is None else []  # once: the layers share them
        sent = self._upload(*writes, *tokens)
        self._write_pages(*sent[: len(writes)])
        if tokens:
            plan.page_ids, plan.slots = sent[len(writes):]
        ops.append_kv(k.contiguous(), v.contiguous(), plan.page_ids, plan.slots, self.page_size, self.data,
                      self.meta(layer))
        self._len[batch.rows, layer] = plan.end
        self._full[layer].update(dict.fromkeys(self._filled_ids(batch, plan)))

    def page_table(self, layer: int, seq_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """FlashInfer page table of ``seq_ids`` in ``layer``: int32 ``kv_indptr [B+1]``, ``kv_indices [nnz]``,
        ``kv_last_page_len [B]`` (0 for a sequence with no tokens in the layer), on the cache's device."""
        self._check_layer(layer)
        batch = self._batch(seq_ids)
        lens = self._len[batch.rows, layer]
        key = (batch.key, lens.tobytes())
        table = self._tables.get(key)
        if table is None:
            indptr, indices = self._table(batch, -(-lens // self.page_size))
            last = np.minimum(lens, (lens - 1) % self.page_size + 1).astype(np.int32)  # 0 for no tokens
            table = tuple(self._upload(indptr, indices, last))
            _remember(self._tables, key, table)
        return table

    def decode(self, layer: int, q: torch.Tensor, seq_ids, *, sm_scale: float | None = None,
               out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
               logits_soft_cap: float = 0.0) -> torch.Tensor:
        """Decode attention of ``q`` (bf16 [B, num_qo_heads, head_dim], one query per sequence) over the tokens of
        ``seq_ids`` in ``layer`` (its last ``sliding_window`` tokens for a sliding-window layer); see
        :func:`torch_zipkv.ops.paged_decode`."""
        if not isinstance(q, torch.Tensor):
            raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
        if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[2] != self.head_dim or \
                q.shape[1] % self.num_kv_heads:
            raise ValueError(f"q must be bf16 [batch, k * {self.num_kv_heads}, {self.head_dim}], got {q.dtype} "
                             f"{tuple(q.shape)}")
        if q.device != self.device:
            raise ValueError(f"q must be on {self.device}, got {q.device}")
        indptr, indices, last = self.page_table(layer, seq_ids)
        if q.shape[0] != len(indptr) - 1:
            raise ValueError(f"q has {q.shape[0]} rows for {len(indptr) - 1} sequences")
        return ops.paged_decode(q, self.data, self.meta(layer), indptr, indices, last, self.page_size, sm_scale,
                                out, lse, self._window_left[layer], logits_soft_cap)

    def prepare_step(self, seq_ids) -> "DecodeStep":
        """Plan one decode step of ``seq_ids`` (one new token each) for every layer at once: new pages open in all
        layers together (one device copy), and the returned :class:`DecodeStep` holds the tensors every layer's
        append and attention use (page ids are shared by all layers, so one page table serves them all).

        Then, for each layer, :meth:`step_append` (or ``ops.append_kv`` with ``step.page_ids``, ``step.slots``)
        and :meth:`step_decode` (or ``ops.paged_decode`` with ``step.kv_indptr``, ...): the per-layer calls do no
        host bookkeeping, and the tensors can feed a captured CUDA Graph. The lengths count the new tokens from
        now on, so append them to every layer before anything else reads the cache. Needs every layer at the same
        length for these sequences; raises CacheFullError, changing nothing, if the new pages do not fit."""
        batch = self._batch(seq_ids)
        lens = self._len[batch.rows]  # [B, layers]
        start = lens[:, 0]
        if (lens != start[:, None]).any():
            raise ValueError("prepare_step needs every layer at the same length for these sequences; use append() "
                             "per layer otherwise")
        plan = self._build_plan(start, None)  # used once: not remembered
        writes = self._open_pages(slice(None), batch, plan)
        indptr, indices = self._table(batch, start // self.page_size + 1)  # the pages after the step
        page_ids = indices[indptr[1:] - 1]  # every sequence's new token goes to its last page
        slots = (start % self.page_size).astype(np.int32)
        last = slots + 1  # the new token is the last page's last
        # The step's one host-to-device copy. The step's tensors come first, nnz-sized last, so each sits at the same
        # place of the buffer every step of a batch.
        indices = np.pad(indices, (0, _table_width(batch, len(indices)) - len(indices)))
        page_ids, slots, indptr, last, indices, *writes = self._upload(page_ids, slots, indptr, last, indices, *writes)
        self._write_pages(*writes)
        self._len[batch.rows] = plan.end[:, None]
        if plan.filled:
            filled = dict.fromkeys(self._filled_ids(batch, plan))
            for full in self._full:
                full.update(filled)
        return DecodeStep(page_ids, slots, indptr, indices, last)

    def step_append(self, layer: int, step: "DecodeStep", k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer's tokens of a step planned by :meth:`prepare_step` (``k``, ``v`` bf16 [B, H, D])."""
        ops.append_kv(k, v, step.page_ids, step.slots, self.page_size, self.data, self.meta(layer))

    def step_decode(self, layer: int, step: "DecodeStep", q: torch.Tensor, *, sm_scale: float | None = None,
                    out: torch.Tensor | None = None, logits_soft_cap: float = 0.0) -> torch.Tensor:
        """Decode attention of one layer in a step planned by :meth:`prepare_step` (``q`` bf16 [B, Hq, D])."""
        return ops.paged_decode(q, self.data, self.meta(layer), step.kv_indptr, step.kv_indices,
                                step.kv_last_page_len, self.page_size, sm_scale, out, None,
                                self._window_left[layer], logits_soft_cap)

    def gather(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens of ``seq_id`` in ``layer`` as bf16 ``k, v`` [tokens, num_kv_heads, head_dim], bit-identical
        to what was appended (for debugging, offload and tests). A sliding-window layer returns the tokens it still
        keeps: the last ones, from the first page not yet freed (:meth:`kept_from`)."""
        self._check_layer(layer)
        seq = self._seq(seq_id)
        length, first = int(self._len[seq.row, layer]), int(self._dropped[seq.row, layer])
        n = -(-length // self.page_size) - first
        ids, = self._upload(seq.pages[first: first + n])
        pages = ops.decompress_pages(self.data, self.meta(layer), ids, self.page_size, self.head_dim)
        k, v = (pages[:, i].reshape(n * self.page_size, self.num_kv_heads, self.head_dim)[
            : length - first * self.page_size] for i in (0, 1))
        return k, v

    def kept_from(self, seq_id: int, layer: int) -> int:
        """The first token of ``seq_id`` that ``layer`` still stores (0 unless its sliding window freed pages)."""
        self._check_layer(layer)
        return int(self._dropped[self._seq(seq_id).row, layer]) * self.page_size

    def meta(self, layer: int) -> torch.Tensor:
        """Meta rows of ``layer``: int32 [max_pages, 2, num_kv_heads, W], for ops on ``data``."""
        return self._meta_views[layer]

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
        are, correct to read, and their bytes come back one call later. A decode loop calls it so.
        """
        self._free_out_of_window()
        placed = self._finish_rounds(wait)
        counts = [len(full) for full in self._full]
        layers = self._all_layers.repeat(counts)
        pids = np.fromiter(itertools.chain.from_iterable(self._full), dtype=np.int64, count=len(layers))
        limit = max(1, _COMPRESS_ROUND_BYTES // self.page_bytes)
        for at in range(0, len(pids), limit):
            if len(self._rounds) >= 2:  # bound the scratch held by rounds in flight: place the oldest first
                placed += self._place(self._rounds.popleft())
            self._start_round(layers[at: at + limit], pids[at: at + limit])
        for full in self._full:
            full.clear()
        if wait:
            placed += self._finish_rounds(wait=True)
        # Slots the pages left are scattered among open pages (after a prefill, one open page per chunk): drain
        # layers holding more than one spare slot chunk, so the room returns to the pool for any layer.
        spare = (self._arena.spare_slot_chunks(self._all_layers) > 1).nonzero()[0].tolist()
        if spare:
            self._apply(lambda layer: self._arena.drain_slots(layer, slack=1), spare)
        return placed

    def _forget_pages(self, layer: int, pages: np.ndarray) -> None:
        """Free ``layer``'s ``pages`` in the arena and drop them from the full pages waiting for compression and from
        any round in flight (which then skips them, even if their ids are reused meanwhile)."""
        self._arena.remove(layer, pages)
        for p in pages.tolist():
            self._full[layer].pop(p, None)
        self._round_of[layer, pages] = -1

    def _free_out_of_window(self) -> None:
        """Free, in every sliding-window layer, each sequence's pages that end before its window: the decode of this
        and every later step attends to the last ``window`` tokens only and skips them."""
        if not len(self._windowed) or not self._seqs:
            return
        seqs = list(self._seqs.values())
        rows = np.array([s.row for s in seqs])
        keep = np.maximum(0, self._len[rows][:, self._windowed] - self._window_tokens) // self.page_size
        dropped = self._dropped[rows][:, self._windowed]
        todo = np.argwhere(keep > dropped)  # a pair turns up once every page_size steps
        if not len(todo):
            return
        layers, pids = [], []
        for i, w in todo.tolist():
            layer, pages = int(self._windowed[w]), seqs[i].pages[dropped[i, w]: keep[i, w]]
            self._forget_pages(layer, pages)
            layers.append(np.full(len(pages), layer))
            pids.append(pages)
            self._dropped[rows[i], layer] = keep[i, w]
        rows_t, zero = self._upload(self._rows(np.concatenate(layers), np.concatenate(pids)),
                                    self._arena.take_dirty())
        self._meta_rows[rows_t] = fmt.NO_STREAM  # a freed page fails loudly if anything reads it
        self._zero_pages(zero)

    def _start_round(self, layers: np.ndarray, pids: np.ndarray) -> None:
        """Compress pages (layers[i], pids[i]) of any layers (layers ascending) with one decompress and one compress
        call on the meta rows of all layers, into a scratch buffer (room for all of them raw, so it cannot overflow)
        and scratch meta rows; start copying where each page's streams start to the host. Nothing waits."""
        n = len(pids)
        scratch = torch.empty(n * self.page_bytes, dtype=torch.uint8, device=self.device)
        meta = torch.empty((n, *self._meta_rows.shape[1:]), dtype=torch.int32, device=self.device)
        ids, local, cursor = self._upload(self._rows(layers, pids).astype(np.int32), np.arange(n, dtype=np.int32),
                                          np.array([0, scratch.numel()], dtype=np.int64))
        kv = ops.decompress_pages(self.data, self._meta_rows, ids, self.page_size, self.head_dim)
        ops.compress_pages(kv, local, scratch, meta, cursor)
        # Pages lie back to back, in order: each starts at word 0 of its (K, head 0) stream (in STREAM_ALIGN units),
        # the last ends at the cursor.
        ends = torch.cat([meta[:, 0, 0, 0].long() * fmt.STREAM_ALIGN, cursor[:1]])
        done = None
        if self.device.type == "cuda":
            host = torch.empty(n + 1, dtype=torch.int64, pin_memory=True)
            ends, done = host.copy_(ends, non_blocking=True), torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        self._round_of[layers, pids] = self._next_round
        self._rounds.append(_Round(self._next_round, layers, pids, scratch, meta, ends, done))
        self._next_round += 1

    def _finish_rounds(self, wait: bool) -> int:
        """Place the rounds in flight, oldest first: all of them (waiting for their sizes) if ``wait``, else those
        whose sizes have arrived. Returns the pages placed."""
        placed = 0
        while self._rounds and (wait or self._rounds[0].done is None or self._rounds[0].done.query()):
            placed += self._place(self._rounds.popleft())
        return placed

    def _place(self, r: _Round) -> int:
        """Put a round's pages that are still its own (not freed since; :attr:`_round_of`) where the arena says:
        their scratch meta rows replace the raw ones, then their bytes are copied there, the rows shifted to match,
        and the slots they left zeroed. Returns how many."""
        if r.done is not None:
            r.done.synchronize()  # no-op once it has run; only compress_full_pages(wait=True) gets here earlier
        ends = r.ends.numpy()
        mine = (self._round_of[r.layers, r.pids] == r.serial).nonzero()[0]
        if not len(mine):
            return 0
        layers, pids = r.layers[mine], r.pids[mine]
        self._round_of[layers, pids] = -1
        sizes = ends[mine + 1] - ends[mine]
        offsets = self._arena.repack(layers, pids, sizes)
        rows = self._rows(layers, pids)
        rows_t, mine_t = self._upload(rows, mine)
        self._meta_rows[rows_t] = r.meta[mine_t]  # relative to scratch until _move shifts them
        self._move(rows, offsets, ends[mine], sizes, r.scratch, self._arena.take_dirty())  # zero the slots they left
        return len(mine)

    def compact(self) -> int:
        """Gather scattered free room into whole chunks that return to the shared pool: compressed pages kept in
        slots move to packed room, sparse slot chunks drain into others, packed chunks close their holes and the
        sparsest empty into the others' tails. Returns the bytes moved. Between steps; no device sync."""
        return self._apply(self._arena.compaction, range(self.num_layers))

    def _apply(self, plan, layers) -> int:
        """Carry out the arena's move batches ``plan(layer)`` for each of ``layers``; returns the bytes moved."""
        moved = 0
        empty = np.empty(0, dtype=np.int64)
        for layer in layers:
            for batch in plan(layer):
                if not batch:
                    continue
                pids, old, new, size = (np.array(x, dtype=np.int64) for x in zip(*batch))
                self._move(self._rows(layer, pids), new, old, size, self.data, empty)
                moved += int(size.sum())
        self._zero_dirty()  # after all copies: a freed slot may have been a source
        return moved

    # ---- device writes: host arrays decided here, sent with one upload per call -------------------------------
    def _rows(self, layers, pids: np.ndarray) -> np.ndarray:
        """Rows of pages (layer, page id) in the all-layer meta table (numpy broadcasting). int64: indexing converts
        int32 indices first, on CUDA with one more kernel."""
        return self._first_rows[layers] + pids

    def _move(self, rows: np.ndarray, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, source: torch.Tensor,
              zero: np.ndarray) -> None:
        """Copy the pages of meta rows ``rows`` (int64) from bytes ``src`` of ``source`` to bytes ``dst`` of data
        (``nbytes`` each, all sources read before any destination is written; every offset and size is a multiple of
        STREAM_ALIGN), add the distance moved to word 0 of their meta rows, then zero slots ``zero``."""
        A = fmt.STREAM_ALIGN
        dst, src = (dst // A).astype(np.int32), (src // A).astype(np.int32)  # units; data holds < 2**31 of them
        dst_t, src_t, rows_t, shift_t, zero_t = self._upload(
            *_ranges((nbytes // A).astype(np.int32), dst, src), rows, dst - src, zero)
        self._units.index_put_((dst_t,), source.view(torch.int64).view(-1, A // 8).index_select(0, src_t))
        # Gather, add, scatter: index_put_(accumulate=True) would copy this strided view of all rows whole on CUDA.
        self._meta_starts[rows_t] += shift_t[:, None, None]
        self._zero_pages(zero_t)

    def _zero_pages(self, slots: torch.Tensor) -> None:
        """Zero raw-page-sized slots of data (slot s: bytes [s * page_bytes, (s + 1) * page_bytes))."""
        if slots.numel():
            self._raw_pages[slots] = 0

    def _zero_dirty(self) -> None:
        slots = self._arena.take_dirty()
        if len(slots):
            self._zero_pages(*self._upload(slots))

    def _write_pages(self, rows: torch.Tensor | None = None, values: torch.Tensor | None = None,
                     zero: torch.Tensor | None = None) -> None:
        """Carry out what :meth:`_open_pages` returned, once on the device (nothing if it returned nothing)."""
        if rows is not None:
            self._zero_pages(zero)
            self._meta_rows[rows] = values

    # ---- accounting ------------------------------------------------------------------------------------------
    def capacity(self, prompt_len: int = 0, max_new_tokens: int = 0, *, reserve: int = 0) -> Capacity:
        """What fits now, charging new pages at raw size (they must take writes before they compress) and keeping
        every running sequence's budget. ``requests`` counts sequences of ``prompt_len + max_new_tokens`` tokens
        that :meth:`add_sequence` would admit now, one after another. ``reserve`` keeps room for that many more
        tokens of every running sequence beyond its pages and budget (for sequences added without a budget).
        Bytes that compression will free later are never promised."""
        extra, extra_ids = np.zeros(self.num_layers, dtype=np.int64), 0
        if reserve and self._seqs:
            seqs = list(self._seqs.values())
            lens = self._len[[s.row for s in seqs]]
            budget = np.array([s.budget for s in seqs])[:, None]
            want = -(-(lens + reserve) // self.page_size)
            extra = np.maximum(0, want - np.maximum(-(-lens // self.page_size), budget)).sum(0)
            have_ids = np.maximum([s.num_ids for s in seqs], budget[:, 0])
            extra_ids = int(np.maximum(0, want.max(1) - have_ids).sum())
        pages = min(self._arena.max_new_pages(extra), len(self._free_ids) - self._reserved_ids - extra_ids)
        pages = max(0, pages)
        per_request = -(-(prompt_len + max_new_tokens) // self.page_size)
        return Capacity(pages=pages, tokens=pages * self.page_size,
                        requests=pages // per_request if per_request else 0)

    def stats(self) -> dict:
        """Bytes and chunks: ``raw_bytes`` (live pages as plain BF16), ``stored_bytes`` (as stored), ``ratio``,
        ``meta_bytes``, ``tokens`` (stored), ``free_chunks`` / ``num_chunks`` / ``chunk_bytes``, ``fragmentation`` (share
        of the bytes in layer-owned chunks that hold no live page: free slots, packed tails, holes, room left by
        pages compressed in place) and ``layers``, one dict per layer (``waiting_full_pages``: full pages not yet
        compressed; ``compressing_pages``: compressed by ``compress_full_pages(wait=False)``, not yet placed)."""
        a = self._arena
        rows = [s.row for s in self._seqs.values()]
        tokens = np.zeros(self.num_layers, dtype=np.int64)  # stored: a sliding window's freed pages are gone
        if rows:
            tokens = (self._len[rows] - self._dropped[rows] * self.page_size).sum(0)
        layers = []
        for layer in range(self.num_layers):
            live = a.offset[layer] >= 0
            pages, stored = int(live.sum()), int(a.nbytes[layer][live].sum())
            layers.append({
                "tokens": int(tokens[layer]), "pages": pages, "raw_bytes": pages * self.page_bytes,
                "stored_bytes": stored, "waiting_full_pages": len(self._full[layer]),
                "compressing_pages": int((self._round_of[layer] >= 0).sum()),
                "slot_chunks": len(a.slot_chunks[layer]), "packed_chunks": len(a.packed_chunks[layer]),
                "free_slots": int(a.free_slot_count[layer]), "promised_pages": int(a.reserved[layer])})
        raw = sum(x["raw_bytes"] for x in layers)
        stored = sum(x["stored_bytes"] for x in layers)
        owned = (a.num_chunks - len(a.pool)) * self.chunk_bytes
        return {
            "tokens": int(tokens.sum()), "raw_bytes": raw, "stored_bytes": stored, "ratio": stored / raw if raw else 1.0,
            "meta_bytes": self._meta.numel() * 4, "num_chunks": a.num_chunks, "free_chunks": len(a.pool),
            "chunk_bytes": self.chunk_bytes, "fragmentation": 1 - stored / owned if owned else 0.0,
            "sequences": len(self._seqs), "free_page_ids": len(self._free_ids), "layers": layers}

    def _describe_free(self) -> str:
        a = self._arena
        return (f"{len(a.pool)} of {a.num_chunks} chunks free, {a.free_slot_count.sum()} free slots, "
                f"{a.reserved.sum()} pages promised to {len(self._seqs)} running sequences")

    # ---- helpers ---------------------------------------------------------------------------------------------
    def _plan(self, batch: _Batch, start: np.ndarray, single: bool, n: int) -> _Plan:
        """The plan of appending n tokens to ``batch`` (all to its one sequence if ``single``, else one each) from
        lengths ``start``; the same for every layer at those lengths, so it is built once and remembered."""
        key = (batch.key, single, n, start.tobytes())
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build_plan(start, np.array([n]) if single else None)
            _remember(self._plans, key, plan)
        return plan

    def _build_plan(self, start: np.ndarray, counts: np.ndarray | None) -> _Plan:
        """Appending ``counts`` tokens to sequences at lengths ``start``; None: one each (a decode step)."""
        P = self.page_size
        if counts is None:  # a token opens a page at slot 0 and fills it at slot P - 1
            end = start + 1
            slot, page = start % P, start // P
            opens, fills = (slot == 0).nonzero()[0], (slot == P - 1).nonzero()[0]
            new = list(zip(opens.tolist(), page[opens].tolist()))
            filled = list(zip(fills.tolist(), page[fills].tolist()))
        else:
            end = start + counts
            new, filled = [], []
            for i, (a, b) in enumerate(zip(start.tolist(), end.tolist())):
                new += [(i, j) for j in range(-(-a // P), -(-b // P))]
                filled += [(i, j) for j in range(a // P, b // P)]
        return _Plan(start=start, counts=counts, end=end, new=new, filled=filled)

    def _open_pages(self, layers: slice, batch: _Batch, plan: _Plan) -> list[np.ndarray]:
        """Give the plan's new pages ids (first layer to reach them) and raw slots in each of ``layers`` (all of them
        for a decode step, one for an append), or raise
        CacheFullError before changing anything. Returns the device writes that makes, for :meth:`_write_pages`
        after an upload: the pages' meta rows (int64 [k]), their values (int32 [k, 2, H, W]) and the slots to zero
        (of slot chunks just taken from the pool); nothing if no page opens."""
        if not plan.new:
            return []
        new = [(batch.seqs[i], j) for i, j in plan.new]
        beyond = sum(j >= s.budget for s, j in new)  # pages outside their sequence's promise
        need_ids = [(s, j) for s, j in new if j >= s.num_ids]
        ids_beyond = sum(j >= s.budget for s, j in need_ids)
        if need_ids and ids_beyond > len(self._free_ids) - self._reserved_ids:
            free = max(0, len(self._free_ids) - self._reserved_ids)
            raise CacheFullError(f"append to layer {range(self.num_layers)[layers][0]}: needs {ids_beyond} page ids "
                                 f"beyond the sequences' "
                                 f"budgets, {free} are free ({len(self._free_ids)} of "
                                 f"{len(self._arena.offset[0])} free, {self._reserved_ids} promised)",
                                 requested=ids_beyond, free=free, unit="page ids")
        if not self._arena.fits(layers, beyond):
            # Name a layer that cannot take them alone; if each can, they only fail together: name the first.
            ids = range(self.num_layers)[layers]
            layer = next((x for x in ids if not self._arena.fits(slice(x, x + 1), beyond)), ids[0])
            free = self._arena.spare_pages(layer)
            raise CacheFullError(f"append to layer {layer}: needs {len(new)} new raw pages, {beyond} of them beyond "
                                 f"the sequences' budgets, but only {free} can be taken without breaking promises "
                                 f"({self._describe_free()})", requested=beyond, free=free, unit="pages")
        for s, j in need_ids:
            s.push(self._free_ids.pop())
            if j < s.budget:
                self._reserved_ids -= 1
        pids = np.array([s.pages[j] for s, j in new], dtype=np.int32)
        self._arena.reserved[layers] -= len(new) - beyond
        slots = self._arena.place_raw(layers, pids)  # [layers, pages]
        # Meta rows: the template's word 0 of stream (K|V, head) plus the page's offset; descriptors all raw.
        values = (slots.reshape(-1, 1) * self._slot_word0 + self._raw_rows.reshape(1, -1))
        rows = self._rows(self._all_layers[layers, None], pids).ravel()
        return [rows, values.reshape(-1, *self._raw_rows.shape), self._arena.take_dirty()]

    def _token_slots(self, batch: _Batch, plan: _Plan) -> list[np.ndarray]:
        """Each token's page id and slot (int32 [n]), once every page of the plan has an id."""
        counts = np.ones_like(plan.start) if plan.counts is None else plan.counts
        seq_index = np.repeat(np.arange(len(counts)), counts)
        pos, = _ranges(counts, plan.start)
        page = (pos // self.page_size).tolist()
        ids = np.fromiter((batch.seqs[i].pages[p] for i, p in zip(seq_index.tolist(), page)), dtype=np.int32,
                          count=len(pos))
        return [ids, (pos % self.page_size).astype(np.int32)]

    def _filled_ids(self, batch: _Batch, plan: _Plan) -> list[int]:
        return [int(batch.seqs[i].pages[p]) for i, p in plan.filled]

    def _table(self, batch: _Batch, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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

    def _batch(self, seq_ids) -> _Batch:
        if isinstance(seq_ids, torch.Tensor):
            seq_ids = seq_ids.tolist()
        key = (int(seq_ids),) if isinstance(seq_ids, (int, np.integer)) else tuple(seq_ids)
        batch = self._batches.get(key)
        if batch is None:
            seqs = [self._seq(s) for s in key]
            if len(set(key)) != len(key):
                raise ValueError(f"seq_ids repeats a sequence: {list(key)}")
            batch = _Batch(key, seqs, np.array([s.row for s in seqs], dtype=np.int64))
            _remember(self._batches, key, batch)
        return batch

    def _seq(self, seq_id) -> _Seq:
        try:
            return self._seqs[seq_id]
        except (KeyError, TypeError):
            raise KeyError(f"seq_id {seq_id!r} is not a running sequence of this cache") from None

    def _check_layer(self, layer) -> None:
        if not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise IndexError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")

    def _check_tokens(self, k, v) -> int:
        if (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dtype == v.dtype == torch.bfloat16
                and k.shape == v.shape and k.dim() == 3 and k.shape[1] == self.num_kv_heads
                and k.shape[2] == self.head_dim and k.device == v.device == self.device):
            return k.shape[0]  # the decode-step path: one test, then the detailed messages below only on error
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.bfloat16:
                raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
            if t.dim() != 3 or tuple(t.shape[1:]) != (self.num_kv_heads, self.head_dim):
                raise ValueError(f"{name} must be [n, {self.num_kv_heads}, {self.head_dim}], got {tuple(t.shape)}")
            if t.device != self.device:
                raise ValueError(f"{name} must be on {self.device}, got {t.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        return k.shape[0]
