// The fused decode-attention kernel of zipkv::paged_decode: reads compressed and raw blocks of one paged cache in a
// single pass, copies them to shared memory still compressed (cp.async), rebuilds BF16 in registers right before
// the tensor-core instruction, and keeps an online softmax in float32. Split-KV (flash-decoding) with a merge kernel.
//
// Work split: one CTA per (request, kv head, split). Its 4 warps take the split's 16-token tiles round-robin; each
// warp runs its own cp.async pipeline of kStages tiles (K and V blocks of a tile land in one stage) and its own
// online softmax; the warps' states merge in shared memory at the end.
//
// Tensor-core mapping (mma.sync.m16n8k16, bf16 in, fp32 accumulate; lane = 4 g + t):
//   S = Q K^T: M = the GQA group's query rows (row g, and g + 8 when the group exceeds 8), N = 8 tokens, K = 16 dims.
//     The B operand is K token-major: format.h stores exactly the lane's registers together (K positions).
//   O = P V:   M = query rows, N = 8 dims, K = 16 tokens; P comes straight from S's accumulators (FlashAttention-2),
//     the B operand is V dim-major (V positions of format.h).
// A lane's 16 values of a block are 16 low bytes + 8 code bytes (compressed) or 32 bytes (raw); they rebuild into
// 8 bf16x2 registers in position order with 2 code decodes (format.h decode_high_bytes) and 8 byte permutes.
//
// Bad device contents cannot raise without a host sync, so they poison the result instead of being read: a page id
// out of range, a missing stream, an invalid descriptor or a stream past the end of data turns its tile into NaN;
// an inconsistent page-table entry (indptr, last_page_len) turns the request's output and lse into NaN.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "../format.h"

