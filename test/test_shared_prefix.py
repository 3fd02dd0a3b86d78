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
from torch_zipkv.shared_prefix import (MIN_PAGES, dense_attention, find_group, merge_parts, pass_pages,
                                       shared_prefix_tables)

from conftest import rel_err, requires_cuda

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


def test_tables_lay_the_pass_out_for_padded_rows(monkeypatch):
    a = np.arange(10, 40, dtype=np.int32)
    pages = [np.arange(50, 60, dtype=np.int32), a, np.r_[a[:21], 1, 2], a.copy()]
    t = shared_prefix_tables(pages, np.array([9, 28, 23, 25]), rows=8, num_kv_heads=H, page_size=P,
                             head_dim=D)
    # rows 1-3 share 21 pages, of which the pass covers 20 (four significant bits); the rest decode per row
    assert t["sharing_rows"] == 3 and t["shared_pages"] == 20 and t["prefix_ids"].tolist() == a[:20].tolist()
    assert t["sharing"].tolist() == [0, 1, 1, 1, 0, 0, 0, 0] and t["skip"].tolist() == [0, 20, 20, 20]
    page_bytes = 2 * P * H * D * 2
    monkeypatch.setattr(shared_prefix, "MAX_PASS_BYTES", 9 * page_bytes)  # the scratch's cap: 9 pages -> 9
    t = shared_prefix_tables(pages, np.array([9, 28, 23, 25]), rows=8, num_kv_heads=H, page_size=P,
                             head_dim=D)
    assert t["shared_pages"] == 9 and t["skip"].tolist() == [0, 9, 9, 9]


def test_pass_sizes_keep_four_significant_bits():
    """The pages a pass covers keep four significant bits (8 sizes an octave for a CUDA Graph's buffers)."""
    assert [pass_pages(n, 10_000) for n in (4, 5, 15, 16, 17, 31, 255, 256, 257, 1000)] == \
        [4, 5, 15, 16, 16, 30, 240, 256, 256, 960]
    assert pass_pages(1000, 300) == 288


@pytest.mark.parametrize("cap", [0.0, 5.0])
def test_dense_attention_is_float64_attention(gen, cap):
    """The pass's attention (flash on CPU here, the soft cap's float32 path) against float64, lse included."""
    q = torch.randn(2, 3, 20, D, generator=gen).bfloat16()
    k, v = (torch.randn(2, 3, 70, D, generator=gen).bfloat16() for _ in range(2))
    out, lse = dense_attention(q, k, v, 0.3, cap)
    s = torch.einsum("nhld,nhsd->nhls", q.double(), k.double()) * 0.3
    if cap:
        s = cap * torch.tanh(s / cap)
    assert rel_err(out, s.softmax(-1) @ v.double()) < 1e-2
    assert (lse.double() - s.logsumexp(-1)).abs().max() < 1e-3


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
    out_parts = torch.cat([torch.stack(outs), torch.randn(3, 2, hq, D, dtype=torch.float64)], 1).bfloat16()
    lse_parts = torch.cat([torch.stack(lses), torch.randn(3, 2, hq, dtype=torch.float64)], 1).float()  # 2 padded rows
    merged = merge_parts(out_parts, lse_parts, own_out.bfloat16(), own_lse.float())
    assert merged.dtype == torch.bfloat16 and merged.shape == (rows, hq, D) and rel_err(merged, whole) < 1e-2
    lse_parts[:] = -math.inf
    empty = merge_parts(out_parts, lse_parts, torch.zeros_like(merged), torch.full((rows, hq), -math.inf))
    assert (empty == 0).all()
    lse_parts[0, 2, 1] = math.nan
    poisoned = merge_parts(out_parts, lse_parts, own_out.bfloat16(), own_lse.float())
    assert poisoned[2, 1].isnan().all() and not poisoned[[0, 1, 3, 4]].isnan().any()


def kv_rows(n: int, seed: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(n, H, D, generator=g).bfloat16().to(device) for _ in range(2)) for _ in range(LAYERS)]


