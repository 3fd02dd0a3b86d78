// Warp-level movement of one block (16 tokens x 32 dims of one stream) between a page in natural layout and the
// lane-owned position order of format.h: lane L owns positions [16 L, 16 L + 16). Shared by the storage kernels.
#pragma once

#include <cuda_bf16.h>
#include <cstdint>

#include "../format.h"

namespace zipkv::cuda {

constexpr int kWarp = 32;
// One block staged in shared memory, rows of 32 dims padded to 20 words: the K gather (rows g, words 8cc + t) and
// the V gather (rows 2t, words 4j + g/2) then hit 32 distinct banks, and 16-byte row chunks stay aligned.
constexpr int kRowWords = 20;
constexpr int kStageWords = kTileTokens * kRowWords;

// Address (in bf16 elements) of (token 0, dim 0) of block b of stream (page i, is_v, head) in a [n, 2, P, H, D] tensor.
__device__ __forceinline__ int64_t natural_block_base(int64_t stream, int b, int P, int H, int D) {
  const int64_t i = stream / (2 * H);
  const int is_v = (stream / H) % 2, head = stream % H, spans = D / kBlockDims;
  return (((i * 2 + is_v) * P + (b / spans) * kTileTokens) * H + head) * D + (b % spans) * kBlockDims;
}

// Starts copying a block in natural layout (row stride in elements) into its staged form with 16-byte cp.async,
// two per lane; cp_async_wait_all() completes them. No registers hold the data in between.
__device__ __forceinline__ void cp_async_block_to_stage(const uint16_t* base, int64_t row_stride, uint32_t* stage,
                                                        int lane) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int c = lane + kWarp * j, row = c / 4, part = c % 4;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(static_cast<uint32_t>(
                     __cvta_generic_to_shared(stage + row * kRowWords + part * 4))),
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

__device__ __forceinline__ uint16_t& stage_at(uint32_t* stage, int tok, int dim) {
  return reinterpret_cast<uint16_t*>(stage + tok * kRowWords)[dim];
}

// The (tok, dim) of the lane's idx-th value (idx in [0, 16)); inverse of format.h's k_position / v_position.
__device__ __forceinline__ void lane_value_coords(int is_v, int lane, int idx, int* tok, int* dim) {
  const int g = lane / 4, t = lane % 4, i = idx % 4, pair = 2 * t + (i / 2) * 8 + i % 2;
  if (is_v) {
    *dim = g + 8 * (idx / 4);
    *tok = pair;
  } else {
    *tok = g + 8 * (idx / 8);
    *dim = 16 * ((idx / 4) % 2) + pair;
  }
}

// The lane's 16 values of a staged block, in position order.
__device__ __forceinline__ void gather_lane_values(const uint32_t* stage, int is_v, int lane, uint16_t v[16]) {
#pragma unroll
  for (int idx = 0; idx < 16; ++idx) {
    int tok, dim;
    lane_value_coords(is_v, lane, idx, &tok, &dim);
    v[idx] = reinterpret_cast<const uint16_t*>(stage + tok * kRowWords)[dim];
  }
}

__device__ __forceinline__ void scatter_lane_values(uint32_t* stage, int is_v, int lane, const uint16_t v[16]) {
#pragma unroll
  for (int idx = 0; idx < 16; ++idx) {
    int tok, dim;
    lane_value_coords(is_v, lane, idx, &tok, &dim);
    stage_at(stage, tok, dim) = v[idx];
  }
}

}  // namespace zipkv::cuda