namespace zipkv::cuda::decode {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kSlotBytes = kRawBlockBytes;  // every block gets a raw-sized slot in its stage
constexpr float kLog2e = 1.4426950408889634f;
constexpr uint8_t kDescBad = 0xFF;  // not a format descriptor: the block must not be read; it decodes to NaN

struct Params {
  const uint16_t* q;         // [batch, Hq, D]
  const uint8_t* data;       // [data_bytes]
  const int32_t* meta;       // [num_pages, 2, H, words]
  const int32_t* kv_indptr;  // [batch + 1]
  const int32_t* kv_indices; // [nnz]
  const int32_t* kv_last;    // [batch]
  uint16_t* out;             // [batch, Hq, D]           (num_splits == 1)
  float* lse;                // [batch, Hq] or nullptr   (num_splits == 1), natural log
  float* part_o;             // [splits, batch, Hq, D]   (num_splits > 1), normalised per split
  float* part_lse;           // [splits, batch, Hq]      (num_splits > 1), log2 domain
  int64_t data_bytes, num_pages, nnz;
  int batch, Hq, H, group, page_size, words, num_splits;
  float scale_log2;  // sm_scale * log2(e): the softmax runs in base 2
};

// Geometry and pipeline depth per head_dim. A stage holds one tile's K and V blocks (raw-sized slots); the depth
// keeps >= 2 tiles in flight per warp while leaving room for 1-3 CTAs per SM.
template <int D>
struct Cfg {
  static constexpr int kBlocks = D / kBlockDims;  // blocks per tile, of K and of V each
  static constexpr int kStages = D == 64 ? 4 : 3;
  static constexpr int kStageBytes = 2 * kBlocks * kSlotBytes;
  static constexpr int kPipeBytes = kWarps * kStages * kStageBytes;
  static constexpr int kDescBytes = kWarps * kStages * 32 * 16;  // one uint4 of descriptors per lane and stage
  static constexpr int kSmemBytes = kPipeBytes + kDescBytes;
  static constexpr int kMinCtas = D == 64 ? 3 : D == 128 ? 2 : 1;
  static_assert(kWarps * 16 * D * 4 + kWarps * 16 * 2 * 4 <= kPipeBytes, "warp merge reuses the pipeline buffers");
};

// ---------------------------------------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// d[0..1] (row g) and, when kHalves == 2, d[2..3] (row g + 8) += A * B for one m16n8k16 step.
// With one half the upper rows are zero and their results are discarded, so only 2 accumulators stay live.
template <int kHalves>
__device__ __forceinline__ void mma(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  if constexpr (kHalves == 2) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    float u0, u1;
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(u0), "=f"(u1)
        : "r"(a[0]), "r"(0u), "r"(a[2]), "r"(0u), "r"(b0), "r"(b1), "f"(d[0]), "f"(d[1]), "f"(0.f), "f"(0.f));
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Bytes of x that are invalid descriptors (0x81..0xFF) keep their top bit; the rest are 0.
__device__ __forceinline__ uint32_t invalid_desc_bytes(uint32_t x) {
  return x & 0x80808080u & ((x & 0x7F7F7F7Fu) + 0x7F7F7F7Fu);
}
// Bit j set when byte j of x is 0x80 or above (raw, or invalid and caught separately).
__device__ __forceinline__ uint32_t raw_bits(uint32_t x) {
  x &= 0x80808080u;
  return ((x >> 7) | (x >> 14) | (x >> 21) | (x >> 28)) & 0xF;
}

// ---------------------------------------------------------------------------------------------- block rebuild
// The lane's 16 values of a block (in its stage slot) as 8 bf16x2 registers in position order. Raw slots hold the
// lane's first 16 bytes at 16 lane and its last 16 at 512 + 16 lane (bank-conflict free); compressed slots hold the
// low bytes at 16 lane and the code bytes at 512 + 8 lane.
__device__ __forceinline__ void rebuild(const uint8_t* slot, uint8_t desc, int lane, uint32_t r[8]) {
  if (desc == kDescRaw) {
    const uint4 a = *reinterpret_cast<const uint4*>(slot + 16 * lane);
    const uint4 b = *reinterpret_cast<const uint4*>(slot + kLowBytes + 16 * lane);
    r[0] = a.x, r[1] = a.y, r[2] = a.z, r[3] = a.w, r[4] = b.x, r[5] = b.y, r[6] = b.z, r[7] = b.w;
  } else if (desc < kDescRaw) {
    const uint4 lo = *reinterpret_cast<const uint4*>(slot + 16 * lane);
    const uint2 cw = *reinterpret_cast<const uint2*>(slot + kLowBytes + 8 * lane);
    uint32_t h[4];
    decode_high_bytes(cw.x, desc, &h[0], &h[1]);
    decode_high_bytes(cw.y, desc, &h[2], &h[3]);
    const uint32_t l[4] = {lo.x, lo.y, lo.z, lo.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // bytes (lo0, hi0, lo1, hi1) and (lo2, hi2, lo3, hi3)
      r[2 * j] = __byte_perm(l[j], h[j], 0x5140);
      r[2 * j + 1] = __byte_perm(l[j], h[j], 0x7362);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) r[j] = 0xFFFFFFFFu;  // NaN: the block was refused
  }
}

// ---------------------------------------------------------------------------------------------- tile addressing
// What the issue step needs about one tile's two streams (K, V) of this kv head. It is loaded one iteration early
// and only stored here, not used, so the loads' latency hides under the current tile's math.
template <int D>
struct TileMeta {
  static constexpr int kDescWords = Cfg<D>::kBlocks >= 4 ? Cfg<D>::kBlocks / 4 : 1;
  int32_t start[2];              // meta word 0 of the K and V rows (256-byte units; < 0: no stream)
  uint32_t desc[2][kDescWords];  // the descriptor words holding the tile's blocks
  uint32_t raw_before[2];        // raw (or invalid) blocks of the stream in the words before those
  bool bad;                      // page id out of range, or an invalid descriptor in the words before
};

// Loads a tile's meta. For page_size > 16 the earlier descriptor words of the stream are counted here (L1/L2 hits:
// the page's other tiles read the same row).
template <int D>
__device__ __forceinline__ void load_tile_meta(const Params& p, int head, int32_t page, int tile_in_page,
                                               TileMeta<D>& m) {
  constexpr int kB = Cfg<D>::kBlocks;
  m.bad = page < 0 || page >= p.num_pages;
  const int first_word = tile_in_page * kB / 4;  // the descriptor word holding the tile's first block
#pragma unroll
  for (int kv = 0; kv < 2; ++kv) {
    m.start[kv] = -1, m.raw_before[kv] = 0;
#pragma unroll
    for (int w = 0; w < TileMeta<D>::kDescWords; ++w) m.desc[kv][w] = 0;
    if (m.bad) continue;  // warp-uniform; never read meta rows that do not exist
    const uint32_t* row = reinterpret_cast<const uint32_t*>(p.meta + ((int64_t{page} * 2 + kv) * p.H + head) * p.words);
    m.start[kv] = static_cast<int32_t>(__ldg(row));
#pragma unroll
    for (int w = 0; w < TileMeta<D>::kDescWords; ++w) m.desc[kv][w] = __ldg(row + 1 + first_word + w);
    uint32_t inval = 0;
    for (int w = 0; w < first_word; ++w) {
      const uint32_t x = __ldg(row + 1 + w);
      m.raw_before[kv] += __popc(x & 0x80808080u);
      inval |= invalid_desc_bytes(x);
    }
    m.bad |= inval != 0;
  }
}

// Issues the cp.async copies of one tile into a stage and records its descriptors (kDescBad for refused blocks) in
// the lane's descriptor slot. Every lane copies exactly the bytes it will read back, so no barrier is needed.
template <int D>
__device__ __forceinline__ void issue_tile(const Params& p, int tile_in_page, const TileMeta<D>& m, uint8_t* stage,
                                           uint4* desc_slot, int lane) {
  constexpr int kB = Cfg<D>::kBlocks, kW = TileMeta<D>::kDescWords;
  uint8_t descs[2 * kB];
#pragma unroll
  for (int kv = 0; kv < 2; ++kv) {
    uint32_t dw[kW], inval = 0, raw = 0, before = m.raw_before[kv];
#pragma unroll
    for (int w = 0; w < kW; ++w) dw[w] = m.desc[kv][w];
    if constexpr (kB == 2) {  // the tile is half of a descriptor word
      if (tile_in_page % 2) {
        before += __popc(dw[0] & 0x8080u);
        inval |= invalid_desc_bytes(dw[0] & 0xFFFFu);
        dw[0] >>= 16;
      } else {
        dw[0] &= 0xFFFFu;
      }
    }
#pragma unroll
    for (int w = 0; w < kW; ++w) {
      inval |= invalid_desc_bytes(dw[w]);
      raw |= raw_bits(dw[w]) << (4 * w);
    }
    const int first = tile_in_page * kB;
    const int64_t start = static_cast<int64_t>(m.start[kv]) * kStreamAlign;
    const int64_t end = start + int64_t{kCompBlockBytes} * (first + kB) +
                        int64_t{kRawBlockBytes - kCompBlockBytes} * (before + __popc(raw));
    const bool ok = !m.bad && m.start[kv] >= 0 && inval == 0 && end <= p.data_bytes;
#pragma unroll
    for (int c = 0; c < kB; ++c) {
      const uint8_t desc = static_cast<uint8_t>(dw[c / 4] >> (8 * (c % 4)));
      descs[kv * kB + c] = ok ? desc : kDescBad;
      if (!ok) continue;
      const int64_t off = start + int64_t{kCompBlockBytes} * (first + c) +
                          int64_t{kRawBlockBytes - kCompBlockBytes} * (before + __popc(raw & ((1u << c) - 1)));
      const uint8_t* src = p.data + off;
      const uint32_t dst = smem_addr(stage + (kv * kB + c) * kSlotBytes);
      if (desc == kDescRaw) {
        cp_async16(dst + 16 * lane, src + 32 * lane);
        cp_async16(dst + kLowBytes + 16 * lane, src + 32 * lane + 16);
      } else {
        cp_async16(dst + 16 * lane, src + 16 * lane);
        cp_async8(dst + kLowBytes + 8 * lane, src + kLowBytes + 8 * lane);
      }
    }
  }
  uint32_t packed[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < 2 * kB; ++j) packed[j / 4] |= static_cast<uint32_t>(descs[j]) << (8 * (j % 4));
  *desc_slot = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

__device__ __forceinline__ uint8_t desc_at(const uint4& d, int j) {
  const uint32_t w = j < 4 ? d.x : j < 8 ? d.y : j < 12 ? d.z : d.w;
  return static_cast<uint8_t>(w >> (8 * (j % 4)));
}

// ---------------------------------------------------------------------------------------------- the kernel
template <int D, int kHalves>
__global__ void __launch_bounds__(kThreads, Cfg<D>::kMinCtas) paged_decode_kernel(const Params p) {
  using C = Cfg<D>;
  constexpr int kB = C::kBlocks, kS = C::kStages, kAcc = 2 * kHalves;
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int split = blockIdx.x % p.num_splits;
  const int head = (blockIdx.x / p.num_splits) % p.H;
  const int b = blockIdx.x / (p.num_splits * p.H);
  const int64_t qrow0 = static_cast<int64_t>(b) * p.Hq + static_cast<int64_t>(head) * p.group;

  // The request's page-table entries; an inconsistent one poisons the request.
  const int32_t begin = p.kv_indptr[b], end = p.kv_indptr[b + 1];
  const int32_t npages = end - begin, last = npages > 0 ? p.kv_last[b] : 0;
  const bool bad_request =
      begin < 0 || npages < 0 || end > p.nnz || (npages > 0 && (last < 1 || last > p.page_size));
  const int64_t seq_len = bad_request || npages == 0 ? 0 : static_cast<int64_t>(npages - 1) * p.page_size + last;
  const int n_tiles = static_cast<int>((seq_len + kTileTokens - 1) / kTileTokens);
  const int per_split = ((n_tiles + p.num_splits - 1) / p.num_splits + kWarps - 1) / kWarps * kWarps;
  const int chunk_begin = min(split * per_split, n_tiles), chunk_end = min(chunk_begin + per_split, n_tiles);
  const int n_mine = max(0, (chunk_end - chunk_begin - warp + kWarps - 1) / kWarps);  // this warp's tiles
  const int tiles_per_page = p.page_size / kTileTokens;
  auto tile_of = [&](int i) { return chunk_begin + warp + i * kWarps; };

  // Q fragments (A operand): row g (and g + 8), dims 16 kc + {2t, 2t+1} and 16 kc + {2t+8, 2t+9}.
  uint32_t qa[D / 16][4];
#pragma unroll
  for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = g + 8 * (j % 2), dim = 16 * kc + 2 * t + 8 * (j / 2);
      qa[kc][j] = row < p.group && (kHalves == 2 || j % 2 == 0)
                      ? *reinterpret_cast<const uint32_t*>(p.q + (qrow0 + row) * D + dim)
                      : 0u;
    }
  }