def sharing_cache(gen, prefix_pages: int, private: list[int], unshared: list[int], device: str = "cpu",
                  poison: bool = False):
    """A cache whose first sequence wrote ``prefix_pages`` pages of a prompt (and cached them); one sequence per entry
    of ``private`` starts from them and appends that many tokens of its own; ``unshared`` sequences hold their own
    tokens only. ``poison``: one key of the prefix is a NaN. Returns (cache, seq ids)."""
    cache = CompressedPagedKVCache(LAYERS, H, D, page_size=P, device=device, max_bytes=64 << 20)
    tokens = list(range(prefix_pages * P))
    first = cache.add_sequence(prefix_pages * P + 40, 4)
    for layer, (k, v) in enumerate(kv_rows(prefix_pages * P + 5, 0, device)):
        if poison:
            k[P + 3, 1, 7] = float("nan")
        cache.append(layer, first, k, v)
    cache.cache_pages(first, page_hashes(tokens, P))
    ids = [first]
    for i, n in enumerate(private):
        prefix = cache.match_prefix(page_hashes(tokens, P))
        assert len(prefix) == prefix_pages
        sid = cache.add_sequence(prefix_pages * P + n, 4, prefix=prefix)
        for layer, (k, v) in enumerate(kv_rows(n, 1 + i, device)):
            cache.append(layer, sid, k, v)
        ids.append(sid)
    for i, n in enumerate(unshared):
        sid = cache.add_sequence(n, 4)
        for layer, (k, v) in enumerate(kv_rows(n, 100 + i, device)):
            cache.append(layer, sid, k, v)
        ids.append(sid)
    cache.compress_full_pages()
    return cache, ids


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
@pytest.mark.parametrize("extra_rows", [0, 3])
@pytest.mark.parametrize("cap", [0.0, 30.0])
def test_step_over_shared_pages_matches_one_call_and_float64(gen, extra_rows, cap, device):
    """Five sequences over 6 shared compressed pages (one at a page boundary, one inside its first private page) and
    two of their own, in mixed order: the step with the pass (laid out for padded rows too) against paged_decode
    over every row's pages in one call, and against float64 attention over the gathered tokens."""
    cache, ids = sharing_cache(gen, 6, [17, 1, 16, 40], [30, 90], device)
    order = [ids[5], ids[1], ids[0], ids[6], ids[3], ids[2], ids[4]]
    rows = len(order) + extra_rows
    step = cache.prepare_step(order, shared_prefix=True, rows=rows)
    assert step.shared is not None and step.shared.sharing_rows == 5 and step.shared.shared_pages == 6
    assert step.shared.rows == rows
    for layer in range(LAYERS):
        k, v = (torch.randn(len(order), H, D, generator=gen).bfloat16().to(device) for _ in range(2))
        cache.step_append(layer, step, k, v)
        q = torch.randn(rows, H * GROUP, D, generator=gen).bfloat16().to(device)
        got = cache.step_decode(layer, step, q, logits_soft_cap=cap)[: len(order)].cpu()
        one = cache.decode(layer, q[: len(order)], order, logits_soft_cap=cap).cpu()
        assert rel_err(got, one.double()) < 1e-2
        for r, sid in enumerate(order):
            keys, vals = (t.cpu().double().repeat_interleave(GROUP, 1) for t in cache.gather(layer, sid))  # [n,Hq,D]
            logits = torch.einsum("hd,nhd->hn", q[r].cpu().double(), keys) / math.sqrt(D)
            if cap:
                logits = cap * torch.tanh(logits / cap)
            ref = torch.einsum("hn,nhd->hd", logits.softmax(-1), vals)
            assert rel_err(got[r], ref) < 1e-2, (layer, r)


def test_a_nan_in_the_shared_pages_reaches_only_the_rows_that_hold_them(gen):
    """Every row of a step runs through the prefix's attention; a row that does not hold the prefix drops its part.
    With a NaN key in the prefix, the rows that hold it come out NaN (as one paged_decode over their pages gives), the
    others exactly as if the pass were not there."""
    cache, ids = sharing_cache(gen, 6, [17, 40], [30, 90], poison=True)
    order = [ids[3], ids[1], ids[0], ids[4], ids[2]]
    step = cache.prepare_step(order, shared_prefix=True, rows=8)
    assert step.shared.sharing_rows == 3
    k, v = (torch.randn(len(order), H, D, generator=gen).bfloat16() for _ in range(2))
    cache.step_append(0, step, k, v)
    q = torch.randn(8, H * GROUP, D, generator=gen).bfloat16()
    got = cache.step_decode(0, step, q)[: len(order)]
    one = cache.decode(0, q[: len(order)], order)
    holds = torch.tensor([False, True, True, False, True])
    assert got[holds][:, GROUP:2 * GROUP].isnan().all() and one[holds][:, GROUP:2 * GROUP].isnan().all()
    assert not got[~holds].isnan().any() and rel_err(got[~holds], one[~holds].double()) < 1e-2


def test_no_pass_without_enough_shared_pages_or_with_sliding_windows(gen):
    """No pass below MIN_PAGES shared pages, when not asked, or in a cache with a sliding-window layer; with one, the
    step's page table holds each row's pages after the prefix."""
    cache, ids = sharing_cache(gen, MIN_PAGES - 1, [20, 20], [30])
    assert cache.prepare_step(ids, shared_prefix=True).shared is None
    cache, ids = sharing_cache(gen, 6, [20, 20], [30])
    assert cache.prepare_step(ids).shared is None
    cache, ids = sharing_cache(gen, 6, [20, 20], [30])
    with pytest.raises(ValueError, match="rows must be an int >= 4, got 2"):
        cache.prepare_step(ids, shared_prefix=True, rows=2)
    with pytest.raises(TypeError, match="shared_prefix must be a bool, got int"):
        cache.prepare_step(ids, shared_prefix=4)
    step = cache.prepare_step(ids, shared_prefix=True)
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
    assert windowed.prepare_step([a, b], shared_prefix=True).shared is None
