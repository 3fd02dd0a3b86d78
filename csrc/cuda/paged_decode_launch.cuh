// Launch of the decode kernels for one head_dim; included by the per-head_dim instantiation files
// (paged_decode_hd64.cu, ...) so the three builds compile in parallel and a build can leave one out.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "paged_decode.cuh"

namespace zipkv::cuda::decode {

template <int D, int kHalves, int kCtas>
void set_smem_limit() {
  // Once per instantiation, outside any graph capture in practice (the first call of a program runs eagerly).
  static const bool done = [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(paged_decode_kernel<D, kHalves, kCtas>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg<D, kCtas>::kSmemBytes));
    return true;
  }();
  (void)done;
}

template <int D, int kHalves, int kCtas>
int occupancy() {
  // Once per instantiation, like the shared-memory limit it depends on.
  static const int n = [] {
    set_smem_limit<D, kHalves, kCtas>();
    int ctas = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, paged_decode_kernel<D, kHalves, kCtas>,
                                                                 kThreads, Cfg<D, kCtas>::kSmemBytes));
    return ctas;
  }();
  return n;
}

template <int D, int kHalves, int kCtas>
void launch_kernel(const Params& p, cudaStream_t stream) {
  set_smem_limit<D, kHalves, kCtas>();
  const unsigned int ctas = static_cast<unsigned int>(int64_t{p.batch} * p.H * p.num_splits);
  paged_decode_kernel<D, kHalves, kCtas><<<ctas, kThreads, Cfg<D, kCtas>::kSmemBytes, stream>>>(p);
}

// The variant serving a head_dim and group: kHalves = 2 when the group spans both row halves of the MMA, and the
// residency (CTAs per SM) each variant's registers allow (d 128: 162 registers -> 3, 189 with two halves -> 2;
// d 64: <= 123 -> 4; d 256: 255 -> 1). benchmarks/NOTES.md (v7) measured 3 against 2 and 4 against 3.
// Calls f.template operator()<kHalves, kCtas>().
template <int D, typename F>
auto dispatch(int group, F&& f) {
  constexpr int kOne = D == 64 ? 4 : D == 128 ? 3 : 1, kTwo = D == 64 ? 4 : D == 128 ? 2 : 1;
  return group > 8 ? f.template operator()<2, kTwo>() : f.template operator()<1, kOne>();
}

template <int D>
int ctas_per_sm(int group) {
  return dispatch<D>(group, []<int kHalves, int kCtas>() { return occupancy<D, kHalves, kCtas>(); });
}

template <int D>
void launch(const Params& p, cudaStream_t stream) {
  dispatch<D>(p.group, [&]<int kHalves, int kCtas>() { launch_kernel<D, kHalves, kCtas>(p, stream); });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.num_splits > 1) {
    merge_splits_kernel<D><<<static_cast<unsigned int>(int64_t{p.batch} * p.Hq), D, 0, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

#define ZIPKV_INSTANTIATE_DECODE(D)                         \
  template int ctas_per_sm<D>(int group);                   \
  template void launch<D>(const Params& p, cudaStream_t stream);

}  // namespace zipkv::cuda::decode
