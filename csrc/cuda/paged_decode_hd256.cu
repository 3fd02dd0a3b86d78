// zipkv::paged_decode CUDA kernels for head_dim 256 (one file per head_dim, as FlashAttention does).
#include "paged_decode_launch.cuh"

namespace zipkv::cuda::decode {
ZIPKV_INSTANTIATE_DECODE(256)
}  // namespace zipkv::cuda::decode
