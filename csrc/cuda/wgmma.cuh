// Hopper warpgroup MMA (wgmma) as the prefill kernel uses it: A from shared memory (Q K^T) or registers (P V), B from
// shared memory, both by descriptor; bf16 in, fp32 accumulate, D += A B. The four warps of a warpgroup issue each
// instruction together; warp w holds rows 16 w .. 16 w + 15 of the 64, in mma.sync's m16n8k16 layouts (A: a[0..3] rows
// g, g + 8 by k halves; D: d[j][0..1] row g, columns 8 j + 2 t, + 1, d[j][2..3] row g + 8), so S's accumulators are P's
// A operand as they stand. Shared-memory operands use the 128-byte swizzle: rows of 64 bf16 (128 bytes), the 16-byte
// chunk c of row r stored at chunk c ^ (r % 8), atoms of 8 rows (1,024 bytes, 1,024-byte aligned).
#pragma once

#include <cstdint>

namespace zipkv::cuda {

// A shared-memory matrix descriptor (PTX "matrix descriptor format"): start address, leading and stride byte offsets
// (16-byte units), 128-byte swizzle (layout type 1 in bits 62-63), base offset 0 (atoms 1,024-byte aligned). Kept as
// two words, so that an offset within shared memory is one 32-bit add to the low word's address field (14 bits:
// every shared address is below 2^18, so the add never carries into the leading byte offset above it).
struct SmemDescWords {
  uint32_t lo, hi;
};
__device__ __forceinline__ SmemDescWords smem_desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return {((addr & 0x3FFFF) >> 4) | (lbo >> 4) << 16, (sbo >> 4) | 1u << 30};
}
__device__ __forceinline__ uint64_t desc_at(SmemDescWords d, uint32_t byte_offset) {
  return static_cast<uint64_t>(d.hi) << 32 | (d.lo + (byte_offset >> 4));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Shared-memory writes of the generic proxy (st.shared, stmatrix) made visible to the async proxy that wgmma reads by;
// each writing thread fences before the barrier that orders them before the MMA.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// A warpgroup's register budget a thread, raised or lowered (every warp of the warpgroup executes it): the registers
// one warpgroup gives back are the pool another takes from.
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
// Keeps the compiler from moving reads or writes of registers an async MMA uses (its accumulators, or A fragments it
// still reads) across the MMA's issue or wait.
__device__ __forceinline__ void fence_register(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void fence_register(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }
template <typename T, int N>
__device__ __forceinline__ void fence_registers(T (&x)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) fence_register(x[i][e]);
  }
}

// D[64 x 64] += A[64 x 16] B[16 x 64], A and B K-major from shared memory (A's rows and B's, its 64 columns, hold 16
// k values each).
__device__ __forceinline__ void wgmma_m64n64k16(float (&d)[8][4], uint64_t desc_a, uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
      "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

// D[64 x 128] += A[64 x 16] B[16 x 128], B MN-major.
__device__ __forceinline__ void wgmma_m64n128k16_mn(float (&d)[16][4], const uint32_t a[4], uint64_t desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]),
        "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]),
        "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]),
        "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]),
        "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]),
        "+f"(d[15][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

}  // namespace zipkv::cuda
