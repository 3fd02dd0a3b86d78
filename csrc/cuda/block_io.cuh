// Warp-level movement of one block (16 tokens x 32 dims of one stream) between a page in natural layout and the
// lane-owned position order of format.h: lane L owns positions [16 L, 16 L + 16), and the packed-word encode and
// decode of those positions. Shared by the storage kernels; the decode kernel rebuilds with decode_lane.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "../format.h"

namespace zipkv::cuda {

constexpr int kWarp = 32;
// One block staged in shared memory, rows of 32 dims padded to 20 words: the 8 row addresses of an ldmatrix (or
// stmatrix) phase then hit 8 distinct 16-byte bank groups, and 16-byte row chunks stay aligned.
constexpr int kRowWords = 20;
constexpr int kStageWords = kTileTokens * kRowWords;

// Address (in bf16 elements) of (token 0, dim 0) of block b of stream (page i, is_v, head) in a [n, 2, P, H, D] tensor
// whose dims 2-4 are contiguous and whose page and K|V strides are page_stride and kv_stride.
__device__ __forceinline__ int64_t natural_block_base(int64_t stream, int b, int P, int H, int D, int64_t page_stride,
                                                      int64_t kv_stride) {
  const int64_t i = stream / (2 * H);
  const int is_v = (stream / H) % 2, head = stream % H, spans = D / kBlockDims;
  return i * page_stride + is_v * kv_stride + ((b / spans) * kTileTokens * H + head) * static_cast<int64_t>(D) +
         (b % spans) * kBlockDims;
}

// The same in a contiguous [n, 2, P, H, D] tensor.
__device__ __forceinline__ int64_t natural_block_base(int64_t stream, int b, int P, int H, int D) {
  const int64_t kv_stride = static_cast<int64_t>(P) * H * D;
  return natural_block_base(stream, b, P, H, D, 2 * kv_stride, kv_stride);
}

// Starts copying a block in natural layout (row stride in elements) into its staged form with 16-byte cp.async,
// two per lane; cp_async_wait_all() completes them. No registers hold the data in between.
__device__ __forceinline__ void cp_async_block_to_stage(const uint16_t* base, int64_t row_stride, uint32_t* stage,
                                                        int lane) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int c = lane + kWarp * j, row = c / 4, part = c % 4;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(
                     static_cast<uint32_t>(__cvta_generic_to_shared(stage + row * kRowWords + part * 4))),
                 "l"(base + row * row_stride + part * 8)
                 : "memory");
  }
}

__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;\n" ::: "memory");
}

// Stores a staged block back to natural layout with 16-byte stores.
__device__ __forceinline__ void store_stage_to_block(const uint32_t* stage, uint16_t* base, int64_t row_stride,
                                                     int lane) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int c = lane + kWarp * j, row = c / 4, part = c % 4;
    *reinterpret_cast<uint4*>(base + row * row_stride + part * 8) =
        *reinterpret_cast<const uint4*>(stage + row * kRowWords + part * 4);
  }
}

// The lane's 16 positions of a staged block are 8 words (word m = positions 2m, 2m + 1, low half first), and
// format.h's position order is the mma fragment order, which is ldmatrix's: word m is the lane's fragment of one
// 8x8 matrix of the stage (K: tokens 8 (m % 2).., dims 8 (m / 2)..; V, transposed: tokens 8 (m / 2 % 2).., dims
// 8 (2 (m / 4) + m % 2)..). So two ldmatrix.x4 (stmatrix.x4 back) move a lane's words, 16 bytes per row address.
// The block row (token) and 8-dim chunk this lane addresses in call c (words 4c..4c+3): row r % 8 of matrix j = r / 8.
struct FragmentRow {
  int row, chunk;
};
__device__ __forceinline__ FragmentRow fragment_row(int is_v, int c, int lane) {
  const int j = lane / 8, r = lane % 8;
  return is_v ? FragmentRow{8 * (j / 2) + r, 2 * c + j % 2} : FragmentRow{8 * (j % 2) + r, 2 * c + j / 2};
}
// That row's word in a block's stage.
__device__ __forceinline__ int fragment_row_word(int is_v, int c, int lane) {
  const FragmentRow f = fragment_row(is_v, c, lane);
  return f.row * kRowWords + 4 * f.chunk;
}

__device__ __forceinline__ void load_lane_words(const uint32_t* stage, int is_v, int lane, uint32_t w[8]) {
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(stage + fragment_row_word(is_v, c, lane)));
    if (is_v) {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w[4 * c]), "=r"(w[4 * c + 1]), "=r"(w[4 * c + 2]), "=r"(w[4 * c + 3])
                   : "r"(a));
    } else {
      asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(w[4 * c]), "=r"(w[4 * c + 1]), "=r"(w[4 * c + 2]), "=r"(w[4 * c + 3])
                   : "r"(a));
    }
  }
}

