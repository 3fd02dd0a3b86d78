// CUDA op zipkv::paged_decode: argument checks, the split-KV plan, the workspace, and the dispatch on head_dim.
// The kernels are in paged_decode.cuh.
//
// The plan is made on the host from shapes alone (batch, kv heads, nnz pages), never from tensor contents, so the op
// never syncs and a captured CUDA Graph replays the same plan: when batch x kv_heads CTAs would leave SMs idle or end
// in a partial wave, each request's tiles are cut into `splits` chunks whose partial results a second kernel merges.
// The workspace (partial outputs and lse) is sized by the same shapes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "paged_decode.cuh"

namespace zipkv::cuda {
namespace {

constexpr int kMinTilesPerSplit = 2 * decode::kWarps;  // below this a split's pipeline is mostly prologue
// The plan's cost model, in tiles: a CTA costs its tiles plus a fixed start/finish (pipeline fill, the warps' merge,
// the epilogue); a split plan adds the merge kernel. Splitting must save 5% over no split, and of the split counts
// within 3% of the best the fewest win (the model is no finer than that).
constexpr double kCtaOverheadTiles = 8.0, kMergeTiles = 12.0, kSplitGain = 0.05, kNearBest = 0.03;
// When CTAs outnumber the slots, SMs take new CTAs as old ones finish and end unevenly: the last CTAs started run
// with few others on their SM, at a lower rate. Fitted: ~1.5 CTA-times of tail per SM (benchmarks/NOTES.md, v7).
constexpr double kTailCtaTimes = 1.5;

int num_sms(int device) {
  static int cached[64] = {0};
  int& n = cached[device % 64];
  if (n == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

int occupancy(int head_dim, int group) {
  switch (head_dim) {
    case 64: return decode::ctas_per_sm<64>(group);
    case 128: return decode::ctas_per_sm<128>(group);
    default: return decode::ctas_per_sm<256>(group);
  }
}

int plan_splits(int64_t batch, int64_t kv_heads, int64_t nnz_pages, int page_size, int head_dim, int group,
                int64_t window_left, int device) {
  // Time of n CTAs in CTA-times per SM (an SM is saturated from 2 resident CTAs on): if they all fit at once, the
  // busiest SM's share (a lone CTA runs at about half the rate); otherwise SMs share them evenly, plus the tail.
  const int64_t sms = num_sms(device), residency = std::max(1, occupancy(head_dim, group));
  const int64_t slots = sms * residency, ctas = batch * kv_heads, saturated = std::min<int64_t>(2, residency);
  auto cta_times = [&](int64_t n) {
    return n <= slots ? static_cast<double>(std::max(saturated, (n + sms - 1) / sms))
                      : static_cast<double>(n) / static_cast<double>(sms) + kTailCtaTimes;
  };
  double avg_tiles = static_cast<double>(nnz_pages * (page_size / kTileTokens)) / static_cast<double>(batch);
  if (window_left >= 0) avg_tiles = std::min(avg_tiles, static_cast<double>(window_left / kTileTokens + 2));
  auto cost = [&](int s) { return cta_times(ctas * s) * (avg_tiles / s + kCtaOverheadTiles) + (s > 1 ? kMergeTiles : 0); };
  int max_splits = 1;
  while (max_splits < decode::kMaxSplits && avg_tiles / (max_splits + 1) >= kMinTilesPerSplit) ++max_splits;
  double least = cost(1);
  for (int s = 2; s <= max_splits; ++s) least = std::min(least, cost(s));
  if (cost(1) <= (1.0 + kSplitGain) * least) return 1;
  int s = 2;
  while (cost(s) > (1.0 + kNearBest) * least) ++s;
  return s;
}

void paged_decode_cuda(const at::Tensor& q, const at::Tensor& data, const at::Tensor& meta,
                       const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                       int64_t page_size, double sm_scale, at::Tensor& out, const std::optional<at::Tensor>& lse,
                       int64_t window_left, double logits_soft_cap) {
  check_decode_args(q, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, out, lse, window_left,
                    logits_soft_cap);
  const int64_t batch = q.size(0);
  if (batch == 0 || q.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const int D = q.size(2), H = meta.size(2), Hq = q.size(1);
  TORCH_CHECK(batch * H * decode::kMaxSplits < (int64_t{1} << 31),
              "zipkv.paged_decode: batch x num_kv_heads too large");

  decode::Params p{};
  p.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  p.data = data.data_ptr<uint8_t>();
  p.meta = meta.data_ptr<int32_t>();
  p.kv_indptr = kv_indptr.data_ptr<int32_t>();
  p.kv_indices = kv_indices.data_ptr<int32_t>();
  p.kv_last = kv_last_page_len.data_ptr<int32_t>();
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.data_bytes = data.numel();
  p.num_pages = meta.size(0);
  p.nnz = kv_indices.size(0);
  p.batch = static_cast<int>(batch);
  p.Hq = Hq;
  p.H = H;
  p.group = Hq / H;
  p.page_size = static_cast<int>(page_size);
  p.words = meta.size(3);
  p.window_left = static_cast<int>(window_left);
  p.scale_log2 = static_cast<float>(sm_scale) * decode::kLog2e;
  if (logits_soft_cap > 0.0) {
    p.cap_log2 = static_cast<float>(logits_soft_cap) * decode::kLog2e;
    p.scale_cap = static_cast<float>(sm_scale / logits_soft_cap);
  }
  p.num_splits = plan_splits(batch, H, p.nnz, p.page_size, D, p.group, window_left, q.get_device());

  at::Tensor workspace;
  if (p.num_splits > 1) {
    const int64_t rows = batch * Hq;
    workspace = at::empty({p.num_splits * rows * (D + 1)}, q.options().dtype(at::kFloat));
    p.part_o = workspace.data_ptr<float>();
    p.part_lse = p.part_o + p.num_splits * rows * D;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (D) {
    case 64: decode::launch<64>(p, stream); break;
    case 128: decode::launch<128>(p, stream); break;
    default: decode::launch<256>(p, stream); break;  // check_geometry allowed only 64/128/256
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CUDA, m) { m.impl("paged_decode", &paged_decode_cuda); }

}  // namespace zipkv::cuda
