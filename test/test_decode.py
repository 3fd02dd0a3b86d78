"""paged_decode (CPU kernel) against dense float64 attention, on compressed, raw and mixed pages."""

import math

import pytest
import torch

import torch_zipkv
from torch_zipkv import format as fmt
from torch_zipkv import reference

from conftest import (minus_inf_page_case, page_table, pages_with_zero_blocks, random_kv, rel_err, spread_layers,
                      store)


def run_case(kv, raw_pages, seq_lens, num_qo_heads, gen, scale=None, **kw):
    n, _, P, H, D = kv.shape
    ckv = store(kv, raw_pages)
    indptr, indices, last = page_table(seq_lens, P, n, gen)
    q = torch.randn(len(seq_lens), num_qo_heads, D, generator=gen).to(torch.bfloat16)
    lse = torch.empty(len(seq_lens), num_qo_heads)
    out = torch_zipkv.paged_decode(q, ckv, indptr, indices, last, sm_scale=scale, lse=lse, **kw)
    ref, ref_lse = reference.decode_attention(q, kv, indptr, indices, last, scale or 1 / math.sqrt(D), **kw)
    return out, lse, ref, ref_lse


@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8])
def test_matches_float64_reference_mixed_pages(gen, head_dim, group):
    heads = 2
    kv = random_kv(24, 16, heads, head_dim, gen)
    kv[kv.abs() < 1e-3] = 0.0  # exact zeros, as BF16 RoPE makes: some blocks zero-aware
    raw_pages = torch.rand(24, generator=gen) < 0.4
    seq_lens = [1, 16, 17, 45, 100]  # 1-token request, full page, partial last pages
    out, lse, ref, ref_lse = run_case(kv, raw_pages, seq_lens, heads * group, gen)
    assert out.dtype == torch.bfloat16 and out.shape == (5, heads * group, head_dim)
    assert rel_err(out, ref) < 1e-2
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
def test_pages_of_zeros_match_float64_reference(gen, head_dim):
    """Blocks of +-0 that are plain, zero-aware or raw (conftest.ZERO_BLOCKS) among random pages, some stored raw."""
    kv = pages_with_zero_blocks(gen, head_dim)
    n = kv.shape[0]
    out, lse, ref, ref_lse = run_case(kv, torch.rand(n, generator=gen) < 0.3, [16 * (n - 3) + 3, 17], 4, gen)
    assert rel_err(out, ref) < 1e-2
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size", [32, 64])
def test_larger_pages(gen, page_size):
    kv = random_kv(10, page_size, 1, 128, gen)
    out, _, ref, _ = run_case(kv, torch.rand(10, generator=gen) < 0.5, [1, page_size + 3, 3 * page_size], 4, gen)
    assert rel_err(out, ref) < 1e-2


def test_scale_and_peaked_softmax(gen):
    """A large sm_scale makes the softmax nearly one-hot: errors in max-tracking would show."""
    kv = random_kv(8, 16, 1, 64, gen, scale=3.0)
    out, lse, ref, ref_lse = run_case(kv, None, [40, 77], 2, gen, scale=2.0)
    assert rel_err(out, ref) < 1e-2
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("window_left", [0, 5, 15, 16, 40, 1000])
def test_sliding_window(gen, window_left):
    """window_left = w attends to the last w + 1 tokens: windows inside one page, on page boundaries, spanning pages
    and longer than the sequence, on mixed pages."""
    kv = random_kv(24, 16, 2, 64, gen)
    out, lse, ref, ref_lse = run_case(kv, torch.rand(24, generator=gen) < 0.4, [1, 16, 17, 45, 100], 4, gen,
                                      window_left=window_left)
    assert rel_err(out, ref) < 1e-2
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_sliding_window_never_reads_pages_before_it(gen):
    """Pages wholly before the window may be freed: their meta rows say "no stream", and decode must not care."""
    kv = random_kv(8, 16, 1, 64, gen)
    ckv = store(kv, None)
    indptr, indices, last = page_table([100], 16, 8, gen)  # 7 pages, 4 tokens in the last
    q = torch.randn(1, 2, 64, generator=gen).to(torch.bfloat16)
    freed = ckv.meta.clone()
    freed[indices[:5].long()] = -1  # tokens 0..79 gone; a window of 20 starts at token 80
    got = torch_zipkv.ops.paged_decode(q, ckv.data, freed, indptr, indices, last, 16, window_left=19)
    ref, _ = reference.decode_attention(q, kv, indptr, indices, last, 1 / 8, window_left=19)
    assert rel_err(got, ref) < 1e-2
    with pytest.raises(ValueError, match="holds no stream"):  # a window reaching into a freed page is caught
        torch_zipkv.ops.paged_decode(q, ckv.data, freed, indptr, indices, last, 16, window_left=20)


@pytest.mark.parametrize("cap", [0.5, 5.0, 50.0])
def test_logits_soft_cap(gen, cap):
    """cap * tanh(logit / cap) on logits large enough that the cap matters (a small cap flattens the softmax)."""
    kv = random_kv(12, 16, 2, 128, gen, scale=3.0)
    out, lse, ref, ref_lse = run_case(kv, None, [7, 33, 60], 8, gen, scale=0.5, logits_soft_cap=cap, window_left=30)
    assert rel_err(out, ref) < 1e-2
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)
    # Capped logits are at most cap: lse <= log(tokens) + cap (the last two requests see 31 tokens of the window).
    assert (lse.double() <= torch.tensor([7.0, 31.0, 31.0]).log()[:, None] + cap + 1e-4).all()


