// Launch of the prefill kernel for one head_dim; included by the per-head_dim instantiation files
// (paged_prefill_hd64.cu, ...), one per entry of format.h's ZIPKV_FOR_EACH_HEAD_DIM, so that they compile in parallel.
#pragma once

#include <c10/cuda/CUDAException.h>

#include <cstdlib>

#include "paged_prefill.cuh"
#include "smem_limit.cuh"

namespace zipkv::cuda::prefill {

template <int D, int kProbe>
void launch_probe(const Params& p, const dim3 grid, cudaStream_t stream) {
  static SmemFlags done{};
  set_smem_limit(paged_prefill_kernel<D, false, kProbe>, Cfg<D>::kSmemBytes, done);
  paged_prefill_kernel<D, false, kProbe><<<grid, kThreads, Cfg<D>::kSmemBytes, stream>>>(p);
}

template <int D>
void launch(const Params& p, int64_t ctas, cudaStream_t stream) {
  static SmemFlags done{}, done_cap{};
  const dim3 grid(static_cast<unsigned int>(ctas), static_cast<unsigned int>(p.H));
  const char* env = std::getenv("ZIPKV_PREFILL_PROBE");  // experiment: probe builds at d 128, no soft cap
  const int probe = env != nullptr ? std::atoi(env) : 0;
  if constexpr (D == 128) {
    if (probe != 0 && p.cap_log2 <= 0.f) {
      switch (probe) {
        case 1: launch_probe<D, 1>(p, grid, stream); break;
        case 3: launch_probe<D, 3>(p, grid, stream); break;
        case 5: launch_probe<D, 5>(p, grid, stream); break;
        case 7: launch_probe<D, 7>(p, grid, stream); break;
        default: TORCH_CHECK(false, "ZIPKV_PREFILL_PROBE: no build ", probe);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
  }
  if (p.cap_log2 > 0.f) {
    set_smem_limit(paged_prefill_kernel<D, true>, Cfg<D>::kSmemBytes, done_cap);
    paged_prefill_kernel<D, true><<<grid, kThreads, Cfg<D>::kSmemBytes, stream>>>(p);
  } else {
    set_smem_limit(paged_prefill_kernel<D, false>, Cfg<D>::kSmemBytes, done);
    paged_prefill_kernel<D, false><<<grid, kThreads, Cfg<D>::kSmemBytes, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#define ZIPKV_INSTANTIATE_PREFILL(D)                                                                     \
  static_assert(::zipkv::head_dim_supported(D), "format.h's ZIPKV_FOR_EACH_HEAD_DIM does not list " #D); \
  template void launch<D>(const Params& p, int64_t ctas, cudaStream_t stream);

}  // namespace zipkv::cuda::prefill
