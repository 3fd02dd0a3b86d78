"""Decode over a shared prefix (cascade attention): the rows of a decode step that hold the same leading full pages (a
system prompt every request shares, stored once by the prefix cache) attend to those pages once, all together, and to
their own pages apart; the two parts merge by their log-sum-exp, exactly as softmax over the union.

Why: in a plain decode every row streams and rebuilds the shared pages for itself. They then sit in L2, the step stops
being HBM-bound, and the rebuild's SM time shows: compressed pages ran 0.83-0.88x raw's speed there, where unshared
they run 1.20-1.28x (docs/performance.md, "Prefix caching end to end").

How: the prefix's pages are rebuilt once per layer and step (``decompress_pages``, bit-exact) into BF16 scratch, every
K and then every V (so the attention reads them by views), and one dense attention runs over them with every row's
query heads as a kv head's queries (torch's flash attention on CUDA and CPU; with a logit soft cap, which it lacks, a
float32 softmax). The rebuild reads the prefix once for all rows, so compression still saves its bytes, and the
attention runs at tensor-core speed.

Measured on the H100 box (one layer, 8B shape, 4,096 shared + 768 own tokens, in a CUDA Graph, with the merge as
eager kernels; benchmarks/results/h100_2026-12-06/): the first pass of this module, one non-causal ``paged_prefill``
over the pages (the tile kernel), took 148 / 421 / 457 us at 32 / 128 / 192 rows (a plain decode: 113 / 365 / 515);
this layout with K and V copied apart after the rebuild, 147 / 264 / 340 us; cut into 8-16 runs of the prefix as the
attention's batch (more CTAs), 148 / 372 / 392 us: each run repeats every row's queries and outputs and the merge
reads them all, which cost more than the extra CTAs gained. So the pass is one run.

The layout (:func:`shared_prefix_tables`, on the host): ``prefix_ids``, the page ids the pass covers (the prefix's
pages rounded down to four significant bits, so a CUDA Graph's buffers come in a few sizes; the rest are each row's
own), and ``sharing``, 1 for each row that holds the prefix (every row attends to it; the others' part is dropped).
Both are tensors whose shapes a compiled step reads, marked dynamic by the engine's graphs: one compilation serves
every bucket and prefix length (each at least 4: dynamo specializes sizes of 0 and 1). Each row's pages after the
pass's are a plain ``paged_decode`` with its lse, and :func:`merge_parts` joins the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import ops

MIN_ROWS = 2  # rows that must share a prefix for the pass to run
MIN_PAGES = 4  # and pages they must share
# Page reads the pass must save ((rows - 1) x shared pages). The pass rebuilds the prefix (reads it compressed, writes
# and reads it as BF16: some 3 reads' worth), runs a second kernel and merges, ~15 us fixed at the 8B shape in a
# graph, where a page read from L2 costs ~10 ns: below ~1,000 reads saved a step would lose. A cost estimate, not
# measured at the threshold: on the H100 the one-run layout (K and V copied, the merge as eager kernels) lost to a
# plain decode at 32 rows x 256 shared pages, 147 against 113 us with 48 us of merge that the engine's compiled step
# fuses, and won from 128 rows.
MIN_SAVED_PAGES = 1024
MAX_PASS_BYTES = 256 << 20  # BF16 scratch one layer's pass may rebuild the prefix into; pages past it decode per row

TENSORS = ("prefix_ids", "sharing")  # SharedTables', in order


@dataclass(frozen=True, eq=False)
class SharedTables:
    """A decode step's shared-prefix pass (device tensors; see the module docstring): ``prefix_ids`` int32 [pages],
    ``sharing`` int32 [rows] (1: the row holds the prefix); ``rows`` (the padded row count the layout is for), the
    sharing rows' count and the pages the pass covers (host ints)."""

    prefix_ids: torch.Tensor
    sharing: torch.Tensor
    rows: int
    sharing_rows: int
    shared_pages: int


def pass_pages(shared: int, cap: int) -> int:
    """The prefix pages a pass covers of ``shared`` (at most ``cap``), rounded down to four significant bits: a
    graph's buffers then come in 8 sizes an octave."""
    n = min(shared, cap)
    return n & ~((1 << max(0, n.bit_length() - 4)) - 1)


