"""GPU box: the CUDA paged_prefill against the float64 reference and the CPU kernel, on random and real KV, mixed
raw/compressed pages, every head_dim and GQA group, q lengths 1 to 1024 (q_len = kv_len included), causal or not,
windows, soft cap, larger pages; both of its kernels (the decode kernel for short queries, the tile kernel for longer
ones: prefill_plan says which, and each test asserts the one it means); speculative verification against successive
CUDA decodes; CUDA Graph replay with other q lengths of the same nnz_q; bad device contents (which poison only their
own request, as NaN). Skipped without a GPU."""

import math

import pytest
import torch

import torch_zipkv
from torch_zipkv import format as fmt, reference

from conftest import capture_graph, random_kv, rel_err, requires_cuda, spread_layers, store, with_zeros
from test_decode_cuda import check  # GPU output and lse against the float64 reference and the CPU kernel
from test_paged_prefill import prefill_case, random_q_lens, speculative_against_decodes

pytestmark = requires_cuda


def to_cuda(ckv):
    return torch_zipkv.CompressedKV(ckv.data.cuda(), ckv.meta.cuda(), ckv.page_size, ckv.head_dim)


def plan_of(q, qo, ckv, table, window_left=-1):
    """prefill_plan of this call on the GPU (any device's tensors)."""
    return torch_zipkv.prefill_plan(q.cuda(), qo.cuda(), to_cuda(ckv), table[1], window_left=window_left)


def prefill_all(kv, raw_pages, kv_lens, q_lens, num_qo_heads, gen, scale=None, q=None, kernel=None, **kw):
    """CUDA and CPU paged_prefill of the same storage and the float64 reference:
    (gpu out, gpu lse, cpu out, ref, ref lse), on the host. kernel: the one prefill_plan must name for the call."""
    ckv, qo, table, q = prefill_case(kv, raw_pages, kv_lens, q_lens, num_qo_heads, gen, q)
    if kernel is not None:
        assert plan_of(q, qo, ckv, table, kw.get("window_left", -1))["kernel"] == kernel
    scale = scale or 1 / math.sqrt(kv.shape[-1])
    lse = torch.empty(q.shape[0], num_qo_heads, device="cuda")
    out = torch_zipkv.paged_prefill(q.cuda(), qo.cuda(), to_cuda(ckv), *(t.cuda() for t in table), sm_scale=scale,
                                    lse=lse, **kw)
    cpu = torch_zipkv.paged_prefill(q, qo, ckv, *table, sm_scale=scale, **kw)
    ref, ref_lse = reference.prefill_attention(q, qo, kv, *table, scale, **kw)
    return out.cpu(), lse.cpu(), cpu, ref, ref_lse


@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 12, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_reference_and_cpu_mixed_pages(gen, head_dim, group, causal):
    heads = 2
    kv = with_zeros(random_kv(60, 16, heads, head_dim, gen), gen)
    raw_pages = torch.rand(60, generator=gen) < 0.4
    kv_lens = [100, 1, 16, 17, 250, 45, 300]
    out, lse, cpu, ref, ref_lse = prefill_all(kv, raw_pages, kv_lens, random_q_lens(kv_lens, gen), heads * group,
                                              gen, causal=causal)
    check(out, lse, cpu, ref, ref_lse)


@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
@pytest.mark.parametrize("q_len, kv_len", [(1024, 1024), (512, 2048), (1000, 1037), (77, 3000)])
def test_long_queries(gen, head_dim, q_len, kv_len):
    """Whole prompts (q_len = kv_len), chunks after earlier chunks, a short chunk over a long context."""
    n = (kv_len + 15) // 16
    kv = with_zeros(random_kv(n, 16, 2, head_dim, gen), gen)
    out, lse, cpu, ref, ref_lse = prefill_all(kv, torch.rand(n, generator=gen) < 0.3, [kv_len], [q_len], 8, gen,
                                              kernel="tiles")
    check(out, lse, cpu, ref, ref_lse)


@pytest.mark.parametrize("kernel", ["tiles", "decode"])
def test_not_causal_takes_fewer_keys_than_queries(gen, kernel):
    """Not causal, more query tokens than keys, and no keys at all (zeros, lse -inf), on both kernels."""
    kv = random_kv(40, 16, 2, 128, gen)
    kv_lens, q_lens = ([20, 0, 5, 300], [37, 3, 5, 70]) if kernel == "tiles" else ([20, 0, 5, 300], [9, 3, 5, 7])
    out, lse, cpu, ref, ref_lse = prefill_all(kv, torch.rand(40, generator=gen) < 0.4, kv_lens, q_lens, 8, gen,
                                              kernel=kernel, causal=False)
    check(out, lse, cpu, ref, ref_lse)
    rows = slice(q_lens[0], q_lens[0] + q_lens[1])
    assert (out[rows] == 0).all() and lse[rows].isneginf().all()


