// The kernel of zipkv::paged_prefill: attention of many query tokens per request over compressed and raw pages.
//
// Prefill is compute-bound, so the KV is rebuilt once per CTA into BF16 shared memory and read from there by the
// tensor cores (the answer FlashInfer gave for FP8 KV: rebuilding per fragment inside the MMA loop made its FP8
// prefill slower than BF16): at head_dim 128 by warpgroup MMAs from 128-byte-swizzled tiles (wgmma.cuh), else by
// ldmatrix + mma.sync. Nothing is decompressed to global memory.
//
// Work split: one CTA per (tile of a request's query tokens, kv head). The M dimension packs the tile's query tokens
// times the GQA group's heads (row r = token r / group, head r % group), 16 rows per warp, 8 compute warps: so each K/V
// chunk is rebuilt once for 128 query rows. The grid comes from shapes alone (nnz_q, batch, kv heads): request b has
// ceil(q_len / T) tiles (T = 128 / group tokens), at most nnz_q / T + batch in all; each CTA finds its (request, tile)
// by a scan of qo_indptr and CTAs past the last tile exit. So the op never syncs and a CUDA Graph replays it with any
// q lengths of the same nnz_q.
//
// A pipeline over chunks of kKV key tokens (a whole number of 16-token tiles), one __syncthreads a chunk. A planner
// warp (the first of a fourth warpgroup, which gives its registers to the compute warps by setmaxnreg) does the
// waiting on the page table and meta rows: lane j plans block j of a chunk (page id, meta row, descriptor, offset) and
// publishes the plan in shared memory ahead of its copy. Each compute warp copies its own blocks of a chunk (cp.async,
// still compressed) kStages chunks ahead into a ring of staging buffers, and rebuilds the same blocks when they have
// landed, kAhead chunks ahead of their multiply, into BF16 K/V tiles (block_io.cuh decode_lane: the lane's words in
// mma A-operand order; stmatrix puts them in natural [token][dim] order). At head_dim 128 (wgmma) four tiles turn and
// the two warpgroups run half a step apart: while one's softmax runs on the SM's ALUs, the other's MMAs run on the
// tensor cores beside its share of the rebuild of chunk i + 2 (the main loop says in which order). (A single warp
// starting every copy, 32 blocks a chunk one after another, was the bound at 3.5 us a chunk; with the copies, plans and
// rebuild of each chunk waited on in turn by the same 4 warps, three barriers a chunk, the kernel ran at 80 TFLOP/s:
// docs/performance.md, "Prefill attention".) S = Q K^T and O += P V follow FlashAttention-2 (mma.sync: Q and K
// fragments by ldmatrix, V by ldmatrix.trans; wgmma: Q, K and V read by descriptor from swizzled tiles, once per
// warpgroup of 64 rows), P from S's accumulators in registers, an online softmax in float32 (base 2) per row, O
// rescaled only when a row's maximum rises by more than 2^8; the position masks are computed only for a warp's chunks
// that cross the causal diagonal, a window edge or kv_len, in 32-bit arithmetic relative to the chunk.
//
// Bad device contents cannot raise without a host sync (paged_decode.cuh): a page id out of range, a meta row that
// is missing, of another geometry or version, an invalid descriptor, a stream past the end of data, or an
// inconsistent page-table entry (indptr, last_page_len, qo_indptr, q_len > kv_len) turn the request's rows of out
// and lse into NaN; no byte outside data is read.
#pragma once
#include "paged_prefill.cuh"

#include <cuda_bf16.h>

#include <cstdint>

#include "../format.h"
#include "block_io.cuh"
#include "request_search.cuh"
#include "softmax.cuh"
#include "wgmma.cuh"

namespace zipkv::cuda::prefill_old {
// main's kernel for an A/B in one build (experiment): its descriptors by the old arithmetic
__device__ __forceinline__ uint64_t smem_desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | static_cast<uint64_t>(lbo >> 4) << 16 |
         static_cast<uint64_t>(sbo >> 4) << 32 | uint64_t{1} << 62;
}

constexpr int kComputeWarps = 8;
constexpr int kPlanner = kComputeWarps;  // the warp index of the planner
// The planner's warp is the first of a warpgroup of its own (its other three warps only keep the barriers): register
// budgets are moved between whole warpgroups (setmaxnreg), from the planner's to the compute warps', which get
// kComputeRegs a thread where 12 warps at launch get 168 (three of them on one scheduler's register file).
constexpr int kWarps = kComputeWarps + 4;  // as prefill_plan reports them
constexpr int kComputeRegs = 224, kPlannerRegs = 56;
static_assert(kComputeWarps * 32 * kComputeRegs + 128 * kPlannerRegs <= 65536, "the register file holds both budgets");
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 16 * kComputeWarps;  // M rows of a CTA: query tokens x GQA heads
constexpr int kPlanRing = 4;               // chunks' plans in shared memory (> kStages)
constexpr int kMaxBlocks = 32;             // blocks of a chunk at most: one per planner lane
constexpr uint8_t kDescSkip = 0xFE;        // a tile outside the CTA's keys: zeros, never read
constexpr uint8_t kDescBad = 0xFF;         // a refused block: zeros, and the request becomes NaN

struct Params {
  const uint16_t* q;          // [nnz_q, Hq, D]
  const int32_t* qo_indptr;   // [batch + 1]
  const uint8_t* data;        // [data_bytes]
  const int32_t* meta;        // [num_pages, 2, H, words]
  const int32_t* kv_indptr;   // [batch + 1]
  const int32_t* kv_indices;  // [nnz_kv]
  const int32_t* kv_last;     // [batch]
  uint16_t* out;              // [nnz_q, Hq, D]
  float* lse;                 // [nnz_q, Hq] or nullptr, natural log
  int64_t data_bytes, num_pages, nnz_kv;
  int nnz_q, batch, Hq, H, group, page_size, words;
  int tile_tokens;  // query tokens per CTA: kRows / group
  int causal, window_left;
  float scale_log2;           // sm_scale * log2(e)
  float cap_log2, scale_cap;  // soft cap (cap_log2 > 0): cap * log2(e), sm_scale / cap
};

