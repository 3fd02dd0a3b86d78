// zipkv::paged_decode CUDA kernels for head_dim 64 (one file per head_dim, as FlashAttention does).
#include "paged_decode_launch.cuh"

namespace zipkv::cuda::decode {
ZIPKV_INSTANTIATE_DECODE(64)
}  // namespace zipkv::cuda::decode