def test_prefill_plan_picks_the_kernel(gen):
    """Up to 32 query rows (q_len x group) per request on average: the decode kernel, 8 rows a CTA up to 8 on average,
    16 up to 16, else 32 (16 for a group of 1, whose 32 rows span more tokens than a slot's bounds can tell apart, and
    at head_dim 256), in CTAs of 4 warps; more: the tile kernel's 128 rows, in 8 compute warps and a producer; an
    empty batch launches nothing. The decode kernel splits a small batch's long pages as decode_plan does."""
    kv = random_kv(600, 16, 2, 128, gen)
    for kv_lens, q_lens, heads, kernel, rows in [
            ([1000] * 8, [4] * 8, 4, "decode", 8),      # spec. verification, group 2: 8 rows
            ([1000] * 8, [4] * 8, 8, "decode", 16),     # group 4: 16 rows
            ([1000] * 8, [8] * 8, 8, "decode", 32),     # 32 rows: one CTA
            ([1000] * 8, [5] * 8, 8, "decode", 32),     # 20 rows
            ([1000] * 8, [32] * 8, 2, "decode", 16),    # group 1, 32 rows: two CTAs of 16
            ([1000] * 8, [9] * 8, 8, "tiles", 128),     # 36 rows
            ([1000] * 4, [100, 1, 1, 1], 2, "decode", 16),  # ragged: 103 rows over 4 requests
            ([1000] * 2, [512, 512], 8, "tiles", 128)]:
        ckv, qo, table, q = prefill_case(kv, None, kv_lens, q_lens, heads, gen)
        plan = plan_of(q, qo, ckv, table)
        assert (plan["kernel"], plan["rows_per_cta"]) == (kernel, rows), (q_lens, heads)
        assert plan["num_splits"] >= 1 and plan["warps_per_cta"] == (4 if kernel == "decode" else 12)
        assert (plan["ctas_per_sm"] > 0) == (kernel == "decode")
    ckv, qo, table, q = prefill_case(kv, None, [9000], [4], 8, gen)  # one request: its pages split
    assert plan_of(q, qo, ckv, table)["num_splits"] > 1
    empty = plan_of(q[:0], torch.zeros(1, dtype=torch.int32), ckv, table)
    assert empty == {"kernel": None, "num_splits": 0, "warps_per_cta": 0, "ctas_per_sm": 0, "rows_per_cta": 0}


