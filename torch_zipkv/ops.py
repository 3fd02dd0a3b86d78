"""Typed wrappers of the ``torch.ops.zipkv`` ops, the storage they write into, and their fake (meta) kernels.

Every op writes into tensors the caller owns and returns nothing, so ``torch.compile(fullgraph=True)`` and CUDA
Graphs can take them; the wrappers allocate ``out`` when it is None, and :func:`empty_storage` allocates the storage
(``data``, ``meta``, ``cursor``) for a number of pages. Shapes use these names: ``n`` pages in a call, ``P``
page_size, ``H`` num_kv_heads, ``D`` head_dim, ``W`` = format.meta_words(P, D). Options are keyword-only.

Errors (docs/api.md, Errors): a wrong Python type or dtype raises TypeError; a wrong shape, size, device, contiguity,
alignment or value raises ValueError, and so does bad content the CPU kernels find (page ids, page tables, meta rows);
a full ``data`` raises RuntimeError. Every message names the op and the argument.
"""

from __future__ import annotations

import math
import numbers
import struct

import torch

from . import format as fmt

zipkv = torch.ops.zipkv

MAX_GROUP = 16  # paged_decode: query heads per kv head (csrc/checks.h kMaxGroup)
_CUDA_MAX_SPLITS = 64  # the CUDA paged_decode's largest split count (csrc/cuda/paged_decode.cuh kMaxSplits)


