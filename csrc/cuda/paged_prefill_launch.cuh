// Launch of the prefill kernel for one head_dim; included by the per-head_dim instantiation files
// (paged_prefill_hd64.cu, ...), one per entry of format.h's ZIPKV_FOR_EACH_HEAD_DIM, so that they compile in parallel.
#pragma once

#include <c10/cuda/CUDAException.h>

#include <cstdlib>

#include "paged_prefill.cuh"
#include "paged_prefill_old.cuh"
#include "smem_limit.cuh"

namespace zipkv::cuda::prefill {

template <int D>
void launch(const Params& p, int64_t ctas, cudaStream_t stream) {
  static SmemFlags done{}, done_cap{};
  const dim3 grid(static_cast<unsigned int>(ctas), static_cast<unsigned int>(p.H));
  if constexpr (D == 128) {  // experiment: ZIPKV_PREFILL_PROBE=99 runs main's kernel (A/B in one build), no soft cap
    const char* env = std::getenv("ZIPKV_PREFILL_PROBE");
    if (env != nullptr && std::atoi(env) == 99 && p.cap_log2 <= 0.f) {
      static SmemFlags done_old{};
      auto* k = prefill_old::paged_prefill_kernel<D, false>;
      set_smem_limit(k, prefill_old::Cfg<D>::kSmemBytes, done_old);
      k<<<grid, prefill_old::kThreads, prefill_old::Cfg<D>::kSmemBytes, stream>>>(
          reinterpret_cast<const prefill_old::Params&>(p));
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