  uint8_t* pipe = smem + warp * kS * C::kStageBytes;
  uint4* desc_slots = reinterpret_cast<uint4*>(smem + C::kPipeBytes) + warp * kS * 32 + lane;

  // Page ids of the warp's tiles, 32 at a time, one per lane; fetched with shuffles.
  int cached_base = -1;
  int32_t cached_page = 0;
  auto page_of = [&](int i) {
    const int base = i / 32 * 32;
    if (base != cached_base) {
      cached_base = base;
      const int k = base + lane;
      cached_page = k < n_mine ? __ldg(p.kv_indices + begin + tile_of(k) / tiles_per_page) : 0;
    }
    return __shfl_sync(0xFFFFFFFFu, cached_page, i % 32);
  };

  TileMeta<D> next;
  auto prefetch = [&](int i) {
    if (i < n_mine) load_tile_meta<D>(p, head, page_of(i), tile_of(i) % tiles_per_page, next);
  };
  auto issue = [&](int i) {
    if (i < n_mine) issue_tile<D>(p, tile_of(i) % tiles_per_page, next, pipe + (i % kS) * C::kStageBytes,
                                  desc_slots + (i % kS) * 32, lane);
    cp_async_commit();
  };

  float o[D / 8][kAcc];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int j = 0; j < kAcc; ++j) o[n][j] = 0.f;
  float m_run[kHalves], l_run[kHalves];
