"""Decode over a shared prefix (cascade attention): the rows of a decode step that hold the same leading full pages (a
system prompt every request shares, stored once by the prefix cache) attend to those pages once, all together, and to
their own pages apart; the two parts merge by their log-sum-exp, exactly as softmax over the union.

Why: in a plain decode every row streams and rebuilds the shared pages for itself. They then sit in L2, the step stops
being HBM-bound, and the rebuild's SM time shows: compressed pages ran 0.83-0.88x raw's speed there, where unshared
they run 1.20-1.28x (docs/performance.md, "Decode over a shared prefix"). Attended once, the prefix is one
``paged_prefill`` call, not causal (every row's position is past the prefix), whose query rows are all the sharing
rows' heads: the prefill kernels rebuild each tile once for up to 128 of them.

The layout (:func:`shared_prefix_tables`, on the host; its shapes come from the padded row count alone, so a CUDA
Graph replays it): the rows sorted by ``perm`` (the sharing rows first), repeated ``parts`` times as the prefill's
queries, part p being two requests: the sharing rows over the p-th run of the prefix's pages, and the other rows over
no pages (zeros, lse -inf). Splitting the prefix into parts gives the GPU enough CTAs. Each row's own pages (after the
prefix for a sharing row, all of them for another) are a plain ``paged_decode`` with its lse, and
:func:`merge_parts` joins the parts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import ops

MIN_ROWS = 2  # rows that must share a prefix for the pass to run
MIN_PAGES = 4  # and pages they must share
# Page reads the pass must save ((rows - 1) x shared pages): its second kernel and the merge cost some 10 us a layer in
# a graph, where a page read costs about 16 ns at the 8B shape's 64 KB a page and 4 TB/s, so below some 600 reads a
# step would lose. Not measured yet: a cost estimate, set low rather than high.
MIN_SAVED_PAGES = 256
_TARGET_CTAS = 264  # the prefix pass's CTAs to aim for: two per SM of an H100 or H200
_TILE_ROWS = 128  # query rows a CTA of paged_prefill's tile kernel takes
_MAX_PARTS = 16


TENSORS = ("perm", "inv_perm", "qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")  # SharedTables', in order


@dataclass(frozen=True, eq=False)
class SharedTables:
    """A decode step's shared-prefix pass (device tensors; see the module docstring): ``perm``, ``inv_perm`` int64
    [rows]; the prefill's ``qo_indptr`` and ``kv_indptr`` int32 [2 parts + 1], ``kv_indices`` int32 (padded),
    ``kv_last_page_len`` int32 [2 parts]; ``parts`` and ``rows`` (the padded row count the layout is for), the
    sharing rows' count and their shared pages' (host ints)."""

    perm: torch.Tensor
    inv_perm: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    parts: int
    rows: int
    sharing_rows: int
    shared_pages: int


def parts_for(rows: int, group: int, num_kv_heads: int) -> int:
    """How many runs the prefix is split into for ``rows`` query rows of ``group`` heads per kv head: a power of two
    that makes about _TARGET_CTAS CTAs of the tile kernel, from shapes alone; at least 2, since a compiled step
    reads the count off a shape that dynamo specializes at 1 (one part would recompile the step)."""
    ctas = max(1, math.ceil(rows * group / _TILE_ROWS)) * num_kv_heads
    return min(_MAX_PARTS, 1 << max(1, math.ceil(math.log2(max(1.0, _TARGET_CTAS / ctas)))))


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


def shared_prefix_tables(pages: list[np.ndarray], full: np.ndarray, rows: int, group: int, num_kv_heads: int,
                         page_size: int) -> dict | None:
    """The shared-prefix pass of a decode step of ``len(pages)`` rows laid out for ``rows`` >= that (a CUDA Graph's
    bucket: the padded rows join the non-sharing ones), or None when no group qualifies (:func:`find_group`).
    Returns the host arrays ``perm``, ``inv_perm`` (int64), ``qo_indptr``, ``kv_indptr``, ``kv_indices`` (padded
    with zeros to a power of two >= 16, so CUDA Graph buffers come in a few sizes), ``kv_last_page_len`` (int32),
    ``skip`` (int64 [len(pages)]: the leading pages of each row the pass covers), and
    the ints ``parts``, ``sharing_rows``, ``shared_pages``."""
    found = find_group(pages, full)
    if found is None:
        return None
    sharing, shared = found
    batch = len(pages)
    others = np.setdiff1d(np.arange(rows, dtype=np.int64), sharing)  # in row order, the padded rows last
    perm = np.concatenate([sharing, others])
    inv_perm = np.empty(rows, dtype=np.int64)
    inv_perm[perm] = np.arange(rows, dtype=np.int64)
    parts = parts_for(rows, group, num_kv_heads)
    n = len(sharing)
    qo = np.zeros(2 * parts + 1, dtype=np.int32)
    qo[1::2] = np.arange(parts) * rows + n
    qo[2::2] = (np.arange(parts) + 1) * rows
    cuts = np.arange(parts + 1) * shared // parts  # part p: the prefix's pages cuts[p] .. cuts[p + 1]
    kv_indptr = np.zeros(2 * parts + 1, dtype=np.int32)
    kv_indptr[1::2] = cuts[1:]
    kv_indptr[2::2] = cuts[1:]
    last = np.zeros(2 * parts, dtype=np.int32)
    last[0::2] = np.where(np.diff(cuts) > 0, page_size, 0)
    skip = np.zeros(batch, dtype=np.int64)
    skip[sharing] = shared
    indices = np.zeros(max(16, 1 << (int(shared) - 1).bit_length()), dtype=np.int32)
    indices[:shared] = pages[int(sharing[0])][:shared]
    return dict(perm=perm, inv_perm=inv_perm, qo_indptr=qo, kv_indptr=kv_indptr, kv_indices=indices,
                kv_last_page_len=last, skip=skip,
                parts=parts, sharing_rows=n, shared_pages=int(shared))


def own_table(indptr: np.ndarray, indices: np.ndarray, skip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A page table (int32 ``indptr`` [B + 1], ``indices``, padded or not) without each row's first ``skip`` pages: the
    rows' own pages after the prefix the pass covers. ``indices`` keeps its length (padded with zeros)."""
    nnz = int(indptr[-1])
    row = np.repeat(np.arange(len(skip)), np.diff(indptr))
    own = indices[:nnz][np.arange(nnz) - indptr[row] >= skip[row]]
    own_indptr = np.concatenate([[0], np.cumsum(np.diff(indptr) - skip)]).astype(np.int32)
    return own_indptr, np.pad(own, (0, len(indices) - len(own))).astype(np.int32)