def empty_storage(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device | str | None = None,
    *,
    capacity: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Storage for ``num_pages`` pages that holds none yet: ``(data, meta, cursor)`` for :func:`compress_pages`,
    :func:`decompress_pages`, :func:`append_kv` and :func:`paged_decode`.

    - ``data``: uint8 [capacity], zero-filled. ``capacity`` defaults to
      ``num_pages * format.raw_page_bytes(page_size, num_kv_heads, head_dim)``, what the pages take stored all raw,
      the most they can take: compressing them all into it never fills it.
    - ``meta``: int32 [num_pages, 2, num_kv_heads, W], every row holding no stream (word 0 = format.NO_STREAM) but
      already tagged with the geometry (word 1 = format.meta_tag(page_size, head_dim)); the rest -1.
    - ``cursor``: int64 [2] = {0, capacity}: ``compress_pages`` stores from byte 0 and never past ``capacity``.

    All three on ``device`` (torch's default device when None), filled on the device without waiting for it (so it
    may be called between steps of a CUDA program; not inside a CUDA Graph capture, which cannot allocate).
    """
    _check_types("empty_storage", num_pages=(num_pages, "int"), page_size=(page_size, "int"),
                 num_kv_heads=(num_kv_heads, "int"), head_dim=(head_dim, "int"), capacity=(capacity, "int?"))
    fmt.check_geometry(page_size, head_dim)
    if num_pages < 0 or num_kv_heads < 1:
        raise ValueError(f"empty_storage: num_pages must be >= 0 and num_kv_heads >= 1, got {num_pages} and "
                         f"{num_kv_heads}")
    if capacity is None:
        capacity = num_pages * fmt.raw_page_bytes(page_size, num_kv_heads, head_dim)
        if capacity >= 2**63:  # a size a tensor cannot have (torch would say "Overflow when unpacking long long")
            raise ValueError(f"empty_storage: capacity (num_pages x raw page bytes) must fit in an int64, got "
                             f"{capacity}")
    elif capacity < 0:
        raise ValueError(f"empty_storage: capacity must be >= 0, got {capacity}")
    data = torch.zeros(capacity, dtype=torch.uint8, device=device)
    meta = torch.full((num_pages, 2, num_kv_heads, fmt.meta_words(page_size, head_dim)), fmt.NO_STREAM,
                      dtype=torch.int32, device=data.device)
    meta[..., 1].fill_(fmt.meta_tag(page_size, head_dim))
    cursor = torch.zeros(2, dtype=torch.int64, device=data.device)
    cursor[1:].fill_(capacity)  # a fill on the device: no host copy, so no wait for the device
    return data, meta, cursor


# Python types of the wrappers' arguments: torch.ops raises RuntimeError for a wrong one, the wrappers TypeError.
_KINDS = {
    "tensor": ((torch.Tensor,), "a torch.Tensor"),
    "tensor?": ((torch.Tensor, type(None)), "a torch.Tensor or None"),
    "int": ((numbers.Integral, torch.SymInt), "an int"),
    "int?": ((numbers.Integral, torch.SymInt, type(None)), "an int or None"),
    "float": ((numbers.Real, torch.SymInt, torch.SymFloat), "a float"),
    "float?": ((numbers.Real, torch.SymInt, torch.SymFloat, type(None)), "a float or None"),
    "bool": ((bool,), "a bool"),
}


def _check_types(op: str, **args: tuple) -> None:
    """Raises TypeError naming the first argument (name=(value, kind)) whose Python type is not its kind's (a bool is
    not an int here), and ValueError for a number that the op's schema cannot take: an int outside int64 (torch.ops
    would raise "expected int, found int") or a float that overflows float64."""
    for name, (value, kind) in args.items():
        types, what = _KINDS[kind]
        if not isinstance(value, types) or (kind.startswith("int") and isinstance(value, bool)):  # checks.is_int's rule
            raise TypeError(f"zipkv.{op}: {name} must be {what}, got {type(value).__name__}")
        if kind.startswith("int") and isinstance(value, numbers.Integral) and not -2**63 <= value < 2**63:
            raise ValueError(f"zipkv.{op}: {name} must fit in an int64, got {value}")
        if kind.startswith("float") and isinstance(value, numbers.Integral):
            try:
                float(value)
            except OverflowError:
                raise ValueError(f"zipkv.{op}: {name} must fit in a float64, got {value}") from None


def compress_pages(
    kv: torch.Tensor,
    page_ids: torch.Tensor,
    data: torch.Tensor,
    meta: torch.Tensor,
    cursor: torch.Tensor,
    *,
    allow_compress: bool = True,
) -> None:
    """Store full pages ``kv`` (bf16 [n, 2, P, H, D]) as meta rows ``page_ids`` (int32 [n]) in the arena ``data``
    (uint8), appending at ``cursor[0]`` (int64 [2] = {next, end}) and advancing it. ``meta``: int32 [pages, 2, H, W].
    ``allow_compress=False`` stores every block raw. Raises RuntimeError, storing nothing, if the pages do not fit
    before ``cursor[1]`` (the CUDA kernel cannot raise: it stores the streams that fit, the others' rows read -1, and
    ``cursor[0]`` still advances by all the bytes needed, past ``cursor[1]``).
    """
    _check_types("compress_pages", kv=(kv, "tensor"), page_ids=(page_ids, "tensor"), data=(data, "tensor"),
                 meta=(meta, "tensor"), cursor=(cursor, "tensor"), allow_compress=(allow_compress, "bool"))
    zipkv.compress_pages(kv, page_ids, allow_compress, data, meta, cursor)


def decompress_pages(
    data: torch.Tensor,
    meta: torch.Tensor,
    page_ids: torch.Tensor,
    page_size: int,
    head_dim: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rebuild pages ``page_ids`` bit-exactly as bf16 [n, 2, page_size, H, head_dim] (into ``out`` if given: contiguous,
    or ``buf.transpose(0, 1)`` of a contiguous [2, n, page_size, H, head_dim] ``buf``, every K and then every V, so
    ``buf[0]`` and ``buf[1]`` are the keys and values of all ``n`` pages in token order)."""
    op = "decompress_pages"
    _check_types(op, data=(data, "tensor"), meta=(meta, "tensor"), page_ids=(page_ids, "tensor"),
                 page_size=(page_size, "int"), head_dim=(head_dim, "int"), out=(out, "tensor?"))
    _check_geometry(op, page_size, head_dim)
    if out is None:
        # What the allocation reads: meta's kv heads and page_ids' length (the op checks the rest).
        _check_value(meta.dim() == 4, op, "meta", lambda: f"must have 4 dims, got shape {list(meta.shape)}")
        _check_tensor(page_ids, op, "page_ids", torch.int32, 1, data.device)
        out = torch.empty(
            (page_ids.shape[0], 2, page_size, meta.shape[2], head_dim), dtype=torch.bfloat16, device=data.device
        )
    else:  # the op reads the geometry off out: it must be the one asked for
        _check_value(out.dim() == 5 and out.shape[2] == page_size and out.shape[4] == head_dim, op, "out",
                     lambda: f"must be [n, 2, {page_size}, num_kv_heads, {head_dim}] for page_size {page_size} and "
                             f"head_dim {head_dim}, got {list(out.shape)}")
    zipkv.decompress_pages(data, meta, page_ids, out)
    return out