#pragma unroll
  for (int r = 0; r < kHalves; ++r) m_run[r] = -INFINITY, l_run[r] = 0.f;

  prefetch(0);
#pragma unroll
  for (int s = 0; s < kS - 1; ++s) {
    issue(s);
    prefetch(s + 1);
  }

  for (int i = 0; i < n_mine; ++i) {
    issue(i + kS - 1);  // `next` holds tile i + kS - 1's meta
    prefetch(i + kS);
    cp_async_wait<kS - 1>();  // tile i has landed (this lane's copies; the lane reads only those)

    const uint8_t* stage = pipe + (i % kS) * C::kStageBytes;
    const uint4 descs = desc_slots[(i % kS) * 32];
    const int64_t left = seq_len - int64_t{kTileTokens} * tile_of(i);
    const int valid = left < kTileTokens ? static_cast<int>(left) : kTileTokens;

    // S = Q K^T for 16 tokens: s[h][.] holds tokens 8 h + 2t, 8 h + 2t + 1 (row g; then row g + 8).
    float s[2][kAcc];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < kAcc; ++j) s[h][j] = 0.f;
#pragma unroll
    for (int c = 0; c < kB; ++c) {
      uint32_t kr[8];
      rebuild(stage + c * kSlotBytes, desc_at(descs, c), lane, kr);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int c2 = 0; c2 < 2; ++c2) mma<kHalves>(s[h], qa[2 * c + c2], kr[4 * h + 2 * c2], kr[4 * h + 2 * c2 + 1]);
    }

    // Online softmax (base 2), per row half; the 4 lanes of a row (t = 0..3) share its max.
    uint32_t pa[4];