def merge_parts(out_parts: torch.Tensor, lse_parts: torch.Tensor, inv_perm: torch.Tensor, out_own: torch.Tensor,
                lse_own: torch.Tensor) -> torch.Tensor:
    """Softmax attention over the union of the parts' keys from each part's normalized output and lse: ``out_parts``
    bf16 [parts, rows, Hq, D] and ``lse_parts`` fp32 [parts, rows, Hq] in ``perm`` order, ``out_own`` bf16
    [B, Hq, D] and ``lse_own`` [B, Hq] in row order (B <= rows). A row with no key anywhere gets zeros; a NaN part
    (a refused page) makes the row NaN, as the kernels' own outputs are."""
    batch = out_own.shape[0]
    lse = torch.cat([lse_parts.index_select(1, inv_perm[:batch]), lse_own[None]])  # [parts + 1, B, Hq]
    vals = torch.cat([out_parts.index_select(1, inv_perm[:batch]), out_own[None]])
    m = lse.amax(0)
    m = torch.where(m == float("-inf"), 0.0, m)  # no key in any part: every weight 0 (NaN stays NaN)
    w = torch.exp(lse - m)
    return ((w[..., None] * vals.float()).sum(0) / w.sum(0).clamp_min(1e-30)[..., None]).to(torch.bfloat16)


def attend_shared(q: torch.Tensor, data: torch.Tensor, meta: torch.Tensor, page_size: int, shared: SharedTables,
                  kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *,
                  sm_scale: float | None = None, logits_soft_cap: float = 0.0) -> torch.Tensor:
    """Decode attention of ``q`` (bf16 [shared.rows, Hq, D]) over a shared prefix and each row's own pages: the
    prefix once for its rows (``paged_prefill``, not causal, in ``shared.parts`` runs), the own pages (the page table
    ``kv_*`` of B <= rows rows, after the prefix for a sharing row) by ``paged_decode``, merged. Returns bf16
    [B, Hq, D]."""
    rows, heads = q.shape[0], q.shape[1]
    # The part count read off a table's shape, not the int: a compiled step whose buffers mark that shape dynamic
    # then serves every part count without recompiling (an int would specialize the graph: a recompile, tens of
    # seconds, in the middle of serving, whenever the batch crosses a size where the count changes).
    parts = shared.kv_last_page_len.shape[0] // 2
    q_parts = q.index_select(0, shared.perm).repeat(parts, 1, 1)
    lse_parts = torch.empty(parts * rows, heads, dtype=torch.float32, device=q.device)
    out_parts = ops.paged_prefill(q_parts, shared.qo_indptr, data, meta, shared.kv_indptr, shared.kv_indices,
                                  shared.kv_last_page_len, page_size, causal=False, sm_scale=sm_scale, lse=lse_parts,
                                  logits_soft_cap=logits_soft_cap)
    own = kv_indptr.shape[0] - 1
    lse_own = torch.empty(own, heads, dtype=torch.float32, device=q.device)
    out_own = ops.paged_decode(q[:own], data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size,
                               sm_scale=sm_scale, lse=lse_own, logits_soft_cap=logits_soft_cap)
    return merge_parts(out_parts.view(parts, rows, *q.shape[1:]), lse_parts.view(parts, rows, heads),
                       shared.inv_perm, out_own, lse_own)