def append_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    page_ids: torch.Tensor,
    slots: torch.Tensor,
    page_size: int,
    data: torch.Tensor,
    meta: torch.Tensor,
) -> None:
    """Write tokens ``k``, ``v`` (bf16 [n, H, D]) into slot ``slots[i]`` of raw page ``page_ids[i]``."""
    _check_types("append_kv", k=(k, "tensor"), v=(v, "tensor"), page_ids=(page_ids, "tensor"),
                 slots=(slots, "tensor"), page_size=(page_size, "int"), data=(data, "tensor"), meta=(meta, "tensor"))
    zipkv.append_kv(k, v, page_ids, slots, page_size, data, meta)


def paged_decode(
    q: torch.Tensor,
    data: torch.Tensor,
    meta: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
    *,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Decode attention of ``q`` (bf16 [batch, Hq, D]) over each request's pages; returns bf16 [batch, Hq, D].

    The page table is FlashInfer's: request b reads pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (int32),
    all full but the last, which holds ``kv_last_page_len[b]`` tokens; ``kv_indices`` may be longer than
    ``kv_indptr[-1]`` (a fixed-size buffer), the rest is never read. ``sm_scale`` defaults to 1/sqrt(D).
    ``lse`` (fp32 [batch, Hq]), if given, receives the natural-log sum of exp of the logits.
    ``window_left`` >= 0 attends to each request's last ``window_left + 1`` tokens only (a sliding window of that
    many tokens, FlashInfer's convention; pages wholly before it are never read, so they may be freed); -1 to all.
    ``logits_soft_cap`` > 0 turns each logit ``x = q.k * sm_scale`` into ``cap * tanh(x / cap)`` (Gemma 2).
    The options (after ``page_size``) are keyword-only.
    """
    _check_types("paged_decode", q=(q, "tensor"), data=(data, "tensor"), meta=(meta, "tensor"),
                 kv_indptr=(kv_indptr, "tensor"), kv_indices=(kv_indices, "tensor"),
                 kv_last_page_len=(kv_last_page_len, "tensor"), page_size=(page_size, "int"),
                 sm_scale=(sm_scale, "float?"), out=(out, "tensor?"), lse=(lse, "tensor?"),
                 window_left=(window_left, "int"), logits_soft_cap=(logits_soft_cap, "float"))
    if sm_scale is None:  # (for a q of the wrong shape, any scale: the op names q)
        sm_scale = 1.0 / math.sqrt(q.shape[-1]) if q.dim() == 3 and q.shape[-1] > 0 else 1.0
    if out is None:
        out = torch.empty_like(q)
    zipkv.paged_decode(q, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out, lse,
                       window_left, logits_soft_cap)
    return out


def paged_prefill(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    data: torch.Tensor,
    meta: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Attention of many query tokens per request over its pages; returns bf16 [nnz_q, Hq, D] (``out`` if given).

    FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` conventions: request b's query tokens are
    ``q[qo_indptr[b]:qo_indptr[b + 1]]`` (q bf16 [nnz_q, Hq, D], qo_indptr int32 [batch + 1], from 0 to nnz_q), its
    keys and values :func:`paged_decode`'s page table. Query token i sits at position ``kv_len - q_len + i``.
    ``causal`` lets it attend to keys at positions up to its own, so the pages must hold the query's own tokens
    (appended first: q_len <= kv_len); not causal, any kv_len goes, 0 included (the rows of a request with no keys get
    zeros and lse -inf: a cascade's shared-prefix pass). ``window_left`` >= 0 keeps keys at positions >= its own minus
    ``window_left`` only.
    ``sm_scale``, ``logits_soft_cap`` and ``lse`` (fp32 [nnz_q, Hq]) as in :func:`paged_decode`.

    On CUDA, short queries (speculative verification) run on the decode kernel, reading each page once for a
    request's query tokens, and longer ones on a tile kernel; :func:`prefill_plan` tells which.
    """
    _check_types("paged_prefill", q=(q, "tensor"), qo_indptr=(qo_indptr, "tensor"), data=(data, "tensor"),
                 meta=(meta, "tensor"), kv_indptr=(kv_indptr, "tensor"), kv_indices=(kv_indices, "tensor"),
                 kv_last_page_len=(kv_last_page_len, "tensor"), page_size=(page_size, "int"), causal=(causal, "bool"),
                 sm_scale=(sm_scale, "float?"), out=(out, "tensor?"), lse=(lse, "tensor?"),
                 window_left=(window_left, "int"), logits_soft_cap=(logits_soft_cap, "float"))
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1]) if q.dim() == 3 and q.shape[-1] > 0 else 1.0
    if out is None:
        out = torch.empty_like(q)
    zipkv.paged_prefill(q, qo_indptr, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out,
                        lse, causal, window_left, logits_soft_cap)
    return out