#pragma unroll
    for (int r = 0; r < kHalves; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int tok = 8 * h + 2 * t + j;
          float& x = s[h][2 * r + j];
          x = tok < valid ? x * p.scale_log2 : -INFINITY;
          mx = fmaxf(mx, x);
        }
      mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 2));
      const float m_new = fmaxf(m_run[r], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // all masked so far: avoid (-inf) - (-inf)
      const float alpha = exp2f(m_run[r] - m_use);
      m_run[r] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          s[h][2 * r + j] = exp2f(s[h][2 * r + j] - m_use);
          sum += s[h][2 * r + j];
        }
      l_run[r] = l_run[r] * alpha + sum;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) o[n][2 * r] *= alpha, o[n][2 * r + 1] *= alpha;
      pa[r] = pack_bf16(s[0][2 * r], s[0][2 * r + 1]);      // row g (+8 r), tokens 2t, 2t + 1
      pa[r + 2] = pack_bf16(s[1][2 * r], s[1][2 * r + 1]);  // tokens 2t + 8, 2t + 9
    }
    if constexpr (kHalves == 1) pa[1] = pa[3] = 0u;

    // Tokens past the end of a partial tile may hold anything (even NaN bit patterns): zero their V values, as
    // 0 * NaN would poison the product although their probability is 0.
    uint32_t vmask[2] = {0xFFFFFFFFu, 0xFFFFFFFFu};
    if (valid < kTileTokens) {
#pragma unroll
      for (int j = 0; j < 2; ++j)
        vmask[j] = (2 * t + 8 * j < valid ? 0x0000FFFFu : 0u) | (2 * t + 8 * j + 1 < valid ? 0xFFFF0000u : 0u);
    }
    // O += P V: block c's lane registers 2 n and 2 n + 1 are dims 32 c + 8 n + g, tokens {2t, 2t+1} and {2t+8, 2t+9}.
#pragma unroll
    for (int c = 0; c < kB; ++c) {
      uint32_t vr[8];
      rebuild(stage + (kB + c) * kSlotBytes, desc_at(descs, kB + c), lane, vr);
#pragma unroll
      for (int n = 0; n < 4; ++n) mma<kHalves>(o[4 * c + n], pa, vr[2 * n] & vmask[0], vr[2 * n + 1] & vmask[1]);
    }
  }
  cp_async_wait<0>();

  // Merge the warps' states (the pipeline buffers are free now): per row, m and l, and the unnormalised O.
