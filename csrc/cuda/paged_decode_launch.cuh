// Launch of the decode kernels for one head_dim; included by the per-head_dim instantiation files
// (paged_decode_hd64.cu, ...), one per entry of format.h's ZIPKV_FOR_EACH_HEAD_DIM, so that they compile in parallel.
// Every one is needed: paged_decode.cu dispatches on every listed head_dim, and a missing file fails to link.
#pragma once

#include <c10/cuda/CUDAException.h>

#include "paged_decode.cuh"
#include "smem_limit.cuh"

namespace zipkv::cuda::decode {

template <int D, bool kMulti, int kHeadTiles, int kCtas, int kWarps>
void set_smem_limit() {
  // Per device (smem_limit.cuh), outside any graph capture in practice (the first call on a device runs eagerly).
  static SmemFlags done{};
  ::zipkv::cuda::set_smem_limit(paged_decode_kernel<D, kMulti, kHeadTiles, kCtas, kWarps>,
                                VariantCfg<D, kMulti, kHeadTiles, kCtas, kWarps>::kSmemBytes, done);
}

template <int D, bool kMulti, int kHeadTiles, int kCtas, int kWarps>
int occupancy() {
  // Once per instantiation and device, like the shared-memory limit it depends on (0: not asked yet).
  static std::atomic<int> cached[kMaxDevices]{};
  std::atomic<int>& n = cached[current_device_index()];
  if (n.load(std::memory_order_acquire) == 0) {
    set_smem_limit<D, kMulti, kHeadTiles, kCtas, kWarps>();
    int ctas = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &ctas, paged_decode_kernel<D, kMulti, kHeadTiles, kCtas, kWarps>, 32 * kWarps,
        VariantCfg<D, kMulti, kHeadTiles, kCtas, kWarps>::kSmemBytes));
    n.store(ctas, std::memory_order_release);
  }
  return n.load(std::memory_order_acquire);
}

template <int D, bool kMulti, int kHeadTiles, int kCtas, int kWarps>
void launch_kernel(const Params& p, cudaStream_t stream) {
  set_smem_limit<D, kMulti, kHeadTiles, kCtas, kWarps>();
  const unsigned int ctas = static_cast<unsigned int>(p.slots * p.H * p.num_splits);
  paged_decode_kernel<D, kMulti, kHeadTiles, kCtas, kWarps>
      <<<ctas, 32 * kWarps, VariantCfg<D, kMulti, kHeadTiles, kCtas, kWarps>::kSmemBytes, stream>>>(p);
}

// The variant serving a head_dim, MMA columns and warps per CTA: kHeadTiles = 2 when the columns (the group's
// heads, or multi's query rows) exceed 8 (two MMA N tiles), 4 when multi's exceed 16 (d <= 128 only), and the
// residency (CTAs per SM) each variant's registers allow (d 128: 160 registers -> 3, 218 with two head tiles -> 2,
// 255 with four -> 2; d 64: 160 with its pairs of tiles -> 3, <= 128 with two head tiles -> 4, 204 with four -> 2;
// d 256: 229 -> 1).
// docs/decode-kernel.md: 3 measured against 2 at d 128 (v7, and v9 again); d 128 at 4 would leave a warp's ring too
// small for two raw tiles; d 64's pairs at 4 CTAs spill and lose (v21). d 128 with one head tile also comes as 2 CTAs
// of 6 warps (has_six_warps), decode only.
// Calls f.template operator()<kMulti, kHeadTiles, kCtas, kWarps>().
template <int D, typename F>
auto dispatch(int cols, int warps, bool multi, F&& f) {
  constexpr int kOne = D == 64 ? 3 : D == 128 ? 3 : 1, kTwo = D == 64 ? 4 : D == 128 ? 2 : 1;
  if (multi) {
    if constexpr (D <= 128) {
      if (cols > 16) return f.template operator()<true, 4, 2, 4>();
    }
    TORCH_CHECK(cols <= 16, "zipkv: the decode kernel has no variant of ", cols, " columns at head_dim ", D);
    return cols > 8 ? f.template operator()<true, 2, kTwo, 4>() : f.template operator()<true, 1, kOne, 4>();
  }
  if constexpr (D == 128) {
    if (warps == 6 && has_six_warps(D, cols)) return f.template operator()<false, 1, 2, 6>();
  }
  return cols > 8 ? f.template operator()<false, 2, kTwo, 4>() : f.template operator()<false, 1, kOne, 4>();
}

template <int D>
int ctas_per_sm(int cols, int warps, bool multi) {
  return dispatch<D>(cols, warps, multi, [&]<bool kMulti, int kHeadTiles, int kCtas, int kWarps>() {
    return occupancy<D, kMulti, kHeadTiles, kCtas, kWarps>();
  });
}

template <int D>
void launch(const Params& p, int warps, bool multi, cudaStream_t stream) {
  dispatch<D>(multi ? p.cols : p.group, warps, multi, [&]<bool kMulti, int kHeadTiles, int kCtas, int kWarps>() {
    launch_kernel<D, kMulti, kHeadTiles, kCtas, kWarps>(p, stream);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (p.num_splits > 1) {
    // Programmatic dependent launch: the merge's CTAs start while the decode grid drains (launch latency hidden).
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned int>((p.rows + kMergeRows - 1) / kMergeRows));
    cfg.blockDim = dim3(32 * kMergeRows);
    cfg.stream = stream;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, merge_splits_kernel<D>, p));
  }
}

#define ZIPKV_INSTANTIATE_DECODE(D)                                                                      \
  static_assert(::zipkv::head_dim_supported(D), "format.h's ZIPKV_FOR_EACH_HEAD_DIM does not list " #D); \
  template int ctas_per_sm<D>(int cols, int warps, bool multi);                                          \
  template void launch<D>(const Params& p, int warps, bool multi, cudaStream_t stream);

}  // namespace zipkv::cuda::decode