def decode_plan(q: torch.Tensor, meta: torch.Tensor, nnz_pages: int, page_size: int, *, window_left: int = -1) -> dict:
    """The launch :func:`paged_decode` makes on a CUDA device for these shapes, without running it.

    Returns ``{"num_splits", "warps_per_cta", "ctas_per_sm"}``: each (request, kv head) is cut into ``num_splits``
    chunks (more than 1 adds the merge kernel); CTAs of ``warps_per_cta`` warps, ``ctas_per_sm`` resident per SM.
    ``nnz_pages`` is the length of ``kv_indices``. Only shapes are read, so it never syncs. An empty batch gives
    zeros (nothing is launched). A host query: call it outside compiled graphs.
    """
    _check_types("decode_plan", q=(q, "tensor"), meta=(meta, "tensor"), nnz_pages=(nnz_pages, "int"),
                 page_size=(page_size, "int"), window_left=(window_left, "int"))
    if q.device.type != "cuda":
        raise ValueError(f"zipkv.decode_plan: q must be on a CUDA device (the CPU kernel has no launch plan), got "
                         f"{q.device}")
    splits, warps, residency = zipkv.decode_plan(q, meta, nnz_pages, page_size, window_left)
    return {"num_splits": splits, "warps_per_cta": warps, "ctas_per_sm": residency}


def prefill_plan(q: torch.Tensor, qo_indptr: torch.Tensor, meta: torch.Tensor, nnz_pages: int, page_size: int, *,
                 window_left: int = -1) -> dict:
    """The kernel and launch :func:`paged_prefill` makes on a CUDA device for these shapes, without running it.

    Returns ``{"kernel", "num_splits", "warps_per_cta", "ctas_per_sm", "rows_per_cta"}``. ``kernel`` is
    ``"decode"`` for short queries (at most 32 query rows, q_len x group, per request on average: speculative
    verification, a few decode steps at once), served by the decode kernel, which streams each tile once for up to
    ``rows_per_cta`` (8, 16 or 32: 32 at head_dim <= 128 with a GQA group of 2 or more) query rows of a
    request and may split a request's pages like :func:`decode_plan`;
    ``"tiles"`` for longer ones (chunked prefill): the tile kernel, 128 query rows per CTA (8 warps
    of 16 and a planner warpgroup: ``warps_per_cta`` 12), never split (``ctas_per_sm`` 0: not asked); ``None`` for an
    empty batch (nothing is launched). Only shapes are read, so it never syncs. A host query: call it outside
    compiled graphs.
    """
    _check_types("prefill_plan", q=(q, "tensor"), qo_indptr=(qo_indptr, "tensor"), meta=(meta, "tensor"),
                 nnz_pages=(nnz_pages, "int"), page_size=(page_size, "int"), window_left=(window_left, "int"))
    if q.device.type != "cuda":
        raise ValueError(f"zipkv.prefill_plan: q must be on a CUDA device (the CPU kernel has no launch plan), got "
                         f"{q.device}")
    kernel, splits, warps, residency, rows = zipkv.prefill_plan(q, qo_indptr, meta, nnz_pages, page_size, window_left)
    return {"kernel": {1: "decode", 0: "tiles"}.get(kernel), "num_splits": splits, "warps_per_cta": warps,
            "ctas_per_sm": residency, "rows_per_cta": rows}


