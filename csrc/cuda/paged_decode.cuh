// The fused decode-attention kernel of zipkv::paged_decode: reads compressed and raw blocks of one paged cache in a
// single pass, copies them to shared memory still compressed (TMA bulk copies), rebuilds BF16 in registers right before
// the tensor-core instruction, and keeps an online softmax in float32. Split-KV (flash-decoding) with a merge kernel.
//
// Work split: one CTA per (request, kv head, split). Its warps (4; 6 in d 128's variant of 2 CTAs per SM, which the
// plan takes where 4-warp CTAs would end in a partial wave) take the split's 16-token tiles round-robin; each warp runs
// its own pipeline through a byte ring in shared memory and its own online softmax; the warps' states merge in shared
// memory at the end. At d 64 a warp takes two of its all-compressed tiles at once where it can (two rebuild chains to
// issue from). A tile's K blocks are contiguous in their stream, and so are its V blocks, so one lane moves a
// whole tile with two bulk copies (TMA, cp.async.bulk) completing on the tile's mbarrier.
//
// Page ids and meta rows are fetched long before use: once per round of 32 tiles each lane plans one tile of the
// next round (from meta words it started loading a round earlier) into a tile table in shared memory, so issuing a
// tile is a table read, a ring check and two copies (docs/decode-kernel.md has the versions and the profile).
//
// Tensor-core mapping (mma.sync.m16n8k16, bf16 in, fp32 accumulate; lane = 4 g + t), transposed so that the 16
// tokens of a tile fill the M dimension and the GQA group (at most 8 heads per N tile) the narrow N dimension: a
// group of 4 wastes half of N instead of three quarters of M, which halves the tensor-core work per tile.
//   S^T = K Q^T: M = 16 tokens, N = 8 heads, K = 16 dims. The A operand is K token-major: format.h's K positions
//     put exactly the lane's A registers together. Q^T (B operand) stays in registers for the whole kernel.
//   O^T = V^T P^T: M = 16 dims, N = 8 heads, K = 16 tokens. The A operand is V dim-major (format.h's V positions);
//     P^T is S^T's accumulators in bf16, moved into B-operand order by two movmatrix.trans per tile.
// A lane's 16 values of a block are 16 low bytes + 8 code bytes (compressed) or two 16-byte pieces 512 bytes apart
// (raw); they rebuild into 8 bf16x2 registers in position order with 2 code decodes (format.h decode_high_bytes: 2
// table permutes each) and 8 byte permutes, or are those registers as loaded. Position order is A-operand register
// order (format v3), so each group of four words is one mma's A operand as it stands. Both kinds of compressed block
// (12-bit and zero-aware, format v5) take the same rebuild: a byte permute of the block's 8-entry table (two words
// made from its descriptor) per 4 values, so no branch in the tile loop depends on the kind; the tile plan counts raw
// blocks as descriptors equal to 0x80 (raw_desc_bytes).
//
// Many query tokens per request (kMulti: paged_prefill's short queries, e.g. speculative verification with q_len 2-8):
// the same kernel with the N columns taken by a request's query rows (row r = token r / group, head r % group of the
// kv head's group) instead of its group's heads. A CTA takes one slot of `cols` (8, 16 or 32) consecutive rows of one
// request, found by a prefix sum over qo_indptr, so every tile it streams serves all of them: the KV is read once per
// slot, not once per query token. The rows' causal and window bounds differ by their token's offset in the slot
// (below 16), kept per MMA column in 4 bits; the grid covers the most slots any qo_indptr of this nnz_q and batch
// can make, and CTAs past the last real slot exit at once.
//
// Bad device contents cannot raise without a host sync, so they poison the result instead of being read: a page id
// out of range, a missing stream, a meta row tagged with another geometry or format version, an invalid descriptor,
// a stream past the end of data or an inconsistent page-table entry (indptr, last_page_len) turns that request's
// output and lse into NaN; no byte outside data is read.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "../format.h"
#include "block_io.cuh"
#include "request_search.cuh"
#include "softmax.cuh"