template <int D>
struct Cfg {
  // d 128: S = Q K^T and O += P V as warpgroup MMAs, K and V tiles read by descriptor from 128-byte-swizzled
  // shared memory, once per warpgroup of 64 rows. d 256 (O alone would be 128 registers a thread) and d 64 use
  // mma.sync: with the same code at d 64, ptxas gave P's fragments the registers that held Q's, so every chunk after
  // the first multiplied P by K (docs/performance.md, "Prefill attention").
  static constexpr bool kWgmma = D == 128;
  static constexpr int kKV = D == 256 ? 32 : 64;  // key tokens per chunk (d 256: registers and shared memory)
  static constexpr int kTiles = kKV / kTileTokens;
  static constexpr int kSpans = D / kBlockDims;             // blocks per 16-token tile, of K and of V each
  static constexpr int kBlocks = 2 * kTiles * kSpans;       // blocks per chunk
  static constexpr int kPerWarp = kBlocks / kComputeWarps;  // blocks a compute warp copies and rebuilds
  // How many chunks ahead of its multiply a chunk is rebuilt: with wgmma 2, so that S of chunk i + 1 runs on the
  // tensor cores under chunk i's softmax and P V of chunk i under the rebuild of chunk i + 2 (two staging buffers
  // make the room); else 1 (two tiles). With wgmma a fourth K/V tile pair holds chunk i - 1 for warpgroup 1, which
  // runs half a step behind warpgroup 0 (the kernel's main loop).
  static constexpr int kAhead = kWgmma ? 2 : 1;
  static constexpr int kTileBufs = kWgmma ? kAhead + 2 : kAhead + 1;  // K/V tile pairs
  static constexpr int kStages = kWgmma || D == 256 ? 2 : 3;          // staging buffers: chunks copied ahead
  static constexpr int kStride = D + 8;  // bf16 per shared row: 16 bytes of pad, conflict-free ldmatrix
  static constexpr int kStageBytes = kBlocks * kRawBlockBytes;
  static constexpr int kQBytes = kRows * (kWgmma ? D : kStride) * 2;  // wgmma: swizzled, unpadded
  static constexpr int kKVBytes = kKV * (kWgmma ? D : kStride) * 2;   // one K or V tile
  static constexpr int kDescBytes = 32;
  static constexpr int kAlign = kWgmma ? 1024 : 0;  // slack to align the tiles' swizzle atoms
  static constexpr int kSmemBytes =
      kAlign + 2 * kTileBufs * kKVBytes + kStages * kStageBytes + kQBytes + kPlanRing * (kDescBytes + 8 * kMaxBlocks);
  static_assert(!kWgmma || (kKVBytes % 1024 == 0 && kStageBytes % 1024 == 0 && kQBytes % 1024 == 0 && D == 128),
                "whole swizzle atoms per tile (K, V and Q, which follows the staging), O as m64n128");
  static_assert(kBlocks <= kMaxBlocks && kBlocks <= kDescBytes, "a planner lane plans each block of a chunk");
  static_assert(kBlocks % kComputeWarps == 0, "the compute warps share a chunk's rebuild evenly");
  static_assert(kStages >= 2 && kStages + kAhead <= kPlanRing, "a chunk's plans outlive its staging and its rebuild");
  static_assert(kSmemBytes <= 227 * 1024, "one CTA fits on an SM");
};

// ---------------------------------------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async8(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most n of this thread's most recent copy groups are still in flight.
template <int n>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(n) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

