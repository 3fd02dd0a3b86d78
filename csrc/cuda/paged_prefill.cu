// CUDA op zipkv::paged_prefill: argument checks, the choice of kernel and its grid from shapes alone, and the dispatch
// on head_dim; zipkv::prefill_plan tells the choice without running it. No tensor contents are read on the host, so
// the op never syncs and can be captured in a CUDA Graph: each grid covers the most CTAs any qo_indptr of this nnz_q
// and batch can make, and CTAs past the real last one exit at once.
//
// Two kernels, by the mean query rows (q_len x group) per request:
// - short queries (speculative verification, a few decode steps at once): the decode kernel's kMulti variant
//   (paged_decode.cuh), memory-bound like decode, each tile streamed once for up to 16 query rows of a request;
// - longer ones (chunked prefill): the tile kernel (paged_prefill.cuh), compute-bound, 128 query rows per CTA, each
//   K/V tile rebuilt into shared memory once per CTA for the ordinary ldmatrix + MMA path.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <vector>

#include "../checks.h"
#include "attention_params.h"
#include "paged_decode_plan.h"
#include "paged_prefill.cuh"

namespace zipkv::cuda {
namespace {

// Up to this many query rows (q_len x group) per request on average the decode kernel serves the batch: one pass over
// each request's pages per 16 rows, where the tile kernel's CTAs of 128 rows stream the pages for an eighth of their
// rows or less. At q_len 2-8 over 8K (group 4: 8-32 rows) the tile kernel of 64 rows took 4.0-4.4x decode's time and
// this takes 1.1-2.4x (docs/performance.md, "Prefill attention"); where the two cross above 32 rows is not measured.
constexpr int64_t kShortRows = 32;

bool short_queries(int64_t nnz_q, int64_t batch, int64_t group) { return nnz_q * group <= kShortRows * batch; }

// The decode kernel's MMA columns for short queries and its launch. Request b takes ceil(q_len_b x group / cols)
// slots per kv head: 8 columns when a request's rows fit one N tile on average, 16 when two, else 32 (one pass over
// the pages for up to 32 rows, where two slots of 16 each streamed them) at head_dim <= 128 (O in 128 registers) and
// a group of 2 or more (a slot's query tokens span at most 16: the kernel's 4-bit bounds per column); the plan is
// made for an even batch.
struct ShortLaunch {
  int cols;
  DecodeLaunch plan;
};
ShortLaunch plan_short(int64_t nnz_q, int64_t batch, int64_t group, int64_t kv_heads, int64_t nnz_pages,
                       int64_t page_size, int head_dim, int64_t window_left) {
  const bool wide = head_dim <= 128 && group >= 2;
  const int cols = nnz_q * group <= 8 * batch ? 8 : nnz_q * group <= 16 * batch || !wide ? 16 : 32;
  const int64_t even_slots = batch * ((nnz_q * group + batch * cols - 1) / (batch * cols));
  return {cols,
          plan_decode_launch(even_slots * kv_heads, batch, nnz_pages, page_size, head_dim, cols, window_left, true)};
}

void paged_prefill_cuda(const at::Tensor& q, const at::Tensor& qo_indptr, const at::Tensor& data,
                        const at::Tensor& meta, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                        const at::Tensor& kv_last_page_len, int64_t page_size, double sm_scale, at::Tensor& out,
                        const std::optional<at::Tensor>& lse, bool causal, int64_t window_left,
                        double logits_soft_cap) {
  check_prefill_args(q, qo_indptr, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out, lse,
                     window_left, logits_soft_cap);
  const int64_t nnz_q = q.size(0), batch = qo_indptr.size(0) - 1;
  if (nnz_q == 0 || q.size(1) == 0 || batch == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const int D = q.size(2), H = meta.size(2), Hq = q.size(1);
  TORCH_CHECK_VALUE((nnz_q + batch) * H < (int64_t{1} << 31), "zipkv.paged_prefill: q's (nnz_q + batch) x ",
                    "num_kv_heads must be below 2^31, got (", nnz_q, " + ", batch, ") x ", H);

  const int64_t group = Hq / H;
  if (short_queries(nnz_q, batch, group)) {
    const ShortLaunch launch = plan_short(nnz_q, batch, group, H, kv_indices.size(0), page_size, D, window_left);
    const int cols = launch.cols;
    decode::Params p{};
    set_attention_params(p, q, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out, lse,
                         window_left, logits_soft_cap);
    p.nnz = kv_indices.size(0);
    p.batch = static_cast<int>(batch);
    p.qo_indptr = qo_indptr.data_ptr<int32_t>();
    p.nnz_q = static_cast<int>(nnz_q);
    p.causal = causal ? 1 : 0;
    p.cols = cols;
    p.slots = nnz_q * group / cols + batch;  // the most slots any qo_indptr of this nnz_q and batch makes
    p.rows = nnz_q * Hq;
    TORCH_CHECK_VALUE(p.slots * H * decode::kMaxSplits < (int64_t{1} << 31), "zipkv.paged_prefill: q's (nnz_q x ",
                      "group / ", cols, " + batch) x num_kv_heads must be below 2^31 / ", decode::kMaxSplits, ", got (",
                      nnz_q, " x ", group, " / ", cols, " + ", batch, ") x ", H);
    launch_decode(p, launch.plan, D, true, q);
    return;
  }

  prefill::Params p{};
  set_attention_params(p, q, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out, lse,
                       window_left, logits_soft_cap);
  p.qo_indptr = qo_indptr.data_ptr<int32_t>();
  p.nnz_kv = kv_indices.size(0);
  p.nnz_q = static_cast<int>(nnz_q);
  p.batch = static_cast<int>(batch);
  p.tile_tokens = prefill::kRows / p.group;
  p.causal = causal ? 1 : 0;
  if (const char* probe = std::getenv("ZIPKV_PREFILL_PROBE")) p.probe = std::atoi(probe);  // experiment only
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (D) {
#define ZIPKV_HEAD_DIM_CASE_(HD) \
  case HD: prefill::launch<HD>(p, stream); return;
    ZIPKV_FOR_EACH_HEAD_DIM(ZIPKV_HEAD_DIM_CASE_)
#undef ZIPKV_HEAD_DIM_CASE_
    default: TORCH_CHECK_VALUE(false, "zipkv.paged_prefill: head_dim must be one of ", head_dims_text(), ", got ", D);
  }
}

// The kernel paged_prefill would run for these shapes and its plan: {kernel (1: the decode kernel's short-query
// variant, 0: the tile kernel, -1: none, an empty batch), splits, warps per CTA, CTAs per SM (0: the tile kernel's is
// not asked), query rows per CTA}.
std::vector<int64_t> prefill_plan_cuda(const at::Tensor& q, const at::Tensor& qo_indptr, const at::Tensor& meta,
                                       int64_t nnz_pages, int64_t page_size, int64_t window_left) {
  const char* op = "prefill_plan";
  check_plan_args(op, q, meta, nnz_pages, page_size, window_left);
  check_tensor(qo_indptr, op, "qo_indptr", at::kInt, 1, q.device());
  TORCH_CHECK_VALUE(qo_indptr.size(0) >= 1, "zipkv.prefill_plan: qo_indptr must have batch + 1 >= 1 entries, got 0");
  const int64_t nnz_q = q.size(0), batch = qo_indptr.size(0) - 1, H = meta.size(2), group = q.size(1) / H;
  if (nnz_q == 0 || q.size(1) == 0 || batch == 0) return {-1, 0, 0, 0, 0};
  if (!short_queries(nnz_q, batch, group)) return {0, 1, prefill::kWarps, 0, prefill::kRows};
  const c10::cuda::CUDAGuard guard(q.device());
  const ShortLaunch launch = plan_short(nnz_q, batch, group, H, nnz_pages, page_size, q.size(2), window_left);
  return {1, launch.plan.splits, launch.plan.warps, launch.plan.ctas_per_sm, launch.cols};
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CUDA, m) {
  m.impl("paged_prefill", &paged_prefill_cuda);
  m.impl("prefill_plan", &prefill_plan_cuda);
}

}  // namespace zipkv::cuda