namespace zipkv::cuda::decode {

constexpr int kMergeRows = 8;       // query rows (one warp each) per CTA of the split merge
constexpr int kMaxSplits = 64;      // the merge's lanes hold two splits each
constexpr uint8_t kDescBad = 0xFF;  // not a format descriptor: the block was not copied; the request becomes NaN

struct Params {
  const uint16_t* q;          // [batch, Hq, D]
  const uint8_t* data;        // [data_bytes]
  const int32_t* meta;        // [num_pages, 2, H, words]
  const int32_t* kv_indptr;   // [batch + 1]
  const int32_t* kv_indices;  // [nnz]
  const int32_t* kv_last;     // [batch]
  uint16_t* out;              // [batch, Hq, D]           (num_splits == 1)
  float* lse;                 // [batch, Hq] or nullptr   (num_splits == 1), natural log
  float* part_o;              // [splits, batch, Hq, D]   (num_splits > 1), normalised per split
  float* part_lse;            // [splits, batch, Hq]      (num_splits > 1), log2 domain
  int64_t data_bytes, num_pages, nnz;
  int batch, Hq, H, group, page_size, words, num_splits;
  int window_left;   // >= 0: attend to each request's last window_left + 1 tokens only; -1: to all
  float scale_log2;  // sm_scale * log2(e): the softmax runs in base 2
  // Soft cap (cap_log2 > 0): logit = cap * tanh(q.k * sm_scale / cap), in base 2: cap_log2 * tanh(q.k * scale_cap).
  float cap_log2, scale_cap;  // cap * log2(e), sm_scale / cap
  int64_t slots;              // CTAs per kv head and split: batch, or (kMulti) at most nnz_q x group / cols + batch
  int64_t rows;               // rows of out, and of part_o per split: batch x Hq, or (kMulti) nnz_q x Hq
  // kMulti only: request b's query tokens are q[qo_indptr[b]:qo_indptr[b + 1]] ([nnz_q, Hq, D]); token i sits at
  // position kv_len - q_len + i; causal: it attends to keys up to its own position; a CTA holds `cols` rows.
  const int32_t* qo_indptr;  // [batch + 1]
  int nnz_q, cols, causal;
};

// kMulti's slots of 32 columns (four head tiles, d <= 128): O alone is 128 registers a thread at d 128, so K and V
// are rebuilt a block at a time right before their MMAs (the kernel's main loop) and Q stays in shared memory (its
// fragments would take 64 registers). (Two head tiles at d 128 the same way, for 3 CTAs per SM as decode's one head
// tile has: 168 registers and 56 bytes of spills with Q in registers, and with Q in shared memory a warp's ring no
// longer holds two raw tiles: not built.)
template <int kHeadTiles>
constexpr bool kBlockwise = kHeadTiles == 4;
template <int kHeadTiles>
constexpr int q_smem_cols() {
  return kBlockwise<kHeadTiles> ? 8 * kHeadTiles : 0;
}

// Bytes of a tile record (TileRec<D>, below): at d 64 it carries its blocks' tables too.
template <int D>
constexpr int kTileRecBytes = D == 64 ? 64 : 32;

// Geometry and pipeline depth per head_dim, target residency (kCtas CTAs per SM) and warps per CTA. Each warp owns a
// byte ring in shared memory as large as kCtas CTAs per SM leave room for; a tile takes exactly its stored size (K
// bytes then V bytes), so compressed tiles keep 4/3 more tiles in flight than raw ones in the same room. kSlots bounds
// the tiles in the ring at once (one mbarrier each). kQCols: 0, Q^T's fragments held in registers; else the columns
// of Q kept in shared memory (rows of D + 8 bf16: conflict-free ldmatrix), each tile reading its fragments from there
// (q_smem_cols, below).
template <int D, int kCtas = 1, int kWarps = 4, int kQCols = 0>
struct Cfg {
  static constexpr int kThreads = 32 * kWarps;
  static constexpr bool kQShared = kQCols > 0;
  static constexpr int kQStride = D + 8;
  static constexpr int kQBytes = kQCols * kQStride * 2;
  static constexpr int kMergeRows = kQCols > 16 ? kQCols : 16;  // a warp's rows in the warp merge
  static constexpr int kBlocks = D / kBlockDims;                // blocks per tile, of K and of V each
  static constexpr int kMaxTileBytes = 2 * kBlocks * kRawBlockBytes;
  static constexpr int kMinTileBytes = 2 * kBlocks * kCompBlockBytes;
  static constexpr int kTableBytes = kWarps * 64 * kTileRecBytes<D>;  // per warp, two rounds of 32 tile records
  // sm_90: 227 KB of shared memory per SM for CTAs, 1 KB of it reserved per CTA; 1 KB here for the mbarriers.
  static constexpr int kCtaBytes = 227 * 1024 / kCtas - 1024;
  static constexpr int kRingBytes = (kCtaBytes - kTableBytes - kQBytes - 1024) / kWarps / 256 * 256;
  static constexpr int kSlots = kRingBytes / kMinTileBytes;
  static constexpr int kPipeBytes = kWarps * kRingBytes;
  static constexpr int kBarBytes = kWarps * kSlots * 8;  // one mbarrier per warp and slot
  static constexpr int kSmemBytes = kPipeBytes + kBarBytes + kTableBytes + kQBytes;
  static_assert(kRingBytes >= 2 * kMaxTileBytes, "a warp's ring holds two tiles of any kind");
  static_assert(kBarBytes <= 1024 && kSmemBytes <= kCtaBytes, "the CTAs fit on one SM");
  static_assert(kWarps * kMergeRows * D * 4 + kWarps * kMergeRows * 2 * 4 <= kPipeBytes,
                "warp merge reuses the pipeline buffers");
  static_assert(kBarBytes % 16 == 0, "the tile records after the mbarriers stay aligned");
};

// The Cfg of one kernel variant (the kernel, its launch and its occupancy query read the same one).
template <int D, bool kMulti, int kHeadTiles, int kCtas, int kWarps>
using VariantCfg = Cfg<D, kCtas, kWarps, q_smem_cols<kHeadTiles>()>;

// ---------------------------------------------------------------------------------------------- PTX wrappers
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Four 8x8 b16 matrices from shared memory: lane l gives row l % 8 of matrix l / 8, and gets row l / 4, elements
// 2 (l % 4) and 2 (l % 4) + 1 of each.
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void mbar_init(uint32_t bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrives on bar (its only arrival per phase) announcing `bytes` of bulk copies that will complete on it.
__device__ __forceinline__ void mbar_arrive_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}
// global -> shared bulk copy (16-byte aligned, size a multiple of 16) completing on bar.
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// Orders this thread's earlier generic-proxy shared-memory accesses before later bulk copies into the same bytes.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// d += A * B for one m16n8k16 step (A: rows g, g + 8 of columns 2t.., 2t + 8..; B: column g of rows 2t.., 2t + 8..;
// d: rows g (d[0], d[1]) and g + 8 (d[2], d[3]) of columns 2t, 2t + 1).
__device__ __forceinline__ void mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                    uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The transpose of an 8x8 bf16 matrix held as one register per lane (row g, columns 2t, 2t + 1).
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Bytes of x that are invalid descriptors (0xF9..0xFF: low 7 bits + 7 reach bit 7) keep their top bit; the rest
// are 0.
static_assert(kDescLast == 0xF8, "invalid_desc_bytes tests for 0xF9..0xFF");
__device__ __forceinline__ uint32_t invalid_desc_bytes(uint32_t x) {
  return x & 0x80808080u & ((x & 0x7F7F7F7Fu) + 0x07070707u);
}

// Bytes of x that are kDescRaw (0x80) keep their top bit; the rest are 0 (an exact zero-byte test of x ^ 0x80...).
__device__ __forceinline__ uint32_t raw_desc_bytes(uint32_t x) {
  const uint32_t y = x ^ 0x80808080u;
  return ~(((y & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) | y) & 0x80808080u;
}

// ---------------------------------------------------------------------------------------------- block rebuild
// The lane's 16 values of a block (at `block` in shared memory, stored as in global memory) as 8 bf16x2 registers
// in position order. Every load below is conflict-free: 16 bytes per lane at a 16-byte stride (or 8 at 8).
// Compressed: 16 low bytes at 16 lane and 8 code bytes at 512 + 8 lane.
// The block's table (t0, t1: format.h code_table) comes from table_at or, at d 64, from the tile record.
__device__ __forceinline__ void rebuild_compressed(const uint8_t* block, const uint2& table, int lane, uint32_t r[8]) {
  decode_lane(*reinterpret_cast<const uint4*>(block + 16 * lane),
              *reinterpret_cast<const uint2*>(block + kLowBytes + 8 * lane), table.x, table.y, r);
}

// Raw: the lane's words 0-3 at 16 lane, 4-7 at 512 + 16 lane (format.h raw_index).
__device__ __forceinline__ void rebuild_raw(const uint8_t* block, int lane, uint32_t r[8]) {
  const uint4 a = *reinterpret_cast<const uint4*>(block + 16 * lane);
  const uint4 b = *reinterpret_cast<const uint4*>(block + kRawHalfBytes + 16 * lane);
  r[0] = a.x, r[1] = a.y, r[2] = a.z, r[3] = a.w, r[4] = b.x, r[5] = b.y, r[6] = b.z, r[7] = b.w;
}

// Either kind of block, without a branch (raw and compressed blocks mix in real KV). Both kinds keep the lane's first
// 16 bytes at 16 lane; the second load takes 16 bytes at 512 + 16 x, x = lane (raw: words 4-7) or lane / 2
// (compressed: the code bytes of this lane and its neighbour, the lane's own half picked by its parity). A refused
// block (kDescBad) reads whatever is there; the caller turns the request's result into NaN. The compressed rebuild
// is decode_lane's, written out with the select per word pair: calling decode_lane and selecting afterwards keeps
// both 8-word sets live (d 128: 147 -> 155 registers).
__device__ __forceinline__ void rebuild_any(const uint8_t* block, uint8_t desc, const uint2& table, int lane,
                                            uint32_t r[8]) {
  static_assert(kLowBytes == kRawHalfBytes, "both kinds' second loads start 512 bytes into the block");
  const bool raw = desc == kDescRaw;
  const uint4 a = *reinterpret_cast<const uint4*>(block + 16 * lane);
  const uint4 b = *reinterpret_cast<const uint4*>(block + kRawHalfBytes + 16 * (raw ? lane : lane / 2));
  const uint32_t c0 = lane % 2 ? b.z : b.x, c1 = lane % 2 ? b.w : b.y;
  uint32_t h[4];
  decode_high_bytes(c0, table.x, table.y, &h[0], &h[1]);
  decode_high_bytes(c1, table.x, table.y, &h[2], &h[3]);
  const uint32_t l[4] = {a.x, a.y, a.z, a.w}, rw[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    r[2 * j] = raw ? rw[2 * j] : __byte_perm(l[j], h[j], 0x5140);
    r[2 * j + 1] = raw ? rw[2 * j + 1] : __byte_perm(l[j], h[j], 0x7362);
  }
}

// ---------------------------------------------------------------------------------------------- tile table
// What issuing one tile needs about its two streams (K, V) of this kv head. Lane k of a warp holds the entry of the
// warp's tile 32 b + k; the loads behind an entry are made a whole round of 32 tiles before it is used.
template <int D>
struct Entry {
  static constexpr int kDescWords = Cfg<D>::kBlocks >= 4 ? Cfg<D>::kBlocks / 4 : 1;
  int32_t page;                  // < 0 or >= num_pages: refused
  int32_t start[2];              // meta word 0 of the K and V rows (256-byte units; < 0: no stream)
  uint32_t desc[2][kDescWords];  // the descriptor words holding the tile's blocks
  uint32_t before[2];            // raw blocks of the stream in the descriptor words before those
  uint32_t bad_before;           // invalid descriptors in those words
};

// Starts the loads of an entry (page ids come from a round earlier). For page_size > 16 the earlier descriptor words
// of the stream are counted here, which waits for them (L1/L2 hits mostly: the page's other tiles read the row).
template <int D>
__device__ __forceinline__ void load_entry(const Params& p, int head, int32_t page, int tile_in_page, Entry<D>& e) {
  constexpr int kB = Cfg<D>::kBlocks;
  const bool ok = page >= 0 && page < p.num_pages;
  e.page = ok ? page : -1;
  e.bad_before = 0;
  const int first_word = tile_in_page * kB / 4;  // the descriptor word holding the tile's first block
#pragma unroll
  for (int kv = 0; kv < 2; ++kv) {
    e.start[kv] = -1, e.before[kv] = 0;
#pragma unroll
    for (int w = 0; w < Entry<D>::kDescWords; ++w) e.desc[kv][w] = 0;
    if (!ok) continue;  // never read meta rows that do not exist
    const uint32_t* row = reinterpret_cast<const uint32_t*>(p.meta + ((int64_t{page} * 2 + kv) * p.H + head) * p.words);
    // A row whose tag is not this call's geometry and version reads as no stream: refused, the request NaN.
    const bool tagged = static_cast<int32_t>(__ldg(row + 1)) == meta_tag(p.page_size, D);
    e.start[kv] = tagged ? static_cast<int32_t>(__ldg(row)) : -1;
#pragma unroll
    for (int w = 0; w < Entry<D>::kDescWords; ++w) e.desc[kv][w] = __ldg(row + kMetaHeaderWords + first_word + w);
    for (int w = 0; w < first_word; ++w) {
      const uint32_t x = __ldg(row + kMetaHeaderWords + w);
      e.before[kv] += __popc(raw_desc_bytes(x));
      e.bad_before |= invalid_desc_bytes(x);
    }
  }
}

// Which straight-line rebuild a stream of a tile takes: every block compressed, every block raw, a mix (its raw
// blocks in a bit mask: one line per pattern of each pair of blocks), or, for a refused stream and for mixes at
// d 256, the general rebuild that finds each block after the ones before it.
constexpr uint32_t kAllComp = 1, kAllRaw = 2, kMixed = 3;

// A tile planned for issue, 32 bytes in the warp's tile table (64 at d 64, below): descriptors (kDescBad for a
// refused stream), where its K and V bytes are, how many, and each stream's kind (bits 0-1 K, 2-3 V; 0: refused) and
// raw-block mask (bits 8-15 K, 16-23 V).
struct TileRecBase {
  uint4 descs;      // K descriptor bytes, then V's
  uint32_t src[2];  // K, V byte offsets in data / 256
  uint32_t bytes;   // K bytes | V bytes << 16 (0 for a refused stream)
  uint32_t kinds;
};
// At d 64 the record also holds the tables of the tile's 4 blocks (K's two, then V's: format.h code_table), made once
// by the planning lane instead of by every lane at every block (table_at): a d-64 tile brings half the bytes of a
// d-128 one for the same per-tile work, so there each instruction on a warp's path shows (decode-kernel.md, v18).
template <int D>
struct TileRec : TileRecBase {};
template <>
struct TileRec<64> : TileRecBase {
  uint2 tables[4];
};

// Validates an entry and plans its tile. Each lane plans its own tile of a round of 32, so this runs once per tile.
template <int D>
__device__ __forceinline__ TileRec<D> plan_tile(const Params& p, int tile_in_page, const Entry<D>& e) {
  constexpr int kB = Cfg<D>::kBlocks, kW = Entry<D>::kDescWords;
  static_assert(sizeof(TileRec<D>) == kTileRecBytes<D>, "Cfg sizes the tile table by kTileRecBytes");
  TileRec<D> t;
  uint8_t descs[2 * kB];
  t.kinds = 0;
#pragma unroll
  for (int kv = 0; kv < 2; ++kv) {
    uint32_t dw[kW], inval = e.bad_before, before = e.before[kv];
#pragma unroll
    for (int w = 0; w < kW; ++w) dw[w] = e.desc[kv][w];
    if constexpr (kB == 2) {  // the tile is half of a descriptor word
      if (tile_in_page % 2) {
        before += __popc(raw_desc_bytes(dw[0] & 0xFFFFu));
        inval |= invalid_desc_bytes(dw[0] & 0xFFFFu);
        dw[0] >>= 16;
      } else {
        dw[0] &= 0xFFFFu;
      }
    }
    uint32_t raw = 0;
#pragma unroll
    for (int w = 0; w < kW; ++w) {
      inval |= invalid_desc_bytes(dw[w]);
      raw += __popc(raw_desc_bytes(dw[w]));
    }
    const int64_t begin = int64_t{e.start[kv]} * kStreamAlign + int64_t{kCompBlockBytes} * tile_in_page * kB +
                          int64_t{kRawBlockBytes - kCompBlockBytes} * before;
    const uint32_t bytes = kCompBlockBytes * kB + (kRawBlockBytes - kCompBlockBytes) * raw;
    const bool ok = e.page >= 0 && e.start[kv] >= 0 && inval == 0 && begin + bytes <= p.data_bytes;
    t.src[kv] = ok ? static_cast<uint32_t>(begin / kStreamAlign) : 0;
    uint32_t mask = 0;
#pragma unroll
    for (int c = 0; c < kB; ++c) {
      const uint8_t d = static_cast<uint8_t>(dw[c / 4] >> (8 * (c % 4)));
      descs[kv * kB + c] = ok ? d : kDescBad;
      mask |= static_cast<uint32_t>(d == kDescRaw) << c;
    }
    if (ok) t.kinds |= (raw == 0 ? kAllComp : raw == kB ? kAllRaw : kMixed) << (2 * kv) | mask << (8 + 8 * kv);
    if (kv == 0) t.bytes = ok ? bytes : 0;
    else t.bytes |= (ok ? bytes : 0) << 16;
  }
  uint32_t packed[4] = {0, 0, 0, 0};
#pragma unroll
  for (int j = 0; j < 2 * kB; ++j) packed[j / 4] |= static_cast<uint32_t>(descs[j]) << (8 * (j % 4));
  t.descs = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  if constexpr (D == 64) {
#pragma unroll
    for (int j = 0; j < 2 * kB; ++j) code_table(descs[j], &t.tables[j].x, &t.tables[j].y);
  }
  return t;
}

// Lane 0 starts the tile's two bulk copies (K bytes, then V bytes right after) into dst on the slot's mbarrier.
__device__ __forceinline__ void issue_tile(const Params& p, const TileRecBase& t, uint8_t* dst, uint32_t bar) {
  const uint32_t kb = t.bytes & 0xFFFFu, vb = t.bytes >> 16;
  fence_proxy_async();  // the warp's reads of these bytes (ordered by the caller's __syncwarp) come first
  mbar_arrive_expect(bar, kb + vb);
  if (kb) bulk_copy(smem_addr(dst), p.data + uint64_t{t.src[0]} * kStreamAlign, kb, bar);
  if (vb) bulk_copy(smem_addr(dst + kb), p.data + uint64_t{t.src[1]} * kStreamAlign, vb, bar);
}

// Bytes a block takes in the ring: a refused stream was not copied at all.
__device__ __forceinline__ int block_size(uint8_t desc) {
  return desc == kDescRaw ? kRawBlockBytes : desc == kDescBad ? 0 : kCompBlockBytes;
}

__device__ __forceinline__ uint8_t desc_at(const uint4& d, int j) {
  const uint32_t w = j < 4 ? d.x : j < 8 ? d.y : j < 12 ? d.z : d.w;
  return static_cast<uint8_t>(w >> (8 * (j % 4)));
}

// format.h code_table(desc_at(d, j)) in five instructions instead of seven (j is a constant in every caller): two byte
// permutes broadcast descriptor j into all four bytes and its zero-aware bit 7 into byte 3's mask.
__device__ __forceinline__ uint2 table_at(const uint4& d, int j) {
  const uint32_t w = j < 4 ? d.x : j < 8 ? d.y : j < 12 ? d.z : d.w;
  const uint32_t k = j % 4;
  uint32_t all, zero;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(all) : "r"(w), "r"(k * 0x1111u));
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(zero) : "r"(w), "r"((8u | k) << 12 | 0x444u));  // 0xFF000000 if bit 7
  return make_uint2(all + 0x03020100u, (all + 0x07060504u) & ~(zero & 0x7F000000u));
}

