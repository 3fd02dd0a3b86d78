// Launch of the decode kernels for one head_dim; included by the per-head_dim instantiation files
// (paged_decode_hd64.cu, ...) so the three builds compile in parallel and a build can leave one out.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "paged_decode.cuh"

namespace zipkv::cuda::decode {

template <int D, int kHalves>
void set_smem_limit() {
  // Once per instantiation, outside any graph capture in practice (the first call of a program runs eagerly).
  static const bool done = [] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(paged_decode_kernel<D, kHalves>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        Cfg<D>::kSmemBytes));
    return true;
  }();
  (void)done;
}

template <int D, int kHalves>
int occupancy() {
  // Once per instantiation, like the shared-memory limit it depends on.
  static const int n = [] {
    set_smem_limit<D, kHalves>();
    int ctas = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, paged_decode_kernel<D, kHalves>, kThreads,
                                                                 Cfg<D>::kSmemBytes));
    return ctas;
  }();
  return n;
}

template <int D>
int ctas_per_sm(int group) {
  return group > 8 ? occupancy<D, 2>() : occupancy<D, 1>();
}

template <int D>
void launch(const Params& p, cudaStream_t stream) {
  const unsigned int ctas = static_cast<unsigned int>(int64_t{p.batch} * p.H * p.num_splits);
  if (p.group > 8) {
    set_smem_limit<D, 2>();
    paged_decode_kernel<D, 2><<<ctas, kThreads, Cfg<D>::kSmemBytes, stream>>>(p);
  } else {
    set_smem_limit<D, 1>();
    paged_decode_kernel<D, 1><<<ctas, kThreads, Cfg<D>::kSmemBytes, stream>>>(p);
  }
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
