"""GPU box: the CUDA storage kernels write the CPU kernels' bytes, round-trip bit-exactly and capture in CUDA Graphs.
Skipped without a GPU."""

import pytest
import torch

import torch_zipkv
from torch_zipkv import empty_storage, ops
from torch_zipkv import format as fmt

from conftest import (bits, capture_graph, random_kv, requires_cuda, spread_layers, store, with_zeros,
                      zero_block_pages)

pytestmark = requires_cuda


@pytest.mark.parametrize("P, H, D", [(16, 8, 128), (16, 3, 64), (16, 1, 256), (32, 2, 128), (64, 4, 256)])
@pytest.mark.parametrize("allow_compress", [True, False])
def test_cuda_bytes_equal_cpu_bytes(gen, P, H, D, allow_compress):
    kv = with_zeros(random_kv(37, P, H, D, gen), gen)
    ids = torch.randperm(37, generator=gen).to(torch.int32)  # rows in random order
    cpu = empty_storage(37, P, H, D, "cpu")
    gpu = empty_storage(37, P, H, D, "cuda")
    ops.compress_pages(kv, ids, *cpu, allow_compress=allow_compress)
    ops.compress_pages(kv.cuda(), ids.cuda(), *gpu, allow_compress=allow_compress)
    for c, g in zip(cpu, gpu):
        assert torch.equal(c, g.cpu())
    out = ops.decompress_pages(gpu[0], gpu[1], ids.cuda(), P, D)
    assert torch.equal(bits(out.cpu()), bits(kv))
    apart = torch.empty(2, *kv.shape[:1], *kv.shape[2:], dtype=torch.bfloat16, device="cuda")  # every K, then every V
    ops.decompress_pages(gpu[0], gpu[1], ids.cuda(), P, D, out=apart.transpose(0, 1))
    assert torch.equal(bits(apart.transpose(0, 1).cpu()), bits(kv))


@pytest.mark.parametrize("head_dim", fmt.HEAD_DIMS)
def test_blocks_of_zeros_cuda_bytes_equal_cpu_bytes(gen, head_dim):
    """conftest.ZERO_BLOCKS (+-0 alone, with subnormals, at each zero-aware limit, with +-Inf and NaN payloads): the
    CUDA encoder picks the CPU's kind for each and writes its bytes; decompression is bit-exact."""
    kv, _ = zero_block_pages(gen, head_dim)
    n = kv.shape[0]
    ids = torch.randperm(n, generator=gen).to(torch.int32)
    cpu, gpu = empty_storage(n, 16, 1, head_dim, "cpu"), empty_storage(n, 16, 1, head_dim, "cuda")
    ops.compress_pages(kv, ids, *cpu)
    ops.compress_pages(kv.cuda(), ids.cuda(), *gpu)
    for c, g in zip(cpu, gpu):
        assert torch.equal(c, g.cpu())
    out = ops.decompress_pages(gpu[0], gpu[1], ids.cuda(), 16, head_dim)
    assert torch.equal(bits(out.cpu()), bits(kv))


def test_many_ctas_and_appending_calls_match_cpu(gen):
    """Thousands of CTAs chain their offsets through the look-back; a second call appends after the first."""
    kv = with_zeros(random_kv(3000, 16, 2, 128, gen), gen)
    cpu, gpu = empty_storage(3000, 16, 2, 128, "cpu"), empty_storage(3000, 16, 2, 128, "cuda")
    for part, allow in ((slice(0, 1000), False), (slice(1000, 3000), True)):
        ids = torch.arange(3000, dtype=torch.int32)[part]
        ops.compress_pages(kv[part], ids, *cpu, allow_compress=allow)
        ops.compress_pages(kv[part].cuda(), ids.cuda(), *gpu, allow_compress=allow)
    for c, g in zip(cpu, gpu):
        assert torch.equal(c, g.cpu())


def test_every_bf16_pattern_round_trips_on_cuda(gen):
    every = torch.arange(-32768, 32768, dtype=torch.int16)
    for p in (every, every[torch.randperm(65536, generator=gen)]):
        kv = p.view(torch.bfloat16).reshape(-1, 2, 16, 2, 128).cuda()
        ckv = torch_zipkv.compress(kv)
        assert torch.equal(bits(torch_zipkv.decompress(ckv)), bits(kv))
        assert torch.equal(ckv.data.cpu(), torch_zipkv.compress(kv.cpu()).data)


def test_real_kv_on_cuda(real_kv):
    for layer in spread_layers(real_kv):
        kv = real_kv[layer]
        g = torch_zipkv.compress(kv.cuda())
        c = torch_zipkv.compress(kv)
        assert torch.equal(g.data.cpu(), c.data) and torch.equal(g.meta.cpu(), c.meta)
        assert torch.equal(bits(torch_zipkv.decompress(g).cpu()), bits(kv))