// Blocks kC, kC + 1 of a mixed stream (raw blocks in `mask`) in one straight line per pattern of the pair, so every
// load and permute is a fixed instruction instead of rebuild_any's both decodes and a select per word (~65 more
// instructions per d 128 stream). Pairs rather than whole streams: 14 whole-stream lines at d 128 made the loop's
// code too large and real KV slower (docs/decode-kernel.md, v12); a uniform branch does not wait for the loads
// before it, so the two pairs' loads are still in flight together.
template <int kB, int kC, typename Tables>
__device__ __forceinline__ void rebuild_pair(uint32_t mask, const uint8_t* base, const Tables& tables, int first,
                                             int lane, uint32_t (&r)[kB][8]) {
  const uint8_t* at =
      base + kCompBlockBytes * kC + (kRawBlockBytes - kCompBlockBytes) * __popc(mask & ((1u << kC) - 1));
  auto line = [&]<uint32_t kPair>() {
    if constexpr (kPair & 1) rebuild_raw(at, lane, r[kC]);
    else rebuild_compressed(at, tables(first + kC), lane, r[kC]);
    const uint8_t* next = at + ((kPair & 1) ? kRawBlockBytes : kCompBlockBytes);
    if constexpr (kPair & 2) rebuild_raw(next, lane, r[kC + 1]);
    else rebuild_compressed(next, tables(first + kC + 1), lane, r[kC + 1]);
  };
  switch ((mask >> kC) & 3u) {
    case 0:
      if constexpr (kB > 2) line.template operator()<0>();
      break;  // a 2-block mix is pattern 1 or 2
    case 1: line.template operator()<1>(); break;
    case 2: line.template operator()<2>(); break;
    default:
      if constexpr (kB > 2) line.template operator()<3>();
      break;
  }
}