// One stmatrix.x4 of words w[0..3] (transposed for V), this lane's row address a (shared).
__device__ __forceinline__ void stmatrix_x4(uint32_t a, int is_v, const uint32_t* w) {
  if (is_v) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(w[0]),
                 "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
  } else {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(w[0]), "r"(w[1]),
                 "r"(w[2]), "r"(w[3])
                 : "memory");
  }
}
__device__ __forceinline__ void store_lane_words(uint32_t* stage, int is_v, int lane, const uint32_t w[8]) {
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    stmatrix_x4(static_cast<uint32_t>(__cvta_generic_to_shared(stage + fragment_row_word(is_v, c, lane))), is_v,
                w + 4 * c);
  }
}

// The block's descriptor (format.h descriptor_for) from every lane's words: exponents compared in place (masked,
// two per word), then one warp-wide min and max.
__device__ __forceinline__ uint8_t warp_block_descriptor(const uint32_t w[8]) {
  uint32_t lo = 0xFFFFFFFFu, hi = 0, lo_big = 0xFFFFFFFFu;
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const uint32_t e = w[m] & 0x7F807F80u;
    lo = __vminu2(lo, e);
    hi = __vmaxu2(hi, e);
    lo_big = __vminu2(lo_big, e | ~__vcmpgeu2(e, 0x01000100u));  // e <= 1 reads as 0xFFFF: not a candidate
  }
  const unsigned emin = __reduce_min_sync(0xffffffffu, min(lo & 0xFFFFu, lo >> 16)) >> 7;
  const unsigned emax = __reduce_max_sync(0xffffffffu, max(hi & 0xFFFFu, hi >> 16)) >> 7;
  const unsigned emin_big = __reduce_min_sync(0xffffffffu, min(lo_big & 0xFFFFu, lo_big >> 16)) >> 7;  // 511: none
  return descriptor_for(static_cast<int>(emin), static_cast<int>(emax), static_cast<int>(emin_big));
}

// The lane's share of a compressed block with descriptor desc: 16 low bytes, and the code words of its two 8-position
// groups (format.h encode_group). High bytes minus b/2 (byte-wise, with no borrow: each high byte's low 7 bits are
// >= b/2, a zero-aware block's e <= 1 values first raised to b/2 + 7) are s << 7 | d; the d of positions 0..3 and of
// 4..7 are then packed into nibbles, and the signs of 4..7 go to bit 3 of each byte.
__device__ __forceinline__ uint32_t high_bytes_to_code(uint32_t h, uint8_t desc) {
  const int half_base = desc_half_base(desc);
  if (desc_zero_aware(desc)) {
    const uint32_t big = ((h & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) & 0x80808080u;  // bytes whose e >> 1 is not 0
    const uint32_t small = (big ^ 0x80808080u) >> 7;                       // 1 in the bytes with e <= 1
    h |= small * static_cast<uint32_t>(half_base + 7);                     // their 7 bits were 0
  }
  return h - static_cast<uint32_t>(half_base) * 0x01010101u;
}

__device__ __forceinline__ void encode_lane(const uint32_t w[8], uint8_t desc, uint4* low, uint2* codes) {
  uint32_t c[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const uint32_t a = high_bytes_to_code(__byte_perm(w[4 * q], w[4 * q + 1], 0x7531), desc);
    const uint32_t b = high_bytes_to_code(__byte_perm(w[4 * q + 2], w[4 * q + 3], 0x7531), desc);
    // Bytes 0 and 2 of (d | d >> 4) hold d of positions {0, 1} and {2, 3} as two nibbles each.
    const uint32_t da = a & 0x07070707u, db = b & 0x07070707u;
    c[q] = __byte_perm(da | (da >> 4), db | (db >> 4), 0x6420) | (a & 0x80808080u) | ((b >> 4) & 0x08080808u);
  }
  *low = make_uint4(__byte_perm(w[0], w[1], 0x6420), __byte_perm(w[2], w[3], 0x6420), __byte_perm(w[4], w[5], 0x6420),
                    __byte_perm(w[6], w[7], 0x6420));
  *codes = make_uint2(c[0], c[1]);
}

// The lane's 8 words from its 16 low bytes and two code words, with the block's table (format.h code_table).
__device__ __forceinline__ void decode_lane(uint4 low, uint2 codes, uint32_t t0, uint32_t t1, uint32_t w[8]) {
  const uint32_t lw[4] = {low.x, low.y, low.z, low.w}, cw[2] = {codes.x, codes.y};
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    uint32_t h[2];
    decode_high_bytes(cw[q], t0, t1, &h[0], &h[1]);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      w[4 * q + 2 * r] = __byte_perm(lw[2 * q + r], h[r], 0x5140);
      w[4 * q + 2 * r + 1] = __byte_perm(lw[2 * q + r], h[r], 0x7362);
    }
  }
}

// Inverse of encode_lane.
__device__ __forceinline__ void decode_lane(uint4 low, uint2 codes, uint8_t desc, uint32_t w[8]) {
  uint32_t t0, t1;
  code_table(desc, &t0, &t1);
  decode_lane(low, codes, t0, t1, w);
}

}  // namespace zipkv::cuda
