"""Decode over a shared prefix (torch_zipkv/shared_prefix.py): the layout of the pass, the merge of attention parts by
their lse against softmax over the union, and a decode step whose rows share cached pages against the same step
attending to every row's pages in one call and against float64 attention, on CPU (test_engine_prefix.py runs it in the
engine, test_engine_cuda.py under CUDA Graphs)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torch_zipkv import CompressedPagedKVCache
from torch_zipkv.page_pool import page_hashes
from torch_zipkv import shared_prefix
from torch_zipkv.shared_prefix import MIN_PAGES, find_group, merge_parts, parts_for, shared_prefix_tables

from conftest import rel_err

LAYERS, H, D, P, GROUP = 2, 2, 64, 16, 4


@pytest.fixture(autouse=True)
def small_savings_count(monkeypatch):
    """These caches are small: any saving runs the pass (its real threshold is tested below)."""
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_PAGES", 1)


def test_no_pass_below_its_savings_threshold(monkeypatch):
    """A group runs the pass only if it saves MIN_SAVED_PAGES page reads: (rows - 1) x shared pages."""
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_PAGES", 30)
    a = np.arange(100, 140, dtype=np.int32)
    assert find_group([a, a, a], np.array([14, 14, 14])) is None  # 2 x 14 = 28 reads saved
    group, common = find_group([a, a, a, a], np.array([14, 14, 14, 14]))  # 3 x 14 = 42
    assert group.tolist() == [0, 1, 2, 3] and common == 14


def test_find_group_saves_the_most_page_reads():
    """Rows with the same first page, matched against the longest of them: the k rows whose common pages save the
    most reads ((k - 1) x pages) win, so a row that diverges early does not break the others' group; fewer than
    MIN_PAGES common pages, or a row alone, is no group; pages not yet full never count."""
    assert MIN_PAGES <= 6
    a = np.arange(100, 120, dtype=np.int32)
    rows = [a, a.copy(), np.r_[a[:6], 7, 8], np.arange(200, 210, dtype=np.int32), np.r_[a[:3], 9, 9, 9]]
    group, common = find_group(rows, np.array([20, 7, 8, 10, 6]))
    assert group.tolist() == [0, 1, 2] and common == 6  # 2 x 6 saved, where rows 0 and 1 alone save 7
    group, common = find_group(rows, np.array([20, 16, 8, 10, 6]))
    assert group.tolist() == [0, 1] and common == 16  # 16 > 2 x 6
    assert find_group([a, rows[3]], np.array([20, 10])) is None  # nothing shared
    assert find_group([a, a], np.array([MIN_PAGES - 1, 20])) is None  # too few full pages in one row


def test_tables_lay_the_pass_out_for_padded_rows():
    a = np.arange(10, 30, dtype=np.int32)
    pages = [np.arange(50, 60, dtype=np.int32), a, np.r_[a[:8], 1, 2]]
    t = shared_prefix_tables(pages, np.array([9, 12, 9]), rows=8, group=GROUP, num_kv_heads=H, page_size=P)
    parts = t["parts"]
    assert parts == parts_for(8, GROUP, H) and t["sharing_rows"] == 2 and t["shared_pages"] == 8
    assert t["perm"].tolist() == [1, 2, 0, 3, 4, 5, 6, 7] and (t["perm"][t["inv_perm"]] == np.arange(8)).all()
    assert t["kv_indices"].tolist() == a[:8].tolist() + [0] * 8 and t["skip"].tolist() == [0, 8, 8]  # padded to 16
    qo, indptr = t["qo_indptr"], t["kv_indptr"]
    for p in range(parts):  # part p: the sharing rows over its run of the prefix, the others over nothing
        assert qo[2 * p: 2 * p + 3].tolist() == [8 * p, 8 * p + 2, 8 * p + 8]
        assert indptr[2 * p + 2] == indptr[2 * p + 1]
    assert indptr[-1] == 8 and (np.diff(indptr[::2]) >= 0).all()
    assert (t["kv_last_page_len"][1::2] == 0).all()
    assert ((t["kv_last_page_len"][::2] == P) == (np.diff(indptr[::2]) > 0)).all()


def test_merge_parts_is_softmax_over_the_union(gen):
    """Attention over disjoint key sets, merged by lse, against attention over all of them (float64); a part with no
    keys counts for nothing, a row with no keys anywhere gets zeros, a NaN part makes its row NaN."""
    rows, hq, n = 5, 4, 40
    q = torch.randn(rows, hq, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(n, hq, D, generator=gen, dtype=torch.float64) for _ in range(2))

    def attend(keys):
        s = torch.einsum("bhd,nhd->bhn", q, k[keys]) / math.sqrt(D)
        return torch.einsum("bhn,nhd->bhd", s.softmax(-1), v[keys]), s.logsumexp(-1)

    whole, _ = attend(torch.arange(n))
    cuts = [torch.arange(0, 7), torch.arange(7, 7), torch.arange(7, 30)]  # the middle part has no keys
    outs, lses = zip(*[attend(c) if len(c) else (torch.zeros(rows, hq, D, dtype=torch.float64),
                                                 torch.full((rows, hq), -math.inf, dtype=torch.float64)) for c in cuts])
    own_out, own_lse = attend(torch.arange(30, n))
    perm = torch.tensor([3, 0, 4, 1, 2])  # the parts in perm order, the own part in row order
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(rows)
    out_parts = torch.stack(outs)[:, perm].bfloat16()
    lse_parts = torch.stack(lses)[:, perm].float()
    merged = merge_parts(out_parts, lse_parts, inv, own_out.bfloat16(), own_lse.float())
    assert merged.dtype == torch.bfloat16 and rel_err(merged, whole) < 1e-2
    lse_parts[:] = -math.inf
    empty = merge_parts(out_parts, lse_parts, inv, torch.zeros_like(merged), torch.full((rows, hq), -math.inf))
    assert (empty == 0).all()
    lse_parts[0, inv[2], 1] = math.nan
    poisoned = merge_parts(out_parts, lse_parts, inv, own_out.bfloat16(), own_lse.float())
    assert poisoned[2, 1].isnan().all() and not poisoned[[0, 1, 3, 4]].isnan().any()


def kv_rows(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(n, H, D, generator=g).bfloat16() for _ in range(2)) for _ in range(LAYERS)]


def sharing_cache(gen, prefix_pages: int, private: list[int], unshared: list[int]):
    """A cache whose first sequence wrote ``prefix_pages`` pages of a prompt (and cached them); one sequence per entry
    of ``private`` starts from them and appends that many tokens of its own; ``unshared`` sequences hold their own
    tokens only. Returns (cache, seq ids)."""
    cache = CompressedPagedKVCache(LAYERS, H, D, page_size=P, device="cpu", max_bytes=64 << 20)
    tokens = list(range(prefix_pages * P))
    first = cache.add_sequence(prefix_pages * P + 40, 4)
    for layer, (k, v) in enumerate(kv_rows(prefix_pages * P + 5, 0)):
        cache.append(layer, first, k, v)
    cache.cache_pages(first, page_hashes(tokens, P))
    ids = [first]
    for i, n in enumerate(private):
        prefix = cache.match_prefix(page_hashes(tokens, P))
        assert len(prefix) == prefix_pages
        sid = cache.add_sequence(prefix_pages * P + n, 4, prefix=prefix)
        for layer, (k, v) in enumerate(kv_rows(n, 1 + i)):
            cache.append(layer, sid, k, v)
        ids.append(sid)
    for i, n in enumerate(unshared):
        sid = cache.add_sequence(n, 4)
        for layer, (k, v) in enumerate(kv_rows(n, 100 + i)):
            cache.append(layer, sid, k, v)
        ids.append(sid)
    cache.compress_full_pages()
    return cache, ids


@pytest.mark.parametrize("extra_rows", [0, 3])
@pytest.mark.parametrize("cap", [0.0, 30.0])
def test_step_over_shared_pages_matches_one_call_and_float64(gen, extra_rows, cap):
    """Five sequences over 6 shared compressed pages (one at a page boundary, one inside its first private page) and
    two of their own, in mixed order: the step with the pass (laid out for padded rows too) against paged_decode
    over every row's pages in one call, and against float64 attention over the gathered tokens."""
    cache, ids = sharing_cache(gen, 6, [17, 1, 16, 40], [30, 90])
    order = [ids[5], ids[1], ids[0], ids[6], ids[3], ids[2], ids[4]]
    rows = len(order) + extra_rows
    step = cache.prepare_step(order, shared_prefix=GROUP, rows=rows)
    assert step.shared is not None and step.shared.sharing_rows == 5 and step.shared.shared_pages == 6
    assert step.shared.rows == rows
    for layer in range(LAYERS):
        k, v = (torch.randn(len(order), H, D, generator=gen).bfloat16() for _ in range(2))
        cache.step_append(layer, step, k, v)
        q = torch.randn(rows, H * GROUP, D, generator=gen).bfloat16()
        got = cache.step_decode(layer, step, q, logits_soft_cap=cap)[: len(order)]
        one = cache.decode(layer, q[: len(order)], order, logits_soft_cap=cap)
        assert rel_err(got, one.double()) < 1e-2
        for r, sid in enumerate(order):
            keys, vals = (t.double().repeat_interleave(GROUP, 1) for t in cache.gather(layer, sid))  # [n, Hq, D]
            logits = torch.einsum("hd,nhd->hn", q[r].double(), keys) / math.sqrt(D)
            if cap:
                logits = cap * torch.tanh(logits / cap)
            ref = torch.einsum("hn,nhd->hd", logits.softmax(-1), vals)
            assert rel_err(got[r], ref) < 1e-2, (layer, r)


