"""paged_prefill (CPU kernel) against dense float64 attention: fresh random and real KV on mixed compressed/raw pages,
query lengths from 1 to 1024 (q_len = kv_len included), causal or not, sliding windows, soft cap, GQA groups 1-16,
every head_dim; speculative verification against successive decodes; bad page tables; torch.compile."""

import math

import pytest
import torch

import torch_zipkv
from torch_zipkv import format as fmt
from torch_zipkv import ops, reference

from conftest import page_table, random_kv, rel_err, spread_layers, store, with_zeros


def prefill_case(kv, raw_pages, kv_lens, q_lens, num_qo_heads, gen, q=None):
    """Storage of kv, a page table for kv_lens, qo_indptr for q_lens and random queries (or q)."""
    n, _, P, H, D = kv.shape
    ckv = store(kv, raw_pages)
    table = page_table(kv_lens, P, n, gen)
    qo = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).to(torch.int32)
    if q is None:
        q = torch.randn(int(qo[-1]), num_qo_heads, D, generator=gen).to(torch.bfloat16)
    return ckv, qo, table, q


def run_both(kv, raw_pages, kv_lens, q_lens, num_qo_heads, gen, scale=None, q=None, **kw):
    """CPU paged_prefill and the float64 reference: (out, lse, ref, ref_lse)."""
    ckv, qo, table, q = prefill_case(kv, raw_pages, kv_lens, q_lens, num_qo_heads, gen, q)
    scale = scale or 1 / math.sqrt(kv.shape[-1])
    lse = torch.empty(q.shape[0], num_qo_heads)
    out = torch_zipkv.paged_prefill(q, qo, ckv, *table, sm_scale=scale, lse=lse, **kw)
    ref, ref_lse = reference.prefill_attention(q, qo, kv, *table, scale, **kw)
    return out, lse, ref, ref_lse


def check(out, lse, ref, ref_lse, tol=1e-2):
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel_err(out, ref) < tol
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-4)


def random_q_lens(kv_lens, gen):
    """A q length in [1, kv_len] per request, the first equal to its kv_len."""
    return [n if i == 0 else int(torch.randint(1, n + 1, (), generator=gen)) for i, n in enumerate(kv_lens)]


@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 3, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_float64_reference_mixed_pages(gen, head_dim, group, causal):
    heads = 2
    kv = with_zeros(random_kv(20, 16, heads, head_dim, gen), gen)  # some blocks zero-aware
    raw_pages = torch.rand(20, generator=gen) < 0.4
    kv_lens = [45, 1, 16, 100, 33]
    q_lens = random_q_lens(kv_lens, gen)
    out, lse, ref, ref_lse = run_both(kv, raw_pages, kv_lens, q_lens, heads * group, gen, causal=causal)
    assert out.shape == (sum(q_lens), heads * group, head_dim)
    check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("q_len", [1024, 700])
def test_long_queries(gen, q_len):
    """1024 query tokens over 1024 keys (a whole prompt) and 700 over 1030 (a chunk after earlier ones)."""
    kv_len = 1024 if q_len == 1024 else 1030
    n = (kv_len + 15) // 16
    kv = random_kv(n, 16, 1, 64, gen)
    out, lse, ref, ref_lse = run_both(kv, torch.rand(n, generator=gen) < 0.3, [kv_len], [q_len], 2, gen)
    check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("window_left", [0, 5, 16, 40, 1000])
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window(gen, window_left, causal):
    """Windows inside one page, on page boundaries, spanning pages, longer than the sequence."""
    kv = random_kv(24, 16, 2, 64, gen)
    kv_lens = [100, 17, 1, 60]
    out, lse, ref, ref_lse = run_both(kv, torch.rand(24, generator=gen) < 0.4, kv_lens, random_q_lens(kv_lens, gen),
                                      4, gen, window_left=window_left, causal=causal)
    check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("cap", [0.5, 50.0])
def test_logits_soft_cap(gen, cap):
    """Gemma 2's cap on logits large enough that it matters, with a window as Gemma 2's local layers use it."""
    kv = random_kv(12, 16, 2, 128, gen, scale=3.0)
    kv_lens = [60, 33, 7]
    out, lse, ref, ref_lse = run_both(kv, None, kv_lens, random_q_lens(kv_lens, gen), 8, gen, scale=0.5,
                                      logits_soft_cap=cap, window_left=30)
    check(out, lse, ref, ref_lse)


