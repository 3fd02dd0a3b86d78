// CUDA kernel of zipkv::append_kv: one thread per (token, K|V, head, dim) writes two bytes into its raw block.
// A token whose page id, slot or meta row is invalid (or tagged with another geometry or format version), or whose
// block is compressed, is not written (the CPU kernel raises for the same input); the kernel never touches memory
// outside data. Two tokens with one (page, slot) race: each 2-byte value of the slot ends up holding one of them,
// unspecified which (so the slot may mix both tokens). The CPU kernel refuses them; here a check (or a rule such as
// "the last wins") would cost every thread a scan of all the call's tokens, or a host sync, so avoiding them is the
// caller's job (the cache never makes them).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "block_io.cuh"

namespace zipkv::cuda {
namespace {

__global__ void append_kv_kernel(const uint16_t* __restrict__ k, const uint16_t* __restrict__ v,
                                 const int32_t* __restrict__ page_ids, const int32_t* __restrict__ slots,
                                 uint8_t* __restrict__ data, int64_t data_bytes, const int32_t* __restrict__ meta,
                                 int64_t num_pages, int64_t total, int P, int H, int D, int words) {
  const int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (x >= total) return;
  const int dim = x % D, head = (x / D) % H, is_v = (x / (int64_t{D} * H)) % 2;
  const int64_t i = x / (int64_t{2} * D * H);
  const int64_t page = page_ids[i];
  const int slot = slots[i];
  if (page < 0 || page >= num_pages || slot < 0 || slot >= P) return;
  const int32_t* row = meta + ((page * 2 + is_v) * H + head) * words;
  int64_t start;
  int nbytes;
  if (read_stream(row, P, D, data_bytes, &start, &nbytes) != kStreamOk) return;
  const uint8_t* desc = row_descriptors(row);
  const int b = (slot / kTileTokens) * (D / kBlockDims) + dim / kBlockDims;
  if (desc[b] != kDescRaw) return;
  uint16_t* block = reinterpret_cast<uint16_t*>(data + start + block_offset(desc, b));
  block[raw_index(position(is_v, slot % kTileTokens, dim % kBlockDims))] = (is_v ? v : k)[(i * H + head) * D + dim];
}

void append_kv_cuda(const at::Tensor& k, const at::Tensor& v, const at::Tensor& page_ids, const at::Tensor& slots,
                    int64_t page_size, at::Tensor& data, const at::Tensor& meta) {
  check_append_args(k, v, page_ids, slots, page_size, data, meta);
  const int64_t total = k.numel() * 2;
  if (total == 0) return;
  const c10::cuda::CUDAGuard guard(data.device());
  constexpr int kThreads = 256;
  append_kv_kernel<<<static_cast<unsigned int>((total + kThreads - 1) / kThreads), kThreads, 0,
                     c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
      reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), page_ids.data_ptr<int32_t>(),
      slots.data_ptr<int32_t>(), data.data_ptr<uint8_t>(), data.numel(), meta.data_ptr<int32_t>(), meta.size(0), total,
      static_cast<int>(page_size), k.size(1), k.size(2), meta.size(3));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CUDA, m) { m.impl("append_kv", &append_kv_cuda); }

}  // namespace zipkv::cuda
