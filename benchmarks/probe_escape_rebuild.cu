// Streaming probe for issue 21's next format candidate (docs/FORMAT.md, Design notes): how fast can warps rebuild
// BF16 from format v5's 12-bit blocks, and from an 11-bit block (2-bit codes into a 4-entry table) whose escape list
// is patched in shared memory? No attention: each lane rebuilds its 16 values of a block into the 8 bf16x2 words an
// mma would take and folds them into a checksum, so only the loads and the rebuild are timed. Raw BF16 read the same
// way is the reference. Two residencies: as many warps as fit, and 12 warps an SM (the decode kernel's at d 64).
//
//   nvcc -O3 -arch=sm_90a -std=c++20 --expt-relaxed-constexpr -o /tmp/probe benchmarks/probe_escape_rebuild.cu
//   /tmp/probe > probe_escape_rebuild.json
//
// The 11-bit block (a sketch, not a format): 512 low bytes as in v5, 128 bytes of codes (lane L: the uint32 at
// 512 + 4L; nibble k holds the code of position k in bits 0-1 and of position 8 + k in bits 2-3), 64 bytes of signs
// (lane L: the uint16 at 640 + 2L, bit j = position j), 704 bytes in all, 16-byte aligned; its escapes (uint16:
// position << 7 | exponent pair) in a separate list, as a page's gathered lists would be.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "../csrc/cuda/block_io.cuh"

