# DRAM probe (session 15): does the memory system read our compressed page layout as fast as the raw one, with the
# decode kernel's access pattern but none of its compute? Each warp streams its (request, kv head) tiles like
# paged_decode does: per 16-token tile one bulk copy of the K stream and one of the V stream of a random page into a
# per-warp ring in shared memory, slots on mbarriers; the consumer only touches 16 bytes per lane per stream and
# optionally spins (clock64) before and after releasing the tile, to stand in for the rebuild and the products.
# Layouts: raw (streams of 4 KB, a page of 16 streams = 64 KB), comp (3 KB streams, 48 KB pages, as compress_pages
# packs them), comp_adj (a head's K and V streams adjacent: one 6 KB copy per tile), comp_pad (3 KB streams in 4 KB
# slots). Shape of the grid's 8K x 64 case: 64 requests x 512 pages, 8 kv heads. Usage: python3 dram_probe.py OUTDIR
import json, sys, time
import cupy as cp
import torch

SRC = r'''
extern "C" __global__ void probe(const unsigned char* __restrict__ data, const int* __restrict__ pages,
                                 int pages_per_req, int splits, int heads, int page_bytes, int stream_bytes,
                                 int adjacent, int ring_bytes, int pre, int post, unsigned long long* sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int split = blockIdx.x % splits, head = (blockIdx.x / splits) % heads, b = blockIdx.x / (splits * heads);
  const int tile_bytes = 2 * stream_bytes;
  const int slots = min(4, ring_bytes / tile_bytes);
  unsigned char* ring = smem + warp * ring_bytes;
  const unsigned bars = (unsigned)__cvta_generic_to_shared(smem + warps * ring_bytes) + warp * 32;
  const int per_split = (pages_per_req + splits - 1) / splits;
  const int c0 = split * per_split, c1 = min(pages_per_req, c0 + per_split);
  const int n_mine = max(0, (c1 - c0 - warp + warps - 1) / warps);
  if (lane == 0) {
    for (int s = 0; s < slots; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(bars + 8 * s));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  auto issue = [&](int i) {
    if (lane != 0 || i >= n_mine) return;
    const long long page = pages[b * pages_per_req + c0 + warp + i * warps];
    const unsigned char* base = data + page * page_bytes;
    const unsigned dst = (unsigned)__cvta_generic_to_shared(ring + (i % slots) * tile_bytes), bar = bars + 8 * (i % slots);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(tile_bytes) : "memory");
    if (adjacent) {
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(dst), "l"(base + 2LL * head * stream_bytes), "r"(tile_bytes), "r"(bar) : "memory");
    } else {
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(dst), "l"(base + (long long)head * stream_bytes), "r"(stream_bytes), "r"(bar) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(dst + stream_bytes), "l"(base + (long long)(heads + head) * stream_bytes), "r"(stream_bytes),
                   "r"(bar) : "memory");
    }
  };
  for (int i = 0; i < slots; ++i) issue(i);
  unsigned long long acc = 0;
  for (int i = 0; i < n_mine; ++i) {
    const unsigned bar = bars + 8 * (i % slots), parity = (i / slots) & 1;
    unsigned done = 0;
    while (!done)
      asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                   : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    const unsigned char* t = ring + (i % slots) * tile_bytes;
    const uint4 k = *reinterpret_cast<const uint4*>(t + 16 * lane);
    const uint4 v = *reinterpret_cast<const uint4*>(t + stream_bytes + 16 * lane);
    acc += k.x ^ k.w ^ v.y ^ v.z;
    if (pre) { const long long c = clock64(); while (clock64() - c < pre) {} }
    __syncwarp();
    issue(i + slots);
    if (post) { const long long c = clock64(); while (clock64() - c < post) {} }
  }
  if (acc == 0x1234567ULL) sink[0] = acc;
}
'''

def main(out):
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    kern = mod.get_function("probe")
    B, H, ppr = 64, 8, 512
    n = B * ppr
    g = torch.Generator().manual_seed(0)
    pages = torch.randperm(n, generator=g).to(torch.int32).cuda()
    data = torch.randint(0, 255, (n * 65536,), dtype=torch.uint8, device="cuda")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sink = torch.zeros(1, dtype=torch.int64, device="cuda")
    layouts = {"raw": (65536, 4096, 0), "comp": (49152, 3072, 0), "comp_adj": (49152, 3072, 1),
               "comp_pad": (65536, 3072, 0)}
    ring = 16640
    rows = []
    for warps, splits in ((4, 3), (6, 1), (4, 1)):
        smem = warps * ring + warps * 32
        kern.max_dynamic_shared_size_bytes = smem
        for pre, post in ((0, 0), (600, 900), (1200, 1800)):
            for name, (page_bytes, stream_bytes, adj) in layouts.items():
                args = (cp.uint64(data.data_ptr()), cp.uint64(pages.data_ptr()), cp.int32(ppr), cp.int32(splits),
                        cp.int32(H), cp.int32(page_bytes), cp.int32(stream_bytes), cp.int32(adj), cp.int32(ring),
                        cp.int32(pre), cp.int32(post), cp.uint64(sink.data_ptr()))
                grid = (B * H * splits,)
                times = []
                for it in range(31):
                    flush.sum(dtype=torch.int32)  # read flush, as bench_decode.py
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    kern(grid, (32 * warps,), args, shared_mem=smem)
                    e.record()
                    torch.cuda.synchronize()
                    if it: times.append(s.elapsed_time(e) * 1e3)
                us = sorted(times)[len(times) // 2]
                nbytes = n * H * 2 * stream_bytes
                row = dict(warps=warps, splits=splits, pre=pre, post=post, layout=name, us=round(us, 1),
                           bytes=nbytes, tbps=round(nbytes / us / 1e6, 3))
                print(row, flush=True)
                rows.append(row)
    with open(f"{out}/dram_probe.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "ring_bytes_per_warp": ring, "rows": rows}, f, indent=1)

if __name__ == "__main__":
    main(sys.argv[1])
