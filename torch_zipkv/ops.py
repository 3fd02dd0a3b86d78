"""Typed wrappers of the ``torch.ops.zipkv`` ops, and their fake (meta) kernels.

Every op writes into tensors the caller owns and returns nothing, so ``torch.compile(fullgraph=True)`` and CUDA
Graphs can take them; the wrappers allocate ``out`` when it is None. Shapes use these names:
``n`` pages in a call, ``P`` page_size, ``H`` num_kv_heads, ``D`` head_dim, ``W`` = format.meta_words(P, D).
"""

from __future__ import annotations

import math

import torch

from . import format as fmt

zipkv = torch.ops.zipkv


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
    """
    zipkv.compress_pages(kv, page_ids, allow_compress, data, meta, cursor)


def decompress_pages(
    data: torch.Tensor,
    meta: torch.Tensor,
    page_ids: torch.Tensor,
    page_size: int,
    head_dim: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rebuild pages ``page_ids`` bit-exactly as bf16 [n, 2, page_size, H, head_dim]."""
    if out is None:
        out = torch.empty(
            (page_ids.shape[0], 2, page_size, meta.shape[2], head_dim), dtype=torch.bfloat16, device=data.device
        )
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
    zipkv.append_kv(k, v, page_ids, slots, page_size, data, meta)


def paged_decode(
    q: torch.Tensor,
    data: torch.Tensor,
    meta: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    page_size: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
) -> torch.Tensor:
    """Decode attention of ``q`` (bf16 [batch, Hq, D]) over each request's pages; returns bf16 [batch, Hq, D].

    The page table is FlashInfer's: request b reads pages ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` (int32),
    all full but the last, which holds ``kv_last_page_len[b]`` tokens. ``sm_scale`` defaults to 1/sqrt(D).
    ``lse`` (fp32 [batch, Hq]), if given, receives the natural-log sum of exp of the logits.
    ``window_left`` >= 0 attends to each request's last ``window_left + 1`` tokens only (a sliding window of that
    many tokens, FlashInfer's convention; pages wholly before it are never read, so they may be freed); -1 to all.
    ``logits_soft_cap`` > 0 turns each logit ``x = q.k * sm_scale`` into ``cap * tanh(x / cap)`` (Gemma 2).
    """
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    if out is None:
        out = torch.empty_like(q)
    zipkv.paged_decode(q, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out, lse,
                       window_left, logits_soft_cap)
    return out


def decode_plan(q: torch.Tensor, meta: torch.Tensor, nnz_pages: int, page_size: int, window_left: int = -1) -> dict:
    """The launch :func:`paged_decode` makes on a CUDA device for these shapes, without running it.

    Returns ``{"num_splits", "warps_per_cta", "ctas_per_sm"}``: each (request, kv head) is cut into ``num_splits``
    chunks (more than 1 adds the merge kernel); CTAs of ``warps_per_cta`` warps, ``ctas_per_sm`` resident per SM.
    ``nnz_pages`` is the length of ``kv_indices``. Only shapes are read, so it never syncs. An empty batch gives
    zeros (nothing is launched). A host query: call it outside compiled graphs.
    """
    if q.device.type != "cuda":
        raise ValueError(f"zipkv.decode_plan: q must be on a CUDA device (the CPU kernel has no launch plan), got "
                         f"{q.device}")
    splits, warps, residency = zipkv.decode_plan(q, meta, nnz_pages, page_size, window_left)
    return {"num_splits": splits, "warps_per_cta": warps, "ctas_per_sm": residency}


# Fake kernels: check what the C++ kernels check from shapes alone, so errors surface while tracing.
def _check(cond: bool, msg: str) -> None:
    torch._check(cond, lambda: msg)


def _check_devices(op: str, data, **tensors) -> None:
    for name, t in tensors.items():
        _check(t is None or t.device == data.device, f"zipkv.{op}: {name} must be on {data.device} like data")


def _check_storage(op: str, data, meta, page_size: int, head_dim: int, num_kv_heads: int) -> None:
    _check(data.dtype == torch.uint8 and data.dim() == 1, f"zipkv.{op}: data must be a 1-D uint8 tensor")
    _check(meta.dtype == torch.int32 and meta.dim() == 4, f"zipkv.{op}: meta must be a 4-D int32 tensor")
    _check(
        meta.shape[1] == 2 and meta.shape[2] == num_kv_heads and meta.shape[3] == fmt.meta_words(page_size, head_dim),
        f"zipkv.{op}: meta must have shape [num_pages, 2, {num_kv_heads}, {fmt.meta_words(page_size, head_dim)}]",
    )


