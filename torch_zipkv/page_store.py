"""The cache's device memory, and every write the cache makes to it: the byte arena ``data`` and each layer's meta
rows (docs/FORMAT.md), which say where each page's streams start in ``data`` and how each block is stored.

Where a page's bytes go is the arena's decision (``torch_zipkv/arena.py``, host only); :class:`PageStore` carries it
out on the device: it opens pages raw in their slots, moves bytes and shifts the meta rows that point at them, and
zeroes freed slots. What to write is decided on the host (numpy) and sent with one copy per call
(:class:`~torch_zipkv.upload.Uploader`).
"""

from __future__ import annotations

import numpy as np
import torch

from . import format as fmt
from .upload import Uploader


def _ranges(counts: torch.Tensor, total: int, *starts: torch.Tensor) -> list[torch.Tensor]:
    """For each tensor of ``starts``: starts[i], starts[i] + 1, ..., starts[i] + counts[i] - 1 for every i,
    concatenated (``total`` = counts.sum(), known on the host, so nothing waits for the device). Expanded where the
    tensors are: a compression round moves ~10^6 units, whose indices cost the host ~10 ms to build and send."""
    within = torch.arange(total, dtype=counts.dtype, device=counts.device)
    within -= torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts, output_size=total)
    return [torch.repeat_interleave(s.to(counts.dtype), counts, output_size=total) + within for s in starts]


