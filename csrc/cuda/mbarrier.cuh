// Shared-memory mbarriers as both attention kernels use them: paged_decode's tiles land on one (bulk copies count
// their bytes), paged_prefill's rebuilt K/V tiles are handed from its producer warps to its MMA warps and back.
// `bar` is the barrier's shared-memory address (8 bytes, 8-byte aligned).
#pragma once

#include <cstdint>

namespace zipkv::cuda {

// A barrier whose phase completes after `count` arrivals (and, with expect_tx, the bytes announced).
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count = 1) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialisation visible to the other threads (and the async proxy) before the CTA barrier that follows.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrives on bar (its only arrival per phase) announcing `bytes` of bulk copies that will complete on it.
__device__ __forceinline__ void mbar_arrive_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// One arrival, releasing this thread's earlier memory accesses to the threads that wait on the phase.
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Waits until the phase of this parity (the barrier's k-th completion has parity k % 2) has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  }
}

}  // namespace zipkv::cuda