// ---------------------------------------------------------------------------------------------- the kernel
template <int D, bool kMulti, int kHeadTiles, int kCtas, int kWarps>
__global__ void __launch_bounds__(32 * kWarps, kCtas) paged_decode_kernel(const Params p) {
  using C = VariantCfg<D, kMulti, kHeadTiles, kCtas, kWarps>;
  constexpr int kB = C::kBlocks, kSlots = C::kSlots, kN = kHeadTiles;
  static_assert(kN != 4 || (kMulti && D <= 128), "4 head tiles: kMulti's 32 rows, O in at most 128 registers");
  // Mixed streams take rebuild_pair's lines at d 64 and 128 with one head tile; with two head tiles (d 64: 128
  // registers at 4 CTAs/SM) they would spill, and d 256 has too many pairs.
  constexpr bool kPairLines = kB <= 4 && kN == 1;
  // A tile's ring bytes are released once its V is in registers, before the softmax and PV. V then stays live
  // across them, which spills with two head tiles at d 64 (128 registers) and d 256: those release after PV.
  // With four head tiles V is rebuilt block by block inside P V (below): its bytes stay in the ring until then.
  constexpr bool kEarlyRelease = (kN == 1 || D == 128) && !kBlockwise<kN>;
  // Pairs of all-compressed tiles in one straight line (below) at d 64 with one head tile, where one tile's rebuild
  // chain leaves the warps stalled (v21). d 128 waits on memory instead, and has no registers to spare.
  constexpr bool kPairTiles = D == 64 && kN == 1;
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // The split merge (a programmatic dependent launch) may be scheduled once every CTA of this grid has started; it
  // waits for this grid's results itself.
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  // CTA x = (row, kv head, split) with the split fastest; decode's rows are requests, head-minor; kMulti's are slots,
  // head-major, so that a request's slots of one kv head run side by side (their tiles meet in L2).
  const int split = blockIdx.x % p.num_splits;
  const int64_t cta = blockIdx.x / p.num_splits;
  const int head = static_cast<int>(kMulti ? cta / p.slots : cta % p.H);
  int b, slot = 0;
  if constexpr (kMulti) {
    // Request b owns ceil(q_len_b x group / cols) slots (every warp finds its CTA's alone).
    const RequestUnit u = find_request_unit(p.qo_indptr, p.batch, p.nnz_q, p.group, p.cols, cta % p.slots, lane);
    if (u.request < 0) return;  // past the last slot
    b = u.request, slot = static_cast<int>(u.index);
  } else {
    b = static_cast<int>(cta / p.H);
  }

  // The request's page-table entries (and query range); an inconsistent one poisons the request.
  const int32_t begin = p.kv_indptr[b], end = p.kv_indptr[b + 1];
  const int32_t npages = end - begin, last = npages > 0 ? p.kv_last[b] : 0;
  bool bad_request = begin < 0 || npages < 0 || end > p.nnz || (npages > 0 && (last < 1 || last > p.page_size));
  int64_t seq_len = bad_request || npages == 0 ? 0 : static_cast<int64_t>(npages - 1) * p.page_size + last;
  // The CTA's MMA columns: decode, the group's heads of request b; kMulti, rows row0 .. row0 + n_cols - 1 of request
  // b's q_len x group (token r / group, head r % group).
  int64_t q_begin = 0, q_len = 1, row0 = 0;
  int n_cols = p.group;
  if constexpr (kMulti) {
    q_begin = __ldg(p.qo_indptr + b);
    q_len = __ldg(p.qo_indptr + b + 1) - q_begin;
    bad_request |= __ldg(p.qo_indptr) != 0 || __ldg(p.qo_indptr + p.batch) != p.nnz_q || q_begin < 0 ||
                   q_begin + q_len > p.nnz_q || __ldg(p.kv_indptr) != 0 || (p.causal && q_len > seq_len);
    if (bad_request) seq_len = 0;
    row0 = int64_t{slot} * p.cols;
    n_cols = static_cast<int>(min(int64_t{p.cols}, min(max(q_len, int64_t{0}), int64_t{p.nnz_q}) * p.group - row0));
  }
  // Column c's row of q and out, and whether it is one (a bad request's query range may leave q).
  auto out_row = [&](int c) -> int64_t {
    if constexpr (kMulti) return (q_begin + (row0 + c) / p.group) * p.Hq + head * p.group + (row0 + c) % p.group;
    else return static_cast<int64_t>(b) * p.Hq + static_cast<int64_t>(head) * p.group + c;
  };
  auto is_row = [&](int c) {
    if constexpr (kMulti) return c < n_cols && q_begin + (row0 + c) / p.group < p.nnz_q && q_begin >= 0;
    else return c < n_cols;
  };
  // Keys column c attends to: [lo, hi) with lo = lo_min + its dlo and hi = hi_min + its dhi, both offsets below 16
  // (the slot's tokens span at most 16). Decode: the window's first token to seq_len for every head. A sliding
  // window's tiles before its tile are not part of the CTA's work at all (never loaded); inside a tile, tokens outside
  // a column's bounds are masked like those past the end.
  int64_t lo_min, lo_max, hi_min, hi_max;
  auto bounds = [&](int64_t i, int64_t& lo, int64_t& hi) {  // of query token i (decode: 0 of q_len 1)
    const int64_t pos = seq_len - q_len + i;
    hi = kMulti && !p.causal ? seq_len : pos + 1;
    lo = p.window_left >= 0 ? max(int64_t{0}, pos - p.window_left) : 0;
    if (bad_request) lo = hi = 0;
  };
  bounds(row0 / p.group, lo_min, hi_min);
  bounds((row0 + max(n_cols, 1) - 1) / p.group, lo_max, hi_max);
  uint32_t dlo = 0, dhi = 0;  // 4 bits per column of the lane: column 8 n + 2 t + j at bits 4 (2 n + j)
  if constexpr (kMulti) {
#pragma unroll
    for (int n = 0; n < kHeadTiles; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        int64_t lo, hi;
        bounds((row0 + min(8 * n + 2 * (lane % 4) + j, max(n_cols, 1) - 1)) / p.group, lo, hi);
        dlo |= static_cast<uint32_t>(lo - lo_min) << (4 * (2 * n + j));
        dhi |= static_cast<uint32_t>(hi - hi_min) << (4 * (2 * n + j));
      }
  }
  const int64_t first = lo_min;
  const int first_tile = static_cast<int>(first / kTileTokens);
  const int n_tiles = max(0, static_cast<int>((hi_max + kTileTokens - 1) / kTileTokens) - first_tile);
  const int per_split = ((n_tiles + p.num_splits - 1) / p.num_splits + kWarps - 1) / kWarps * kWarps;
  const int chunk_begin = first_tile + min(split * per_split, n_tiles);
  const int chunk_end = min(chunk_begin + per_split, first_tile + n_tiles);
  const int n_mine = max(0, (chunk_end - chunk_begin - warp + kWarps - 1) / kWarps);  // this warp's tiles
  const int tiles_per_page = p.page_size / kTileTokens;
  auto tile_of = [&](int i) { return chunk_begin + warp + i * kWarps; };

  // Q^T fragments (B operand): column 8 n + g, dims 16 kc + {2t, 2t+1} and 16 kc + {2t+8, 2t+9}; in registers, or
  // (C::kQShared) column c's dims in row c of the Q tile, zeros where c is no row.
  constexpr int kQN = C::kQShared ? 1 : kN, kQK = C::kQShared ? 1 : D / 16;
  uint32_t qb[kQN][kQK][2];
  uint16_t* const qs = reinterpret_cast<uint16_t*>(smem + C::kPipeBytes + C::kBarBytes + C::kTableBytes);
  if constexpr (C::kQShared) {
    for (int x = threadIdx.x; x < 8 * kN * (D / 8); x += C::kThreads) {
      const int col = x / (D / 8), piece = x % (D / 8);
      const uint4 v = is_row(col) ? *reinterpret_cast<const uint4*>(p.q + out_row(col) * D + 8 * piece)
                                  : make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(qs + col * C::kQStride + 8 * piece) = v;
    }
    __syncthreads();
  } else {
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const int col = 8 * n + g;
      const bool real = is_row(col);
      const int64_t qrow = real ? out_row(col) : 0;
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int dim = 16 * kc + 2 * t + 8 * j;
          qb[n][kc][j] = real ? *reinterpret_cast<const uint32_t*>(p.q + qrow * D + dim) : 0u;
        }
    }
  }
  // Q^T's fragments of N tile n for 32-dim block c: k-step 2c's two registers, then k-step 2c + 1's.
  auto q_frag = [&](int n, int c, uint32_t (&f)[4]) {
    if constexpr (C::kQShared) {
      ldmatrix_x4(f, qs + (8 * n + lane % 8) * C::kQStride + 32 * c + 8 * (lane / 8));
    } else {
      f[0] = qb[n][2 * c][0], f[1] = qb[n][2 * c][1], f[2] = qb[n][2 * c + 1][0], f[3] = qb[n][2 * c + 1][1];
    }
  };

  uint8_t* ring = smem + warp * C::kRingBytes;
  const uint32_t bars = smem_addr(smem + C::kPipeBytes) + warp * kSlots * 8;
  if (lane == 0) {
#pragma unroll
    for (int s = 0; s < kSlots; ++s) mbar_init(bars + 8 * s);
    mbar_init_fence();
  }
  __syncwarp();

  // Tile table: records of the warp's tiles, two rounds of 32 (round k in half k % 2). At refresh(k) lane j plans
  // tile 32 k + j from the meta words it started loading at refresh(k - 1), then starts the loads for round k + 1
  // (whose page ids it loaded at refresh(k - 1)) and the page ids of round k + 2: nothing waits on memory.
  TileRec<D>* table = reinterpret_cast<TileRec<D>*>(smem + C::kPipeBytes + C::kBarBytes) + warp * 64;
  auto page_id = [&](int i) { return i < n_mine ? __ldg(p.kv_indices + begin + tile_of(i) / tiles_per_page) : -1; };
  Entry<D> pending;
  load_entry<D>(p, head, page_id(lane), tile_of(lane) % tiles_per_page, pending);
  int32_t ids_next = page_id(32 + lane);
  int refreshed = -1;
  auto refresh = [&](int k) {
    table[(k % 2) * 32 + lane] = plan_tile<D>(p, tile_of(32 * k + lane) % tiles_per_page, pending);
    load_entry<D>(p, head, ids_next, tile_of(32 * (k + 1) + lane) % tiles_per_page, pending);
    ids_next = page_id(32 * (k + 2) + lane);
    refreshed = k;
    __syncwarp();
  };

  // Ring state, the same in every lane: the ring's byte positions where the next tile goes (head) and where the
  // oldest tile in it starts (tail), and the bytes in use between them. A tile that would run past the ring's end
  // starts at 0, the bytes it skips counted as used until it is consumed; the consumer applies the same rule to the
  // same sizes in the same order, so it finds each tile without a record per slot.
  int issued = 0, head_at = 0, tail_at = 0, used = 0;
  auto fill = [&](int consumed) {  // issue while the next tile fits and a slot is free
    while (issued < n_mine && issued - consumed < kSlots) {
      if (issued / 32 != refreshed) refresh(issued / 32);
      const TileRec<D>& rec = table[(issued / 32 % 2) * 32 + issued % 32];
      const uint32_t bytes = rec.bytes;
      const int size = static_cast<int>((bytes & 0xFFFFu) + (bytes >> 16));
      const bool wrap = head_at + size > C::kRingBytes;
      const int skip = wrap ? C::kRingBytes - head_at : 0;
      if (used + skip + size > C::kRingBytes) break;
      const int start = wrap ? 0 : head_at;
      if (lane == 0) issue_tile(p, rec, ring + start, bars + 8 * (issued % kSlots));
      head_at = start + size;
      used += skip + size;
      ++issued;
    }
  };

  // O^T accumulators: o[mt][n] holds dims 16 mt + g (0, 1) and 16 mt + g + 8 (2, 3) of heads 8 n + 2t (0, 2) and
  // 8 n + 2t + 1 (1, 3). Softmax state per head of the lane: m_run[n][j], l_run[n][j] for head 8 n + 2t + j, l_run
  // summed over the lane's tokens only (the lanes of a head add up at the end).
  float o[D / 16][kN][4];
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) o[mt][n][j] = 0.f;
  float m_run[kN][2], l_run[kN][2];
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) m_run[n][j] = -INFINITY, l_run[n][j] = 0.f;
  bool refused = false;  // a block of the request was refused: its out and lse become NaN

  // Block j's table: from the record at d 64 (read where it is used: the record stays until a round later), else
  // from its descriptor.
  auto tables_of = [](const TileRec<D>& rec, const uint4& descs, int j) {
    if constexpr (D == 64) return rec.tables[j];
    else return table_at(descs, j);
  };

  // The softmax of one tile whose S^T (st: the sum of its two halves' accumulators) is ready, into P^T (pb, B operand
  // order); token k of the tile weighs 0 for a column unless lo <= k - its dlo and k - its dhi < hi (lo = lo_min and
  // hi = hi_min relative to the tile's first token).
  auto weigh = [&](const float (&st)[kN][4], int hi, int lo, uint32_t (&pb)[kN][2]) {
    // Online softmax (base 2) per head; the 8 lanes of a head (g = 0..7, same t) share its running max m_run. A tile
    // whose logits all stay within kMaxSlack of m_run is weighed against the stale m_run as it is: its weights stay
    // below 2^kMaxSlack (as exact in float32 and bf16 as weights below 1), so it needs no cross-lane max and no
    // rescale of O. Only a tile where some lane's logit passes m_run + kMaxSlack (a head's first tile, rarely a later
    // one) takes the full update: the max over the head's lanes, then l and O rescaled to it.
    float x[kN][4];
    if (p.cap_log2 > 0.f) {
#pragma unroll
      for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) x[n][j] = p.cap_log2 * tanhf(st[n][j] * p.scale_cap);
    } else {
#pragma unroll
      for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) x[n][j] = st[n][j] * p.scale_log2;
    }
    bool grow = false;
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int dl = kMulti ? (dlo >> (4 * (2 * n + j))) & 15 : 0, dh = kMulti ? (dhi >> (4 * (2 * n + j))) & 15 : 0;
        x[n][j] = g - dl >= lo && g - dh < hi ? x[n][j] : -INFINITY;
        x[n][2 + j] = g + 8 - dl >= lo && g + 8 - dh < hi ? x[n][2 + j] : -INFINITY;
        grow |= fmaxf(x[n][j], x[n][2 + j]) > m_run[n][j] + kMaxSlack;  // m_run = -inf: any kept token
      }
    if (__any_sync(0xFFFFFFFFu, grow)) {
      float alpha[kN][2];
#pragma unroll
      for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float mx = fmaxf(x[n][j], x[n][2 + j]);
          mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 4));
          mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 8));
          mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 16));
          const float m_new = fmaxf(m_run[n][j], mx);
          alpha[n][j] = m_new == m_run[n][j] ? 1.f : exp2_approx(m_run[n][j] - m_new);  // m_run = -inf: 0
          l_run[n][j] *= alpha[n][j];
          m_run[n][j] = m_new;
        }
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
        for (int n = 0; n < kN; ++n)