@pytest.mark.parametrize("page_size", [32, 64])
def test_larger_pages(gen, page_size):
    kv = with_zeros(random_kv(10, page_size, 1, 128, gen), gen)
    kv_lens = [3 * page_size, page_size + 3, 1]
    out, lse, ref, ref_lse = run_both(kv, torch.rand(10, generator=gen) < 0.5, kv_lens, random_q_lens(kv_lens, gen),
                                      4, gen)
    check(out, lse, ref, ref_lse)


def test_requests_without_queries_or_pages(gen):
    """A request with pages but no query tokens writes nothing; one with neither is fine too."""
    kv = random_kv(8, 16, 1, 64, gen)
    out, lse, ref, ref_lse = run_both(kv, None, [40, 20, 0, 30], [5, 0, 0, 30], 2, gen)
    check(out, lse, ref, ref_lse)


def test_real_kv_mixed_pages(real_kv, gen):
    """SmolLM2's shape (9 query heads, 3 kv heads, d 64) on its real KV, real-scale queries (its K vectors)."""
    for layer in spread_layers(real_kv):
        kv = real_kv[layer]
        n = kv.shape[0]
        kv_lens, q_lens = [300, 64, 700], [300, 8, 130]
        q = kv[torch.randint(0, n, (sum(q_lens),), generator=gen), 0, 3].repeat_interleave(3, dim=1)
        out, lse, ref, ref_lse = run_both(kv, torch.rand(n, generator=gen) < 0.3, kv_lens, q_lens, 9, gen, q=q)
        check(out, lse, ref, ref_lse)


def test_decode_is_prefill_of_one_token(gen):
    """q_len 1 per request is decode: the same bits as paged_decode (the CPU kernels share their arithmetic)."""
    kv = with_zeros(random_kv(16, 16, 2, 64, gen), gen)
    ckv, qo, table, q = prefill_case(kv, torch.rand(16, generator=gen) < 0.4, [30, 1, 77], [1, 1, 1], 8, gen)
    lse_p, lse_d = torch.empty(3, 8), torch.empty(3, 8)
    prefill = torch_zipkv.paged_prefill(q, qo, ckv, *table, lse=lse_p, window_left=20)
    decode = torch_zipkv.paged_decode(q, ckv, *table, lse=lse_d, window_left=20)
    assert torch.equal(prefill.view(torch.int16), decode.view(torch.int16)) and torch.equal(lse_p, lse_d)


def prefix_table(indptr, indices, requests, lens, page_size):
    """The page table of the first lens[i] tokens of each of requests[i] (a prefix of each request's pages)."""
    counts = [(n + page_size - 1) // page_size for n in lens]
    new_indices = torch.cat([indices[int(indptr[b]) : int(indptr[b]) + c] for b, c in zip(requests, counts)])
    new_indptr = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0).to(torch.int32)
    new_last = torch.tensor([(n - 1) % page_size + 1 for n in lens], dtype=torch.int32)
    return new_indptr, new_indices, new_last


def speculative_against_decodes(kv, raw_pages, kv_lens, q_lens, num_qo_heads, gen, device="cpu"):
    """Verification of q_lens[b] draft tokens per request in one causal paged_prefill, and the same tokens decoded
    one at a time (token i over the request's first kv_len - q_len + i + 1 tokens): (prefill out, decode outs, q, qo,
    page table), on the host."""
    ckv, qo, table, q = prefill_case(kv, raw_pages, kv_lens, q_lens, num_qo_heads, gen)
    dev = torch_zipkv.CompressedKV(ckv.data.to(device), ckv.meta.to(device), ckv.page_size, ckv.head_dim)
    prefill = torch_zipkv.paged_prefill(q.to(device), qo.to(device), dev, *(t.to(device) for t in table)).cpu()
    decoded = torch.empty_like(prefill)
    for i in range(max(q_lens)):
        live = [b for b, n in enumerate(q_lens) if i < n]
        sub = prefix_table(table[0], table[1], live, [kv_lens[b] - q_lens[b] + i + 1 for b in live], ckv.page_size)
        rows = torch.tensor([int(qo[b]) + i for b in live])
        decoded[rows] = torch_zipkv.paged_decode(q[rows].to(device), dev, *(t.to(device) for t in sub)).cpu()
    return prefill, decoded, q, qo, table