def test_request_without_pages_gives_zeros(gen):
    kv = random_kv(4, 16, 1, 64, gen)
    out, lse, ref, ref_lse = run_case(kv, None, [20, 0, 5], 1, gen)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and lse[1].item() == float("-inf")
    assert rel_err(out[[0, 2]], ref[[0, 2]]) < 1e-2


def test_out_argument_is_written_in_place(gen):
    kv = random_kv(4, 16, 1, 64, gen)
    ckv = torch_zipkv.compress(kv)
    indptr, indices, last = page_table([30, 10], 16, 4, gen)
    q = torch.randn(2, 2, 64, generator=gen).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    res = torch_zipkv.paged_decode(q, ckv, indptr, indices, last, out=out)
    assert res is out and not out.isnan().any()


def test_real_kv_mixed_pages(real_kv, gen):
    """SmolLM2 shape (9 query heads, 3 kv heads, d 64) on its own KV, real queries taken from its K."""
    for layer in spread_layers(real_kv):
        kv = real_kv[layer]
        n = kv.shape[0]
        raw_pages = torch.rand(n, generator=gen) < 0.3
        seq_lens = [1, 333, 1000, 600]
        ckv = store(kv, raw_pages)
        indptr, indices, last = page_table(seq_lens, 16, n, gen)
        # Real-scale queries: K vectors of the same layer (Q and K live in one space after RoPE).
        q = kv[torch.randint(0, n, (4,), generator=gen), 0, 3].repeat_interleave(3, dim=1)
        out = torch_zipkv.paged_decode(q, ckv, indptr, indices, last)
        ref, _ = reference.decode_attention(q, kv, indptr, indices, last, 1 / 8)
        assert rel_err(out, ref) < 1e-2, layer


def test_kv_indices_longer_than_the_table(gen):
    """kv_indices may be a buffer longer than the table (a compiled step's fixed shape): entries from kv_indptr[-1]
    on, out-of-range ids included, are never read, and the output is the exact table's, bit for bit."""
    kv = random_kv(12, 16, 2, 64, gen)
    ckv = store(kv, torch.rand(12, generator=gen) < 0.4)
    indptr, indices, last = page_table([20, 70, 33], 16, 12, gen)
    q = torch.randn(3, 4, 64, generator=gen).to(torch.bfloat16)
    exact = torch_zipkv.paged_decode(q, ckv, indptr, indices, last)
    padded = torch.cat([indices, torch.tensor([-7, 12, 1 << 30, 0], dtype=torch.int32)])
    out = torch_zipkv.paged_decode(q, ckv, indptr, padded, last)
    assert torch.equal(out.view(torch.int16), exact.view(torch.int16))



@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_page_of_only_minus_inf_logits_weighs_nothing(order):
    """A running max of -inf is "nothing yet" (FlashAttention's rule): the -inf page, first or last, weighs 0 and the
    answer is page 1's V, 2.0, with lse = log(16) + 1/8 (16 tokens of logit 1 * sm_scale). The float64 reference
    (whose logits do not overflow) agrees."""
    kv, q, table = minus_inf_page_case(order)
    lse = torch.empty(1, 1)
    out = torch_zipkv.paged_decode(q, torch_zipkv.compress(kv), *table, lse=lse)
    assert (out[0, 0] == 2.0).all()
    assert lse.item() == pytest.approx(math.log(16) + 1 / 8, abs=1e-3)  # 2.8976 (q.k is 1 to bf16 precision)
    ref, ref_lse = reference.decode_attention(q, kv, *table, 1 / 8)
    assert rel_err(out, ref) < 1e-2
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)


def test_every_logit_minus_inf_attends_to_nothing():
    """A query head whose every logit is -inf gets what a request with no tokens gets: zeros and lse = -inf, from the
    kernel and the reference alike (softmax alone would give NaN). Here K = -inf makes them -inf in float64 too.
    A logit of +inf (the other head of the group) makes that head's out and lse NaN, as documented."""
    bf = torch.bfloat16
    kv = torch.ones(2, 2, 16, 1, 64, dtype=bf)
    kv[:, 0, :, :, 0] = float("-inf")
    q = torch.ones(1, 2, 64, dtype=bf)  # head 0: q.k = 1 * -inf + 63 = -inf for every token
    q[0, 1, 0] = -1.0  # head 1: -1 * -inf + 63 = +inf
    table = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32),
             torch.tensor([9], dtype=torch.int32))
    lse = torch.empty(1, 2)
    out = torch_zipkv.paged_decode(q, torch_zipkv.compress(kv), *table, lse=lse)
    ref, ref_lse = reference.decode_attention(q, kv, *table, 1 / 8)
    assert torch.equal(out[0, 0], torch.zeros(64, dtype=bf)) and lse[0, 0].item() == float("-inf")
    assert torch.equal(ref[0, 0], torch.zeros(64, dtype=torch.float64)) and ref_lse[0, 0].item() == float("-inf")
    assert out[0, 1].isnan().all() and lse[0, 1].isnan()  # a +inf logit: NaN out and lse (CPU and CUDA alike)


def test_v_near_the_bf16_maximum_does_not_overflow():
    """The CPU kernel accumulates the weighted V in float64: two tokens of V = 3e38 (3.004e38 in bf16) average to
    3.004e38, not inf (float32's sum of the two would overflow)."""
    bf = torch.bfloat16
    kv = torch.zeros(1, 2, 16, 1, 64, dtype=bf)
    kv[0, 1, :2] = 3e38
    kv[0, 1, :2, :, 1] = -3e38
    table = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
             torch.tensor([2], dtype=torch.int32))
    out = torch_zipkv.paged_decode(torch.zeros(1, 1, 64, dtype=bf), torch_zipkv.compress(kv), *table)
    assert torch.equal(out[0, 0], kv[0, 1, 0, 0])