def _check_index(op: str, name: str, t, n) -> None:
    _check(t.dtype == torch.int32 and t.dim() == 1, f"zipkv.{op}: {name} must be a 1-D int32 tensor")
    _check(t.shape[0] == n, f"zipkv.{op}: {name} must have {n} entries")


def _check_pages(op: str, name: str, kv) -> None:
    _check(kv.dtype == torch.bfloat16 and kv.dim() == 5 and kv.shape[1] == 2, f"zipkv.{op}: {name} must be bf16 "
           "[n, 2, page_size, num_kv_heads, head_dim]")
    fmt.check_geometry(kv.shape[2], kv.shape[4])


@torch.library.register_fake("zipkv::compress_pages")
def _compress_pages_fake(kv, page_ids, allow_compress, data, meta, cursor):
    _check_pages("compress_pages", "kv", kv)
    _check_storage("compress_pages", data, meta, kv.shape[2], kv.shape[4], kv.shape[3])
    _check_index("compress_pages", "page_ids", page_ids, kv.shape[0])
    _check(cursor.dtype == torch.int64 and cursor.shape == (2,), "zipkv.compress_pages: cursor must be int64 [2]")
    _check_devices("compress_pages", data, kv=kv, page_ids=page_ids, meta=meta, cursor=cursor)


@torch.library.register_fake("zipkv::decompress_pages")
def _decompress_pages_fake(data, meta, page_ids, out):
    _check_pages("decompress_pages", "out", out)
    _check_storage("decompress_pages", data, meta, out.shape[2], out.shape[4], out.shape[3])
    _check_index("decompress_pages", "page_ids", page_ids, out.shape[0])
    _check_devices("decompress_pages", data, meta=meta, page_ids=page_ids, out=out)


@torch.library.register_fake("zipkv::append_kv")
def _append_kv_fake(k, v, page_ids, slots, page_size, data, meta):
    _check(k.dtype == torch.bfloat16 and k.dim() == 3 and v.shape == k.shape, "zipkv.append_kv: k and v must be "
           "bf16 [n, num_kv_heads, head_dim] of one shape")
    fmt.check_geometry(page_size, k.shape[2])
    _check_storage("append_kv", data, meta, page_size, k.shape[2], k.shape[1])
    _check_index("append_kv", "page_ids", page_ids, k.shape[0])
    _check_index("append_kv", "slots", slots, k.shape[0])
    _check_devices("append_kv", data, k=k, v=v, page_ids=page_ids, slots=slots, meta=meta)


@torch.library.register_fake("zipkv::paged_decode")
def _paged_decode_fake(q, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out, lse=None,
                       window_left=-1, logits_soft_cap=0.0):
    _check(window_left >= -1, "zipkv.paged_decode: window_left must be -1 (no window) or a token count >= 0")
    _check(logits_soft_cap >= 0 and math.isfinite(logits_soft_cap), "zipkv.paged_decode: logits_soft_cap must be "
           "0 (off) or a finite cap > 0")
    _check(q.dtype == torch.bfloat16 and q.dim() == 3, "zipkv.paged_decode: q must be bf16 [batch, Hq, D]")
    fmt.check_geometry(page_size, q.shape[2])
    _check(meta.dim() == 4, "zipkv.paged_decode: meta must be a 4-D int32 tensor")
    _check_storage("paged_decode", data, meta, page_size, q.shape[2], meta.shape[2])
    _check(q.shape[1] % meta.shape[2] == 0, "zipkv.paged_decode: num_qo_heads must be a multiple of num_kv_heads")
    _check_index("paged_decode", "kv_indptr", kv_indptr, q.shape[0] + 1)
    _check(kv_indices.dtype == torch.int32 and kv_indices.dim() == 1, "zipkv.paged_decode: kv_indices must be int32")
    _check_index("paged_decode", "kv_last_page_len", kv_last_page_len, q.shape[0])
    _check(out.shape == q.shape and out.dtype == torch.bfloat16, "zipkv.paged_decode: out must be bf16 like q")
    if lse is not None:
        _check(lse.dtype == torch.float32 and lse.shape == q.shape[:2], "zipkv.paged_decode: lse must be fp32 "
               "[batch, Hq]")
    _check_devices("paged_decode", data, q=q, meta=meta, kv_indptr=kv_indptr, kv_indices=kv_indices,
                   kv_last_page_len=kv_last_page_len, out=out, lse=lse)