@pytest.mark.parametrize("group", [1, 4, 8])
def test_speculative_verification_matches_successive_decodes(gen, group):
    """q_len 2-8 draft tokens per request: one paged_prefill agrees at bf16 accuracy with q_len single-token
    paged_decode calls, each over the request's tokens up to its own."""
    kv = with_zeros(random_kv(60, 16, 2, 128, gen), gen)
    kv_lens, q_lens = [200, 37, 90, 16, 150], [2, 8, 5, 3, 4]
    prefill, decoded, q, qo, table = speculative_against_decodes(kv, torch.rand(60, generator=gen) < 0.3, kv_lens,
                                                                 q_lens, 2 * group, gen)
    assert rel_err(prefill, decoded.double()) < 1e-2
    ref, _ = reference.prefill_attention(q, qo, kv, *table, 1 / math.sqrt(128))
    assert rel_err(prefill, ref) < 1e-2 and rel_err(decoded, ref) < 1e-2


def test_window_never_reads_pages_before_it(gen):
    """Pages wholly before every query token's window may be freed (meta rows say "no stream")."""
    kv = random_kv(8, 16, 1, 64, gen)
    ckv, qo, (indptr, indices, last), q = prefill_case(kv, None, [100], [4], 2, gen)
    freed = ckv.meta.clone()
    freed[indices[:4].long()] = -1  # tokens 0..63 gone; query positions 96..99 with a window of 30 start at 66
    got = ops.paged_prefill(q, qo, ckv.data, freed, indptr, indices, last, 16, window_left=30)
    ref, _ = reference.prefill_attention(q, qo, kv, indptr, indices, last, 1 / 8, window_left=30)
    assert rel_err(got, ref) < 1e-2
    with pytest.raises(ValueError, match="holds no stream"):  # a window reaching into a freed page is caught
        ops.paged_prefill(q, qo, ckv.data, freed, indptr, indices, last, 16, window_left=40)


@pytest.mark.parametrize("window_left", [-1, 8])
def test_not_causal_takes_fewer_keys_than_queries(gen, window_left):
    """Not causal, a request's pages need not hold its queries (a cascade's shared-prefix pass: every request's rows
    over one prefix): more query tokens than keys, and no keys at all (zeros, lse -inf); causal refuses both."""
    kv = random_kv(12, 16, 2, 64, gen)
    raw_pages = torch.rand(12, generator=gen) < 0.4
    kv_lens, q_lens = [20, 0, 5, 64], [37, 3, 5, 70]
    out, lse, ref, ref_lse = run_both(kv, raw_pages, kv_lens, q_lens, 4, gen, causal=False, window_left=window_left)
    check(out, lse, ref, ref_lse)
    assert (out[37:40] == 0).all() and lse[37:40].isneginf().all()
    ckv, qo, table, q = prefill_case(kv, raw_pages, kv_lens, q_lens, 4, gen)
    with pytest.raises(ValueError, match="request 0 has 37 query tokens but 20 tokens in its pages"):
        torch_zipkv.paged_prefill(q, qo, ckv, *table, window_left=window_left)


@pytest.fixture
def setup(gen):
    kv = random_kv(6, 16, 2, 64, gen)
    ckv = store(kv, torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.bool))
    table = page_table([40, 30], 16, 6, gen)
    qo = torch.tensor([0, 10, 13], dtype=torch.int32)
    q = torch.randn(13, 4, 64, generator=gen).to(torch.bfloat16)
    return ckv, qo, table, q


@pytest.mark.parametrize("qo, message", [
    ([1, 10, 13], r"qo_indptr\[0\] must be 0, got 1"),
    ([0, 10, 9], r"qo_indptr must be non-decreasing, but qo_indptr\[2\] = 9 < qo_indptr\[1\] = 10"),
    ([0, 10, 12], r"qo_indptr\[2\] = 12 must equal q.shape\[0\] = 13"),
    ([0, 41, 13], "request 0 has 41 query tokens but 40 tokens in its pages"),
])
def test_bad_qo_indptr_contents(setup, qo, message):
    ckv, _, table, q = setup
    with pytest.raises(ValueError, match=message):
        torch_zipkv.paged_prefill(q, torch.tensor(qo, dtype=torch.int32), ckv, *table)


