// CUDA op zipkv::paged_prefill: argument checks, the grid from shapes alone, and the dispatch on head_dim (kernel in
// paged_prefill.cuh). No tensor contents are read on the host, so the op never syncs and can be captured in a CUDA
// Graph: the grid covers the most tiles any qo_indptr of this nnz_q and batch can make, and CTAs past the real last
// tile exit at once.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "paged_prefill.cuh"

namespace zipkv::cuda {
namespace {

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

  prefill::Params p{};
  p.q = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  p.qo_indptr = qo_indptr.data_ptr<int32_t>();
  p.data = data.data_ptr<uint8_t>();
  p.meta = meta.data_ptr<int32_t>();
  p.kv_indptr = kv_indptr.data_ptr<int32_t>();
  p.kv_indices = kv_indices.data_ptr<int32_t>();
  p.kv_last = kv_last_page_len.data_ptr<int32_t>();
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  p.lse = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  p.data_bytes = data.numel();
  p.num_pages = meta.size(0);
  p.nnz_kv = kv_indices.size(0);
  p.nnz_q = static_cast<int>(nnz_q);
  p.batch = static_cast<int>(batch);
  p.Hq = Hq;
  p.H = H;
  p.group = Hq / H;
  p.page_size = static_cast<int>(page_size);
  p.words = meta.size(3);
  p.tile_tokens = prefill::kRows / p.group;
  p.causal = causal ? 1 : 0;
  p.window_left = static_cast<int>(window_left);
  p.scale_log2 = static_cast<float>(sm_scale) * prefill::kLog2e;
  if (logits_soft_cap > 0.0) {
    p.cap_log2 = static_cast<float>(logits_soft_cap) * prefill::kLog2e;
    p.scale_cap = static_cast<float>(sm_scale / logits_soft_cap);
  }
  // Request b takes ceil(q_len_b / T) tiles: at most nnz_q / T + batch in all, whatever the q lengths.
  const int64_t ctas = nnz_q / p.tile_tokens + batch;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  switch (D) {
#define ZIPKV_HEAD_DIM_CASE_(HD) \
  case HD: prefill::launch<HD>(p, ctas, stream); return;
    ZIPKV_FOR_EACH_HEAD_DIM(ZIPKV_HEAD_DIM_CASE_)
#undef ZIPKV_HEAD_DIM_CASE_
    default: TORCH_CHECK_VALUE(false, "zipkv.paged_prefill: head_dim must be one of ", head_dims_text(), ", got ", D);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CUDA, m) { m.impl("paged_prefill", &paged_prefill_cuda); }

}  // namespace zipkv::cuda