def find_group(pages: list[np.ndarray], full: np.ndarray) -> tuple[np.ndarray, int] | None:
    """The rows whose shared leading pages save the most page reads ((rows - 1) x pages): (their indices in ``pages``
    order, the pages they share), or None if no MIN_ROWS rows share MIN_PAGES pages saving MIN_SAVED_PAGES reads.
    ``pages``: each row's page ids in token order; ``full``: how many of them are full and no longer written (a shared
    page always is). Rows with the same first page are candidates; among them, the k that match the longest of them
    furthest."""
    by_first: dict[int, list[int]] = {}
    for i, n in enumerate(full.tolist()):
        if n >= MIN_PAGES:
            by_first.setdefault(int(pages[i][0]), []).append(i)
    best, best_saved = None, 0
    for rows in by_first.values():
        if len(rows) < MIN_ROWS:
            continue
        base_row = max(rows, key=lambda i: full[i])
        base = pages[base_row][: int(full[base_row])]
        match = []
        for i in rows:
            n = min(len(base), int(full[i]))
            same = base[:n] == pages[i][:n]
            match.append(n if same.all() else int(np.argmin(same)))
        order = np.argsort(-np.array(match), kind="stable")
        for k in range(MIN_ROWS, len(rows) + 1):
            common = match[order[k - 1]]
            if common >= MIN_PAGES and (k - 1) * common >= MIN_SAVED_PAGES and (k - 1) * common > best_saved:
                best = (np.sort(np.array(rows, dtype=np.int64)[order[:k]]), common)
                best_saved = (k - 1) * common
    return best


