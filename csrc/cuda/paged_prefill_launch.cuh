// Launch of the prefill kernel for one head_dim; included by the per-head_dim instantiation files
// (paged_prefill_hd64.cu, ...), one per entry of format.h's ZIPKV_FOR_EACH_HEAD_DIM, so that they compile in parallel.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "paged_prefill.cuh"
#include "smem_limit.cuh"

namespace zipkv::cuda::prefill {

// Request b takes ceil(q_len_b / (kCluster T)) units of kCluster CTAs: at most nnz_q / (kCluster T) + batch in all,
// whatever the q lengths.
template <int D, bool kCap>
void launch_kernel(const Params& p, cudaStream_t stream, SmemFlags& done) {
  constexpr int kCl = Cfg<D>::kCluster;
  const int64_t units = p.nnz_q / (int64_t{kCl} * p.tile_tokens) + p.batch;
  const dim3 grid(static_cast<unsigned int>(units * kCl), static_cast<unsigned int>(p.H));
  set_smem_limit(paged_prefill_kernel<D, kCap>, Cfg<D>::kSmemBytes, done);
  if constexpr (kCl > 1) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kCl, attr[0].val.clusterDim.y = 1, attr[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid, cfg.blockDim = dim3(kThreads), cfg.dynamicSmemBytes = Cfg<D>::kSmemBytes, cfg.stream = stream;
    cfg.attrs = attr, cfg.numAttrs = 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, paged_prefill_kernel<D, kCap>, p));
  } else {
    paged_prefill_kernel<D, kCap><<<grid, kThreads, Cfg<D>::kSmemBytes, stream>>>(p);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <int D>
void launch(const Params& p, cudaStream_t stream) {
  static SmemFlags done{}, done_cap{};
  if (p.cap_log2 > 0.f) {
    launch_kernel<D, true>(p, stream, done_cap);
  } else {
    launch_kernel<D, false>(p, stream, done);
  }
}

#define ZIPKV_INSTANTIATE_PREFILL(D)                                                                     \
  static_assert(::zipkv::head_dim_supported(D), "format.h's ZIPKV_FOR_EACH_HEAD_DIM does not list " #D); \
  template void launch<D>(const Params& p, cudaStream_t stream);

}  // namespace zipkv::cuda::prefill
