"""CompressedKV: BF16 KV pages held losslessly in the zipkv format, plus the one-call API around it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import format as fmt
from . import ops


@dataclass(frozen=True)
class CompressedKV:
    """Pages of K and V stored in the zipkv format (docs/FORMAT.md).

    ``data`` (uint8 [nbytes]) holds the streams back to back; ``meta`` (int32 [num_pages, 2, num_kv_heads, W]) has
    one row per (page, K|V, kv head): the stream's offset and one descriptor per block. Build one with
    :func:`compress`; page ``i`` of the input is meta row ``i`` and ``kv_indices`` entries refer to these ids.
    """

    data: torch.Tensor
    meta: torch.Tensor
    page_size: int
    head_dim: int

    @property
    def num_pages(self) -> int:
        return self.meta.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.meta.shape[2]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Bytes held: the streams plus the metadata."""
        return self.data.numel() + self.meta.numel() * self.meta.element_size()

    @property
    def raw_nbytes(self) -> int:
        """Bytes the same pages take as plain BF16."""
        return self.num_pages * 2 * self.page_size * self.num_kv_heads * self.head_dim * 2

    @property
    def ratio(self) -> float:
        """nbytes / raw_nbytes (lower is better; 0.75 plus metadata when every block compresses)."""
        return self.nbytes / self.raw_nbytes if self.raw_nbytes else 1.0

    def descriptors(self) -> torch.Tensor:
        """Block descriptors, uint8 [num_pages, 2, num_kv_heads, blocks]: 0x80 raw, else compressed (base / 2)."""
        nb = fmt.blocks_per_stream(self.page_size, self.head_dim)
        return self.meta[..., 1:].contiguous().view(torch.uint8)[..., :nb]

    @property
    def compressed_block_fraction(self) -> float:
        """Fraction of blocks stored compressed."""
        desc = self.descriptors()
        return (desc != fmt.DESC_RAW).float().mean().item() if desc.numel() else 0.0

    def stats(self) -> dict:
        """Compressed-block fraction and stored/raw bytes of K and V separately (metadata excluded)."""
        desc = self.descriptors()
        out = {}
        for i, name in enumerate("KV"):
            compressed = int((desc[:, i] != fmt.DESC_RAW).sum())
            total = desc[:, i].numel()
            stored = compressed * fmt.COMP_BLOCK_BYTES + (total - compressed) * fmt.RAW_BLOCK_BYTES
            out[name] = {
                "compressed_block_fraction": compressed / total if total else 0.0,
                "stored_bytes": stored,
                "raw_bytes": total * fmt.RAW_BLOCK_BYTES,
                "ratio": stored / (total * fmt.RAW_BLOCK_BYTES) if total else 1.0,
            }
        return out

    def validate(self) -> None:
        """Raises ValueError naming the first meta row that is missing, has an invalid descriptor, or points past
        ``data``. Reads the metadata on the host (a device sync on CUDA)."""
        nb = fmt.blocks_per_stream(self.page_size, self.head_dim)
        meta = self.meta.cpu()
        desc = self.descriptors().cpu().to(torch.int64)
        start = meta[..., 0].to(torch.int64) * fmt.STREAM_ALIGN
        size = torch.where(desc == fmt.DESC_RAW, fmt.RAW_BLOCK_BYTES, fmt.COMP_BLOCK_BYTES).sum(-1)
        problems = [
            (meta[..., 0] < 0, "holds no stream"),
            ((desc > fmt.DESC_RAW).any(-1), "has an invalid block descriptor"),
            (start + size > self.data.numel(), "points past the end of data"),
        ]
        for bad, what in problems:
            if bad.any():
                page, kv, head = (int(x) for x in bad.nonzero()[0])
                raise ValueError(f"CompressedKV.meta[{page}, {'KV'[kv]}, head {head}] {what} (blocks per stream: {nb})")


def compress(kv: torch.Tensor, *, compress: bool = True) -> CompressedKV:
    """Store BF16 pages ``kv`` [num_pages, 2, page_size, num_kv_heads, head_dim] (FlashInfer NHD, K then V)
    losslessly. ``compress=False`` stores every block raw in the same container.

    The result's ``data`` is sized to what was stored (this reads one int64 from the device).
    """
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [num_pages, 2, page_size, num_kv_heads, head_dim], got shape {tuple(kv.shape)}")
    n, _, page_size, heads, head_dim = kv.shape
    fmt.check_geometry(page_size, head_dim)
    capacity = n * 2 * heads * fmt.blocks_per_stream(page_size, head_dim) * fmt.RAW_BLOCK_BYTES
    data = torch.empty(capacity, dtype=torch.uint8, device=kv.device)
    meta = torch.full((n, 2, heads, fmt.meta_words(page_size, head_dim)), -1, dtype=torch.int32, device=kv.device)
    cursor = torch.tensor([0, capacity], dtype=torch.int64, device=kv.device)
    page_ids = torch.arange(n, dtype=torch.int32, device=kv.device)
    ops.compress_pages(kv, page_ids, data, meta, cursor, allow_compress=compress)
    used = int(cursor[0])
    if used != capacity:
        data = data[:used].clone()  # give the unused worst-case room back
    return CompressedKV(data=data, meta=meta, page_size=page_size, head_dim=head_dim)


def decompress(ckv: CompressedKV) -> torch.Tensor:
    """All pages of ``ckv`` as BF16 [num_pages, 2, page_size, num_kv_heads, head_dim], bit-identical to the input
    of :func:`compress`."""
    page_ids = torch.arange(ckv.num_pages, dtype=torch.int32, device=ckv.device)
    return ops.decompress_pages(ckv.data, ckv.meta, page_ids, ckv.page_size, ckv.head_dim)


def paged_decode(
    q: torch.Tensor,
    ckv: CompressedKV,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Decode attention of ``q`` (bf16 [batch, num_qo_heads, head_dim]) over pages of ``ckv``.

    FlashInfer's page table: request b reads pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (int32), whose
    last holds ``kv_last_page_len[b]`` tokens (in [1, page_size]). GQA: num_qo_heads is a multiple of num_kv_heads.
    ``sm_scale`` defaults to 1/sqrt(head_dim); ``lse`` (fp32 [batch, num_qo_heads]) optionally receives the
    log-sum-exp. Returns bf16 [batch, num_qo_heads, head_dim] (``out`` if given). ``window_left`` >= 0: a sliding
    window, each request attends to its last ``window_left + 1`` tokens; ``logits_soft_cap`` > 0: logits
    ``x = q.k * sm_scale`` become ``cap * tanh(x / cap)`` (see :func:`torch_zipkv.ops.paged_decode`).
    """
    return ops.paged_decode(
        q, ckv.data, ckv.meta, kv_indptr, kv_indices, kv_last_page_len, ckv.page_size, sm_scale, out, lse,
        window_left, logits_soft_cap
    )


def decode_plan(q: torch.Tensor, ckv: CompressedKV, kv_indices: torch.Tensor, *, window_left: int = -1) -> dict:
    """The launch :func:`paged_decode` would make for ``q`` over ``ckv`` with this page list, on a CUDA device:
    ``{"num_splits", "warps_per_cta", "ctas_per_sm"}`` (see :func:`torch_zipkv.ops.decode_plan`)."""
    return ops.decode_plan(q, ckv.meta, kv_indices.shape[0], ckv.page_size, window_left)
