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
  static SmemFlags done{}, done_cap{};
  constexpr int kSmem = Cfg<D>::template smem_bytes<kProbe>();
  if (p.cap_log2 > 0.f) {
    set_smem_limit(paged_prefill_kernel<D, true, kProbe>, kSmem, done_cap);
    paged_prefill_kernel<D, true, kProbe><<<grid, kThreads, kSmem, stream>>>(p);
  } else {
    set_smem_limit(paged_prefill_kernel<D, false, kProbe>, kSmem, done);
    paged_prefill_kernel<D, false, kProbe><<<grid, kThreads, kSmem, stream>>>(p);
  }
}

template <int D>
void launch(const Params& p, int64_t ctas, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(ctas), static_cast<unsigned int>(p.H));
  const char* env = std::getenv("ZIPKV_PREFILL_PROBE");
  const int probe = env != nullptr ? std::atoi(env) : 0;
  if constexpr (D != 128) {
    if (probe & 16) {
      launch_probe<D, 16>(p, grid, stream);
    } else {
      launch_probe<D, 0>(p, grid, stream);
    }
  } else switch (probe) {
    case 1: launch_probe<D, 1>(p, grid, stream); break;
    case 2: launch_probe<D, 2>(p, grid, stream); break;
    case 3: launch_probe<D, 3>(p, grid, stream); break;
    case 4: launch_probe<D, 4>(p, grid, stream); break;
    case 8: launch_probe<D, 8>(p, grid, stream); break;
    case 9: launch_probe<D, 9>(p, grid, stream); break;
    case 11: launch_probe<D, 11>(p, grid, stream); break;
    case 12: launch_probe<D, 12>(p, grid, stream); break;
    case 16: launch_probe<D, 16>(p, grid, stream); break;
    case 32: launch_probe<D, 32>(p, grid, stream); break;
    case 48: launch_probe<D, 48>(p, grid, stream); break;
    case 35: launch_probe<D, 35>(p, grid, stream); break;
    case 20: launch_probe<D, 20>(p, grid, stream); break;
    case 18: launch_probe<D, 18>(p, grid, stream); break;
    default: launch_probe<D, 0>(p, grid, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

#define ZIPKV_INSTANTIATE_PREFILL(D)                                                                     \
  static_assert(::zipkv::head_dim_supported(D), "format.h's ZIPKV_FOR_EACH_HEAD_DIM does not list " #D); \
  template void launch<D>(const Params& p, int64_t ctas, cudaStream_t stream);

}  // namespace zipkv::cuda::prefill