// d += A * B, m16n8k16, bf16 in, fp32 accumulate (lane = 4 g + t; A rows g, g + 8; d[0..1] row g, d[2..3] row g + 8,
// columns 2t, 2t + 1).
__device__ __forceinline__ void mma(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---------------------------------------------------------------------------------------------- KV chunk
// Where (row, dims dim..dim + 7) of a tile of kTileRows rows (a K or V tile: kKV tokens; the Q tile: kRows) lies
// (bf16 offset). wgmma: D / 64 column blocks of [kTileRows][64], each row 128 bytes with its 16-byte chunks swizzled
// by the row (wgmma.cuh); else rows of kStride.
template <int D, int kTileRows = Cfg<D>::kKV>
__device__ __forceinline__ int tile_offset(int token, int dim) {
  if constexpr (Cfg<D>::kWgmma) {  // unsigned: the divisions are shifts, with no fix-up for a sign
    const unsigned t = token, d = dim;
    return static_cast<int>((d / 64) * (kTileRows * 64) + t * 64 + (((d % 64) / 8) ^ (t % 8)) * 8);
  } else {
    return token * Cfg<D>::kStride + dim;
  }
}

// Block j of the chunk at key token c0: which of the chunk's 16-token tiles, K or V, which 32-dim span.
template <int D>
struct BlockOf {
  int tile, is_v, span;
  __device__ __forceinline__ explicit BlockOf(int j)  // j >= 0: unsigned, so that each division is a shift
      : tile(static_cast<int>(static_cast<unsigned>(j) / (2 * Cfg<D>::kSpans))),
        is_v(static_cast<int>(static_cast<unsigned>(j) / Cfg<D>::kSpans % 2)),
        span(static_cast<int>(static_cast<unsigned>(j) % Cfg<D>::kSpans)) {}
};

// The page id of block j of the chunk at c0, loaded ahead of its plan; -1 past the CTA's keys [.., hi).
template <int D>
__device__ __forceinline__ int32_t block_page(const Params& p, int kv_first_page, int64_t c0, int64_t hi, int j) {
  const int64_t tok = c0 + int64_t{BlockOf<D>(j).tile} * kTileTokens;
  return j < Cfg<D>::kBlocks && tok < hi ? __ldg(p.kv_indices + kv_first_page + tok / p.page_size) : -1;
}

// Where block j of the chunk at c0 lies: its descriptor (kDescSkip past the CTA's keys, kDescBad for a refused page
// or meta row) and its byte offset in data.
struct BlockPlan {
  int64_t src;
  uint32_t desc;
};

// A block's plan is made in two steps, a chunk apart, so that the planner never waits on a load in the step that
// issues it: first every word of its stream's meta row is loaded, none of them branched on (one round trip, where
// format.h's read_stream takes one per word behind its checks), then the plan is computed from the words in
// registers: the same checks (a missing stream, another geometry or version, an invalid descriptor, a stream past
// the end of data) and the block's offset.
enum WordsState : int { kWordsSkip = 0, kWordsBadPage = 1, kWordsLoaded = 2 };

template <int D>
struct MetaWords {
  static constexpr int kDescs = kMaxPageSize / kTileTokens * (D / kBlockDims);  // of the longest meta row
  static constexpr int kWords = kMetaHeaderWords + (kDescs + 3) / 4;
  int32_t w[kWords];
  int state;  // WordsState
};

template <int D>
__device__ __forceinline__ void load_meta_words(const Params& p, int head, int64_t c0, int64_t hi, int j, int32_t page,
                                                MetaWords<D>& m) {
  const BlockOf<D> blk(j);
  const bool inside = j < Cfg<D>::kBlocks && c0 + int64_t{blk.tile} * kTileTokens < hi;
  const bool ok = inside && page >= 0 && page < p.num_pages;
  m.state = !inside ? kWordsSkip : ok ? kWordsLoaded : kWordsBadPage;
  const int32_t* row = p.meta + ((int64_t{ok ? page : 0} * 2 + blk.is_v) * p.H + head) * p.words;
#pragma unroll
  for (int i = 0; i < MetaWords<D>::kWords; ++i) m.w[i] = ok && i < p.words ? __ldg(row + i) : 0;
}

template <int D>
__device__ __forceinline__ BlockPlan plan_block(const Params& p, int64_t c0, int j, const MetaWords<D>& m) {
  BlockPlan plan{0, kDescSkip};
  if (m.state == kWordsSkip) return plan;
  plan.desc = kDescBad;
  if (m.state != kWordsLoaded || m.w[0] < 0 || tag_status(m.w[1], p.page_size, D) != kStreamOk) return plan;
  const BlockOf<D> blk(j);
  const int64_t tok = c0 + int64_t{blk.tile} * kTileTokens;
  const int b = static_cast<int>(tok % p.page_size) / kTileTokens * Cfg<D>::kSpans + blk.span;
  const int nblocks = blocks_per_stream(p.page_size, D);
  int total = 0, offset = 0;
  uint32_t desc_b = kDescBad;
  bool valid = true;
#pragma unroll
  for (int i = 0; i < MetaWords<D>::kDescs; ++i) {
    if (i < nblocks) {
      const auto d = static_cast<uint8_t>(static_cast<uint32_t>(m.w[kMetaHeaderWords + i / 4]) >> (8 * (i % 4)));
      valid &= desc_valid(d);
      const int bytes = block_bytes(d);
      offset += i < b ? bytes : 0;
      total += bytes;
      desc_b = i == b ? d : desc_b;
    }
  }
  const int64_t start = int64_t{m.w[0]} * kStreamAlign;
  if (valid && start + total <= p.data_bytes) plan.desc = desc_b, plan.src = start + offset;
  return plan;
}

// The planner publishes a chunk's plans (lane j holds block j's) for the compute warps: descriptors and offsets.
template <int D>
__device__ __forceinline__ void publish_plans(BlockPlan plan, uint8_t* descs, int64_t* srcs, int lane) {
  if (lane < Cfg<D>::kBlocks) descs[lane] = static_cast<uint8_t>(plan.desc), srcs[lane] = plan.src;
}

// A compute warp starts the copy of planned block j of a chunk into its staging buffer, still in the format: each
// lane its 16 positions, 16 low bytes and 8 code bytes, or a raw block's two 16-byte pieces.
__device__ __forceinline__ void issue_block(const Params& p, uint32_t desc, int64_t off, uint8_t* dst, int lane) {
  if (desc == kDescSkip || desc == kDescBad) return;
  const uint8_t* src = p.data + off;
  cp_async16(dst + 16 * lane, src + 16 * lane);
  if (desc == kDescRaw) {
    cp_async16(dst + kRawHalfBytes + 16 * lane, src + kRawHalfBytes + 16 * lane);
  } else {
    cp_async8(dst + kLowBytes + 8 * lane, src + kLowBytes + 8 * lane);
  }
}

// A compute warp's blocks of a chunk, j = warp * kPerWarp + i for i < kPerWarp, rebuilt from their staging into bf16
// in the K or V tile (tile_offset's layout): the lane's 8 words in position order (format.h), which are its fragments
// of four 8x8 matrices of the block, go out by two stmatrix. Values of tokens at or past kv_len are zeroed in V (an
// open page's free slots may hold any bit pattern, and 0 * NaN would poison O although their weight is 0). In one
// unrolled line (~50 SASS instructions a compressed block at d 128 where a loop of blocks took ~120): the warp's
// blocks are consecutive spans of one K or V 16-token tile (kPerWarp <= kSpans), so block i's place in the tile is
// the lane's offset for the warp's first block (off0[c], c: the stmatrix call) plus a constant: kBlockDims * i, or
// with the swizzle (where the warp's blocks start at span 0) the column block i / 2 and, for an odd span, bit 2 of
// the 16-byte chunk index flipped (chunk indices below 4 ^ 4: the offset ^ 32).
template <int D>
struct WarpOffsets {
  int off0[2];
};
template <int D>
__device__ __forceinline__ WarpOffsets<D> warp_offsets(int warp, int lane) {
  using C = Cfg<D>;
  const BlockOf<D> blk(warp * C::kPerWarp);
  WarpOffsets<D> l;
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const FragmentRow f = fragment_row(blk.is_v, c, lane);
    l.off0[c] = tile_offset<D>(blk.tile * kTileTokens + f.row, blk.span * kBlockDims + 8 * f.chunk);
  }
  return l;
}
template <int D, int kSpan>
__device__ __forceinline__ int span_offset(int off0) {
  if constexpr (Cfg<D>::kWgmma) {
    return (kSpan / 2) * (Cfg<D>::kKV * 64) + (off0 ^ (32 * (kSpan % 2)));
  } else {
    return off0 + kBlockDims * kSpan;
  }
}
template <int D>
__device__ __forceinline__ bool rebuild_warp_blocks(int warp, int64_t c0, int64_t kv_len, const uint8_t* stage,
                                                    const uint8_t* descs, uint16_t* ks, uint16_t* vs,
                                                    const WarpOffsets<D>& l, int lane) {
  using C = Cfg<D>;
  constexpr int kPer = C::kPerWarp;
  static_assert(C::kSpans % kPer == 0 && kPer <= 4 && (!C::kWgmma || kPer == C::kSpans),
                "a warp's blocks: spans of one tile, from span 0 under the swizzle");
  const int j0 = warp * kPer;
  const BlockOf<D> blk(j0);
  uint32_t dw;  // the warp's descriptor bytes
  if constexpr (kPer == 4) {
    dw = *reinterpret_cast<const uint32_t*>(descs + j0);
  } else {
    dw = *reinterpret_cast<const uint16_t*>(descs + j0);
  }
  const uint8_t* base = stage + j0 * kRawBlockBytes;
  uint16_t* const dst = blk.is_v ? vs : ks;
  bool refused = false;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const uint8_t desc = static_cast<uint8_t>(dw >> (8 * i));
    const uint8_t* src = base + i * kRawBlockBytes;
    uint32_t w[8];
    if (desc == kDescSkip || desc == kDescBad) {
#pragma unroll
      for (int m = 0; m < 8; ++m) w[m] = 0;
    } else if (desc == kDescRaw) {
      const uint4 a = *reinterpret_cast<const uint4*>(src + 16 * lane);
      const uint4 b = *reinterpret_cast<const uint4*>(src + kRawHalfBytes + 16 * lane);
      w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
    } else {
      decode_lane(*reinterpret_cast<const uint4*>(src + 16 * lane),
                  *reinterpret_cast<const uint2*>(src + kLowBytes + 8 * lane), desc, w);
    }
    refused |= desc == kDescBad;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      int off;
      switch (i) {  // a constant after unrolling
        case 0: off = span_offset<D, 0>(l.off0[c]); break;
        case 1: off = span_offset<D, 1>(l.off0[c]); break;
        case 2: off = span_offset<D, 2>(l.off0[c]); break;
        default: off = span_offset<D, 3>(l.off0[c]); break;
      }
      stmatrix_x4(smem_u32(dst + off), blk.is_v, w + 4 * c);
    }
  }
  // The V tail: where the warp's tile holds kv_len's last tokens (the last chunk only), its rows past kv_len are
  // zeroed, 16 rows x 4 pieces of 16 bytes a block, lane k zeroing pieces k and k + 32.
  const int64_t tok = c0 + int64_t{blk.tile} * kTileTokens;
  if (blk.is_v && tok + kTileTokens > kv_len && tok < kv_len) {
    __syncwarp();
    const int valid = static_cast<int>(kv_len - tok);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int piece = lane + 32 * k, row = piece / 4;
        if (row < valid) continue;
        *reinterpret_cast<uint4*>(
            dst + tile_offset<D>(blk.tile * kTileTokens + row, (blk.span + i) * kBlockDims + (piece % 4) * 8)) =
            make_uint4(0, 0, 0, 0);
      }
    }
  }
  return refused;
}

