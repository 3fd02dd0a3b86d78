// CUDA op zipkv::paged_decode: argument checks, the split-KV plan, the workspace, and the dispatch on head_dim
// (dispatch_head_dim; kernels in paged_decode.cuh); zipkv::decode_plan tells the plan without running it. The plan
// and the launch also serve paged_prefill's short queries (paged_decode_plan.h).
//
// The plan is made on the host from shapes alone (batch, kv heads, nnz pages), never from tensor contents, so the op
// never syncs and a captured CUDA Graph replays the same plan: when batch x kv_heads CTAs would leave SMs idle or end
// in a partial wave, each request's tiles are cut into `splits` chunks whose partial results a second kernel merges,
// or (d 128) CTAs of 6 warps fill the waves better than 4. The workspace (partial outputs and lse) is sized by the
// same shapes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <vector>

#include "../checks.h"
#include "attention_params.h"
#include "paged_decode.cuh"
#include "paged_decode_plan.h"
#include "smem_limit.cuh"

namespace zipkv::cuda {
namespace {

constexpr int kMinTilesPerWarp = 2;  // below this per warp a split's pipeline is mostly prologue
// The plan's cost model, in tiles of SM time: a CTA costs its tiles plus a fixed start/finish per warp (pipeline fill,
// the warps' merge, the epilogue); a split plan adds the merge kernel. Splitting must save 5% over no split, and of
// the split counts within 3% of the best the fewest win (the model is no finer than that). A 6-warp layout must
// save kSixGain (plan_decode).
constexpr double kOverheadTilesPerWarp = 2.0, kMergeTiles = 12.0, kSplitGain = 0.05, kNearBest = 0.03, kSixGain = 0.02;
// Short-query slots of 32 rows (four head tiles, K and V rebuilt a block at a time) start and finish at a far higher
// cost, fitted on 8K x 48, 64 and 96 at 1-4 splits (docs/performance.md, "Prefill attention"): ~16 tiles per warp.
constexpr double kWideOverheadTilesPerWarp = 16.0;
// When CTAs outnumber the slots, SMs take new CTAs as old ones finish and end unevenly: the last CTAs started run
// with few others on their SM, at a lower rate. Fitted: ~1.5 CTA-times of tail per SM (docs/decode-kernel.md, v7).
constexpr double kTailCtaTimes = 1.5;
// An SM streams at its full rate from 8 resident warps on (2 CTAs of 4; a lone CTA of 4 runs at about half).
constexpr int kSaturatedWarps = 8;

// SMs of the current device (the caller's CUDAGuard makes q's device current), asked once per device.
int num_sms() {
  static std::atomic<int> cached[kMaxDevices]{};
  const int device = current_device_index();
  if (cached[device].load(std::memory_order_acquire) == 0) {
    int n = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    cached[device].store(n, std::memory_order_release);
  }
  return cached[device].load(std::memory_order_acquire);
}

// The one dispatch on head_dim: f.template operator()<D>() with D = head_dim as a compile-time constant, for each D of
// format.h's ZIPKV_FOR_EACH_HEAD_DIM (each instantiated by its paged_decode_hd<D>.cu). Any other head_dim raises
// ValueError (check_geometry refuses it before any dispatch).
template <typename F>
void dispatch_head_dim(const char* op, int head_dim, F&& f) {
  switch (head_dim) {
#define ZIPKV_HEAD_DIM_CASE_(D) \
  case D: f.template operator()<D>(); return;
    ZIPKV_FOR_EACH_HEAD_DIM(ZIPKV_HEAD_DIM_CASE_)
#undef ZIPKV_HEAD_DIM_CASE_
    default: TORCH_CHECK_VALUE(false, "zipkv.", op, ": head_dim must be one of ", head_dims_text(), ", got ", head_dim);
  }
}

int occupancy(int head_dim, int cols, int warps, bool multi) {
  int ctas = 0;
  dispatch_head_dim("paged_decode", head_dim, [&]<int D>() { ctas = decode::ctas_per_sm<D>(cols, warps, multi); });
  return ctas;
}

// Shapes the plan sees; the tile count is the batch's mean (ragged batches are planned as if even).
struct Shape {
  int64_t ctas;         // batch x kv_heads (multi: slots x kv heads): one CTA each before splitting
  double tiles;         // mean 16-token tiles per request inside the window
  int head_dim, group;  // group: the MMA columns a CTA fills (multi: Params::cols)
  bool multi;
};

struct Plan {
  int splits = 1, warps = 4;
};

// A CTA's start and finish per warp, in tiles.
double overhead_tiles(const Shape& x) {
  return x.multi && x.group > 16 ? kWideOverheadTilesPerWarp : kOverheadTilesPerWarp;
}

// Tiles of SM time that k CTAs of `warps` warps and `work` tiles each take on one SM, `residency` of them fitting at
// once: an SM streams at its full rate from kSaturatedWarps resident warps on (or from all it can hold).
double sm_time(int64_t k, double work, int warps, int64_t residency) {
  const int64_t saturated = std::min<int64_t>(kSaturatedWarps, residency * warps);
  return static_cast<double>(k) * work * static_cast<double>(saturated) /
         static_cast<double>(std::min(saturated, k * warps));
}

// Time of `splits` x ctas equal CTAs of `warps` warps run as lockstep waves: each full wave costs an SM its resident
// CTAs' work, the partial last wave the busiest SM's share at its rate. It ignores how uneven finishing smooths many
// waves: decode uses it only to compare layouts at split counts already chosen, where a partial wave is what
// differs; short-query slots, equal CTAs, for their split count too.
double wave_time(const Shape& x, int splits, int warps) {
  const int64_t sms = num_sms(), residency = std::max(1, occupancy(x.head_dim, x.group, warps, x.multi));
  const int64_t n = x.ctas * splits, full = n / (sms * residency), rest = n % (sms * residency);
  const double work = x.tiles / splits + overhead_tiles(x) * warps;
  return static_cast<double>(full) * sm_time(residency, work, warps, residency) +
         (rest > 0 ? sm_time((rest + sms - 1) / sms, work, warps, residency) : 0.0) + (splits > 1 ? kMergeTiles : 0.0);
}

// The split count for CTAs of 4 warps, from the fitted model: a CTA costs its tiles plus a start/finish per warp;
// if all CTAs fit at once, the busiest SM's share at its rate, otherwise an even share plus the tail. Short-query
// slots (multi) run as lockstep waves (wave_time): an even batch's slots are equal CTAs, and their measured times
// at 1-4 splits follow the waves (the tail, fitted on decode's ragged finishes, made 32-row slots at 8K x 64 split 3
// ways, 22% slower than 1; docs/performance.md).
int plan_splits(const Shape& x) {
  constexpr int warps = 4;
  const int64_t sms = num_sms(), residency = std::max(1, occupancy(x.head_dim, x.group, warps, x.multi));
  auto cost = [&](int s) {
    if (x.multi) return wave_time(x, s, warps);
    const int64_t n = x.ctas * s;
    const double work = x.tiles / s + kOverheadTilesPerWarp * warps;
    const double t = n > sms * residency ? (static_cast<double>(n) / static_cast<double>(sms) + kTailCtaTimes) * work
                                         : sm_time((n + sms - 1) / sms, work, warps, residency);
    return t + (s > 1 ? kMergeTiles : 0.0);
  };
  int max_splits = 1;
  while (max_splits < decode::kMaxSplits && x.tiles / (max_splits + 1) >= kMinTilesPerWarp * warps) ++max_splits;
  double least = cost(1);
  for (int s = 2; s <= max_splits; ++s) least = std::min(least, cost(s));
  if (cost(1) <= (1.0 + kSplitGain) * least) return 1;
  int s = 2;
  while (cost(s) > (1.0 + kNearBest) * least) ++s;
  return s;
}

// CTAs of 4 warps at plan_splits' count; where a 6-warp variant exists (has_six_warps), one unsplit CTA of 6 warps
// per (request, kv head) instead if its waves are kSixGain faster. On the H200, 6 x 2 per SM has 264 slots and
// 4 x 3 has 396: 512 CTAs fill 1.94 waves of the first and 1.29 of the second. Measured (docs/decode-kernel.md, v13):
// 2K x 64 112.8 -> 105.4 us, 8K x 64 381.9 -> 379.3; split 6-warp CTAs never beat the 4-warp plan.
// Only from more CTAs than 4-warp slots (fewer make no partial wave: the split plan was measured there) up to two
// waves of 6-warp CTAs (over more, uneven finishing blurs the waves and the two layouts measured the same).
Plan plan_decode(const Shape& x) {
  const Plan four{plan_splits(x), 4};
  if (x.multi || !decode::has_six_warps(x.head_dim, x.group)) return four;
  const int64_t sms = num_sms();
  if (x.ctas <= sms * occupancy(x.head_dim, x.group, 4, x.multi) ||
      x.ctas > 2 * sms * occupancy(x.head_dim, x.group, 6, x.multi))
    return four;
  return wave_time(x, 1, 6) * (1.0 + kSixGain) < wave_time(x, four.splits, 4) ? Plan{1, 6} : four;
}

}  // namespace

DecodeLaunch plan_decode_launch(int64_t ctas, int64_t batch, int64_t nnz_pages, int64_t page_size, int head_dim,
                                int cols, int64_t window_left, bool multi) {
  double tiles = static_cast<double>(nnz_pages * (page_size / kTileTokens)) / static_cast<double>(batch);
  if (window_left >= 0) tiles = std::min(tiles, static_cast<double>(window_left / kTileTokens + 2));
  const Plan plan = plan_decode(Shape{ctas, tiles, head_dim, cols, multi});
  return {plan.splits, plan.warps, occupancy(head_dim, cols, plan.warps, multi)};
}

void launch_decode(decode::Params& p, const DecodeLaunch& plan, int head_dim, bool multi, const at::Tensor& q) {
  p.num_splits = plan.splits;
  at::Tensor workspace;
  if (p.num_splits > 1) {
    workspace = at::empty({p.num_splits * p.rows * (head_dim + 1)}, q.options().dtype(at::kFloat));
    p.part_o = workspace.data_ptr<float>();
    p.part_lse = p.part_o + p.num_splits * p.rows * head_dim;
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dispatch_head_dim("paged_decode", head_dim, [&]<int kD>() { decode::launch<kD>(p, plan.warps, multi, stream); });
}

namespace {

void paged_decode_cuda(const at::Tensor& q, const at::Tensor& data, const at::Tensor& meta, const at::Tensor& kv_indptr,
                       const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len, int64_t page_size,
                       double sm_scale, at::Tensor& out, const std::optional<at::Tensor>& lse, int64_t window_left,
                       double logits_soft_cap) {
  check_decode_args(q, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out, lse, window_left,
                    logits_soft_cap);
  const int64_t batch = q.size(0);
  if (batch == 0 || q.size(1) == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const int D = q.size(2), H = meta.size(2), Hq = q.size(1);
  TORCH_CHECK_VALUE(batch * H * decode::kMaxSplits < (int64_t{1} << 31), "zipkv.paged_decode: q's batch x ",
                    "num_kv_heads must be below 2^31 / ", decode::kMaxSplits, ", got ", batch, " x ", H);

  decode::Params p{};
  set_attention_params(p, q, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out, lse,
                       window_left, logits_soft_cap);
  p.nnz = kv_indices.size(0);
  p.batch = static_cast<int>(batch);
  p.slots = batch;
  p.rows = batch * Hq;
  const DecodeLaunch plan = plan_decode_launch(batch * H, batch, p.nnz, page_size, D, p.group, window_left, false);
  launch_decode(p, plan, D, false, q);
}

// The plan paged_decode would make for these shapes: {splits, warps per CTA, CTAs per SM}; {0, 0, 0} for an empty
// batch, which launches nothing.
std::vector<int64_t> decode_plan_cuda(const at::Tensor& q, const at::Tensor& meta, int64_t nnz_pages, int64_t page_size,
                                      int64_t window_left) {
  check_plan_args("decode_plan", q, meta, nnz_pages, page_size, window_left);
  const int64_t group = q.size(1) / meta.size(2);
  if (q.size(0) == 0) return {0, 0, 0};
  const c10::cuda::CUDAGuard guard(q.device());
  const DecodeLaunch plan = plan_decode_launch(q.size(0) * meta.size(2), q.size(0), nnz_pages, page_size, q.size(2),
                                               static_cast<int>(group), window_left, false);
  return {plan.splits, plan.warps, plan.ctas_per_sm};
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CUDA, m) {
  m.impl("paged_decode", &paged_decode_cuda);
  m.impl("decode_plan", &decode_plan_cuda);
}

}  // namespace zipkv::cuda