namespace {

constexpr int kBlocks = 1 << 21;  // 2 Mi blocks: 2 GiB of BF16, 40x the L2

#define CHECK(x)                                                                            \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

// The checksum every variant folds its 8 words into (3-input XORs): it keeps the rebuild live at little cost.
__device__ __forceinline__ uint32_t fold(const uint32_t w[8]) {
  return (w[0] ^ w[1] ^ w[2]) ^ (w[3] ^ w[4] ^ w[5]) ^ (w[6] ^ w[7]);
}

__global__ void probe_raw(const uint8_t* __restrict__ data, int n, uint32_t* out) {
  const int lane = threadIdx.x % 32, warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int warps = gridDim.x * blockDim.x / 32;
  uint32_t acc = 0;
  for (int b = warp; b < n; b += warps) {
    const uint8_t* blk = data + int64_t{b} * 1024;
    const uint4 x = __ldcs(reinterpret_cast<const uint4*>(blk + 16 * lane));
    const uint4 y = __ldcs(reinterpret_cast<const uint4*>(blk + 512 + 16 * lane));
    const uint32_t w[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
    acc ^= fold(w);
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

__global__ void probe_v5(const uint8_t* __restrict__ data, const uint8_t* __restrict__ desc, int n, uint32_t* out) {
  const int lane = threadIdx.x % 32, warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int warps = gridDim.x * blockDim.x / 32;
  uint32_t acc = 0;
  for (int b = warp; b < n; b += warps) {
    const uint8_t* blk = data + int64_t{b} * 768;
    const uint4 low = __ldcs(reinterpret_cast<const uint4*>(blk + 16 * lane));
    const uint2 codes = __ldcs(reinterpret_cast<const uint2*>(blk + 512 + 8 * lane));
    uint32_t t0, t1, w[8];
    zipkv::code_table(__ldg(desc + b), &t0, &t1);
    zipkv::cuda::decode_lane(low, codes, t0, t1, w);
    acc ^= fold(w);
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

// kPatch = false: the same 11-bit rebuild without the escape patch (what the patch costs is the difference).
template <bool kPatch>
__global__ void probe_11e(const uint8_t* __restrict__ data, const uint8_t* __restrict__ desc,
                          const uint16_t* __restrict__ esc, const int* __restrict__ esc_start, int n, uint32_t* out) {
  __shared__ __align__(16) uint8_t planes[8][2][512];  // per warp (<= 8 a CTA), two used in turn: no sync before reuse
  const int lane = threadIdx.x % 32, wib = threadIdx.x / 32, warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const int warps = gridDim.x * blockDim.x / 32;
  uint32_t acc = 0;
  int turn = 0;
  for (int b = warp; b < n; b += warps) {
    const uint8_t* blk = data + int64_t{b} * 704;
    const uint4 low = __ldcs(reinterpret_cast<const uint4*>(blk + 16 * lane));
    const uint32_t c = __ldcs(reinterpret_cast<const uint32_t*>(blk + 512 + 4 * lane));
    const uint32_t s = __ldcs(reinterpret_cast<const uint16_t*>(blk + 640 + 2 * lane));
    const uint32_t t = __ldg(desc + b) * 0x01010101u + 0x03020100u;  // 4-entry table, bit 7 of each entry clear
    const uint32_t s0 = c & 0x33333333u, s1 = (c >> 2) & 0x33333333u;
    uint32_t h[4] = {zipkv::byte_select(t, t, s0), zipkv::byte_select(t, t, s0 >> 16), zipkv::byte_select(t, t, s1),
                     zipkv::byte_select(t, t, s1 >> 16)};
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = zipkv::take_signs(h[i], ((s >> (4 * i)) & 0xFu) * 0x10204080u);
    if constexpr (kPatch) {
      uint8_t* plane = planes[wib][turn];
      turn ^= 1;
      *reinterpret_cast<uint4*>(plane + 16 * lane) = make_uint4(h[0], h[1], h[2], h[3]);
      const int start = __ldg(esc_start + b), k = __ldg(esc_start + b + 1) - start;
      __syncwarp();
      if (lane < k) {
        const uint32_t e = __ldcs(esc + start + lane);
        uint8_t* p = plane + (e >> 7);
        *p = static_cast<uint8_t>((*p & 0x80u) | (e & 0x7Fu));
      }
      __syncwarp();
      const uint4 r = *reinterpret_cast<const uint4*>(plane + 16 * lane);
      h[0] = r.x, h[1] = r.y, h[2] = r.z, h[3] = r.w;
    }
    const uint32_t lw[4] = {low.x, low.y, low.z, low.w};
    uint32_t w[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      w[2 * i] = __byte_perm(lw[i], h[i], 0x5140);
      w[2 * i + 1] = __byte_perm(lw[i], h[i], 0x7362);
    }
    acc ^= fold(w);
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

__global__ void fill(uint32_t* p, size_t words, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < words; i += size_t{gridDim.x} * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 0x9E3779B1u ^ seed;
    x ^= x >> 15, x *= 0x2C1B3C6Du, x ^= x >> 12;
    p[i] = x;
  }
}

template <typename F>
float median_ms(F&& launch) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  launch();  // warm-up
  std::vector<float> t;
  for (int i = 0; i < 15; ++i) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  CHECK(cudaGetLastError());
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount, n = kBlocks;
  std::mt19937_64 rng(0);
  // Escapes: 0..26 a block (13 on average, as on SmolLM2's real KV), distinct positions.
  std::vector<int> start(n + 1, 0);
  std::vector<uint16_t> esc;
  for (int b = 0; b < n; ++b) {
    const int k = static_cast<int>(rng() % 27);
    for (int i = 0; i < k; ++i) esc.push_back(static_cast<uint16_t>(((i * 37 + b) % 512) << 7 | (rng() % 128)));
    start[b + 1] = start[b] + k;
  }
  std::vector<uint8_t> desc(n);
  for (auto& d : desc) d = static_cast<uint8_t>(rng() % 120);
  const size_t raw_bytes = size_t{1024} * n, v5_bytes = size_t{768} * n, e11_bytes = size_t{704} * n;

  uint8_t *d_raw, *d_v5, *d_e11, *d_desc;
  uint16_t* d_esc;
  int* d_start;
  uint32_t* d_out;
  CHECK(cudaMalloc(&d_raw, raw_bytes));
  CHECK(cudaMalloc(&d_v5, v5_bytes));
  CHECK(cudaMalloc(&d_e11, e11_bytes));
  CHECK(cudaMalloc(&d_desc, n));
  CHECK(cudaMalloc(&d_esc, esc.size() * 2));
  CHECK(cudaMalloc(&d_start, (n + 1) * sizeof(int)));
  CHECK(cudaMalloc(&d_out, static_cast<size_t>(sms) * 64 * 32 * 4));
  fill<<<sms * 8, 256>>>(reinterpret_cast<uint32_t*>(d_raw), raw_bytes / 4, 1);  // random bytes: timing only
  fill<<<sms * 8, 256>>>(reinterpret_cast<uint32_t*>(d_v5), v5_bytes / 4, 2);
  fill<<<sms * 8, 256>>>(reinterpret_cast<uint32_t*>(d_e11), e11_bytes / 4, 3);
  CHECK(cudaGetLastError());
  CHECK(cudaMemcpy(d_desc, desc.data(), n, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_esc, esc.data(), esc.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_start, start.data(), (n + 1) * sizeof(int), cudaMemcpyHostToDevice));

  const double bf16 = 1024.0 * n;
  const double read_raw = bf16, read_v5 = 768.0 * n + n,
               read_11 = 704.0 * n + n + 4.0 * (n + 1), read_11e = read_11 + 2.0 * esc.size();
  std::printf("{\"probe\": \"probe_escape_rebuild\", \"device\": \"%s\", \"blocks\": %d, \"mean_escapes\": %.2f,\n",
              prop.name, n, static_cast<double>(esc.size()) / n);
  std::printf(" \"note\": \"bf16_TBps = BF16 bytes delivered per second; read_TBps = bytes loaded per second\",\n");
  std::printf(" \"runs\": [\n");
  const struct {
    const char* name;
    int grid_per_sm, threads;
  } layouts[] = {{"many warps (8 CTAs of 8 an SM, as many as fit)", 8, 256}, {"12 warps an SM", 3, 128}};
  bool first = true;
  for (const auto& l : layouts) {
    const int grid = sms * l.grid_per_sm, th = l.threads;
    const float t_raw = median_ms([&] { probe_raw<<<grid, th>>>(d_raw, n, d_out); });
    const float t_v5 = median_ms([&] { probe_v5<<<grid, th>>>(d_v5, d_desc, n, d_out); });
    const float t_11 = median_ms([&] { probe_11e<false><<<grid, th>>>(d_e11, d_desc, d_esc, d_start, n, d_out); });
    const float t_11e = median_ms([&] { probe_11e<true><<<grid, th>>>(d_e11, d_desc, d_esc, d_start, n, d_out); });
    const struct {
      const char* name;
      float ms;
      double read;
    } rows[] = {{"raw", t_raw, read_raw}, {"v5 12-bit", t_v5, read_v5}, {"11-bit, no patch", t_11, read_11},
                {"11-bit + escapes patched in shared memory", t_11e, read_11e}};
    for (const auto& r : rows) {
      std::printf("%s  {\"layout\": \"%s\", \"variant\": \"%s\", \"us\": %.1f, \"bf16_TBps\": %.3f, \"read_TBps\": %.3f}",
                  first ? "" : ",\n", l.name, r.name, r.ms * 1e3, bf16 / r.ms / 1e9, r.read / r.ms / 1e9);
      first = false;
    }
  }
  std::printf("\n ]}\n");
  return 0;
}
