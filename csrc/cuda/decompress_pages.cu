// CUDA kernel of zipkv::decompress_pages: each warp fetches four blocks, rebuilds them in registers and writes them in
// natural layout with 16-byte stores (out's page and K|V strides: contiguous, or K and V apart). A stream whose meta
// row is missing, corrupt or tagged with another geometry or format version (format.h read_stream) is never read: its
// values come back as 0xFFFF (NaN).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "block_io.cuh"

namespace zipkv::cuda {
namespace {

constexpr int kWarps = 8;

constexpr int kBlocksPerWarp = 4;  // all blocks' loads are issued before any is decoded

__global__ void __launch_bounds__(kWarps* kWarp, 4)
    decompress_pages_kernel(const uint8_t* __restrict__ data, int64_t data_bytes, const int32_t* __restrict__ meta,
                            const int32_t* __restrict__ page_ids, int64_t num_pages, uint16_t* __restrict__ out,
                            int64_t page_stride, int64_t kv_stride, int64_t num_blocks, int P, int H, int D,
                            int words) {
  __shared__ __align__(16) uint32_t stage[kWarps][kStageWords];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int nb = blocks_per_stream(P, D);
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kBlocksPerWarp;
  const int warp_blocks = static_cast<int>(num_blocks - first < kBlocksPerWarp ? num_blocks - first : kBlocksPerWarp);

  // Lane k finds the warp's block k: K or V, where it goes, and (when its meta row is sound) its descriptor and
  // bytes. The other lanes take these by shuffle.
  int64_t my_src = -1, my_dst = 0;
  int my_desc = kDescRaw, my_is_v = 0;
  if (lane < warp_blocks) {
    const int64_t x = first + lane, stream = x / nb;
    const int b = static_cast<int>(x % nb);
    my_is_v = static_cast<int>((stream / H) % 2);
    my_dst = natural_block_base(stream, b, P, H, D, page_stride, kv_stride);
    const int64_t page = page_ids[stream / (2 * H)];
    if (page >= 0 && page < num_pages) {
      const int32_t* row = meta + ((page * 2 + my_is_v) * H + stream % H) * words;
      int64_t start;
      int nbytes;
      if (read_stream(row, P, D, data_bytes, &start, &nbytes) == kStreamOk) {
        const uint8_t* d = row_descriptors(row);
        my_desc = d[b];
        my_src = start + block_offset(d, b);
      }
    }
  }
  const unsigned v_blocks = __ballot_sync(0xffffffffu, my_is_v);

  // Fetch: raw, the lane's two 16-byte pieces; compressed, its 16 low bytes (words 0-3) and 8 code bytes (words 4-5).
  uint32_t w[kBlocksPerWarp][8];
#pragma unroll
  for (int k = 0; k < kBlocksPerWarp; ++k) {
    if (k >= warp_blocks) break;
    const int64_t src = __shfl_sync(0xffffffffu, my_src, k);
    const int desc = __shfl_sync(0xffffffffu, my_desc, k);
    if (src < 0) continue;
    const uint4* p = reinterpret_cast<const uint4*>(data + src);
    uint4 a, b;
    if (desc == kDescRaw) {
      a = p[lane];
      b = p[kRawHalfBytes / 16 + lane];
    } else {
      a = p[lane];
      const uint2 codes = reinterpret_cast<const uint2*>(data + src + kLowBytes)[lane];
      b = make_uint4(codes.x, codes.y, 0, 0);
    }
    w[k][0] = a.x, w[k][1] = a.y, w[k][2] = a.z, w[k][3] = a.w;
    w[k][4] = b.x, w[k][5] = b.y, w[k][6] = b.z, w[k][7] = b.w;
  }

  // Rebuild in registers, then through shared memory to natural layout (16-byte stores). An unreadable stream's
  // values come back as 0xFFFF (NaN).
#pragma unroll
  for (int k = 0; k < kBlocksPerWarp; ++k) {
    if (k >= warp_blocks) break;
    const int64_t src = __shfl_sync(0xffffffffu, my_src, k), dst = __shfl_sync(0xffffffffu, my_dst, k);
    const int desc = __shfl_sync(0xffffffffu, my_desc, k);
    if (src < 0) {
#pragma unroll
      for (int m = 0; m < 8; ++m) w[k][m] = 0xFFFFFFFFu;
    } else if (desc != kDescRaw) {
      decode_lane(make_uint4(w[k][0], w[k][1], w[k][2], w[k][3]), make_uint2(w[k][4], w[k][5]), desc, w[k]);
    }
    store_lane_words(stage[warp], (v_blocks >> k) & 1, lane, w[k]);
    __syncwarp();
    store_stage_to_block(stage[warp], out + dst, static_cast<int64_t>(H) * D, lane);
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
      reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), out.stride(0), out.stride(1), num_blocks, P, H, D,
      meta.size(3));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CUDA, m) { m.impl("decompress_pages", &decompress_pages_cuda); }

}  // namespace zipkv::cuda