def test_short_query_plan_splits_a_partial_wave_only():
    """32-row slots (q_len 8, group 4, 8K of context per request) are equal CTAs, planned as lockstep waves: two full
    waves run unsplit (splitting 8K x 64 three ways cost 22% on an H100, docs/performance.md); one CTA past a full
    wave, whose last wave would hold lone CTAs, they split."""
    H, D, P, q_len, ctx = 8, 128, 16, 8, 8192
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = torch.empty(1, 2, H, fmt.meta_words(P, D), dtype=torch.int32, device="cuda")

    def plan(batch):
        q = torch.empty(batch * q_len, 4 * H, D, dtype=torch.bfloat16, device="cuda")
        qo = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda")
        return torch_zipkv.ops.prefill_plan(q, qo, meta, batch * ctx // P, P)

    per_sm = plan(1)["ctas_per_sm"]
    two_waves, past_one = 2 * sms * per_sm // H, sms * per_sm // H + 1
    assert plan(two_waves)["rows_per_cta"] == 32 and plan(two_waves)["num_splits"] == 1
    assert plan(past_one)["num_splits"] > 1


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [2, 3, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_short_queries_in_slots_of_32_rows(gen, head_dim, group, causal):
    """Over 16 query rows per request on average (head_dim <= 128, group >= 2): one slot of 32 rows per request and
    kv head (four MMA N tiles, Q's fragments from shared memory, K and V rebuilt a block at a time), the rows' bounds
    up to 15 tokens apart; with a window and a soft cap too, on mixed pages with partial tiles."""
    heads = 2
    kv = with_zeros(random_kv(60, 16, heads, head_dim, gen), gen)
    raw_pages = torch.rand(60, generator=gen) < 0.4
    kv_lens = [100, 16, 17, 250, 45, 300, 33, 40]
    q_lens = [min(n, 32 // group) for n in kv_lens]
    ckv, qo, table, q = prefill_case(kv, raw_pages, kv_lens, q_lens, heads * group, gen)
    assert plan_of(q, qo, ckv, table)["rows_per_cta"] == 32
    for kw in [{}, {"window_left": 20}, {"logits_soft_cap": 5.0}]:
        out, lse, cpu, ref, ref_lse = prefill_all(kv, raw_pages, kv_lens, q_lens, heads * group, gen, causal=causal,
                                                  kernel="decode", **kw)
        check(out, lse, cpu, ref, ref_lse)


def short_q_lens(kv_lens, group, gen):
    """A q length per request in [1, min(kv_len, 32 / group)]: at most 32 rows each, the decode kernel's."""
    return [int(torch.randint(1, max(1, min(n, 32 // group)) + 1, (), generator=gen)) for n in kv_lens]


@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 12, 16])
@pytest.mark.parametrize("causal", [True, False])
def test_short_queries_match_reference_and_cpu(gen, head_dim, group, causal):
    """The decode kernel's short-query variant: q_len 1 to 32 / group, slots of 8, 16 or 32 rows that cut across a
    request's tokens (group 3, 5, 12), partial tiles at both ends of a row's keys."""
    heads = 2
    kv = with_zeros(random_kv(60, 16, heads, head_dim, gen), gen)
    kv_lens = [100, 1, 16, 17, 250, 45, 300, 33]
    out, lse, cpu, ref, ref_lse = prefill_all(kv, torch.rand(60, generator=gen) < 0.4, kv_lens,
                                              short_q_lens(kv_lens, group, gen), heads * group, gen, causal=causal,
                                              kernel="decode")
    check(out, lse, cpu, ref, ref_lse)


@pytest.mark.parametrize("kv_lens, q_lens, group", [
    ([1000, 300, 50, 16, 700, 64, 20, 90], [200, 1, 1, 1, 1, 1, 1, 2], 1),  # one request of 13 slots of 16
    ([40] * 33 + [900] * 7, [1, 2, 3, 4] * 10, 4),                          # 40 requests: the slot search's 2 rounds
    ([5000, 4000], [6, 32], 1)])                                             # split plans
def test_short_queries_ragged_batches(gen, kv_lens, q_lens, group):
    kv = with_zeros(random_kv(700, 16, 2, 128, gen), gen)
    out, lse, cpu, ref, ref_lse = prefill_all(kv, torch.rand(700, generator=gen) < 0.3, kv_lens, q_lens, 2 * group,
                                              gen, kernel="decode")
    check(out, lse, cpu, ref, ref_lse)


# Per kernel: (kv_lens, q_lens (None: random_q_lens, the first = its kv_len), query heads over 2 kv heads).
WINDOW_CASES = {"tiles": ([1000, 17, 1, 200], None, 8), "decode": ([3000, 17, 1, 200], [16, 8, 1, 16], 2)}


@pytest.mark.parametrize("window_left", [0, 5, 15, 16, 40, 300, 5000])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", ["tiles", "decode"])
def test_sliding_window(gen, window_left, causal, kernel):
    """Each row's window starts at its own token's position (the decode kernel: within a slot of 16 rows the starts
    differ by up to 15)."""
    kv_lens, q_lens, heads = WINDOW_CASES[kernel]
    kv = random_kv(220, 16, 2, 128, gen)
    out, lse, cpu, ref, ref_lse = prefill_all(kv, torch.rand(220, generator=gen) < 0.4, kv_lens,
                                              q_lens or random_q_lens(kv_lens, gen), heads, gen,
                                              window_left=window_left, causal=causal, kernel=kernel)
    check(out, lse, cpu, ref, ref_lse)


@pytest.mark.parametrize("cap", [0.5, 5.0, 50.0])
@pytest.mark.parametrize("kernel", ["tiles", "decode"])
def test_logits_soft_cap(gen, cap, kernel):
    kv = random_kv(50, 16, 2, 256, gen, scale=3.0)
    kv_lens = [600, 33, 7]
    q_lens = random_q_lens(kv_lens, gen) if kernel == "tiles" else [8, 4, 7]
    out, lse, cpu, ref, ref_lse = prefill_all(kv, None, kv_lens, q_lens, 4, gen, scale=0.5, logits_soft_cap=cap,
                                              window_left=100, kernel=kernel)
    check(out, lse, cpu, ref, ref_lse)


@pytest.mark.parametrize("page_size, head_dim", [(32, 64), (64, 128), (128, 256), (48, 64)])
@pytest.mark.parametrize("kernel", ["tiles", "decode"])
def test_larger_pages(gen, page_size, head_dim, kernel):
    """Tiles past the first of a page find their blocks after the raw blocks before them in the meta row."""
    kv = with_zeros(random_kv(12, page_size, 2, head_dim, gen), gen, rate=2e-3)
    kv_lens = [3 * page_size, page_size + 3, 1, 2 * page_size - 5]
    q_lens = random_q_lens(kv_lens, gen) if kernel == "tiles" else [5, 4, 1, 8]
    out, lse, cpu, ref, ref_lse = prefill_all(kv, torch.rand(12, generator=gen) < 0.3, kv_lens, q_lens, 6, gen,
                                              kernel=kernel)
    check(out, lse, cpu, ref, ref_lse)


def test_requests_without_queries_or_pages(gen):
    kv = random_kv(8, 16, 1, 64, gen)
    out, lse, cpu, ref, ref_lse = prefill_all(kv, None, [40, 20, 0, 30], [5, 0, 0, 30], 2, gen)
    check(out, lse, cpu, ref, ref_lse)


def test_real_kv_mixed_pages(real_kv, gen):
    """SmolLM2's shape (9 query heads, 3 kv heads, d 64) on its real KV, real-scale queries (its K vectors)."""
    for layer in spread_layers(real_kv):
        kv = real_kv[layer]
        n = kv.shape[0]
        for kv_lens, q_lens, kernel in [([1200, 333, 400, 64], [512, 333, 8, 2], "tiles"),
                                        ([1000, 333, 300, 64, 250], [4, 8, 2, 1, 10], "decode"),
                                        ([1000, 333, 300, 64], [10, 9, 10, 6], "decode")]:  # slots of 32 rows
            q = kv[torch.randint(0, n, (sum(q_lens),), generator=gen), 0, 3].repeat_interleave(3, dim=1)
            out, lse, cpu, ref, ref_lse = prefill_all(kv, torch.rand(n, generator=gen) < 0.3, kv_lens, q_lens, 9,
                                                      gen, q=q, kernel=kernel)
            check(out, lse, cpu, ref, ref_lse)


@pytest.mark.parametrize("head_dim, group", [(128, 4), (128, 1), (64, 3), (256, 8), (128, 16)])
def test_speculative_verification_matches_successive_decodes(gen, head_dim, group):
    """q_len 2-8 per request (speculative verification) in one paged_prefill agrees at bf16 accuracy with q_len
    single-token CUDA paged_decode calls, and both with the float64 reference."""
    kv = with_zeros(random_kv(400, 16, 2, head_dim, gen), gen)
    kv_lens = [1000, 37, 900, 16, 1500, 300, 8, 2000]
    q_lens = [2, 8, 5, 3, 4, 6, 7, 8]
    raw_pages = torch.rand(400, generator=gen) < 0.3
    prefill, decoded, q, qo, table = speculative_against_decodes(kv, raw_pages, kv_lens, q_lens, 2 * group, gen,
                                                                 device="cuda")
    ckv = store(kv, raw_pages)
    assert plan_of(q, qo, ckv, table)["kernel"] == ("decode" if group <= 4 else "tiles")  # 43 x group rows / 8
    assert not prefill.isnan().any()
    assert rel_err(prefill, decoded.double()) < 1e-2
    ref, _ = reference.prefill_attention(q, qo, kv, *table, 1 / math.sqrt(head_dim))
    assert rel_err(prefill, ref) < 1e-2 and rel_err(decoded, ref) < 1e-2


@pytest.mark.parametrize("kernel, splits", [
    ("tiles", ([100, 30, 70], [1, 1, 198], [199, 0, 1], [66, 67, 67])),
    ("decode", ([8, 4, 4], [1, 1, 14], [16, 0, 0], [0, 0, 16], [5, 6, 5]))])
def test_cuda_graph_replay_takes_other_q_lengths(gen, kernel, splits):
    """The launch comes from shapes alone: a graph captured with one split of nnz_q into requests replays another
    (qo_indptr's contents changed in place) and gives eager's bits."""
    P, H, D = 16, 2, 128
    kv = with_zeros(random_kv(200, P, H, D, gen), gen)
    ckv, qo, table, q = prefill_case(kv, torch.rand(200, generator=gen) < 0.3, [1000, 700, 900], splits[0], 8, gen)
    assert plan_of(q, qo, ckv, table)["kernel"] == kernel
    gpu, table = to_cuda(ckv), tuple(t.cuda() for t in table)
    q, qo = q.cuda(), qo.cuda()
    out, lse = torch.empty_like(q), torch.empty(q.shape[0], 8, device="cuda")

    def step():
        torch_zipkv.paged_prefill(q, qo, gpu, *table, out=out, lse=lse)

    graph = capture_graph(step)
    for lens in splits:
        qo.copy_(torch.tensor([0, *lens]).cumsum(0))
        q.copy_(torch.randn(q.shape, generator=gen))
        graph.replay()
        got, got_lse = out.clone(), lse.clone()
        step()
        assert torch.equal(got.view(torch.int16), out.view(torch.int16)) and torch.equal(got_lse, lse)
        ref, _ = reference.prefill_attention(q.cpu(), qo.cpu(), kv, *(t.cpu() for t in table), 1 / math.sqrt(D))
        assert rel_err(got.cpu(), ref) < 1e-2


@pytest.mark.parametrize("q_len, pages", [(4, 2), (40, 3)])  # the decode kernel, the tile kernel
def test_bad_device_contents_poison_only_their_request(gen, q_len, pages):
    """CUDA cannot raise on device contents without a sync: a bad page id, a corrupt meta row, an inconsistent page
    table or q_len > kv_len give NaN rows for the request that has them, never an out-of-bounds read; the other
    requests' rows are untouched."""
    P, H, D, n = 16, 1, 64, 6 * pages
    kv = random_kv(n, P, H, D, gen).cuda()
    ckv = torch_zipkv.compress(kv)
    indptr = torch.arange(0, n + 1, pages, dtype=torch.int32, device="cuda")
    indices = torch.arange(n, dtype=torch.int32, device="cuda")
    last = torch.full((6,), 16, dtype=torch.int32, device="cuda")
    qo = torch.arange(0, 6 * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    q = torch.randn(6 * q_len, 2, D, generator=gen).to(torch.bfloat16).cuda()
    assert torch_zipkv.prefill_plan(q, qo, ckv, indices)["kernel"] == ("decode" if q_len == 4 else "tiles")
    good = torch_zipkv.paged_prefill(q, qo, ckv, indptr, indices, last)
    meta = ckv.meta.clone()
    meta[pages, 0, 0, 2] = 0x000000FF      # request 1: descriptor 0xFF (invalid) in its first page's K row
    meta[2 * pages + 1, 1, 0, 0] = 10**8   # request 2: V stream far past the end of data
    meta[3 * pages, 0, 0, 0] = -1          # request 3: no stream
    bad_indices = indices.clone()
    bad_indices[4 * pages + 1] = n         # request 4: page id out of range
    bad_last = last.clone()
    bad_last[5] = 0                        # request 5: last page length outside [1, page_size]
    lse = torch.empty(6 * q_len, 2, device="cuda")
    out = torch_zipkv.paged_prefill(q, qo, torch_zipkv.CompressedKV(ckv.data, meta, P, D), indptr, bad_indices,
                                    bad_last, lse=lse)
    torch.cuda.synchronize()
    assert torch.equal(out[:q_len].view(torch.int16), good[:q_len].view(torch.int16))
    assert out[q_len:].isnan().all() and lse[q_len:].isnan().all()
    # More query tokens than the request's pages hold (q_len > kv_len) poisons that request only.
    first = pages * P - 12  # of the pages * 16 tokens request 0 holds
    rest = 6 * q_len - first
    lens = [first] + [rest // 5 + (i < rest % 5) for i in range(5)]
    long_qo = torch.tensor([0, *lens], device="cuda").cumsum(0).to(torch.int32)
    assert torch_zipkv.prefill_plan(q, long_qo, ckv, indices)["kernel"] == ("decode" if q_len == 4 else "tiles")
    fine = torch_zipkv.paged_prefill(q, long_qo, ckv, indptr, indices, last)
    tiny = last.clone()
    tiny[0] = 1  # request 0 holds (pages - 1) x 16 + 1 tokens for its pages x 16 - 12 queries
    out = torch_zipkv.paged_prefill(q, long_qo, ckv, indptr, indices, tiny)
    assert not fine.isnan().any() and out[:first].isnan().all()
    assert torch.equal(out[first:].view(torch.int16), fine[first:].view(torch.int16))


def test_opcheck_paged_prefill_cuda(gen):
    kv = random_kv(6, 16, 2, 64, gen)
    ckv, qo, table, q = prefill_case(kv, None, [30, 50], [7, 50], 4, gen)
    args = (q.cuda(), qo.cuda(), ckv.data.cuda(), ckv.meta.cuda(), *(t.cuda() for t in table), 16, 0.125,
            torch.empty_like(q).cuda(), torch.empty(57, 4, device="cuda"), True, -1, 0.0)
    torch.library.opcheck(torch.ops.zipkv.paged_prefill.default, args)