def test_append_matches_cpu(gen):
    kv = random_kv(5, 16, 2, 64, gen)
    raw = torch.ones(5, dtype=torch.bool)
    cpu, gpu = store(kv, raw), store(kv.cuda(), raw)
    k, v = torch.randn(2, 7, 2, 64, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([0, 4, 2, 2, 3, 1, 0], dtype=torch.int32)
    slots = torch.tensor([0, 15, 7, 8, 1, 3, 9], dtype=torch.int32)
    ops.append_kv(k, v, ids, slots, 16, cpu.data, cpu.meta)
    ops.append_kv(k.cuda(), v.cuda(), ids.cuda(), slots.cuda(), 16, gpu.data, gpu.meta)
    assert torch.equal(cpu.data, gpu.data.cpu())


@pytest.mark.parametrize("allow_compress", [True, False])  # compressing (look-back) and raw (fixed offsets)
def test_overflow_stores_a_prefix_and_reports_it(gen, allow_compress):
    """CUDA cannot raise without a sync: streams past cursor[1] are not written, their rows read -1 and cursor[0]
    advances by the bytes needed, so cursor[0] > cursor[1] tells the caller."""
    kv = random_kv(64, 16, 1, 64, gen)  # 128 streams: several CTAs
    need = torch_zipkv.compress(kv, allow_compress=allow_compress).data.numel()
    stream_bytes = 1536 if allow_compress else 2048
    data, meta, cursor = empty_storage(64, 16, 1, 64, "cuda", capacity=need)
    cursor[1] = need // 2
    ops.compress_pages(kv.cuda(), torch.arange(64, dtype=torch.int32, device="cuda"), data, meta, cursor,
                       allow_compress=allow_compress)
    assert cursor.tolist() == [need, need // 2]
    offsets = meta[..., 0].flatten().cpu()
    stored = offsets >= 0
    assert stored.any() and not stored.all() and not stored[stored.nonzero().max() + 1 :].any()
    assert (offsets[stored] * 256 + stream_bytes <= need // 2).all()


def test_corrupt_meta_never_read_out_of_bounds(gen):
    kv = random_kv(3, 16, 1, 64, gen).cuda()
    ckv = torch_zipkv.compress(kv)
    bad = torch_zipkv.CompressedKV(ckv.data, ckv.meta.clone(), 16, 64)
    bad.meta[1, 0, 0, 0] = 10**8  # far past data
    out = torch_zipkv.decompress(bad)
    torch.cuda.synchronize()
    assert (bits(out[1, 0]) == -1).all()  # 0xFFFF: NaN, never a plausible value
    assert torch.equal(bits(out[[0, 2]]), bits(kv[[0, 2]])) and torch.equal(bits(out[1, 1]), bits(kv[1, 1]))


def test_storage_ops_capture_in_cuda_graph(gen):
    """compress -> append -> decompress as one graph; replays on new inputs give the new, exact results."""
    n, P, H, D = 8, 16, 2, 128
    kv = torch.empty(n, 2, P, H, D, dtype=torch.bfloat16, device="cuda")
    tok = torch.empty(2, 1, H, D, dtype=torch.bfloat16, device="cuda")
    data, meta, cursor = empty_storage(n + 1, P, H, D, "cuda")
    ids = torch.arange(n, dtype=torch.int32, device="cuda")
    open_id = torch.tensor([n], dtype=torch.int32, device="cuda")
    all_ids = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    slot = torch.tensor([5], dtype=torch.int32, device="cuda")
    out = torch.empty(n + 1, 2, P, H, D, dtype=torch.bfloat16, device="cuda")
    zero_page = torch.zeros(1, 2, P, H, D, dtype=torch.bfloat16, device="cuda")

    def body():
        cursor[:1].zero_()  # a device-side reset: no host copy inside the graph
        ops.compress_pages(zero_page, open_id, data, meta, cursor, allow_compress=False)  # the open page
        ops.compress_pages(kv, ids, data, meta, cursor)
        ops.append_kv(tok[0], tok[1], open_id, slot, P, data, meta)
        ops.decompress_pages(data, meta, all_ids, P, D, out=out)

    graph = capture_graph(body)
    for _ in range(3):
        new_kv = with_zeros(random_kv(n, P, H, D, gen), gen)
        new_tok = torch.randn(2, 1, H, D, generator=gen).to(torch.bfloat16)
        kv.copy_(new_kv)
        tok.copy_(new_tok)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(bits(out[:n].cpu()), bits(new_kv))
        expected_open = torch.zeros(2, P, H, D, dtype=torch.bfloat16)
        expected_open[:, 5] = new_tok[:, 0]
        assert torch.equal(bits(out[n].cpu()), bits(expected_open))


def test_opcheck_cuda(gen):
    kv = random_kv(4, 16, 2, 64, gen).cuda()
    ids = torch.arange(4, dtype=torch.int32, device="cuda")
    data, meta, cursor = empty_storage(4, 16, 2, 64, "cuda")
    torch.library.opcheck(torch.ops.zipkv.compress_pages.default, (kv, ids, True, data, meta, cursor))
    ckv = torch_zipkv.compress(kv)
    torch.library.opcheck(torch.ops.zipkv.decompress_pages.default, (ckv.data, ckv.meta, ids, torch.empty_like(kv)))
