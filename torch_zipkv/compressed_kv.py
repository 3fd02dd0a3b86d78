"""CompressedKV: BF16 KV pages held losslessly in the zipkv format, plus the one-call API around it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import format as fmt
from . import ops
from .checks import is_int


@dataclass(frozen=True)
class CompressedKV:
    """Pages of K and V stored in the zipkv format (docs/FORMAT.md).

    ``data`` (uint8 [nbytes]) holds the streams back to back; ``meta`` (int32 [num_pages, 2, num_kv_heads, W]) has
    one row per (page, K|V, kv head): the stream's offset, a tag with the geometry it was written with, and one
    descriptor per block. Build one with
    :func:`compress`; page ``i`` of the input is meta row ``i`` and ``kv_indices`` entries refer to these ids.
    Construction checks the fields' types (TypeError) and shapes (ValueError); :meth:`validate` checks the contents.
    """

    data: torch.Tensor
    meta: torch.Tensor
    page_size: int
    head_dim: int

    def __post_init__(self) -> None:
        for name, ok, what in (("data", torch.is_tensor, "a torch.Tensor"), ("meta", torch.is_tensor, "a torch.Tensor"),
                               ("page_size", is_int, "an int"), ("head_dim", is_int, "an int")):  # a bool is no int
            if not ok(getattr(self, name)):
                raise TypeError(f"CompressedKV: {name} must be {what}, got {type(getattr(self, name)).__name__}")
        for name, dtype in (("data", torch.uint8), ("meta", torch.int32)):
            if getattr(self, name).dtype != dtype:
                raise TypeError(f"CompressedKV: {name} must be {dtype}, got {getattr(self, name).dtype}")
        error = fmt.geometry_error(self.page_size, self.head_dim)
        if error is not None:
            raise ValueError(f"CompressedKV: {error}")
        words = fmt.meta_words(self.page_size, self.head_dim)
        if self.data.dim() != 1:
            raise ValueError(f"CompressedKV: data must be 1-D, got shape {tuple(self.data.shape)}")
        if self.meta.dim() != 4 or self.meta.shape[1] != 2 or self.meta.shape[3] != words:
            raise ValueError(f"CompressedKV: meta must be [num_pages, 2, num_kv_heads, {words}] for page_size "
                             f"{self.page_size} and head_dim {self.head_dim}, got {tuple(self.meta.shape)}")
        if self.meta.device != self.data.device:
            raise ValueError(f"CompressedKV: meta must be on data's device {self.data.device}, got {self.meta.device}")

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
        return self.num_pages * fmt.raw_page_bytes(self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def ratio(self) -> float:
        """nbytes / raw_nbytes (lower is better; 0.75 plus metadata when every block compresses)."""
        return self.nbytes / self.raw_nbytes if self.raw_nbytes else 1.0

    def descriptors(self) -> torch.Tensor:
        """Block descriptors, uint8 [num_pages, 2, num_kv_heads, blocks]: 0x80 raw, 0..127 compressed (base / 2),
        0x81..0xF8 zero-aware compressed (0x80 | base / 2)."""
        return fmt.descriptors(self.meta, self.page_size, self.head_dim)

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
        """Raises ValueError naming the first meta row that is missing, was written for another page_size or
        head_dim or by another format version (its tag), has an invalid descriptor, or points past ``data``. Reads
        the metadata on the host (a device sync on CUDA).

        These structural checks are all there is (docs/api.md, Errors): a changed byte of ``data``, or a change of
        ``meta`` that keeps every row well formed (another offset inside ``data``, another valid descriptor), passes
        and decodes to other values. The format carries no checksum."""
        nb = fmt.blocks_per_stream(self.page_size, self.head_dim)
        meta = self.meta.cpu()
        desc = self.descriptors().cpu().to(torch.int64)
        start = meta[..., 0].to(torch.int64) * fmt.STREAM_ALIGN
        size = torch.where(desc == fmt.DESC_RAW, fmt.RAW_BLOCK_BYTES, fmt.COMP_BLOCK_BYTES).sum(-1)
        tag = meta[..., 1]
        version = (tag >> 16) & 0xFFFF  # the tag's magic and version bytes
        ours = (fmt.META_MAGIC << 8) | 0x80 | fmt.FORMAT_VERSION
        problems = [
            (meta[..., 0] < 0, "holds no stream"),
            (version != ours, f"is not a row of format version {fmt.FORMAT_VERSION} (another version's, or corrupted)"),
            (tag != fmt.meta_tag(self.page_size, self.head_dim), None),  # another geometry: its own message below
            ((desc > fmt.DESC_LAST).any(-1), "has an invalid block descriptor"),
            (start + size > self.data.numel(), "points past the end of data"),
        ]
        for bad, what in problems:
            if bad.any():
                page, kv, head = (int(x) for x in bad.nonzero()[0])
                row = f"CompressedKV.meta[{page}, {'KV'[kv]}, head {head}]"
                if what is None:
                    written = fmt.tag_geometry(int(tag[page, kv, head]))
                    raise ValueError(f"{row} was written for page_size {written[0]} and head_dim {written[1]}, not "
                                     f"the CompressedKV's page_size {self.page_size} and head_dim {self.head_dim}")
                raise ValueError(f"{row} {what} (blocks per stream: {nb})")


def _require_ckv(op: str, ckv) -> None:
    if not isinstance(ckv, CompressedKV):
        raise TypeError(f"{op}: ckv must be a CompressedKV, got {type(ckv).__name__}")


def compress(kv: torch.Tensor, *, allow_compress: bool = True) -> CompressedKV:
    """Store BF16 pages ``kv`` [num_pages, 2, page_size, num_kv_heads, head_dim] (FlashInfer NHD, K then V)
    losslessly. ``allow_compress=False`` stores every block raw in the same container.

    The result's ``data`` is sized to what was stored (this reads one int64 from the device).
    """
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"compress: kv must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dtype != torch.bfloat16:
        raise TypeError(f"compress: kv must be torch.bfloat16, got {kv.dtype}")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"compress: kv must be [num_pages, 2, page_size, num_kv_heads, head_dim], got shape "
                         f"{tuple(kv.shape)}")
    n, _, page_size, heads, head_dim = kv.shape
    error = fmt.geometry_error(page_size, head_dim)
    if error is not None:
        raise ValueError(f"compress: kv's {error}")
    data, meta, cursor = ops.empty_storage(n, page_size, heads, head_dim, kv.device)
    page_ids = torch.arange(n, dtype=torch.int32, device=kv.device)
    ops.compress_pages(kv, page_ids, data, meta, cursor, allow_compress=allow_compress)
    used = int(cursor[0])
    if used != data.numel():
        data = data[:used].clone()  # give the unused worst-case room back
    return CompressedKV(data=data, meta=meta, page_size=page_size, head_dim=head_dim)


def decompress(ckv: CompressedKV) -> torch.Tensor:
    """All pages of ``ckv`` as BF16 [num_pages, 2, page_size, num_kv_heads, head_dim], bit-identical to the input
    of :func:`compress`."""
    _require_ckv("decompress", ckv)
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
    _require_ckv("paged_decode", ckv)
    return ops.paged_decode(q, ckv.data, ckv.meta, kv_indptr, kv_indices, kv_last_page_len, ckv.page_size,
                            sm_scale=sm_scale, out=out, lse=lse, window_left=window_left,
                            logits_soft_cap=logits_soft_cap)


def paged_prefill(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    ckv: CompressedKV,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Attention of many query tokens per request (q bf16 [nnz_q, num_qo_heads, head_dim], request b's tokens
    ``q[qo_indptr[b]:qo_indptr[b + 1]]``) over pages of ``ckv`` that already hold them: query token i of a request
    sits at position kv_len - q_len + i. Returns bf16 [nnz_q, num_qo_heads, head_dim] (see
    :func:`torch_zipkv.ops.paged_prefill`)."""
    _require_ckv("paged_prefill", ckv)
    return ops.paged_prefill(q, qo_indptr, ckv.data, ckv.meta, kv_indptr, kv_indices, kv_last_page_len,
                             ckv.page_size, causal=causal, sm_scale=sm_scale, out=out, lse=lse,
                             window_left=window_left, logits_soft_cap=logits_soft_cap)