def test_bad_page_table_contents(setup):
    ckv, qo, (indptr, indices, last), q = setup
    with pytest.raises(ValueError, match=r"zipkv.paged_prefill: kv_indices\[1\] = 6 is out of range \[0, 6\)"):
        torch_zipkv.paged_prefill(q, qo, ckv, indptr, torch.tensor([0, 6, 1, 2, 3], dtype=torch.int32), last)
    with pytest.raises(ValueError, match=r"zipkv.paged_prefill: kv_last_page_len\[0\] = 0 must be in \[1, page_size"):
        torch_zipkv.paged_prefill(q, qo, ckv, indptr, indices, torch.tensor([0, 14], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"zipkv.paged_prefill: kv_indptr\[2\] = 9 exceeds kv_indices.numel\(\) = 5"):
        torch_zipkv.paged_prefill(q, qo, ckv, torch.tensor([0, 3, 9], dtype=torch.int32), indices, last)


def test_wrapper_rejects_wrong_python_types(setup):
    ckv, qo, table, q = setup
    with pytest.raises(TypeError, match="zipkv.paged_prefill: causal must be a bool, got int"):
        torch_zipkv.paged_prefill(q, qo, ckv, *table, causal=1)
    with pytest.raises(TypeError, match="zipkv.paged_prefill: qo_indptr must be a torch.Tensor, got list"):
        ops.paged_prefill(q, [0, 10, 13], ckv.data, ckv.meta, *table, 16)


def test_compiled_prefill_has_no_graph_breaks(setup):
    """torch.compile(fullgraph=True) traces the op through its fake kernel, and the compiled step computes the same."""
    ckv, qo, table, q = setup

    def step(q, qo, data, meta, indptr, indices, last):
        out = ops.paged_prefill(q, qo, data, meta, indptr, indices, last, 16, window_left=20)
        return out.float().sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    args = (q, qo, ckv.data, ckv.meta, *table)
    assert torch.equal(compiled(*args), step(*args))


def test_cache_prefill_of_several_sequences_is_each_ones_alone(gen):
    """CompressedPagedKVCache.prefill over several sequences' last tokens in one call (q_lens each; 0 included) gives
    each sequence what a call for it alone gives, bit for bit, over its compressed and raw pages; q_lens that do not
    match the ids or q, or ask more tokens than a sequence holds, are refused."""
    cache = torch_zipkv.CompressedPagedKVCache(2, 2, 64, page_size=16, device="cpu", max_bytes=16 << 20)
    lens, q_lens = [40, 17, 33], [9, 0, 33]
    sids = [cache.add_sequence(n) for n in lens]
    for sid, n in zip(sids, lens):
        for layer in range(2):
            cache.append(layer, sid, *(torch.randn(n, 2, 64, generator=gen).bfloat16() for _ in range(2)))
    cache.compress_full_pages()
    q = torch.randn(sum(q_lens), 8, 64, generator=gen).bfloat16()
    got = cache.prefill(1, q, sids, q_lens=q_lens, logits_soft_cap=5.0)
    at = 0
    for sid, m in zip(sids, q_lens):
        if m:
            alone = cache.prefill(1, q[at: at + m], sid, logits_soft_cap=5.0)
            assert torch.equal(got[at: at + m].view(torch.int16), alone.view(torch.int16))
        at += m
    with pytest.raises(ValueError, match=r"q_lens must give the query tokens of each of the 3 seq_ids"):
        cache.prefill(1, q, sids, q_lens=[9, 33])
    with pytest.raises(ValueError, match=r"q_lens \[9, 1, 33\] sum to 43, but q has 42 rows"):
        cache.prefill(1, q, sids, q_lens=[9, 1, 33])
    with pytest.raises(ValueError, match="q has 42 query tokens for sequence .*, which holds 40"):
        cache.prefill(1, q, sids[0])
    with pytest.raises(ValueError, match="q_lens goes with a list of seq_ids"):
        cache.prefill(1, q, sids[0], q_lens=[42])
