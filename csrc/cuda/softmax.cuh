// The online softmax's arithmetic that the decode and prefill kernels share: base-2 logits, weights by the
// special-function unit, and the slack that lets a chunk's weights be taken against a stale row maximum.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace zipkv::cuda {

constexpr float kLog2e = 1.4426950408889634f;
// log2 of the largest softmax weight a tile or chunk may take before the row maximum is updated: weights below 2^8
// are as exact in float32 and bf16 as weights below 1, so O and l are rescaled only where a logit rises past it.
constexpr float kMaxSlack = 8.f;

// 2^x by the special-function unit, subnormal results flushed to 0 (softmax weights that small do not count).
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

}  // namespace zipkv::cuda