#pragma unroll
          for (int j = 0; j < 4; ++j) o[mt][n][j] *= alpha[n][j % 2];
    }
#pragma unroll
    for (int n = 0; n < kN; ++n) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float m_use = m_run[n][j] == -INFINITY ? 0.f : m_run[n][j];  // all masked so far: avoid -inf - -inf
        x[n][j] = exp2_approx(x[n][j] - m_use);
        x[n][2 + j] = exp2_approx(x[n][2 + j] - m_use);
        l_run[n][j] += x[n][j] + x[n][2 + j];
      }
      // P^T for the PV product: tokens 2t, 2t + 1 (then 2t + 8, 2t + 9) of head 8 n + g.
      pb[n][0] = transpose8x8(pack_bf16(x[n][0], x[n][1]));
      pb[n][1] = transpose8x8(pack_bf16(x[n][2], x[n][3]));
    }
  };
  // O^T += V^T P^T for block c's V words (vc): words 4 h .. 4 h + 3 are, in order, the A registers of its 16-dim tile
  // 2 c + h (dims 32 c + 16 h + g, then + 8, of tokens 2t.., then 2t + 8..).
  auto pv_block = [&](int c, const uint32_t (&vc)[8], const uint32_t (&pb)[kN][2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int n = 0; n < kN; ++n)
        mma(o[2 * c + h][n], vc[4 * h], vc[4 * h + 1], vc[4 * h + 2], vc[4 * h + 3], pb[n][0], pb[n][1]);
  };
  // Softmax and P V of a tile whose V registers (vr) are ready.
  auto attend = [&](const float (&st)[kN][4], const uint32_t (&vr)[kB][8], int hi, int lo) {
    uint32_t pb[kN][2];
    weigh(st, hi, lo, pb);
#pragma unroll
    for (int c = 0; c < kB; ++c) pv_block(c, vr[c], pb);
  };

  if (n_mine > 0) fill(0);
  for (int i = 0; i < n_mine; ++i) {
    // Tile i's record and place in the ring are known before its bytes land: only the shared loads wait for them.
    const TileRec<D>& rec = table[(i / 32 % 2) * 32 + i % 32];
    const uint4 descs = rec.descs;
    const uint32_t kinds = rec.kinds, k_bytes = rec.bytes & 0xFFFFu;
    const int size = static_cast<int>(k_bytes + (rec.bytes >> 16));
    const bool wrap = tail_at + size > C::kRingBytes;
    const int start = wrap ? 0 : tail_at;
    const uint8_t* stage = ring + start;
    // Two tiles at once where both are all compressed and full and the second is already issued: one straight line
    // rebuilds and multiplies both, so each warp has two independent rebuild chains to issue from (d 64's warps stall
    // on one chain's latency: docs/decode-kernel.md, v18-v21), and the pair costs one release. Softmax and PV still
    // run tile by tile, in order, so the result is bit for bit the single-tile loop's. (All-raw pairs as well made
    // raw pages 1-3% faster and compressed ones up to 10% slower than this: v21.)
    if constexpr (kPairTiles) {
      constexpr uint32_t kTileComp = kAllComp | kAllComp << 2;
      const TileRec<D>& rec_b = table[((i + 1) / 32 % 2) * 32 + (i + 1) % 32];
      if (i + 1 < issued && kinds == kTileComp && rec_b.kinds == kTileComp &&
          hi_min - int64_t{kTileTokens} * tile_of(i + 1) >= kTileTokens &&
          int64_t{kTileTokens} * tile_of(i) >= lo_max) {
        const int size_b = static_cast<int>((rec_b.bytes & 0xFFFFu) + (rec_b.bytes >> 16));
        const bool wrap_b = start + size + size_b > C::kRingBytes;
        const int start_b = wrap_b ? 0 : start + size;
        const uint8_t* stage_b = ring + start_b;
        mbar_wait(bars + 8 * (i % kSlots), (i / kSlots) & 1);
        mbar_wait(bars + 8 * ((i + 1) % kSlots), ((i + 1) / kSlots) & 1);
        // Block j (K's, then V's) of both tiles.
        auto rebuild2 = [&](int j, uint32_t (&ra)[8], uint32_t (&rb)[8]) {
          rebuild_compressed(stage + kCompBlockBytes * j, tables_of(rec, descs, j), lane, ra);
          rebuild_compressed(stage_b + kCompBlockBytes * j, tables_of(rec_b, rec_b.descs, j), lane, rb);
        };
        uint32_t ka[kB][8], kb[kB][8];
#pragma unroll
        for (int c = 0; c < kB; ++c) rebuild2(c, ka[c], kb[c]);
        float sa[kN][4], sa2[kN][4], sb[kN][4], sb2[kN][4];
#pragma unroll
        for (int n = 0; n < kN; ++n)
#pragma unroll
          for (int j = 0; j < 4; ++j) sa[n][j] = 0.f, sa2[n][j] = 0.f, sb[n][j] = 0.f, sb2[n][j] = 0.f;
#pragma unroll
        for (int c = 0; c < kB; ++c)
#pragma unroll
          for (int n = 0; n < kN; ++n) {
            mma(sa[n], ka[c][0], ka[c][1], ka[c][2], ka[c][3], qb[n][2 * c][0], qb[n][2 * c][1]);
            mma(sa2[n], ka[c][4], ka[c][5], ka[c][6], ka[c][7], qb[n][2 * c + 1][0], qb[n][2 * c + 1][1]);
            mma(sb[n], kb[c][0], kb[c][1], kb[c][2], kb[c][3], qb[n][2 * c][0], qb[n][2 * c][1]);
            mma(sb2[n], kb[c][4], kb[c][5], kb[c][6], kb[c][7], qb[n][2 * c + 1][0], qb[n][2 * c + 1][1]);
          }
#pragma unroll
        for (int n = 0; n < kN; ++n)
#pragma unroll
          for (int j = 0; j < 4; ++j) sa[n][j] += sa2[n][j], sb[n][j] += sb2[n][j];
        uint32_t va[kB][8], vb[kB][8];
#pragma unroll
        for (int c = 0; c < kB; ++c) rebuild2(kB + c, va[c], vb[c]);
        // Both tiles are in registers: release them (tile i's bytes, then tile i + 1's, as the single loop would).
        used -= (wrap ? C::kRingBytes - tail_at : 0) + size;
        tail_at = start + size;
        used -= (wrap_b ? C::kRingBytes - tail_at : 0) + size_b;
        tail_at = start_b + size_b;
        __syncwarp();
        // The refill (which may plan a round of tiles) waits for tile i's softmax and PV, so that only tile i + 1's V
        // registers stay live across it (before it, they spilled).
        attend(sa, va, kTileTokens, -kTileTokens);
        fill(i + 2);
        attend(sb, vb, kTileTokens, -kTileTokens);
        ++i;
        continue;
      }
    }
    refused |= (invalid_desc_bytes(descs.x) | invalid_desc_bytes(descs.y) | invalid_desc_bytes(descs.z) |
                invalid_desc_bytes(descs.w)) != 0;         // only kDescBad is invalid here
    mbar_wait(bars + 8 * (i % kSlots), (i / kSlots) & 1);  // tile i has landed
    // The columns' bounds relative to the tile's first token, clamped to what a tile can tell apart.
    const int64_t tile0 = int64_t{kTileTokens} * tile_of(i);
    const int lo = static_cast<int>(min(max(lo_min - tile0, int64_t{-kTileTokens}), int64_t{kTileTokens}));
    const int hi = static_cast<int>(min(max(hi_min - tile0, int64_t{-kTileTokens}), int64_t{2 * kTileTokens}));
    const int hi_any = hi + static_cast<int>(min(hi_max - hi_min, int64_t{kTileTokens}));  // past every column's

    // The lane's registers of a stream's blocks (V's bytes follow K's). An all-compressed tile (every block of random
    // data, most tiles of real V) takes one straight line for both streams, V at a fixed offset (per-stream
    // conditions alone cost 5% at d 64: docs/decode-kernel.md, v11). Otherwise a stream of one kind (all compressed or
    // all raw) takes a straight line from its start, a mixed one the line of its raw-block pattern, and a refused one
    // (or a mix at d 256) finds each block after the ones before it (raw 1024 bytes, compressed 768, refused 0).
    const bool tile_comp = kinds == (kAllComp | kAllComp << 2);
    auto tables = [&](int j) { return tables_of(rec, descs, j); };
    auto rebuild_blocks = [&](int kv, uint32_t (&r)[kB][8]) {
      if (tile_comp) {
#pragma unroll
        for (int c = 0; c < kB; ++c)
          rebuild_compressed(stage + kCompBlockBytes * (kv * kB + c), tables(kv * kB + c), lane, r[c]);
        return;
      }
      const uint8_t* base = stage + (kv ? k_bytes : 0u);
      const uint32_t kind = (kinds >> (2 * kv)) & 3u;
      if (kind == kAllComp) {
#pragma unroll
        for (int c = 0; c < kB; ++c) rebuild_compressed(base + kCompBlockBytes * c, tables(kv * kB + c), lane, r[c]);
      } else if (kind == kAllRaw) {
#pragma unroll
        for (int c = 0; c < kB; ++c) rebuild_raw(base + kRawBlockBytes * c, lane, r[c]);
      } else if (kPairLines && kind == kMixed) {
        if constexpr (kPairLines) {
          const uint32_t mask = (kinds >> (8 + 8 * kv)) & 0xFFu;
          rebuild_pair<kB, 0>(mask, base, tables, kv * kB, lane, r);
          if constexpr (kB == 4) rebuild_pair<kB, 2>(mask, base, tables, kv * kB, lane, r);
        }
      } else {
        int off = 0;
#pragma unroll
        for (int c = 0; c < kB; ++c) {
          const uint8_t desc = desc_at(descs, kv * kB + c);
          rebuild_any(base + off, desc, tables(kv * kB + c), lane, r[c]);
          off += block_size(desc);
        }
      }
    };
    // Tokens past the end of a partial tile (or before a window) may hold anything (even NaN bit patterns): zero
    // the V values of those no column attends to, as 0 * NaN would poison the product although their probability
    // is 0. Lane word j holds tokens 2t, 2t + 1 (j / 2 even) or 2t + 8, 2t + 9 (j / 2 odd).
    auto v_mask = [&](int j) {
      auto kept = [&](int tok) { return tok >= lo && tok < hi_any; };
      return (kept(2 * t + 8 * j) ? 0x0000FFFFu : 0u) | (kept(2 * t + 8 * j + 1) ? 0xFFFF0000u : 0u);
    };
    if constexpr (kBlockwise<kN>) {
      // Four head tiles: O takes 128 registers at d 128, so K and V are rebuilt a block at a time, each right before
      // its MMAs (K's before S, V's inside P V after the softmax), Q's fragments read from shared memory per block,
      // and S in one chain: rebuilding whole streams first, as below, spilled 264 bytes. The ring bytes are released
      // after P V.
      auto block_words = [&](int kv, int c, int& off, uint32_t (&w)[8]) {
        const uint8_t desc = desc_at(descs, kv * kB + c);
        if (tile_comp) {
          rebuild_compressed(stage + kCompBlockBytes * (kv * kB + c), tables(kv * kB + c), lane, w);
        } else {
          rebuild_any(stage + (kv ? k_bytes : 0u) + off, desc, tables(kv * kB + c), lane, w);
          off += block_size(desc);
        }
      };
      float st[kN][4];
#pragma unroll
      for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int j = 0; j < 4; ++j) st[n][j] = 0.f;
      int off = 0;
#pragma unroll
      for (int c = 0; c < kB; ++c) {
        uint32_t kc[8];
        block_words(0, c, off, kc);
#pragma unroll
        for (int n = 0; n < kN; ++n) {
          uint32_t qf[4];
          q_frag(n, c, qf);
          mma(st[n], kc[0], kc[1], kc[2], kc[3], qf[0], qf[1]);
          mma(st[n], kc[4], kc[5], kc[6], kc[7], qf[2], qf[3]);
        }
      }
      const bool v_masked = hi_any < kTileTokens || lo > 0;
      uint32_t pb[kN][2];
      weigh(st, hi, lo, pb);
      off = 0;
#pragma unroll
      for (int c = 0; c < kB; ++c) {
        uint32_t vc[8];
        block_words(1, c, off, vc);
        if (v_masked) {
#pragma unroll
          for (int j = 0; j < 8; ++j) vc[j] &= v_mask(j / 2 % 2);
        }
        pv_block(c, vc, pb);
      }
      used -= (wrap ? C::kRingBytes - tail_at : 0) + size;
      tail_at = start + size;
      __syncwarp();  // every lane is done reading tile i before its bytes and slot are reused
      fill(i + 1);
      continue;
    }

    uint32_t kr[kB][8];
    rebuild_blocks(0, kr);

    // S^T = K Q^T for 16 tokens: s[n] holds tokens g (0, 1) and g + 8 (2, 3) of heads 8 n + 2t, 8 n + 2t + 1. The
    // two 16-dim halves of each 32-dim block accumulate separately (two shorter dependent mma chains). A block's K
    // words 0-3 are the A registers of its first 16-dim half, 4-7 those of its second (format.h, version 3): the
    // rebuilt or loaded words go to the tensor cores with no register moves in between.
    float s[kN][4], s2[kN][4];
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) s[n][j] = 0.f, s2[n][j] = 0.f;
#pragma unroll
    for (int c = 0; c < kB; ++c) {
      uint32_t qf[kN][4];
#pragma unroll
      for (int n = 0; n < kN; ++n) q_frag(n, c, qf[n]);
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        mma(s[n], kr[c][0], kr[c][1], kr[c][2], kr[c][3], qf[n][0], qf[n][1]);
        mma(s2[n], kr[c][4], kr[c][5], kr[c][6], kr[c][7], qf[n][2], qf[n][3]);
      }
    }

    uint32_t vr[kB][8];
    rebuild_blocks(1, vr);
    if (hi_any < kTileTokens || lo > 0) {
      const uint32_t vmask[2] = {v_mask(0), v_mask(1)};
#pragma unroll
      for (int c = 0; c < kB; ++c)
#pragma unroll
        for (int j = 0; j < 8; ++j) vr[c][j] &= vmask[j / 2 % 2];
    }
    // Tile i is in registers now: its ring bytes and slot can go to the next tile before the softmax and PV run.
    auto release = [&] {
      used -= (wrap ? C::kRingBytes - tail_at : 0) + size;
      tail_at = start + size;
      __syncwarp();  // every lane is done reading tile i before its bytes and slot are reused
      fill(i + 1);
    };
    if constexpr (kEarlyRelease) release();
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int j = 0; j < 4; ++j) s[n][j] += s2[n][j];
    attend(s, vr, hi, lo);
    if constexpr (!kEarlyRelease) release();
  }

  // Merge the warps' states (the pipeline buffers are free now): per head, m and l, and the unnormalised O.
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int o2 = 4; o2 < 32; o2 *= 2) l_run[n][j] += __shfl_xor_sync(0xFFFFFFFFu, l_run[n][j], o2);
      if (refused) l_run[n][j] = __int_as_float(0x7FFFFFFF);
    }
  __syncthreads();
  constexpr int kMR = C::kMergeRows;
  float* ow = reinterpret_cast<float*>(smem);  // [kWarps][kMR][D]
  float* ml = ow + kWarps * kMR * D;           // [kWarps][kMR][2]
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = 8 * n + 2 * t + j;
      float* dst = ow + (warp * kMR + row) * D + g;
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt) dst[16 * mt] = o[mt][n][j], dst[16 * mt + 8] = o[mt][n][2 + j];
      if (g == 0) ml[(warp * kMR + row) * 2] = m_run[n][j], ml[(warp * kMR + row) * 2 + 1] = l_run[n][j];
    }
  __syncthreads();

  const float nan = __int_as_float(0x7FFFFFFF);
  for (int x = threadIdx.x; x < n_cols * D; x += C::kThreads) {
    const int row = x / D, dim = x % D;
    if (!is_row(row)) continue;
    float m = -INFINITY;
    // A warp that refused a block has l = NaN, but its max can still be -inf (fmaxf drops the NaN logits of garbage
    // bytes), and then the weighted sum below never reads its l: test it apart, or the request reads as empty (0).
    bool poisoned = false;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      m = fmaxf(m, ml[(w * kMR + row) * 2]);
      poisoned |= ml[(w * kMR + row) * 2 + 1] != ml[(w * kMR + row) * 2 + 1];
    }
    float l = 0.f, acc = 0.f;
    if (m != -INFINITY) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(ml[(w * kMR + row) * 2] - m);
        l += ml[(w * kMR + row) * 2 + 1] * f;
        acc += ow[(w * kMR + row) * D + dim] * f;
      }
    }
    const float val = bad_request || poisoned ? nan : l == 0.f ? 0.f : acc / l;
    const float lse2 = bad_request || poisoned ? nan : l == 0.f ? -INFINITY : m + log2f(l);
    const int64_t qrow = out_row(row);
    if (p.num_splits == 1) {
      const __nv_bfloat16 v = __float2bfloat16_rn(val);
      p.out[qrow * D + dim] = *reinterpret_cast<const uint16_t*>(&v);
      if (p.lse != nullptr && dim == 0) p.lse[qrow] = lse2 / kLog2e;
    } else {
      p.part_o[(split * p.rows + qrow) * D + dim] = val;
      if (dim == 0) p.part_lse[split * p.rows + qrow] = lse2;
    }
  }
}