#pragma unroll
  for (int r = 0; r < kHalves; ++r) {
    l_run[r] += __shfl_xor_sync(0xFFFFFFFFu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xFFFFFFFFu, l_run[r], 2);
  }
  __syncthreads();
  float* ow = reinterpret_cast<float*>(smem);  // [kWarps][16][D]
  float* ml = ow + kWarps * 16 * D;            // [kWarps][16][2]
#pragma unroll
  for (int r = 0; r < kHalves; ++r) {
    const int row = g + 8 * r;
    float* dst = ow + (warp * 16 + row) * D;
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      *reinterpret_cast<float2*>(dst + 8 * n + 2 * t) = make_float2(o[n][2 * r], o[n][2 * r + 1]);
    if (t == 0) ml[(warp * 16 + row) * 2] = m_run[r], ml[(warp * 16 + row) * 2 + 1] = l_run[r];
  }
  __syncthreads();

  const float nan = __int_as_float(0x7FFFFFFF);
  for (int x = threadIdx.x; x < p.group * D; x += kThreads) {
    const int row = x / D, dim = x % D;
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, ml[(w * 16 + row) * 2]);
    float l = 0.f, acc = 0.f;
    if (m != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(ml[(w * 16 + row) * 2] - m);
        l += ml[(w * 16 + row) * 2 + 1] * f;
        acc += ow[(w * 16 + row) * D + dim] * f;
      }
    }
    // l > 0 or NaN from here on: a NaN anywhere (refused block) propagates to the output.
    const float val = bad_request ? nan : l == 0.f ? 0.f : acc / l;
    const float lse2 = bad_request ? nan : l == 0.f ? -INFINITY : m + log2f(l);
    const int64_t qrow = qrow0 + row;
    if (p.num_splits == 1) {
      const __nv_bfloat16 v = __float2bfloat16_rn(val);
      p.out[qrow * D + dim] = *reinterpret_cast<const uint16_t*>(&v);
      if (p.lse != nullptr && dim == 0) p.lse[qrow] = lse2 / kLog2e;
    } else {
      const int64_t rows = static_cast<int64_t>(p.batch) * p.Hq;
      p.part_o[(split * rows + qrow) * D + dim] = val;
      if (dim == 0) p.part_lse[split * rows + qrow] = lse2;
    }
  }
}

// Combines the splits of each query row: out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse).
template <int D>
__global__ void __launch_bounds__(D) merge_splits_kernel(const Params p) {
  const int64_t row = blockIdx.x, rows = static_cast<int64_t>(p.batch) * p.Hq;
  const int dim = threadIdx.x;
  float m = -INFINITY;
  bool nan = false;
  for (int s = 0; s < p.num_splits; ++s) {
    const float x = p.part_lse[s * rows + row];
    nan |= x != x;
    m = fmaxf(m, x);
  }
  float l = 0.f, acc = 0.f;
  if (m != -INFINITY && !nan) {
    for (int s = 0; s < p.num_splits; ++s) {
      const float x = p.part_lse[s * rows + row];
      if (x == -INFINITY) continue;  // an empty split: its partial O was never written
      const float f = exp2f(x - m);
      l += f;
      acc += f * p.part_o[(s * rows + row) * D + dim];
    }
  }
  const float qnan = __int_as_float(0x7FFFFFFF);
  const float val = nan ? qnan : l == 0.f ? 0.f : acc / l;
  const __nv_bfloat16 v = __float2bfloat16_rn(val);
  p.out[row * D + dim] = *reinterpret_cast<const uint16_t*>(&v);
  if (p.lse != nullptr && dim == 0) p.lse[row] = nan ? qnan : l == 0.f ? -INFINITY : (m + log2f(l)) / kLog2e;
}

// Host side, one instantiation per head_dim (paged_decode_hd*.cu): occupancy of the kernel, and the launches.
template <int D>
int ctas_per_sm(int group);
template <int D>
void launch(const Params& p, cudaStream_t stream);

}  // namespace zipkv::cuda::decode