def test_no_pass_without_enough_shared_pages_or_with_sliding_windows(gen):
    """No pass below MIN_PAGES shared pages, when not asked, or in a cache with a sliding-window layer; with one, the
    step's page table holds each row's pages after the prefix."""
    cache, ids = sharing_cache(gen, MIN_PAGES - 1, [20, 20], [30])
    assert cache.prepare_step(ids, shared_prefix=GROUP).shared is None
    cache, ids = sharing_cache(gen, 6, [20, 20], [30])
    assert cache.prepare_step(ids).shared is None
    cache, ids = sharing_cache(gen, 6, [20, 20], [30])
    with pytest.raises(ValueError, match="rows must be an int >= 4, got 2"):
        cache.prepare_step(ids, shared_prefix=GROUP, rows=2)
    step = cache.prepare_step(ids, shared_prefix=GROUP)
    # 7 + 8 + 8 + 2 pages after the step, of which the first three sequences share 6
    assert step.shared.sharing_rows == 3 and int(step.kv_indptr[-1]) == 25 - 3 * 6
    windowed = CompressedPagedKVCache(LAYERS, H, D, page_size=P, device="cpu", max_bytes=16 << 20,
                                      sliding_window=[None, 64])
    tokens = list(range(6 * P))
    a = windowed.add_sequence(6 * P + 1)
    for layer, (k, v) in enumerate(kv_rows(6 * P, 0)):
        windowed.append(layer, a, k, v)
    windowed.cache_pages(a, page_hashes(tokens, P))
    b = windowed.add_sequence(6 * P + 8, prefix=windowed.match_prefix(page_hashes(tokens, P)))
    for layer, (k, v) in enumerate(kv_rows(8, 1)):
        windowed.append(layer, b, k, v)
    assert windowed.prepare_step([a, b], shared_prefix=GROUP).shared is None