def shared_prefix_tables(pages: list[np.ndarray], full: np.ndarray, rows: int, num_kv_heads: int, page_size: int,
                         head_dim: int) -> dict | None:
    """The shared-prefix pass of a decode step of ``len(pages)`` rows laid out for ``rows`` >= that (a CUDA Graph's
    bucket: the padded rows share nothing), or None when no group qualifies (:func:`find_group`). Returns the host
    arrays ``prefix_ids`` (int32 [pages]), ``sharing`` (int32 [rows]), ``skip`` (int64
    [len(pages)]: the leading pages of each row the pass covers), and the ints ``sharing_rows``, ``shared_pages``."""
    found = find_group(pages, full)
    if found is None:
        return None
    sharing, shared = found
    page_bytes = 2 * page_size * num_kv_heads * head_dim * 2
    used = pass_pages(int(shared), max(MIN_PAGES, MAX_PASS_BYTES // page_bytes))
    if used < MIN_PAGES:
        return None
    skip = np.zeros(len(pages), dtype=np.int64)
    skip[sharing] = used
    mask = np.zeros(rows, dtype=np.int32)
    mask[sharing] = 1
    ids = np.ascontiguousarray(pages[int(sharing[0])][:used], dtype=np.int32)
    return dict(prefix_ids=ids, sharing=mask, skip=skip, sharing_rows=len(sharing), shared_pages=used)


def own_table(indptr: np.ndarray, indices: np.ndarray, skip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A page table (int32 ``indptr`` [B + 1], ``indices``, padded or not) without each row's first ``skip`` pages: the
    rows' own pages after the prefix the pass covers. ``indices`` keeps its length (padded with zeros)."""
    nnz = int(indptr[-1])
    row = np.repeat(np.arange(len(skip)), np.diff(indptr))
    own = indices[:nnz][np.arange(nnz) - indptr[row] >= skip[row]]
    own_indptr = np.concatenate([[0], np.cumsum(np.diff(indptr) - skip)]).astype(np.int32)
    return own_indptr, np.pad(own, (0, len(indices) - len(own))).astype(np.int32)


def merge_parts(out_parts: torch.Tensor, lse_parts: torch.Tensor, out_own: torch.Tensor,
                lse_own: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of the parts' keys from each part's normalized output and lse: ``out_parts``
    bf16 [parts, rows, Hq, D] and ``lse_parts`` fp32 [parts, rows, Hq], ``out_own`` bf16 [B, Hq, D] and ``lse_own``
    [B, Hq], in row order (B <= rows). A row with no key anywhere gets zeros; a NaN part (a refused page) makes the
    row NaN, as the kernels' own outputs are."""
    batch = out_own.shape[0]
    lse = torch.cat([lse_parts[:, :batch], lse_own[None]])  # [parts + 1, B, Hq]
    vals = torch.cat([out_parts[:, :batch], out_own[None]])
    m = lse.amax(0)
    m = torch.where(m == float("-inf"), 0.0, m)  # no key in any part: every weight 0 (NaN stays NaN)
    w = torch.exp(lse - m)
    return ((w[..., None] * vals.float()).sum(0) / w.sum(0).clamp_min(1e-30)[..., None]).to(torch.bfloat16)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    logits_soft_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` bf16 [N, H, L, D] over ``k``, ``v`` bf16 [N, H, S, D] (last dim contiguous), no mask:
    (out bf16 [N, H, L, D], lse fp32 [N, H, L], natural log). torch's flash attention (the aten ops behind
    ``scaled_dot_product_attention``, the ones that return the lse; traced by torch.compile); with a soft cap, which
    they lack, a float32 softmax."""
    if logits_soft_cap > 0:
        s = torch.einsum("nhld,nhsd->nhls", q.float(), k.float()) * scale
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        lse = torch.logsumexp(s, -1)
        return torch.einsum("nhls,nhsd->nhld", torch.exp(s - lse[..., None]), v.float()).to(torch.bfloat16), lse
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, scale=scale)
    return out, lse


def attend_prefix(q: torch.Tensor, data: torch.Tensor, meta: torch.Tensor, page_size: int, shared: SharedTables,
                  sm_scale: float, logits_soft_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass's first part: every row of ``q`` (bf16 [rows, Hq, D]) over the prefix's pages, rebuilt once into
    BF16 scratch: (out bf16 [1, rows, Hq, D], lse fp32 [1, rows, Hq]), a row that does not hold the prefix with
    zeros and lse -inf (whatever the pages hold: another row's NaN must not reach it)."""
    rows, heads, dim = q.shape
    kv_heads = meta.shape[2]
    group = heads // kv_heads
    ids = shared.prefix_ids
    # Every K, then every V ([2, P, page, Hkv, D]), so each is [1, Hkv, keys, D] by views alone. The op itself: its
    # wrapper's checks do not trace.
    kv = torch.empty(2, ids.shape[0], page_size, kv_heads, dim, dtype=torch.bfloat16, device=q.device)
    torch.ops.zipkv.decompress_pages(data, meta, ids, kv.transpose(0, 1))
    k, v = (kv[i].view(1, -1, kv_heads, dim).transpose(1, 2) for i in (0, 1))
    qd = q.view(rows, kv_heads, group, dim).transpose(0, 1).reshape(1, kv_heads, rows * group, dim)
    out, lse = dense_attention(qd, k, v, sm_scale, logits_soft_cap)
    out = out.reshape(kv_heads, rows, group, dim).transpose(0, 1).reshape(1, rows, heads, dim)
    lse = lse.reshape(kv_heads, rows, group).transpose(0, 1).reshape(1, rows, heads)
    holds = (shared.sharing != 0)[None, :, None]
    return torch.where(holds[..., None], out, 0), torch.where(holds, lse, float("-inf"))


def attend_shared(q: torch.Tensor, data: torch.Tensor, meta: torch.Tensor, page_size: int, shared: SharedTables,
                  kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *,
                  sm_scale: float | None = None, logits_soft_cap: float = 0.0) -> torch.Tensor:
    """Decode attention of ``q`` (bf16 [shared.rows, Hq, D]) over a shared prefix and each row's own pages: the
    prefix once for every row (:func:`attend_prefix`), the own pages (the page table ``kv_*`` of B <= rows rows,
    after the prefix for a sharing row) by ``paged_decode``, merged. Returns bf16 [B, Hq, D]."""
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    out_parts, lse_parts = attend_prefix(q, data, meta, page_size, shared, sm_scale, logits_soft_cap)
    own = kv_indptr.shape[0] - 1
    lse_own = torch.empty(own, q.shape[1], dtype=torch.float32, device=q.device)
    out_own = ops.paged_decode(q[:own], data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size,
                               sm_scale=sm_scale, lse=lse_own, logits_soft_cap=logits_soft_cap)
    return merge_parts(out_parts, lse_parts, out_own, lse_own)