// ---------------------------------------------------------------------------------------------- the kernel
// Q's A fragments of a warp's 16 rows, k-step k (16 dims), from the Q tile.
template <int D>
__device__ __forceinline__ void load_q_fragment(uint32_t a[4], const uint16_t* qs, int warp, int lane, int k) {
  ldmatrix_x4(a, qs + (warp * 16 + lane % 8 + (lane / 8 % 2) * 8) * Cfg<D>::kStride + k * 16 + (lane / 16) * 8);
}

// A chunk's logits from S's accumulators (s: a warp's 16 rows x kKV keys), masked where kMasked, in base 2, and the
// online softmax per row (a lane holds 2 rows, the 4 lanes of a quad share them): s becomes the chunk's weights, O and
// l are rescaled where the row maximum rises. kCap: the soft cap's map. Both maps increase with s (sm_scale > 0,
// checks.h), so a row's maximum is taken over s itself and scaled once, and each weight is one FFMA and one ex2.
template <int D, bool kCap, bool kMasked>
__device__ __forceinline__ void online_softmax(const Params& p, float (&s)[Cfg<D>::kKV / 8][4], int t,
                                               const int rel_pos[2], int kv_rem, float (&o)[D / 8][4], float m_run[2],
                                               float l_run[2]) {
  constexpr int kSN = Cfg<D>::kKV / 8;
  const float mul = kCap ? 1.f : p.scale_log2;
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int n = 0; n < kSN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[n][e];
      if constexpr (kCap) x = p.cap_log2 * tanh_approx(x * p.scale_cap);
      if constexpr (kMasked) {
        const int key = n * 8 + 2 * t + (e % 2), pos = rel_pos[e / 2];
        const bool keep =
            key < kv_rem && (!p.causal || key <= pos) && (p.window_left < 0 || key >= pos - p.window_left);
        x = keep ? x : -INFINITY;
      }
      s[n][e] = x;
      mx[e / 2] = fmaxf(mx[e / 2], x);
    }
  }
  bool rise = false;
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    mx[h2] = fmaxf(mx[h2], __shfl_xor_sync(0xFFFFFFFFu, mx[h2], 1));
    mx[h2] = fmaxf(mx[h2], __shfl_xor_sync(0xFFFFFFFFu, mx[h2], 2));
    mx[h2] *= mul;                           // -inf stays -inf: nothing to weigh in this chunk
    rise |= mx[h2] > m_run[h2] + kMaxSlack;  // -inf + 8 is -inf: a row's first finite logit always rises
  }
  if (__any_sync(0xFFFFFFFFu, rise)) {  // warp-uniform, so the rescale is one branch, not 64 predicated FMULs
    float alpha[2];
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) {
      alpha[h2] = 1.f;
      if (mx[h2] > m_run[h2] + kMaxSlack) {
        alpha[h2] = m_run[h2] == -INFINITY ? 0.f : exp2_approx(m_run[h2] - mx[h2]);
        m_run[h2] = mx[h2];
      }
      l_run[h2] *= alpha[h2];
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      o[n][0] *= alpha[0], o[n][1] *= alpha[0], o[n][2] *= alpha[1], o[n][3] *= alpha[1];
    }
  }
  // A maximum of -inf means nothing weighed yet: weigh against 0 (exp2(-inf - 0) = 0, -inf - -inf would be NaN).
  const float m_use[2] = {m_run[0] == -INFINITY ? 0.f : m_run[0], m_run[1] == -INFINITY ? 0.f : m_run[1]};