# Fake kernels: the checks of csrc/checks.h (and of the CUDA ops, where they check shapes), in the same order, with
# the same error types and messages, from shapes, dtypes, devices, strides and scalars alone, so that a graph that
# would fail at run time fails while it is traced. Contents (page ids, page tables, meta rows) are the kernels' to
# check. (FakeTensorMode logs every TypeError it sees before re-raising it.)
def _check_value(cond, op: str, name: str, what) -> None:
    torch._check_value(cond, lambda: f"zipkv.{op}: {name} {what() if callable(what) else what}")


def _check_tensor(t, op: str, name: str, dtype: torch.dtype, dim: int, device: torch.device,
                  contiguous: bool = True) -> None:
    torch._check_type(t.dtype == dtype, lambda: f"zipkv.{op}: {name} must be {dtype}, got {t.dtype}")
    _check_value(t.dim() == dim, op, name, lambda: f"must have {dim} dims, got shape {list(t.shape)}")
    _check_value(t.device == device, op, name, lambda: f"must be on {device} (like the other tensors), got {t.device}")
    _check_value(not contiguous or t.is_contiguous(), op, name, "must be contiguous")


def _check_aligned(t, op: str, name: str) -> None:
    # A tensor's storage starts aligned; its offset into that storage decides.
    _check_value(t.storage_offset() * t.element_size() % 16 == 0, op, name,
                 "must start at a 16-byte aligned address (a fresh tensor, not an odd slice)")


def _check_geometry(op: str, page_size, head_dim) -> None:
    error = fmt.geometry_error(page_size, head_dim)
    torch._check_value(error is None, lambda: f"zipkv.{op}: {error}")


def _check_storage(op: str, data, meta, page_size, head_dim, num_kv_heads) -> None:
    _check_tensor(data, op, "data", torch.uint8, 1, data.device)
    _check_tensor(meta, op, "meta", torch.int32, 4, data.device)
    _check_aligned(data, op, "data")
    words = fmt.meta_words(page_size, head_dim)
    _check_value(meta.shape[1] == 2 and meta.shape[2] == num_kv_heads and meta.shape[3] == words, op, "meta",
                 lambda: f"must have shape [num_pages, 2, {num_kv_heads}, {words}] for page_size {page_size} and "
                         f"head_dim {head_dim}, got {list(meta.shape)}")
    _check_value(meta.shape[0] < 2**31, op, "meta", "has too many pages for int32 page ids")


def _check_index(op: str, name: str, t, n, device) -> None:
    _check_tensor(t, op, name, torch.int32, 1, device)
    _check_value(t.shape[0] == n, op, name, lambda: f"must have {n} entries, got {t.shape[0]}")


def _check_pages(op: str, name: str, kv, device, kv_apart: bool = False) -> None:
    _check_tensor(kv, op, name, torch.bfloat16, 5, device, contiguous=not kv_apart)
    _check_value(not kv_apart or kv.is_contiguous() or kv.transpose(0, 1).is_contiguous(), op, name,
                 "must be contiguous, or the transpose(0, 1) of a contiguous [2, n, page_size, num_kv_heads, head_dim] "
                 "tensor (K and V apart)")
    _check_value(kv.shape[1] == 2, op, name, lambda: "must be [n, 2, page_size, num_kv_heads, head_dim] with K and V "
                 f"stacked on dim 1, got {list(kv.shape)}")
    _check_value(kv.shape[3] >= 1, op, name, lambda: f"must have num_kv_heads >= 1 (dim 3), got {list(kv.shape)}")
    _check_geometry(op, kv.shape[2], kv.shape[4])