def _nnz_pages(op: str, kv_indices) -> int:
    if not isinstance(kv_indices, torch.Tensor):
        raise TypeError(f"{op}: kv_indices must be a torch.Tensor, got {type(kv_indices).__name__}")
    if kv_indices.dim() != 1:
        raise ValueError(f"{op}: kv_indices must have 1 dims, got shape {list(kv_indices.shape)}")
    return kv_indices.shape[0]


def decode_plan(q: torch.Tensor, ckv: CompressedKV, kv_indices: torch.Tensor, *, window_left: int = -1) -> dict:
    """The launch :func:`paged_decode` would make for ``q`` over ``ckv`` with this page list, on a CUDA device:
    ``{"num_splits", "warps_per_cta", "ctas_per_sm"}`` (see :func:`torch_zipkv.ops.decode_plan`)."""
    _require_ckv("decode_plan", ckv)
    return ops.decode_plan(q, ckv.meta, _nnz_pages("decode_plan", kv_indices), ckv.page_size, window_left=window_left)


def prefill_plan(q: torch.Tensor, qo_indptr: torch.Tensor, ckv: CompressedKV, kv_indices: torch.Tensor, *,
                 window_left: int = -1) -> dict:
    """The kernel and launch :func:`paged_prefill` would make for ``q`` over ``ckv`` with this page list, on a CUDA
    device: ``{"kernel", "num_splits", "warps_per_cta", "ctas_per_sm", "rows_per_cta"}`` (see
    :func:`torch_zipkv.ops.prefill_plan`)."""
    _require_ckv("prefill_plan", ckv)
    return ops.prefill_plan(q, qo_indptr, ckv.meta, _nnz_pages("prefill_plan", kv_indices), ckv.page_size,
                            window_left=window_left)