// Combines the splits of each query row: out = sum_s w_s o_s / sum_s w_s with w_s = 2^(lse_s - max lse). One warp
// per row: lane s holds split s's lse (and split s + 32's), so a row costs two round trips to L2 (all lse, then all
// partial O, loads unrolled) instead of two per split; each lane owns D / 32 consecutive dims (vector loads).
// Launched as a programmatic dependent of the decode kernel: its CTAs are scheduled while the decode grid's last
// CTAs still run, and wait here for the partial results.
template <int D>
__global__ void __launch_bounds__(32 * kMergeRows) merge_splits_kernel(const Params p) {
  constexpr int kV = D / 32;  // dims per lane: 2, 4 or 8
  using Vec = std::conditional_t<kV == 2, float2, float4>;
  constexpr int kVecs = kV * 4 / static_cast<int>(sizeof(Vec));
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const int64_t rows = p.rows;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kMergeRows + threadIdx.x / 32;
  if (row >= rows) return;
  const int lane = threadIdx.x % 32;
  float x[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int s = lane + 32 * j;
    x[j] = s < p.num_splits ? __ldg(p.part_lse + s * rows + row) : -INFINITY;
  }
  const bool nan = __any_sync(0xFFFFFFFFu, x[0] != x[0] || x[1] != x[1]);
  float m = fmaxf(x[0], x[1]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xFFFFFFFFu, m, o));
  float w[2], l = 0.f;
  // A split with lse -inf (empty, or every logit -inf: docs/api.md, Numerics) weighs 0; its partial O never counts.
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    w[j] = nan || x[j] == -INFINITY ? 0.f : exp2f(x[j] - m);
    l += w[j];
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) l += __shfl_xor_sync(0xFFFFFFFFu, l, o);
  float acc[kV] = {};