def _float32(x: float) -> float:
    """x rounded to float32, as C++'s static_cast<float> rounds it: +-inf past the float32 range, NaN stays NaN."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # struct refuses what rounds to inf
        return math.copysign(math.inf, x)


_LOG2E_F32 = _float32(1.4426950408889634)  # csrc/checks.h kLog2eF


def _check_scale_and_cap(op: str, sm_scale: float, logits_soft_cap: float) -> None:
    # As csrc/checks.h check_scale_and_cap: the values the kernels use, in float32 (a product of two float32 values is
    # exact in float64, so rounding it once gives float32's product).
    scale = _float32(sm_scale)
    _check_value(math.isfinite(scale) and scale > 0 and math.isfinite(_float32(scale * _LOG2E_F32)), op, "sm_scale",
                 lambda: f"must be > 0 and finite as a float32, and so must sm_scale * log2(e) (sm_scale at most about "
                         f"2.36e38), got {sm_scale:g}")
    cap = _float32(logits_soft_cap)
    _check_value(logits_soft_cap == 0 or (math.isfinite(cap) and cap > 0 and math.isfinite(_float32(cap * _LOG2E_F32))
                                          and math.isfinite(_float32(sm_scale / logits_soft_cap))),
                 op, "logits_soft_cap", lambda: f"must be 0 (off) or a finite cap > 0 as a float32, with cap * log2(e) "
                 f"and sm_scale / cap finite as float32 too, got {logits_soft_cap:g}")


def _check_window_left(op: str, window_left: int) -> None:
    _check_value(-1 <= window_left < 2**31, op, "window_left",
                 lambda: f"must be -1 (no window) or a token count in [0, 2^31), got {window_left}")


def _check_group(op: str, num_qo_heads, num_kv_heads) -> None:
    _check_value(num_kv_heads > 0 and num_qo_heads % num_kv_heads == 0, op, "q",
                 lambda: f"has {num_qo_heads} heads, not a multiple of meta's {num_kv_heads} kv heads")
    group = num_qo_heads // num_kv_heads
    _check_value(1 <= group <= MAX_GROUP, op, "q's", lambda: f"GQA group size (num_qo_heads / num_kv_heads) must be "
                 f"in [1, {MAX_GROUP}], got {group}")


@torch.library.register_fake("zipkv::compress_pages")
def _compress_pages_fake(kv, page_ids, allow_compress, data, meta, cursor):
    op = "compress_pages"
    _check_pages(op, "kv", kv, data.device)
    _check_storage(op, data, meta, kv.shape[2], kv.shape[4], kv.shape[3])
    _check_index(op, "page_ids", page_ids, kv.shape[0], data.device)
    _check_tensor(cursor, op, "cursor", torch.int64, 1, data.device)
    _check_value(cursor.shape[0] == 2, op, "cursor", lambda: f"must be int64 [2] = {{next, end}}, got shape "
                 f"{list(cursor.shape)}")
    # (The CUDA kernel's grid limit, 2^31 CTAs, needs more pages than any device holds.)


@torch.library.register_fake("zipkv::decompress_pages")
def _decompress_pages_fake(data, meta, page_ids, out):
    op = "decompress_pages"
    _check_pages(op, "out", out, data.device, kv_apart=True)
    _check_storage(op, data, meta, out.shape[2], out.shape[4], out.shape[3])
    _check_index(op, "page_ids", page_ids, out.shape[0], data.device)


@torch.library.register_fake("zipkv::append_kv")
def _append_kv_fake(k, v, page_ids, slots, page_size, data, meta):
    op = "append_kv"
    _check_tensor(k, op, "k", torch.bfloat16, 3, data.device)
    _check_tensor(v, op, "v", torch.bfloat16, 3, data.device)
    _check_value(v.shape == k.shape, op, "v", lambda: f"must have the shape of k {list(k.shape)}, got {list(v.shape)}")
    _check_geometry(op, page_size, k.shape[2])
    _check_storage(op, data, meta, page_size, k.shape[2], k.shape[1])
    _check_index(op, "page_ids", page_ids, k.shape[0], data.device)
    _check_index(op, "slots", slots, k.shape[0], data.device)


def _check_query_and_storage(op, q, data, meta, page_size, sm_scale, window_left, logits_soft_cap) -> int:
    """As csrc/checks.h check_query_and_storage; returns meta's kv heads (-1 for meta of the wrong rank)."""
    _check_window_left(op, window_left)
    _check_scale_and_cap(op, sm_scale, logits_soft_cap)
    _check_tensor(q, op, "q", torch.bfloat16, 3, data.device)
    _check_geometry(op, page_size, q.shape[2])
    num_kv_heads = meta.shape[2] if meta.dim() == 4 else -1
    _check_storage(op, data, meta, page_size, q.shape[2], num_kv_heads)
    _check_group(op, q.shape[1], num_kv_heads)
    return num_kv_heads


