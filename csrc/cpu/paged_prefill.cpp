// CPU kernel of zipkv::paged_prefill: the readable reference of attention with many query tokens per request. Work
// items are (request, kv head, block of query tokens): each decodes the pages its tokens can see (once for all the
// tokens and GQA heads of the block), then a two-pass softmax per query row.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../checks.h"
#include "stream.h"

namespace zipkv::cpu {
namespace {

constexpr int kQueryBlock = 32;  // query tokens per work item: the pages it decodes serve 32 x group rows

struct Item {
  int64_t b;
  int h;
  int64_t q0, q1;  // the item's query tokens, request-relative
};

// The keys query token i of a request (q_len tokens over kv_len) attends to: [lo, hi).
struct KeyRange {
  int64_t lo, hi;
};
KeyRange key_range(int64_t i, int64_t q_len, int64_t kv_len, bool causal, int64_t window_left) {
  const int64_t pos = kv_len - q_len + i;
  return {window_left >= 0 ? std::max<int64_t>(0, pos - window_left) : 0, causal ? pos + 1 : kv_len};
}

void paged_prefill_cpu(const at::Tensor& q, const at::Tensor& qo_indptr, const at::Tensor& data, const at::Tensor& meta,
                       const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                       int64_t page_size, double sm_scale, at::Tensor& out, const std::optional<at::Tensor>& lse,
                       bool causal, int64_t window_left, double logits_soft_cap) {
  const char* op = "paged_prefill";
  check_prefill_args(q, qo_indptr, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out, lse,
                     window_left, logits_soft_cap);
  const int64_t nnz_q = q.size(0), batch = qo_indptr.size(0) - 1, num_pages = meta.size(0);
  const int Hq = q.size(1), H = meta.size(2), D = q.size(2), P = page_size, group = Hq / H;
  check_page_table(op, kv_indptr, kv_indices, kv_last_page_len, P, num_pages);
  const int32_t* qo = qo_indptr.data_ptr<int32_t>();
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  const int32_t* indices = kv_indices.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(qo[0] == 0, "zipkv.paged_prefill: qo_indptr[0] must be 0, got ", qo[0]);
  std::vector<Item> items;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(qo[b + 1] >= qo[b], "zipkv.paged_prefill: qo_indptr must be non-decreasing, but qo_indptr[",
                      b + 1, "] = ", qo[b + 1], " < qo_indptr[", b, "] = ", qo[b]);
    const int64_t q_len = qo[b + 1] - qo[b], kv_len = request_tokens(indptr, last, b, P);
    TORCH_CHECK_VALUE(!causal || q_len <= kv_len, "zipkv.paged_prefill: request ", b, " has ", q_len,
                      " query tokens but ", kv_len,
                      " tokens in its pages: a causal query's pages must hold its own "
                      "tokens (q_len <= kv_len)");
    for (int64_t q0 = 0; q0 < q_len; q0 += kQueryBlock)
      for (int h = 0; h < H; ++h) items.push_back({b, h, q0, std::min<int64_t>(q_len, q0 + kQueryBlock)});
  }
  TORCH_CHECK_VALUE(qo[batch] == nnz_q, "zipkv.paged_prefill: qo_indptr[", batch, "] = ", qo[batch],
                    " must equal q.shape[0] = ", nnz_q, " (every query token belongs to one request)");
  const float cap = static_cast<float>(logits_soft_cap), scale = static_cast<float>(sm_scale);

  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* op_out = out.data_ptr<at::BFloat16>();
  float* lp = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kf, vf, qf(D), s;
    std::vector<double> acc(D);
    for (int64_t x = begin; x < end; ++x) {
      const Item& it = items[x];
      const int64_t q_len = qo[it.b + 1] - qo[it.b], kv_len = request_tokens(indptr, last, it.b, P);
      // The pages any token of the item sees (keys [lo, hi) widen with the token index), decoded once; pages wholly
      // outside them (before a window, after the causal limit) are never read.
      const int64_t lo = key_range(it.q0, q_len, kv_len, causal, window_left).lo;
      const int64_t hi = key_range(it.q1 - 1, q_len, kv_len, causal, window_left).hi;
      const int64_t p0 = lo / P, p1 = (hi + P - 1) / P;
      kf.resize((p1 - p0) * P * D);
      vf.resize((p1 - p0) * P * D);
      for (int64_t j = p0; j < p1; ++j) {
        const int64_t page = indices[indptr[it.b] + j];
        decode_stream(op, data, meta, page, 0, it.h, P, D, kf.data() + (j - p0) * P * D);
        decode_stream(op, data, meta, page, 1, it.h, P, D, vf.data() + (j - p0) * P * D);
      }
      s.resize(hi - lo);
      for (int64_t i = it.q0; i < it.q1; ++i) {
        const KeyRange r = key_range(i, q_len, kv_len, causal, window_left);
        for (int g = 0; g < group; ++g) {
          const int64_t row = (qo[it.b] + i) * Hq + it.h * group + g;
          for (int d = 0; d < D; ++d) qf[d] = bf16_to_float(qp[row * D + d]);
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t t = r.lo; t < r.hi; ++t) {
            const float* k = kf.data() + (t - p0 * P) * D;
            float dot = 0.f;
            for (int d = 0; d < D; ++d) dot += qf[d] * k[d];
            float logit = dot * scale;
            if (cap > 0.f) logit = cap * std::tanh(logit / cap);
            s[t - lo] = logit;
            mx = std::max(mx, logit);
          }
          // As paged_decode: every logit -inf (or no keys) attends to nothing (out 0, lse -inf); a NaN or +inf logit
          // makes the row NaN. The weighted sum of V accumulates in double (V near the bf16 maximum).
          // A max of -inf weighs the logits against 0 instead (exp(-inf - 0) = 0, where -inf - -inf is NaN).
          const float m_use = mx == -std::numeric_limits<float>::infinity() ? 0.f : mx;
          std::fill(acc.begin(), acc.end(), 0.0);
          double l = 0.0;
          for (int64_t t = r.lo; t < r.hi; ++t) {
            const double p = std::exp(s[t - lo] - m_use);
            l += p;
            const float* v = vf.data() + (t - p0 * P) * D;
            for (int d = 0; d < D; ++d) acc[d] += p * v[d];
          }
          const double inv = l == 0.0 ? 0.0 : 1.0 / l;
          for (int d = 0; d < D; ++d) op_out[row * D + d] = static_cast<at::BFloat16>(static_cast<float>(acc[d] * inv));
          if (lp) lp[row] = l == 0.0 ? -std::numeric_limits<float>::infinity() : static_cast<float>(mx + std::log(l));
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CPU, m) { m.impl("paged_prefill", &paged_prefill_cpu); }

}  // namespace zipkv::cpu