#pragma unroll
  for (int n = 0; n < kSN; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[n][e] = exp2_approx(fmaf(s[n][e], mul, -m_use[e / 2]));
      l_run[e / 2] += s[n][e];
    }
  }
}

// S = Q K^T for one compute warp's 16 rows over one chunk's K tile (ks). With wgmma the four warps of a warpgroup
// call it together, Q read by descriptor from the swizzled Q tile (held in registers, its 32 registers a thread made
// ptxas spill the loop's addresses), and the MMAs are only started: attend_chunk waits for them, so that the rebuild
// of the next chunk runs while the tensor cores work. Else each warp alone, Q's fragments read from qs.
template <int D>
__device__ __forceinline__ void start_scores(const uint16_t* qs, const uint16_t* ks, int warp, int lane,
                                             float (&s)[Cfg<D>::kKV / 8][4]) {
  using C = Cfg<D>;
  constexpr int kSN = C::kKV / 8;  // S n-tiles of 8 keys
#pragma unroll
  for (int n = 0; n < kSN; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
  if constexpr (C::kWgmma) {
    // K-major A and B: Q's rows are query rows, the K tile's keys; k-step k is 32 bytes into the swizzle row of
    // column block k / 4.
    const uint32_t kb = smem_u32(ks), qb = smem_u32(qs) + warp / 4 * (64 * 128);  // the warpgroup's 64 rows of Q
    fence_registers(s);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      wgmma_m64n64k16(s, smem_desc_sw128(qb + (k / 4) * (kRows * 128) + (k % 4) * 32, 16, 1024),
                      smem_desc_sw128(kb + (k / 4) * (C::kKV * 128) + (k % 4) * 32, 16, 1024));
    }
    wgmma_commit();
  } else {
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
      uint32_t a[4];
      load_q_fragment<D>(a, qs, warp, lane, k);
#pragma unroll
      for (int n = 0; n < kSN / 2; ++n) {
        uint32_t bk[4];
        ldmatrix_x4(bk, ks + (n * 16 + lane % 8 + (lane / 16) * 8) * C::kStride + k * 16 + (lane / 8 % 2) * 8);
        mma(s[2 * n], a, bk[0], bk[1]);
        mma(s[2 * n + 1], a, bk[2], bk[3]);
      }
    }
  }
}