def _check_page_table_and_out(op, q, batch, kv_indptr, kv_indices, kv_last_page_len, out, lse) -> None:
    """As csrc/checks.h check_page_table_and_out."""
    rows, num_qo_heads = q.shape[0], q.shape[1]
    _check_index(op, "kv_indptr", kv_indptr, batch + 1, q.device)
    _check_tensor(kv_indices, op, "kv_indices", torch.int32, 1, q.device)
    _check_index(op, "kv_last_page_len", kv_last_page_len, batch, q.device)
    _check_tensor(out, op, "out", torch.bfloat16, 3, q.device)
    _check_value(out.shape == q.shape, op, "out", lambda: f"must have q's shape {list(q.shape)}, got {list(out.shape)}")
    _check_aligned(q, op, "q")
    _check_aligned(out, op, "out")
    if lse is not None:
        _check_tensor(lse, op, "lse", torch.float32, 2, q.device)
        _check_value(lse.shape == (rows, num_qo_heads), op, "lse",
                     lambda: f"must be [{rows}, {num_qo_heads}], got {list(lse.shape)}")


@torch.library.register_fake("zipkv::paged_decode")
def _paged_decode_fake(q, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out, lse=None,
                       window_left=-1, logits_soft_cap=0.0):
    op = "paged_decode"
    num_kv_heads = _check_query_and_storage(op, q, data, meta, page_size, sm_scale, window_left, logits_soft_cap)
    batch, num_qo_heads = q.shape[0], q.shape[1]
    _check_page_table_and_out(op, q, batch, kv_indptr, kv_indices, kv_last_page_len, out, lse)
    if data.device.type == "cuda" and batch > 0 and num_qo_heads > 0:
        _check_value(batch * num_kv_heads * _CUDA_MAX_SPLITS < 2**31, op, "q's", lambda: f"batch x num_kv_heads "
                     f"must be below 2^31 / {_CUDA_MAX_SPLITS}, got {batch} x {num_kv_heads}")


@torch.library.register_fake("zipkv::paged_prefill")
def _paged_prefill_fake(q, qo_indptr, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out,
                        lse=None, causal=True, window_left=-1, logits_soft_cap=0.0):
    op = "paged_prefill"
    num_kv_heads = _check_query_and_storage(op, q, data, meta, page_size, sm_scale, window_left, logits_soft_cap)
    _check_tensor(qo_indptr, op, "qo_indptr", torch.int32, 1, data.device)
    _check_value(qo_indptr.shape[0] >= 1, op, "qo_indptr", "must have batch + 1 >= 1 entries, got 0")
    batch = qo_indptr.shape[0] - 1
    _check_page_table_and_out(op, q, batch, kv_indptr, kv_indices, kv_last_page_len, out, lse)
    if data.device.type == "cuda" and q.shape[0] > 0 and q.shape[1] > 0 and batch > 0:
        _check_value((q.shape[0] + batch) * num_kv_heads < 2**31, op, "q's", lambda: f"(nnz_q + batch) x "
                     f"num_kv_heads must be below 2^31, got ({q.shape[0]} + {batch}) x {num_kv_heads}")