class PageStore:
    """``data``: uint8 [num_bytes], the bytes of every layer's pages. ``meta``: int32 [layers, max_pages, 2, H, W],
    the meta rows of page id p of a layer at ``meta[layer, p]``; a page id names the same token range in every layer.
    ``meta_rows`` views all of them as one table (row ``layer * max_pages + page``, :meth:`rows`), so one op call
    covers pages of all layers. Slot s of ``data`` is bytes [s * page_bytes, (s + 1) * page_bytes): room for one
    page of one layer stored raw."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, page_bytes: int,
                 max_pages: int, num_bytes: int, device: torch.device, upload: Uploader):
        self.page_size, self.head_dim, self.page_bytes, self.device, self.upload = page_size, head_dim, page_bytes, \
            device, upload
        W = fmt.meta_words(page_size, head_dim)
        self.data = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        self.meta = torch.full((num_layers, max_pages, 2, num_kv_heads, W), fmt.NO_STREAM, dtype=torch.int32,
                               device=device)
        self.meta_views = list(self.meta)  # meta(layer) without an indexing op per call
        # data in 256-byte units (moves) and raw-page units (zeroing), as int64 words: 8 bytes per indexed element
        self._units = self.data.view(torch.int64).view(-1, fmt.STREAM_ALIGN // 8)
        self._slots = self.data.view(torch.int64).view(-1, page_bytes // 8)
        self.meta_rows = self.meta.view(-1, 2, num_kv_heads, W)
        self._starts = self.meta_rows[..., 0]  # word 0 of each stream: where it starts (in STREAM_ALIGN units)
        self._first_rows = np.arange(num_layers, dtype=np.int64) * max_pages  # each layer's row 0
        # Meta rows of an open page at offset 0: stream (K|V, head) starts at (kv * H + head) * stream bytes.
        stream_units = page_size * head_dim * 2 // fmt.STREAM_ALIGN
        self._raw_rows = np.empty((2, num_kv_heads, W), dtype=np.int32)
        self._raw_rows[..., 1:] = fmt.raw_descriptor_words(page_size, head_dim)
        self._raw_rows[..., 0] = np.arange(2 * num_kv_heads).reshape(2, num_kv_heads) * stream_units
        # Per flat row position: the STREAM_ALIGN units of a slot at word 0, else 0. A slot number times this, plus
        # the template, gives the rows of a page open in that slot.
        word0 = (np.arange(self._raw_rows.size) % W == 0).astype(np.int32)
        self._slot_word0 = word0 * (page_bytes // fmt.STREAM_ALIGN)

    def rows(self, layers, pids: np.ndarray) -> np.ndarray:
        """Rows of pages (layer, page id) in ``meta_rows`` (numpy broadcasting). int64: indexing converts int32
        indices first, on CUDA with one more kernel."""
        return self._first_rows[layers] + pids

    def open_rows(self, slots: np.ndarray) -> np.ndarray:
        """The meta rows (int32 [n, 2, H, W]) of pages open raw in ``slots``: every block raw, each stream where the
        slot holds it. ``append_kv`` fills such a page."""
        values = slots.reshape(-1, 1) * self._slot_word0 + self._raw_rows.reshape(1, -1)
        return values.reshape(-1, *self._raw_rows.shape)

    def write_open_rows(self, rows: torch.Tensor | None = None, values: torch.Tensor | None = None,
                        zero: torch.Tensor | None = None) -> None:
        """On the device already (sent with the rest of a call's upload): zero slots ``zero`` (new slot chunks), then
        write the meta rows ``values`` of pages opened there (:meth:`open_rows`) at ``rows``. Nothing if not given."""
        if rows is not None:
            self.zero_slots(zero)
            self.meta_rows[rows] = values

    def move(self, rows: np.ndarray, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, source: torch.Tensor,
             zero: np.ndarray) -> None:
        """Copy the pages of meta rows ``rows`` (int64) from bytes ``src`` of ``source`` to bytes ``dst`` of data
        (``nbytes`` each, all sources read before any destination is written; every offset and size is a multiple of
        STREAM_ALIGN), add the distance moved to word 0 of their meta rows, then zero slots ``zero``."""
        A = fmt.STREAM_ALIGN
        dst, src = dst // A, src // A  # units; data holds < 2**31 of them
        counts = (nbytes // A).astype(np.int64)
        counts_t, dst_t, src_t, rows_t, shift_t, zero_t = self.upload(
            counts, dst.astype(np.int64), src.astype(np.int64), rows, (dst - src).astype(np.int32), zero)
        dst_t, src_t = _ranges(counts_t, int(counts.sum()), dst_t, src_t)
        self._units.index_put_((dst_t,), source.view(torch.int64).view(-1, A // 8).index_select(0, src_t))
        # Gather, add, scatter: index_put_(accumulate=True) would copy this strided view of all rows whole on CUDA.
        self._starts[rows_t] += shift_t[:, None, None]
        self.zero_slots(zero_t)

    # Constants are written with index_fill_, never ``t[index] = constant``: on CUDA that indexed assignment copies
    # the constant to the device from pageable memory, and that copy waits for the stream to drain. A decode step
    # that freed a page then stalled the host until the device had run out of work.
    def forget_rows(self, rows: np.ndarray, zero: np.ndarray) -> None:
        """Mark meta ``rows`` as pages that are gone (a read of them fails loudly), then zero slots ``zero``."""
        rows_t, zero_t = self.upload(rows.astype(np.int64, copy=False), zero)
        self.meta_rows.index_fill_(0, rows_t, fmt.NO_STREAM)
        self.zero_slots(zero_t)

    def forget_ids(self, ids: np.ndarray, zero: np.ndarray) -> None:
        """:meth:`forget_rows` for page ``ids`` in every layer."""
        ids_t, zero_t = self.upload(ids.astype(np.int64, copy=False), zero)
        self.meta.index_fill_(1, ids_t, fmt.NO_STREAM)
        self.zero_slots(zero_t)

    def zero(self, slots: np.ndarray) -> None:
        """Zero ``slots`` (host slot numbers)."""
        if len(slots):
            self.zero_slots(*self.upload(slots))

    def zero_slots(self, slots: torch.Tensor) -> None:
        """Zero ``slots`` (int64 slot numbers on the device)."""
        if slots.numel():
            self._slots.index_fill_(0, slots, 0)
