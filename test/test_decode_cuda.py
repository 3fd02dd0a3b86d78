"""GPU box: the fused CUDA paged_decode against the float64 reference and the CPU kernel, on random and real KV,
mixed raw/compressed pages, every head_dim and group size, split and unsplit plans, CUDA Graph replay, and bad device
contents (which poison only their own request, as NaN). Skipped without a GPU."""

import math

import pytest
import torch

import torch_zipkv
from torch_zipkv import format as fmt, reference

from conftest import (capture_graph, compressible_kv, minus_inf_page_case, page_table, pages_with_zero_blocks,
                      random_kv, rel_err, requires_cuda, spread_layers, store, with_zeros)

pytestmark = requires_cuda


def decode_both(kv, raw_pages, seq_lens, num_qo_heads, gen, scale=None, **kw):
    """CUDA and CPU paged_decode of the same storage; returns (gpu out, gpu lse, cpu out, cpu lse, ref, ref lse).
    ``kw``: window_left, logits_soft_cap for all three."""
    n, _, P, H, D = kv.shape
    scale = scale or 1 / math.sqrt(D)
    ckv = store(kv, raw_pages)
    gpu = torch_zipkv.CompressedKV(ckv.data.cuda(), ckv.meta.cuda(), P, D)
    indptr, indices, last = page_table(seq_lens, P, n, gen)
    q = torch.randn(len(seq_lens), num_qo_heads, D, generator=gen).to(torch.bfloat16)
    lse_g = torch.empty(len(seq_lens), num_qo_heads, device="cuda")
    out_g = torch_zipkv.paged_decode(q.cuda(), gpu, indptr.cuda(), indices.cuda(), last.cuda(), sm_scale=scale,
                                     lse=lse_g, **kw)
    lse_c = torch.empty(len(seq_lens), num_qo_heads)
    out_c = torch_zipkv.paged_decode(q, ckv, indptr, indices, last, sm_scale=scale, lse=lse_c, **kw)
    ref, ref_lse = reference.decode_attention(q, kv, indptr, indices, last, scale, **kw)
    return out_g.cpu(), lse_g.cpu(), out_c, lse_c, ref, ref_lse


def check(out_g, lse_g, out_c, ref, ref_lse, tol=1e-2):
    assert not out_g.isnan().any()
    assert rel_err(out_g, ref) < tol
    assert rel_err(out_g, out_c.double()) < tol
    torch.testing.assert_close(lse_g.double(), ref_lse, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8, 12, 16])
def test_matches_reference_and_cpu_mixed_pages(gen, head_dim, group):
    heads = 2
    kv = with_zeros(random_kv(40, 16, heads, head_dim, gen), gen)
    raw_pages = torch.rand(40, generator=gen) < 0.4
    seq_lens = [1, 16, 17, 45, 0, 100, 250]  # 1-token, full page, partial last pages, an empty request
    out_g, lse_g, out_c, lse_c, ref, ref_lse = decode_both(kv, raw_pages, seq_lens, heads * group, gen)
    live = [0, 1, 2, 3, 5, 6]
    check(out_g[live], lse_g[live], out_c[live], ref[live], ref_lse[live])
    assert torch.equal(out_g[4], torch.zeros_like(out_g[4])) and (lse_g[4] == float("-inf")).all()


@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
def test_pages_of_zeros_match_reference_and_cpu(gen, head_dim):
    """Blocks of +-0 that are plain, zero-aware or raw (conftest.ZERO_BLOCKS) among random pages, some stored raw."""
    kv = pages_with_zero_blocks(gen, head_dim)
    n = kv.shape[0]
    out_g, lse_g, out_c, _, ref, ref_lse = decode_both(kv, torch.rand(n, generator=gen) < 0.3,
                                                       [16 * (n - 3) + 3, 17], 4, gen)
    check(out_g, lse_g, out_c, ref, ref_lse)