#pragma unroll 4
  for (int s = 0; s < p.num_splits; ++s) {
    const float ws = __shfl_sync(0xFFFFFFFFu, s < 32 ? w[0] : w[1], s % 32);
    const Vec* src = reinterpret_cast<const Vec*>(p.part_o + (s * rows + row) * D + lane * kV);
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      const Vec val = __ldg(src + v);
      const float* f = reinterpret_cast<const float*>(&val);
#pragma unroll
      for (int e = 0; e < static_cast<int>(sizeof(Vec)) / 4; ++e)
        acc[v * sizeof(Vec) / 4 + e] += ws == 0.f ? 0.f : ws * f[e];  // never 0 * (unwritten bytes)
    }
  }
  const float qnan = __int_as_float(0x7FFFFFFF);
  uint32_t packed[kV / 2];
#pragma unroll
  for (int e = 0; e < kV / 2; ++e) {
    const float a = nan ? qnan : l == 0.f ? 0.f : acc[2 * e] / l, b = nan ? qnan : l == 0.f ? 0.f : acc[2 * e + 1] / l;
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    packed[e] = *reinterpret_cast<const uint32_t*>(&h);
  }
  uint16_t* dst = p.out + row * D + lane * kV;
  if constexpr (kV == 2) *reinterpret_cast<uint32_t*>(dst) = packed[0];
  else if constexpr (kV == 4) *reinterpret_cast<uint2*>(dst) = make_uint2(packed[0], packed[1]);
  else *reinterpret_cast<uint4*>(dst) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  if (p.lse != nullptr && lane == 0) p.lse[row] = nan ? qnan : l == 0.f ? -INFINITY : (m + log2f(l)) / kLog2e;
}

// d 128 with one head tile also comes as 2 CTAs of 6 warps per SM: the same 12 warps and ring bytes per SM as 3 CTAs
// of 4, in fewer, larger CTAs, which the plan takes when they fill the SMs' slots more evenly.
constexpr bool has_six_warps(int head_dim, int group) { return head_dim == 128 && group <= 8; }

// Host side, one instantiation per head_dim (paged_decode_hd*.cu): occupancy of the kernel, and the launches.
// warps: 4, or 6 where has_six_warps (never with multi); other values mean 4. cols: the MMA columns a CTA fills,
// the group (decode) or Params::cols (multi: kMulti).
template <int D>
int ctas_per_sm(int cols, int warps, bool multi);
template <int D>
void launch(const Params& p, int warps, bool multi, cudaStream_t stream);

}  // namespace zipkv::cuda::decode
