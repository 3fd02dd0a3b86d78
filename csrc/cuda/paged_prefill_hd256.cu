// zipkv::paged_prefill CUDA kernel for head_dim 256 (one file per head_dim, as FlashAttention does).
#include "paged_prefill_launch.cuh"

namespace zipkv::cuda::prefill {
ZIPKV_INSTANTIATE_PREFILL(256)
}  // namespace zipkv::cuda::prefill