@pytest.mark.parametrize("page_size, head_dim", [(32, 64), (64, 128), (128, 256), (48, 64), (128, 64)])
def test_larger_pages_count_raw_blocks_before_the_tile(gen, page_size, head_dim):
    """Tiles past the first of a page find their blocks by counting the raw blocks before them in the meta row."""
    kv = with_zeros(random_kv(12, page_size, 2, head_dim, gen), gen, rate=2e-3)
    raw_pages = torch.rand(12, generator=gen) < 0.3
    seq_lens = [1, page_size + 3, 3 * page_size, 2 * page_size - 5]
    out_g, lse_g, out_c, _, ref, ref_lse = decode_both(kv, raw_pages, seq_lens, 6, gen)
    check(out_g, lse_g, out_c, ref, ref_lse)


@pytest.mark.parametrize("head_dim, group", [(64, 3), (64, 12), (128, 4), (128, 16), (256, 2)])
def test_every_raw_block_pattern_of_a_stream(gen, head_dim, group):
    """Every pattern of raw and compressed blocks inside one K or V stream (a value far below the others keeps its
    block raw), each stream with its own: the kernel rebuilds mixed streams by pattern (docs/decode-kernel.md, v12), so
    each pattern is a code path of its own."""
    blocks, heads = head_dim // 32, 2
    patterns = 2**blocks
    n = max(8, patterns // heads)
    kv = compressible_kv(n, 16, heads, head_dim, gen)
    want = torch.zeros(n, 2, heads, blocks, dtype=torch.bool)
    for p in range(n):
        for h in range(heads):
            i = p * heads + h
            for s, mask in ((0, i % patterns), (1, (5 * i + 1) % patterns)):  # x -> 5x + 1 permutes the patterns
                for c in range(blocks):
                    if mask >> c & 1:
                        token, dim = torch.randint(16, (2,), generator=gen).tolist()
                        kv[p, s, token, h, 32 * c + 2 * dim] = 1e-30  # far below the block's window
                        want[p, s, h, c] = True
    ckv = store(kv)
    raw = ckv.descriptors()[..., :blocks] == fmt.DESC_RAW
    assert torch.equal(raw, want)  # the storage kept exactly the blocks the test made raw
    for s in range(2):
        seen = {int(sum(int(b) << c for c, b in enumerate(row))) for row in raw[:, s].reshape(-1, blocks)}
        assert len(seen) == patterns
    out_g, lse_g, out_c, _, ref, ref_lse = decode_both(kv, None, [16 * (n // 2), 16 * (n - n // 2) - 5],
                                                       heads * group, gen)
    check(out_g, lse_g, out_c, ref, ref_lse)


@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
def test_raw_compressed_and_mixed_storage_give_identical_bits(gen, head_dim):
    """The same values stored raw, compressed, or page by page either way rebuild to the same registers, whichever
    path a tile takes (alone, or at d 64 paired with the warp's next tile when both are of one kind): outputs agree
    bit for bit."""
    kv = compressible_kv(30, 16, 4, head_dim, gen)
    indptr, indices, last = page_table([300, 77, 33], 16, 30, gen, device="cuda")
    q = torch.randn(3, 16, head_dim, generator=gen).to(torch.bfloat16).cuda()
    comp = torch_zipkv.compress(kv.cuda())
    raw = torch_zipkv.compress(kv.cuda(), allow_compress=False)
    mixed_cpu = store(kv, torch.rand(30, generator=gen) < 0.5)
    mixed = torch_zipkv.CompressedKV(mixed_cpu.data.cuda(), mixed_cpu.meta.cuda(), 16, head_dim)
    assert comp.compressed_block_fraction == 1.0 and raw.compressed_block_fraction == 0.0
    assert 0.2 < mixed.compressed_block_fraction < 0.8
    out_comp = torch_zipkv.paged_decode(q, comp, indptr, indices, last)
    out_raw = torch_zipkv.paged_decode(q, raw, indptr, indices, last)
    out_mixed = torch_zipkv.paged_decode(q, mixed, indptr, indices, last)
    assert torch.equal(out_comp.view(torch.int16), out_raw.view(torch.int16))
    assert torch.equal(out_comp.view(torch.int16), out_mixed.view(torch.int16))
    ref, _ = reference.decode_attention(q.cpu(), kv, indptr.cpu(), indices.cpu(), last.cpu(), 1 / math.sqrt(head_dim))
    assert rel_err(out_comp, ref) < 1e-2


@pytest.mark.parametrize("batch, heads, seq", [(1, 1, 9000), (2, 2, 5000), (3, 8, 2051), (400, 2, 40)])
@pytest.mark.parametrize("D", fmt.HEAD_DIMS)
def test_split_and_unsplit_plans(gen, batch, heads, seq, D):
    """Few long requests are split across CTAs and merged (the first case into more than 32 splits: the merge's
    lanes then hold two splits each; every head_dim: its own vector width in the merge); many short ones run one CTA
    per (request, head). The plan the op reports says which."""
    P = 16
    lens = [seq - 7 * (b % 5) for b in range(batch)]
    n = sum((x + P - 1) // P for x in lens)
    kv = with_zeros(random_kv(n, P, heads, D, gen), gen)
    plan = plan_of(batch, heads * 4, heads, D, n)
    if batch == 1:
        assert plan["num_splits"] > 32, plan  # the merge's lanes hold two splits each
    else:
        assert (plan["num_splits"] > 1) == (batch < 400), plan
    assert plan["warps_per_cta"] == 4, plan  # no partial wave of 4-warp CTAs here: 6-warp CTAs are not taken
    out_g, lse_g, out_c, _, ref, ref_lse = decode_both(kv, torch.rand(n, generator=gen) < 0.3, lens, heads * 4, gen)
    check(out_g, lse_g, out_c, ref, ref_lse)


def plan_of(batch, num_qo_heads, num_kv_heads, head_dim, nnz_pages, page_size=16, window_left=-1):
    """This device's launch plan for a decode of these shapes (only shapes are read)."""
    q = torch.empty(batch, num_qo_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    meta = torch.empty(1, 2, num_kv_heads, fmt.meta_words(page_size, head_dim), dtype=torch.int32, device="cuda")
    return torch_zipkv.ops.decode_plan(q, meta, nnz_pages, page_size, window_left=window_left)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_six_warp_ctas(gen, group):
    """d 128: where 4-warp CTAs (3 per SM) would end in a partial wave, the plan runs one CTA of 6 warps (2 per SM)
    per (request, kv head), a kernel variant of its own (docs/decode-kernel.md, v13). Find the smallest batch of ragged
    ~600-token requests it takes, and check that variant against the reference and the CPU kernel."""
    H, D, P = 4, 128, 16

    def lens(batch):
        return [600 - 37 * (b % 7) for b in range(batch)]

    def plan(batch):
        return plan_of(batch, H * group, H, D, sum((x + P - 1) // P for x in lens(batch)))

    batch = next((b for b in range(1, 512) if plan(b)["warps_per_cta"] == 6), None)
    assert batch is not None, "no batch takes the 6-warp CTAs"
    assert plan(batch) == {"num_splits": 1, "warps_per_cta": 6, "ctas_per_sm": 2}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert 3 * sms < batch * H <= 4 * sms  # only where 4-warp CTAs leave a partial wave, up to two 6-warp waves
    seq_lens = lens(batch)
    n = sum((x + P - 1) // P for x in seq_lens)
    kv = with_zeros(random_kv(n, P, H, D, gen), gen)
    out_g, lse_g, out_c, _, ref, ref_lse = decode_both(kv, torch.rand(n, generator=gen) < 0.3, seq_lens, H * group,
                                                       gen)
    check(out_g, lse_g, out_c, ref, ref_lse)


def test_decode_plan_layouts():
    """Only d 128 with one MMA head tile (group <= 8) has 6-warp CTAs; an empty batch launches nothing."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for D, group, residency in ((64, 3, 3), (64, 12, 4), (256, 2, 1), (128, 12, 2), (128, 16, 2)):
        for batch in (1, 100, 4 * sms // 2, 1000):
            plan = plan_of(batch, 2 * group, 2, D, batch * 128)
            assert plan["warps_per_cta"] == 4 and plan["ctas_per_sm"] == residency, (D, group, batch, plan)
    assert plan_of(0, 8, 2, 128, 0) == {"num_splits": 0, "warps_per_cta": 0, "ctas_per_sm": 0}
    assert plan_of(16, 8, 2, 128, 16 * 128)["ctas_per_sm"] == 3


@pytest.mark.parametrize("window_left", [0, 7, 15, 16, 100, 4000])
@pytest.mark.parametrize("head_dim, page_size", [(128, 16), (64, 64)])
def test_sliding_window(gen, window_left, head_dim, page_size):
    """Windows inside a tile, on tile and page boundaries, across pages, and longer than some requests; short
    requests (one CTA each) and long ones (split plans)."""
    lens = [1, 17, 45, 300, 6000]
    n = sum(-(-x // page_size) for x in lens)
    kv = with_zeros(random_kv(n, page_size, 2, head_dim, gen), gen)
    out_g, lse_g, out_c, _, ref, ref_lse = decode_both(kv, torch.rand(n, generator=gen) < 0.3, lens, 8, gen,
                                                       window_left=window_left)
    check(out_g, lse_g, out_c, ref, ref_lse)


@pytest.mark.parametrize("cap", [0.5, 30.0])
def test_logits_soft_cap(gen, cap):
    kv = random_kv(40, 16, 2, 128, gen, scale=3.0)
    out_g, lse_g, out_c, _, ref, ref_lse = decode_both(kv, None, [40, 77, 300], 8, gen, scale=0.5,
                                                       logits_soft_cap=cap)
    check(out_g, lse_g, out_c, ref, ref_lse)
    out_g, lse_g, out_c, _, ref, ref_lse = decode_both(kv, None, [40, 77, 300], 8, gen, scale=0.5,
                                                       logits_soft_cap=cap, window_left=50)
    check(out_g, lse_g, out_c, ref, ref_lse)


def test_pages_before_the_window_are_never_read(gen):
    """A sliding-window cache frees the pages before the window: their meta rows say "no stream" and their bytes may
    be anything (NaN before the window inside the first kept tile too). Decode reads none of it."""
    kv = random_kv(8, 16, 1, 64, gen)
    kv[2, :, :5] = float("nan")  # tokens 32..36: before a window that starts at token 37
    ckv = torch_zipkv.compress(kv.cuda())
    meta = ckv.meta.clone()
    indptr = torch.tensor([0, 7], dtype=torch.int32, device="cuda")
    indices = torch.arange(7, dtype=torch.int32, device="cuda")
    last = torch.tensor([4], dtype=torch.int32, device="cuda")  # 100 tokens; window of 63 starts at 37
    meta[:2] = -1
    q = torch.randn(1, 2, 64, generator=gen).to(torch.bfloat16)
    out = torch_zipkv.ops.paged_decode(q.cuda(), ckv.data, meta, indptr, indices, last, 16, window_left=62).cpu()
    ref, _ = reference.decode_attention(q, kv, indptr.cpu(), indices.cpu(), last.cpu(), 1 / 8, window_left=62)
    assert not out.isnan().any() and rel_err(out, ref) < 1e-2


def test_peaked_softmax_and_large_scale(gen):
    kv = random_kv(24, 16, 1, 64, gen, scale=3.0)
    out_g, lse_g, out_c, _, ref, ref_lse = decode_both(kv, None, [40, 77, 200], 2, gen, scale=2.0)
    check(out_g, lse_g, out_c, ref, ref_lse)


def test_garbage_past_the_last_token_is_ignored(gen):
    """Unfilled slots of an open page can hold anything, NaN and Inf included: they must not reach the output."""
    kv = random_kv(6, 16, 2, 64, gen)
    kv[5, :, 9:] = float("nan")
    kv[4, :, 3:] = float("inf")
    indptr = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    indices = torch.tensor([0, 1, 5, 4, 2, 3], dtype=torch.int32)
    last = torch.tensor([9, 3, 16], dtype=torch.int32)
    q = torch.randn(3, 4, 64, generator=gen).to(torch.bfloat16)
    ckv = torch_zipkv.compress(kv.cuda())
    out = torch_zipkv.paged_decode(q.cuda(), ckv, indptr.cuda(), indices.cuda(), last.cuda()).cpu()
    ref, _ = reference.decode_attention(q, kv, indptr, indices, last, 1 / 8)
    assert not out.isnan().any() and rel_err(out, ref) < 1e-2


def test_kv_indices_longer_than_the_table(gen):
    """Entries of kv_indices from kv_indptr[-1] on, out-of-range ids included, are never read (a compiled step's
    fixed-size table): the output is the exact table's, bit for bit, and the CPU kernel's within bf16 rounding."""
    kv = random_kv(12, 16, 2, 128, gen)
    ckv = store(kv.cuda(), torch.rand(12, generator=gen) < 0.4)
    indptr, indices, last = page_table([20, 70, 33], 16, 12, gen, device="cuda")
    q = torch.randn(3, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    exact = torch_zipkv.paged_decode(q, ckv, indptr, indices, last)
    padded = torch.cat([indices, torch.tensor([-7, 12, 1 << 30, 0], dtype=torch.int32, device="cuda")])
    out = torch_zipkv.paged_decode(q, ckv, indptr, padded, last)
    assert torch.equal(out.view(torch.int16), exact.view(torch.int16)) and not out.isnan().any()
    ref, _ = reference.decode_attention(q.cpu(), kv, indptr.cpu(), indices.cpu(), last.cpu(), 128 ** -0.5)
    assert rel_err(out.cpu(), ref) < 1e-2


def test_real_kv_mixed_pages(real_kv, gen):
    """SmolLM2's own shape (9 query heads, 3 kv heads, d 64) on its real KV, real-scale queries (its K vectors)."""
    for layer in spread_layers(real_kv):
        kv = real_kv[layer]
        n = kv.shape[0]
        ckv = store(kv, torch.rand(n, generator=gen) < 0.3)
        gpu = torch_zipkv.CompressedKV(ckv.data.cuda(), ckv.meta.cuda(), 16, 64)
        indptr, indices, last = page_table([1, 333, 1000, 600], 16, n, gen)
        q = kv[torch.randint(0, n, (4,), generator=gen), 0, 3].repeat_interleave(3, dim=1)
        out = torch_zipkv.paged_decode(q.cuda(), gpu, indptr.cuda(), indices.cuda(), last.cuda()).cpu()
        ref, _ = reference.decode_attention(q, kv, indptr, indices, last, 1 / 8)
        cpu = torch_zipkv.paged_decode(q, ckv, indptr, indices, last)
        assert rel_err(out, ref) < 1e-2 and rel_err(out, cpu.double()) < 1e-2, layer


@pytest.mark.parametrize("seq", [70, 6000])  # one CTA per request; split with a merge kernel
def test_cuda_graph_replay_matches_eager(gen, seq):
    P, H, D = 16, 2, 128
    n = 2 * ((seq + P - 1) // P)
    ckv = torch_zipkv.compress(with_zeros(random_kv(n, P, H, D, gen), gen).cuda())
    indptr, indices, last = page_table([seq, seq - 20], P, n, gen, device="cuda")
    q = torch.empty(2, 8, D, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    lse = torch.empty(2, 8, device="cuda")

    def step():
        torch_zipkv.paged_decode(q, ckv, indptr, indices, last, out=out, lse=lse)

    q.copy_(torch.randn(2, 8, D, generator=gen))
    graph = capture_graph(step)
    for _ in range(3):
        q.copy_(torch.randn(2, 8, D, generator=gen))
        graph.replay()
        got, got_lse = out.clone(), lse.clone()
        step()
        assert torch.equal(got.view(torch.int16), out.view(torch.int16)) and torch.equal(got_lse, lse)
        last_len = int(last[0])
        assert 1 <= last_len <= P and not got.isnan().any()


def test_bad_device_contents_poison_only_their_request(gen):
    """CUDA cannot raise on device contents without a sync: bad page ids, corrupt meta rows and inconsistent page
    tables give NaN for the requests that use them, and never an out-of-bounds read; the others are untouched."""
    P, H, D = 16, 1, 64
    kv = random_kv(12, P, H, D, gen).cuda()
    ckv = torch_zipkv.compress(kv)
    q = torch.randn(6, 2, D, generator=gen).to(torch.bfloat16).cuda()
    indptr = torch.tensor([0, 2, 4, 6, 8, 10, 12], dtype=torch.int32, device="cuda")
    indices = torch.arange(12, dtype=torch.int32, device="cuda")
    last = torch.full((6,), 16, dtype=torch.int32, device="cuda")
    good = torch_zipkv.paged_decode(q, ckv, indptr, indices, last)
    meta = ckv.meta.clone()
    meta[2, 0, 0, 2] = 0x000000FF  # request 1: descriptor 0xFF (invalid) in its first page's K row
    meta[5, 1, 0, 0] = 10**8       # request 2: V stream far past the end of data
    meta[6, 0, 0, 0] = -1          # request 3: no stream
    bad_indices = indices.clone()
    bad_indices[9] = 12            # request 4: page id out of range
    bad_last = last.clone()
    bad_last[5] = 0                # request 5: last page length outside [1, page_size]
    bad = torch_zipkv.CompressedKV(ckv.data, meta, P, D)
    lse = torch.empty(6, 2, device="cuda")
    out = torch_zipkv.paged_decode(q, bad, indptr, bad_indices, bad_last, lse=lse)
    torch.cuda.synchronize()
    assert torch.equal(out[0].view(torch.int16), good[0].view(torch.int16))
    assert out[1:].isnan().all() and lse[1:].isnan().all()
    # An indptr that runs past kv_indices poisons that request too.
    bad_indptr = indptr.clone()
    bad_indptr[6] = 13
    out = torch_zipkv.paged_decode(q, ckv, bad_indptr, indices, last)
    assert out[5].isnan().all() and torch.equal(out[:5].view(torch.int16), good[:5].view(torch.int16))


def test_opcheck_paged_decode_cuda(gen):
    kv = random_kv(6, 16, 2, 64, gen).cuda()
    ckv = torch_zipkv.compress(kv)
    indptr, indices, last = page_table([30, 50], 16, 6, gen, device="cuda")
    q = torch.randn(2, 4, 64, generator=gen).to(torch.bfloat16).cuda()
    args = (q, ckv.data, ckv.meta, indptr, indices, last, 16, 0.125, torch.empty_like(q),
            torch.empty(2, 4, device="cuda"))
    torch.library.opcheck(torch.ops.zipkv.paged_decode.default, args)


def decode_cuda(q, kv, table, sm_scale=None):
    """paged_decode of q over kv (compressed on the GPU) with page table `table` (CPU tensors); returns CPU out, lse."""
    lse = torch.empty(q.shape[0], q.shape[1], device="cuda")
    out = torch_zipkv.paged_decode(q.cuda(), torch_zipkv.compress(kv.cuda()), *(t.cuda() for t in table),
                                   sm_scale=sm_scale, lse=lse)
    return out.cpu(), lse.cpu()


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_page_of_only_minus_inf_logits_weighs_nothing(order):
    """Issue 19's reproducer (test_decode.py has the CPU side): page 0's logits overflow float32 to -inf, page 1's
    are 1; in either order the answer is page 1's V, 2.0, and lse = log(16) + 1/8."""
    kv, q, table = minus_inf_page_case(order)
    out, lse = decode_cuda(q, kv, table)
    assert (out[0, 0] == 2.0).all()
    assert lse.item() == pytest.approx(math.log(16) + 1 / 8, abs=1e-3)


def test_splits_of_only_minus_inf_logits_weigh_nothing(gen):
    """A long request, split across CTAs: its first 4000 tokens (the first splits and warps, wholly) have logits
    that overflow float32 to -inf (q.k = 1e20 * -1e20), the rest finite ones. The merge of the splits, and of the
    warps inside the mixed split, must weigh the -inf parts 0: the float64 reference (no overflow) agrees."""
    P, D, n = 16, 128, 563  # 9000 tokens
    kv = random_kv(n, P, 1, D, gen)
    kv[:, 0, :, :, 0] = 0.0
    kv[:250, 0, :, :, 0] = -1e20
    q = torch.randn(1, 4, D, generator=gen).to(torch.bfloat16)
    q[:, :, 0] = 1e20
    table = (torch.tensor([0, n], dtype=torch.int32), torch.arange(n, dtype=torch.int32),  # pages in token order
             torch.tensor([P - 8], dtype=torch.int32))
    assert plan_of(1, 4, 1, D, n)["num_splits"] > 4
    out, lse = decode_cuda(q, kv, table)
    ref, ref_lse = reference.decode_attention(q, kv, *table, D ** -0.5)
    assert not out.isnan().any() and rel_err(out, ref) < 1e-2
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("seq", [40, 9000])  # one CTA; split with a merge kernel
def test_every_logit_minus_inf_attends_to_nothing(seq):
    """A query head whose every logit is -inf (here K = -inf, so in float64 too) gets zeros and lse = -inf, like an
    empty request, as on CPU and in the reference; a head whose logits are +inf gets NaN (documented)."""
    P, D = 16, 64
    n = (seq + P - 1) // P
    kv = torch.ones(n, 2, P, 1, D, dtype=torch.bfloat16)
    kv[:, 0, :, :, 0] = float("-inf")
    q = torch.ones(1, 2, D, dtype=torch.bfloat16)  # head 0: q.k = -inf
    q[0, 1, 0] = -1.0  # head 1: q.k = +inf
    table = (torch.tensor([0, n], dtype=torch.int32), torch.arange(n, dtype=torch.int32),
             torch.tensor([(seq - 1) % P + 1], dtype=torch.int32))
    out, lse = decode_cuda(q, kv, table)
    ref, ref_lse = reference.decode_attention(q, kv, *table, 1 / 8)
    assert torch.equal(out[0, 0], torch.zeros(D, dtype=torch.bfloat16)) and lse[0, 0].item() == float("-inf")
    assert torch.equal(ref[0, 0], torch.zeros(D, dtype=torch.float64)) and ref_lse[0, 0].item() == float("-inf")
    assert out[0, 1].isnan().all() and lse[0, 1].isnan()


def test_v_overflow_limit_is_as_documented(gen):
    """docs/api.md: the CUDA kernel accumulates weight x V in float32 with softmax weights up to 2^8, so nothing
    overflows while 2^8 x tokens x max|V| < 3.4e38; past that a result may be inf (two tokens of V = 3e38 give inf,
    where the CPU kernel, accumulating in float64, gives 3.004e38)."""
    P, D, seq = 16, 128, 300
    n = (seq + P - 1) // P
    bound = torch.finfo(torch.float32).max / (2**8 * seq)
    kv = random_kv(n, P, 2, D, gen, scale=2.0)
    kv[:, 1] = (torch.rand(n, P, 2, D, generator=gen) * 2 - 1) * bound
    indptr, indices, last = page_table([seq], P, n, gen)
    q = torch.randn(1, 8, D, generator=gen).to(torch.bfloat16)
    out, _ = decode_cuda(q, kv, (indptr, indices, last))
    ref, _ = reference.decode_attention(q, kv, indptr, indices, last, D ** -0.5)
    assert out.isfinite().all() and rel_err(out, ref) < 1e-2

    kv = torch.zeros(1, 2, P, 1, D, dtype=torch.bfloat16)
    kv[0, 1, :2] = 3e38
    table = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
             torch.tensor([2], dtype=torch.int32))
    out, _ = decode_cuda(torch.zeros(1, 1, D, dtype=torch.bfloat16), kv, table)
    assert out.isinf().all()  # the documented limit; the CPU kernel gives kv[0, 1, 0] (test_decode.py)
