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

template <int D>
int ctas_per_sm(int group) {
  // Both variants use the same shared memory, which is what bounds residency; ask for the one that will run.
  auto query = [](auto kernel) {
    int n = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, Cfg<D>::kSmemBytes));
    return n;
  };
  if (group > 8) {
    set_smem_limit<D, 2>();
    static const int n = query(paged_decode_kernel<D, 2>);
    return n;
  }
  set_smem_limit<D, 1>();
  static const int n = query(paged_decode_kernel<D, 1>);
  return n;
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
