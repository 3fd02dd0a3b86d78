// CUDA op zipkv::paged_decode: argument checks, the split-KV plan, the workspace, and the dispatch on head_dim.
// The kernels are in paged_decode.cuh.
//
// The plan is made on the host from shapes alone (batch, kv heads, nnz pages), never from tensor contents, so the op
// never syncs and a captured CUDA Graph replays the same plan: when batch x kv_heads CTAs would leave SMs idle or end
// in a partial wave, each request's tiles are cut into `splits` chunks whose partial results a second kernel merges.
// The workspace (partial outputs and lse) is sized by the same shapes.
#include <ATen/ATen.h>
#include <cstdlib>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "paged_decode.cuh"

namespace zipkv::cuda {
namespace {

constexpr int kMinTilesPerWarp = 2;  // below this per warp a split's pipeline is mostly prologue
// The plan's cost model, in tiles of SM time: a CTA costs its tiles plus a fixed start/finish per warp (pipeline fill,
// the warps' merge, the epilogue); a split plan adds the merge kernel. Splitting must save 5% over no split, and of
// the split counts within 3% of the best the fewest win (the model is no finer than that).
constexpr double kOverheadTilesPerWarp = 2.0, kMergeTiles = 12.0, kSplitGain = 0.05, kNearBest = 0.03;
// When CTAs outnumber the slots, SMs take new CTAs as old ones finish and end unevenly: the last CTAs started run
// with few others on their SM, at a lower rate. Fitted: ~1.5 CTA-times of tail per SM (benchmarks/NOTES.md, v7).
constexpr double kTailCtaTimes = 1.5;
// An SM streams at its full rate from 8 resident warps on (2 CTAs of 4; a lone CTA of 4 runs at about half).
constexpr int kSaturatedWarps = 8;

int num_sms(int device) {
  static int cached[64] = {0};
  int& n = cached[device % 64];
  if (n == 0) C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

int occupancy(int head_dim, int group, int warps) {
  switch (head_dim) {
    case 64: return decode::ctas_per_sm<64>(group, warps);
    case 128: return decode::ctas_per_sm<128>(group, warps);
    default: return decode::ctas_per_sm<256>(group, warps);
  }
}

struct Plan {
  int splits = 1, warps = 4;
  double cost = 0.0;
};

// The best split count for CTAs of `warps` warps, and its modelled cost.
Plan plan_for(int warps, int64_t batch, int64_t kv_heads, int64_t nnz_pages, int page_size, int head_dim, int group,
              int64_t window_left, int device) {
  // Time of n CTAs, each of `work` tiles, in tiles of SM time: if they all fit at once, the busiest SM's share at
  // its rate (below kSaturatedWarps resident warps an SM streams proportionally slower); otherwise SMs share them
  // evenly, plus the tail.
  const int64_t sms = num_sms(device), residency = std::max(1, occupancy(head_dim, group, warps));
  const int64_t slots = sms * residency, ctas = batch * kv_heads;
  const int64_t saturated = std::min<int64_t>(kSaturatedWarps, residency * warps);
  auto sm_time = [&](int64_t n, double work) {
    if (n > slots) return (static_cast<double>(n) / static_cast<double>(sms) + kTailCtaTimes) * work;
    const int64_t k = (n + sms - 1) / sms;
    return static_cast<double>(k) * work * static_cast<double>(saturated) /
           static_cast<double>(std::min(saturated, k * warps));
  };
  double avg_tiles = static_cast<double>(nnz_pages * (page_size / kTileTokens)) / static_cast<double>(batch);
  if (window_left >= 0) avg_tiles = std::min(avg_tiles, static_cast<double>(window_left / kTileTokens + 2));
  auto cost = [&](int s) {
    return sm_time(ctas * s, avg_tiles / s + kOverheadTilesPerWarp * warps) + (s > 1 ? kMergeTiles : 0);
  };
  int max_splits = 1;
  while (max_splits < decode::kMaxSplits && avg_tiles / (max_splits + 1) >= kMinTilesPerWarp * warps) ++max_splits;
  double least = cost(1);
  for (int s = 2; s <= max_splits; ++s) least = std::min(least, cost(s));
  Plan plan{1, warps, cost(1)};
  if (plan.cost <= (1.0 + kSplitGain) * least) return plan;
  int s = 2;
  while (cost(s) > (1.0 + kNearBest) * least) ++s;
  return Plan{s, warps, cost(s)};
}

int env_int(const char* name) {
  const char* env = std::getenv(name);
  return env == nullptr ? 0 : std::atoi(env);
}

// CTAs of 4 warps unless a variant of 6 (has_six_warps) is modelled to save kSplitGain: 4 is what every version of
// the kernel was measured with. Experiment switches for the benchmarks (branch v13-six-warp-ctas, not for users):
// ZIPKV_DECODE_WARPS=4 or 6 forces the warps, ZIPKV_DECODE_SPLITS=n the split count (clamped to 1..kMaxSplits).
Plan plan_decode(int64_t batch, int64_t kv_heads, int64_t nnz_pages, int page_size, int head_dim, int group,
                 int64_t window_left, int device) {
  // Read on every call (a getenv is ~0.1 us) so one benchmark process can sweep them.
  const int forced_warps = env_int("ZIPKV_DECODE_WARPS"), forced_splits = env_int("ZIPKV_DECODE_SPLITS");
  Plan plan = plan_for(4, batch, kv_heads, nnz_pages, page_size, head_dim, group, window_left, device);
  if (decode::has_six_warps(head_dim, group) && forced_warps != 4) {
    const Plan six = plan_for(6, batch, kv_heads, nnz_pages, page_size, head_dim, group, window_left, device);
    if (forced_warps == 6 || six.cost * (1.0 + kSplitGain) < plan.cost) plan = six;
  }
  if (forced_splits > 0) plan.splits = std::min(forced_splits, decode::kMaxSplits);
  return plan;
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
  const Plan plan = plan_decode(batch, H, p.nnz, p.page_size, D, p.group, window_left, q.get_device());
  p.num_splits = plan.splits;

  at::Tensor workspace;
  if (p.num_splits > 1) {
    const int64_t rows = batch * Hq;
    workspace = at::empty({p.num_splits * rows * (D + 1)}, q.options().dtype(at::kFloat));
    p.part_o = workspace.data_ptr<float>();
    p.part_lse = p.part_o + p.num_splits * rows * D;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (D) {
    case 64: decode::launch<64>(p, plan.warps, stream); break;
    case 128: decode::launch<128>(p, plan.warps, stream); break;
    default: decode::launch<256>(p, plan.warps, stream); break;  // check_geometry allowed only 64/128/256
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CUDA, m) { m.impl("paged_decode", &paged_decode_cuda); }

}  // namespace zipkv::cuda