// One compute warp's 16 rows of a chunk: S (from start_scores) becomes P, the A operand of P V (pa), by the online
// softmax, its state carried in m_run and l_run (O rescaled where a row's maximum rises). masked: the chunk crosses
// the causal diagonal, a window edge or kv_len for some row of the warp; rel_pos: the rows' positions relative to the
// chunk's first key (clamped), kv_rem: kv_len minus that key (clamped).
template <int D, bool kCap>
__device__ __forceinline__ void softmax_to_p(const Params& p, float (&s)[Cfg<D>::kKV / 8][4], int lane, bool masked,
                                             const int rel_pos[2], int kv_rem, float (&o)[D / 8][4], float m_run[2],
                                             float l_run[2], uint32_t (&pa)[Cfg<D>::kKV / 16][4]) {
  using C = Cfg<D>;
  const int t = lane % 4;
  if (masked) {
    online_softmax<D, kCap, true>(p, s, t, rel_pos, kv_rem, o, m_run, l_run);
  } else {
    online_softmax<D, kCap, false>(p, s, t, rel_pos, kv_rem, o, m_run, l_run);
  }
  // P's accumulators are the A operand as they stand (two n-tiles of 8 keys = one k-step of 16).
#pragma unroll
  for (int kk = 0; kk < C::kKV / 16; ++kk) {
    pa[kk][0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]), pa[kk][1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
    pa[kk][2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
    pa[kk][3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

// O += P V over one chunk (the V tile vs). With wgmma the four warps of a warpgroup call it together and the MMAs
// are only started: the caller waits for them, and keeps pa alive to there.
template <int D>
__device__ __forceinline__ void start_pv(const uint16_t* vs, int lane, float (&o)[D / 8][4],
                                         uint32_t (&pa)[Cfg<D>::kKV / 16][4]) {
  using C = Cfg<D>;
  if constexpr (C::kWgmma) {
    // MN-major B: the V tile's rows are keys (k), its column blocks of 64 dims LBO apart, 8-key atoms SBO apart.
    const uint32_t vb = smem_u32(vs);
    fence_registers(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < C::kKV / 16; ++kk) {
      wgmma_m64n128k16_mn(o, pa[kk], smem_desc_sw128(vb + kk * 16 * 128, C::kKV * 128, 1024));
    }
    wgmma_commit();  // the caller waits (wgmma_wait_all, then fence_registers(o))
  } else {
#pragma unroll
    for (int kk = 0; kk < C::kKV / 16; ++kk) {
#pragma unroll
      for (int n = 0; n < D / 16; ++n) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, vs + (kk * 16 + lane % 8 + (lane / 8 % 2) * 8) * C::kStride + n * 16 + (lane / 16) * 8);
        mma(o[2 * n], pa[kk], bv[0], bv[1]);
        mma(o[2 * n + 1], pa[kk], bv[2], bv[3]);
      }
    }
  }
}

template <int D, bool kCap>
__device__ __forceinline__ void attend_chunk(const Params& p, float (&s)[Cfg<D>::kKV / 8][4], const uint16_t* vs,
                                             int lane, bool masked, const int rel_pos[2], int kv_rem,
                                             float (&o)[D / 8][4], float m_run[2], float l_run[2],
                                             uint32_t (&pa)[Cfg<D>::kKV / 16][4]) {
  softmax_to_p<D, kCap>(p, s, lane, masked, rel_pos, kv_rem, o, m_run, l_run, pa);
  start_pv<D>(vs, lane, o, pa);
}

// kCap: a soft cap is set (p.cap_log2 > 0), a compile-time choice so that the logits' map costs nothing without one.
template <int D, bool kCap>
__global__ void __launch_bounds__(kThreads, 1) paged_prefill_kernel(const Params p) {
  using C = Cfg<D>;
  constexpr int kS = C::kStages;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  // The K/V tiles first, 1,024-byte aligned for wgmma's swizzle atoms.
  constexpr uint32_t kA = C::kAlign > 0 ? C::kAlign : 1;
  uint8_t* smem = smem_raw + (kA - smem_u32(smem_raw) % kA) % kA;
  uint16_t* kv_tiles = reinterpret_cast<uint16_t*>(smem);                                 // [kTileBufs][K, V][kKVBytes]
  uint8_t* stages = smem + 2 * C::kTileBufs * C::kKVBytes;                                // [kS][kStageBytes]
  uint16_t* qs = reinterpret_cast<uint16_t*>(stages + kS * C::kStageBytes);               // [kQBytes]
  uint8_t* desc_ring = reinterpret_cast<uint8_t*>(qs) + C::kQBytes;                       // [kPlanRing][kDescBytes]
  int64_t* src_ring = reinterpret_cast<int64_t*>(desc_ring + kPlanRing * C::kDescBytes);  // [kPlanRing][kMaxBlocks]
  __shared__ int s_request, s_tile, s_bad;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int head = blockIdx.y;  // kv head
  const int T = p.tile_tokens, group = p.group;
  const int* qo = p.qo_indptr;

  // Which (request, tile) this CTA is: request b owns ceil(q_len_b / T) consecutive CTAs (a prefix sum over the
  // batch, 32 requests per step of warp 0). Within a request the last tiles come first: under a causal mask they see
  // the most keys, and the CTAs that start first should take them.
  if (warp == 0) {
    const RequestUnit u = find_request_unit(qo, p.batch, p.nnz_q, 1, T, blockIdx.x, lane);
    if (lane == 0) s_request = u.request, s_tile = static_cast<int>(u.count - 1 - u.index), s_bad = 0;
  }
  __syncthreads();
  const int b = s_request;
  if (b < 0) return;  // past the last tile

  // The request's page-table entries; an inconsistent one poisons its rows.
  const int q_begin = __ldg(qo + b), q_end = __ldg(qo + b + 1);
  const int kp0 = __ldg(p.kv_indptr + b), kp1 = __ldg(p.kv_indptr + b + 1), last = __ldg(p.kv_last + b);
  const int64_t kv_len = kp1 > kp0 ? int64_t{kp1 - kp0 - 1} * p.page_size + last : 0;
  const int64_t q_len = int64_t{q_end} - q_begin;
  const bool bad_request = __ldg(qo) != 0 || __ldg(qo + p.batch) != p.nnz_q || q_begin < 0 || q_end > p.nnz_q ||
                           __ldg(p.kv_indptr) != 0 || kp0 < 0 || kp1 < kp0 || kp1 > p.nnz_kv ||
                           (kp1 > kp0 && (last < 1 || last > p.page_size)) || (p.causal && q_len > kv_len);
  const int t0 = s_tile * T;                                     // the tile's first query token, request-relative
  const int nt = static_cast<int>(min(int64_t{T}, q_len - t0));  // its query tokens
  const int rows = nt * group;

  // Q tile into shared memory (padding rows zero), 16 bytes per thread and step.
  constexpr int kPieces = D / 8;
  for (int i = threadIdx.x; i < kRows * kPieces; i += kThreads) {
    const int r = i / kPieces, piece = i % kPieces;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < rows && !bad_request) {
      const int64_t qrow = (int64_t{q_begin} + t0 + r / group) * p.Hq + head * group + r % group;
      v = __ldg(reinterpret_cast<const uint4*>(p.q + qrow * D) + piece);
    }
    *reinterpret_cast<uint4*>(qs + tile_offset<D, kRows>(r, piece * 8)) = v;
  }
  if constexpr (C::kWgmma) fence_proxy_async_smem();  // Q is read by wgmma after the next barrier

  // The keys the tile's rows see: [lo, hi). Pages wholly outside are never read.
  const int64_t pos0 = kv_len - q_len + t0;  // position of the tile's first query token
  const int64_t hi = bad_request ? 0 : p.causal ? min(kv_len, pos0 + nt) : kv_len;
  const int64_t lo = p.window_left >= 0 ? max(int64_t{0}, pos0 - p.window_left) : 0;
  const int64_t c_first = lo / kTileTokens * kTileTokens;
  const int chunks = hi > c_first ? static_cast<int>((hi - c_first + C::kKV - 1) / C::kKV) : 0;
  const auto chunk_key = [&](int ci) { return c_first + int64_t{ci} * C::kKV; };
  const auto kv_tile = [&](int ci, int is_v) {
    return kv_tiles + ((ci % C::kTileBufs) * 2 + is_v) * (C::kKVBytes / 2);
  };

  if (warp >= kPlanner) {
    setmaxnreg_dec<kPlannerRegs>();
    if (warp > kPlanner) {  // the planner's warpgroup's other warps: only the barriers the planner keeps
      for (int i = 0; i < chunks + 3; ++i) __syncthreads();
      return;
    }
    // ---- The planner: publishes the plans of chunk ci + kS + kAhead while chunk ci is multiplied (the compute warps
    // copy chunk ci + kS + kAhead - 1 in that step). The first kS + kAhead chunks are planned at once (page id, words
    // and plan in a chain, once per CTA); from then on page ids are loaded two chunks ahead of their plans and meta
    // words one, each step using what the step before loaded, so that the planner never waits on a load in the step
    // that issues it.
    constexpr int kLead = kS + C::kAhead;
    MetaWords<D> words;
    const auto page_of = [&](int ci) { return ci < chunks ? block_page<D>(p, kp0, chunk_key(ci), hi, lane) : -1; };
    const auto publish = [&](int ci, BlockPlan plan) {
      publish_plans<D>(plan, desc_ring + ci % kPlanRing * C::kDescBytes, src_ring + ci % kPlanRing * kMaxBlocks, lane);
    };
    for (int ci = 0; ci < kLead && ci < chunks; ++ci) {
      load_meta_words<D>(p, head, chunk_key(ci), hi, lane, page_of(ci), words);
      publish(ci, plan_block<D>(p, chunk_key(ci), lane, words));
    }
    if (kLead < chunks) load_meta_words<D>(p, head, chunk_key(kLead), hi, lane, page_of(kLead), words);
    int32_t page_next = page_of(kLead + 1);
    __syncthreads();  // the plans of chunks 0..kLead - 1 published
    __syncthreads();  // chunks 0..kAhead - 1 rebuilt
    for (int ci = 0; ci < chunks; ++ci) {
      const int next = ci + kLead;
      if (next < chunks) publish(next, plan_block<D>(p, chunk_key(next), lane, words));
      if (next + 1 < chunks) load_meta_words<D>(p, head, chunk_key(next + 1), hi, lane, page_next, words);
      page_next = page_of(next + 2);
      __syncthreads();
    }
    __syncthreads();  // the compute warps' refusal flags
    return;
  }

  // ---- The compute warps: rebuild chunk ci + 1 while multiplying chunk ci.
  setmaxnreg_inc<kComputeRegs>();
  // The warp's rows: positions of its two rows per lane (g and g + 8), the range of its 16 rows' positions, and
  // whether any of its rows is real. A chunk is skipped, or the rows multiplied at all, by the unit that issues the
  // MMAs together: the warpgroup of 64 rows with wgmma, else the warp.
  const bool warp_active = warp * 16 < rows;
  int64_t pos_row[2];
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) pos_row[h2] = pos0 + (warp * 16 + g + 8 * h2) / group;
  const int64_t wpos_lo = pos0 + warp * 16 / group, wpos_hi = pos0 + (warp * 16 + 15) / group;
  constexpr int kUnitRows = C::kWgmma ? 64 : 16;
  const int unit_row0 = warp * 16 / kUnitRows * kUnitRows;
  const bool unit_active = unit_row0 < rows;
  const int64_t upos_lo = pos0 + unit_row0 / group, upos_hi = pos0 + (unit_row0 + kUnitRows - 1) / group;

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  bool refused = false;
  // Each compute warp copies, and then rebuilds, blocks warp * kPerWarp.. of every chunk: its copies are its own to
  // wait for, and its staging bytes its own to reuse.
  constexpr int kPerWarp = C::kPerWarp;
  const WarpOffsets<D> offsets = warp_offsets<D>(warp, lane);
  const auto issue_chunk = [&](int ci) {
    if (ci < chunks) {
      const uint8_t* descs = desc_ring + ci % kPlanRing * C::kDescBytes;
      const int64_t* srcs = src_ring + ci % kPlanRing * kMaxBlocks;
#pragma unroll
      for (int i = 0; i < kPerWarp; ++i) {
        const int j = warp * kPerWarp + i;
        issue_block(p, descs[j], srcs[j], stages + ci % kS * C::kStageBytes + j * kRawBlockBytes, lane);
      }
    }
    cp_async_commit();  // one group a chunk, empty past the last: "at most kS - 1 in flight" means the oldest landed
  };
  const auto rebuild_chunk = [&](int ci) {
    const uint8_t* stage = stages + ci % kS * C::kStageBytes;
    const uint8_t* descs = desc_ring + ci % kPlanRing * C::kDescBytes;
    refused |= rebuild_warp_blocks<D>(warp, chunk_key(ci), kv_len, stage, descs, kv_tile(ci, 0), kv_tile(ci, 1),
                                      offsets, lane);
    if constexpr (C::kWgmma) fence_proxy_async_smem();  // the tiles are read by wgmma after the next barrier
  };

  // Which rows of the warp chunk ci reaches: all keys masked for every row (causal: past the last row; window:
  // before the first row's window) skip the chunk; masks only where some key of some row falls outside.
  const auto chunk_none = [&](int64_t c0) {
    return (p.causal && c0 > upos_hi) || (p.window_left >= 0 && c0 + C::kKV - 1 < upos_lo - p.window_left);
  };
  const auto chunk_masked = [&](int64_t c0) {
    return c0 + C::kKV > kv_len || (p.causal && c0 + C::kKV - 1 > wpos_lo) ||
           (p.window_left >= 0 && c0 < wpos_hi - p.window_left);
  };
  constexpr int64_t kFar = int64_t{1} << 30;  // past any key of a chunk, and any window
  const auto relative = [&](int64_t c0, int rel_pos[2]) {
#pragma unroll
    for (int h2 = 0; h2 < 2; ++h2) rel_pos[h2] = static_cast<int>(max(min(pos_row[h2] - c0, kFar), -kFar));
    return static_cast<int>(min(kv_len - c0, int64_t{C::kKV}));  // kv_rem
  };

  // Copies kS chunks ahead of their rebuild, rebuilds kAhead chunks ahead of their multiply. A chunk's staging
  // buffer is refilled right after its rebuild: in step ci with chunk ci + kAhead - 1 + kS.
  __syncthreads();  // Q staged, the plans of chunks 0..kS + kAhead - 1 published
  for (int ci = 0; ci < kS; ++ci) issue_chunk(ci);
#pragma unroll
  for (int r = 0; r < C::kAhead; ++r) {
    cp_async_wait<kS - 1>();  // chunk r
    if (r < chunks) rebuild_chunk(r);
    if (r + 1 < C::kAhead) issue_chunk(r + kS);
  }
  if constexpr (C::kWgmma) {  // the V tile warpgroup 1's P V of "chunk -1" (P = 0) reads: zeros, never NaN
    uint4* z = reinterpret_cast<uint4*>(kv_tile(C::kTileBufs - 1, 1));
    for (int i = threadIdx.x; i < C::kKVBytes / 16; i += 32 * kComputeWarps) z[i] = make_uint4(0, 0, 0, 0);
    fence_proxy_async_smem();
  }
  __syncthreads();  // chunks 0..kAhead - 1 rebuilt
  if constexpr (C::kWgmma) {
    // The two warpgroups run half a step apart, so that one's softmax runs under the other's MMAs and rebuild (FA3's
    // ping-pong, here within the one barrier a chunk). Warpgroup 0 in step ci: S of chunk ci + 1 started, chunk ci's
    // softmax, its P V started, the rebuild of chunk ci + 2, then both waited for. Warpgroup 1: P V of chunk ci - 1
    // started (the fourth tile pair holds it; "chunk -1" is P = 0 times a zeroed V tile), the rebuild, both waited
    // for (with S of chunk ci, started the step before), chunk ci's softmax, then S of chunk ci + 1 started, in
    // flight across the barrier. Every warpgroup runs every chunk's MMAs (a chunk it does not reach, or rows past the
    // tile's, is masked whole, its results unused), so that no MMA is issued or waited for under a branch: ptxas
    // serializes wgmma that it cannot prove uniform (the branch between the warpgroups is on a value made uniform by
    // a shuffle, as FA3 does).
    float s_cur[C::kKV / 8][4];
    uint32_t pa[C::kKV / 16][4];
    start_scores<D>(qs, kv_tile(0, 0), warp, lane, s_cur);
    wgmma_wait_all();
    fence_registers(s_cur);
    const auto masked_at = [&](int64_t c0) { return chunk_none(c0) || !unit_active || chunk_masked(c0); };
    if (__shfl_sync(0xFFFFFFFFu, warp / 4, 0) == 1) {
#pragma unroll
      for (int kk = 0; kk < C::kKV / 16; ++kk) pa[kk][0] = pa[kk][1] = pa[kk][2] = pa[kk][3] = 0u;
      for (int ci = 0; ci < chunks; ++ci) {
        issue_chunk(ci + C::kAhead - 1 + kS);                         // into the staging chunk ci + 1 left
        start_pv<D>(kv_tile(ci + C::kTileBufs - 1, 1), lane, o, pa);  // chunk ci - 1
        cp_async_wait<kS - 1>();                                      // chunk ci + 2, copied a step ago
        if (ci + 2 < chunks) rebuild_chunk(ci + 2);
        wgmma_wait_all();  // P V of chunk ci - 1, S of chunk ci
        fence_registers(o);
        fence_registers(s_cur);
        fence_registers(pa);
        const int64_t c0 = chunk_key(ci);
        int rel_pos[2];
        const int kv_rem = relative(c0, rel_pos);
        softmax_to_p<D, kCap>(p, s_cur, lane, masked_at(c0), rel_pos, kv_rem, o, m_run, l_run, pa);
        start_scores<D>(qs, kv_tile(ci + 1, 0), warp, lane, s_cur);  // past the last chunk: stale bytes, never used
        __syncthreads();  // chunk ci + 2 rebuilt, chunk ci - 1's tiles free, the plans of chunk ci + kS + 2 published
      }
      start_pv<D>(kv_tile(chunks + C::kTileBufs - 1, 1), lane, o, pa);  // the last chunk
      wgmma_wait_all();
      fence_registers(o);
      fence_registers(s_cur);
      fence_registers(pa);
    } else {
      float s_next[C::kKV / 8][4];
      for (int ci = 0; ci < chunks; ++ci) {
        issue_chunk(ci + C::kAhead - 1 + kS);
        start_scores<D>(qs, kv_tile(ci + 1, 0), warp, lane, s_next);
        const int64_t c0 = chunk_key(ci);
        int rel_pos[2];
        const int kv_rem = relative(c0, rel_pos);
        attend_chunk<D, kCap>(p, s_cur, kv_tile(ci, 1), lane, masked_at(c0), rel_pos, kv_rem, o, m_run, l_run, pa);
        cp_async_wait<kS - 1>();
        if (ci + 2 < chunks) rebuild_chunk(ci + 2);
        wgmma_wait_all();  // S of chunk ci + 1, P V of chunk ci
        fence_registers(o);
        fence_registers(s_next);
        fence_registers(pa);
#pragma unroll
        for (int n = 0; n < C::kKV / 8; ++n) {
#pragma unroll
          for (int e = 0; e < 4; ++e) s_cur[n][e] = s_next[n][e];
        }
        __syncthreads();
      }
    }
  } else {
    for (int ci = 0; ci < chunks; ++ci) {
      issue_chunk(ci + kS);     // into the staging chunk ci left
      cp_async_wait<kS - 1>();  // chunk ci + 1, copied two steps ago
      if (ci + 1 < chunks) rebuild_chunk(ci + 1);
      const int64_t c0 = chunk_key(ci);
      if (unit_active && !chunk_none(c0)) {
        float s[C::kKV / 8][4];
        start_scores<D>(qs, kv_tile(ci, 0), warp, lane, s);
        int rel_pos[2];
        const int kv_rem = relative(c0, rel_pos);
        uint32_t pa[C::kKV / 16][4];
        attend_chunk<D, kCap>(p, s, kv_tile(ci, 1), lane, chunk_masked(c0), rel_pos, kv_rem, o, m_run, l_run, pa);
      }
      __syncthreads();  // chunk ci + 1 rebuilt, chunk ci's tiles free, the plans of chunk ci + kS + 1 published
    }
  }
  if (refused) atomicOr(&s_bad, 1);
  __syncthreads();
  const bool poisoned = bad_request || s_bad != 0;
  if (!warp_active) return;

  const float nan = __int_as_float(0x7FFFFFFF);
#pragma unroll
  for (int h2 = 0; h2 < 2; ++h2) {
    float l = l_run[h2];
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 1);
    l += __shfl_xor_sync(0xFFFFFFFFu, l, 2);
    const int r = warp * 16 + g + 8 * h2;
    // A bad request's rows: those of the tile inside q (its q range may itself be the inconsistent entry).
    const int64_t token = int64_t{q_begin} + t0 + r / group;
    if (r >= rows || token < 0 || token >= p.nnz_q) continue;
    const int64_t qrow = token * p.Hq + head * group + r % group;
    const float inv = l == 0.f ? 0.f : 1.f / l;
    uint32_t* dst = reinterpret_cast<uint32_t*>(p.out + qrow * D);
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const float x = poisoned ? nan : o[n][2 * h2] * inv, y = poisoned ? nan : o[n][2 * h2 + 1] * inv;
      dst[n * 4 + t] = pack_bf16(x, y);
    }
    if (p.lse != nullptr && t == 0)
      p.lse[qrow] = poisoned ? nan : l == 0.f ? -INFINITY : (m_run[h2] + log2f(l)) / kLog2e;
  }
}

template <int D>
void launch(const Params& p, int64_t ctas, cudaStream_t stream);

}  // namespace zipkv::cuda::prefill_old
