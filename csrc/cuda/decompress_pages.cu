// CUDA kernel of zipkv::decompress_pages: each warp fetches two blocks, rebuilds them in registers, written in natural layout with
// 16-byte stores. A stream whose meta row is missing or corrupt is never read: its values come back as 0xFFFF (NaN).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "block_io.cuh"

namespace zipkv::cuda {
namespace {

constexpr int kWarps = 8;

constexpr int kBlocksPerWarp = 2;  // both blocks' loads are issued before either is decoded

// Fetches the lane's bytes of a block stored at src with descriptor desc: raw, its 32 bytes; compressed, its 16 low
// bytes (r[0]) and 8 code bytes (r[1].x, r[1].y).
__device__ __forceinline__ void fetch_lane_bytes(const uint8_t* src, uint8_t desc, int lane, uint4 r[2]) {
  if (desc == kDescRaw) {
    r[0] = reinterpret_cast<const uint4*>(src)[2 * lane];
    r[1] = reinterpret_cast<const uint4*>(src)[2 * lane + 1];
  } else {
    r[0] = reinterpret_cast<const uint4*>(src)[lane];
    const uint2 codes = reinterpret_cast<const uint2*>(src + kLowBytes)[lane];
    r[1] = make_uint4(codes.x, codes.y, 0, 0);
  }
}

// The lane's 16 values (position order) from its fetched bytes.
__device__ __forceinline__ void rebuild_lane_values(const uint4 r[2], uint8_t desc, uint16_t v[16]) {
  if (desc == kDescRaw) {
    const uint16_t* rv = reinterpret_cast<const uint16_t*>(r);
#pragma unroll
    for (int idx = 0; idx < 16; ++idx) v[idx] = rv[idx];
    return;
  }
  const uint32_t lw[4] = {r[0].x, r[0].y, r[0].z, r[0].w}, cw[2] = {r[1].x, r[1].y};
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    uint32_t h[2];
    decode_high_bytes(cw[q], desc, &h[0], &h[1]);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t lo = (lw[2 * q + j / 4] >> (8 * (j % 4))) & 0xFF, hi = (h[j / 4] >> (8 * (j % 4))) & 0xFF;
      v[8 * q + j] = static_cast<uint16_t>((hi << 8) | lo);
    }
  }
}

__global__ void __launch_bounds__(kWarps * kWarp, 4) decompress_pages_kernel(
    const uint8_t* __restrict__ data, int64_t data_bytes, const int32_t* __restrict__ meta,
    const int32_t* __restrict__ page_ids, int64_t num_pages, uint16_t* __restrict__ out, int64_t num_blocks, int P,
    int H, int D, int words) {
  __shared__ uint32_t stage[kWarps][kStageWords];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int nb = blocks_per_stream(P, D);
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kBlocksPerWarp;
  uint4 bytes[kBlocksPerWarp][2];
  uint8_t desc[kBlocksPerWarp];
  bool ok[kBlocksPerWarp];
#pragma unroll
  for (int k = 0; k < kBlocksPerWarp; ++k) {
    const int64_t x = first + k, stream = x / nb;
    ok[k] = false;
    if (x >= num_blocks) continue;
    const int64_t page = page_ids[stream / (2 * H)];
    if (page < 0 || page >= num_pages) continue;
    const int32_t* row = meta + ((page * 2 + (stream / H) % 2) * H + stream % H) * words;
    int64_t start;
    int nbytes;
    if (read_stream(row, nb, data_bytes, &start, &nbytes) != kStreamOk) continue;
    const uint8_t* d = reinterpret_cast<const uint8_t*>(row + 1);
    const int b = x % nb;
    desc[k] = d[b];
    ok[k] = true;
    fetch_lane_bytes(data + start + block_offset(d, b), desc[k], lane, bytes[k]);
  }
#pragma unroll
  for (int k = 0; k < kBlocksPerWarp; ++k) {
    const int64_t x = first + k, stream = x / nb;
    if (x >= num_blocks) break;
    uint16_t v[16];
    if (ok[k]) {
      rebuild_lane_values(bytes[k], desc[k], v);
    } else {
#pragma unroll
      for (int idx = 0; idx < 16; ++idx) v[idx] = 0xFFFF;
    }
    scatter_lane_values(stage[warp], (stream / H) % 2, lane, v);
    __syncwarp();
    store_stage_to_block(stage[warp], out + natural_block_base(stream, x % nb, P, H, D), static_cast<int64_t>(H) * D,
                         lane);
    __syncwarp();
  }
}

void decompress_pages_cuda(const at::Tensor& data, const at::Tensor& meta, const at::Tensor& page_ids,
                           at::Tensor& out) {
  check_decompress_args(data, meta, page_ids, out);
  const int64_t n = out.size(0);
  if (n == 0) return;
  const int P = out.size(2), H = out.size(3), D = out.size(4);
  const int64_t num_blocks = n * 2 * H * blocks_per_stream(P, D);
  const c10::cuda::CUDAGuard guard(data.device());
  const int64_t per_cta = kWarps * kBlocksPerWarp;
  decompress_pages_kernel<<<static_cast<unsigned int>((num_blocks + per_cta - 1) / per_cta), kWarps * kWarp, 0,
                            c10::cuda::getCurrentCUDAStream()>>>(
      data.data_ptr<uint8_t>(), data.numel(), meta.data_ptr<int32_t>(), page_ids.data_ptr<int32_t>(), meta.size(0),
      reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), num_blocks, P, H, D, meta.size(3));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CUDA, m) { m.impl("decompress_pages", &decompress_pages_cuda); }

}  // namespace zipkv::cuda
