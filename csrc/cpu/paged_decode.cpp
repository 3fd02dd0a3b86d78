// CPU kernel of zipkv::paged_decode: the readable reference of the fused decode. Per (request, kv head): decode each
// page's K and V to float, then an online softmax over its tokens for every query head of the GQA group.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "../checks.h"
#include "stream.h"

namespace zipkv::cpu {
namespace {

void paged_decode_cpu(const at::Tensor& q, const at::Tensor& data, const at::Tensor& meta, const at::Tensor& kv_indptr,
                      const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len, int64_t page_size,
                      double sm_scale, at::Tensor& out, const std::optional<at::Tensor>& lse, int64_t window_left,
                      double logits_soft_cap) {
  check_decode_args(q, data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, out, lse, window_left,
                    logits_soft_cap);
  const int64_t batch = q.size(0), num_pages = meta.size(0);
  const int Hq = q.size(1), H = meta.size(2), D = q.size(2), P = page_size, group = Hq / H;
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  const int32_t* indices = kv_indices.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  check_page_table("paged_decode", kv_indptr, kv_indices, kv_last_page_len, P, num_pages);
  const float cap = static_cast<float>(logits_soft_cap), scale = static_cast<float>(sm_scale);

  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* op = out.data_ptr<at::BFloat16>();
  float* lp = lse.has_value() ? lse->data_ptr<float>() : nullptr;
  at::parallel_for(0, batch * H, 1, [&](int64_t begin, int64_t end) {
    // The weighted sum of V (and the sum of weights) accumulate in double: in float, tokens whose V is near the bf16
    // maximum overflow it (two tokens of V = 3e38 would give inf where the exact mean, 3.004e38, fits).
    std::vector<float> kf(P * D), vf(P * D), qf(group * D), m(group), s(P);
    std::vector<double> acc(group * D), l(group);
    for (int64_t x = begin; x < end; ++x) {
      const int64_t b = x / H;
      const int h = x % H;
      for (int r = 0; r < group * D; ++r) qf[r] = bf16_to_float(qp[(b * Hq + h * group) * D + r]);
      std::fill(acc.begin(), acc.end(), 0.0);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0);
      // A sliding window starts at token `first`; pages wholly before it are skipped, never decoded.
      const int64_t tokens = request_tokens(indptr, last, b, P);
      const int64_t first = window_left >= 0 ? std::max<int64_t>(0, tokens - window_left - 1) : 0;
      for (int64_t j = indptr[b] + first / P; j < indptr[b + 1]; ++j) {
        const int len = j + 1 == indptr[b + 1] ? last[b] : P;
        const int lo = j == indptr[b] + first / P ? static_cast<int>(first % P) : 0;
        decode_stream("paged_decode", data, meta, indices[j], 0, h, P, D, kf.data());
        decode_stream("paged_decode", data, meta, indices[j], 1, h, P, D, vf.data());
        for (int g = 0; g < group; ++g) {
          float mx = m[g];
          for (int t = lo; t < len; ++t) {
            float dot = 0.f;
            for (int d = 0; d < D; ++d) dot += qf[g * D + d] * kf[t * D + d];
            s[t] = dot * scale;
            if (cap > 0.f) s[t] = cap * std::tanh(s[t] / cap);
            mx = std::max(mx, s[t]);
          }
          // A running max of -inf means "nothing yet": every logit so far is -inf (finite bf16 q and k can overflow
          // q.k to -inf in float). As in FlashAttention, weigh such tokens against 0 instead: exp(-inf - 0) = 0, where
          // exp(-inf - -inf) would be NaN. The first finite logit then becomes the max (alpha = 0 rescales zeros).
          constexpr float kNegInf = -std::numeric_limits<float>::infinity();
          const float m_use = mx == kNegInf ? 0.f : mx;
          const float alpha = m[g] == kNegInf ? 0.f : std::exp(m[g] - mx);
          l[g] *= alpha;
          for (int d = 0; d < D; ++d) acc[g * D + d] *= alpha;
          for (int t = lo; t < len; ++t) {
            const double p = std::exp(s[t] - m_use);
            l[g] += p;
            for (int d = 0; d < D; ++d) acc[g * D + d] += p * vf[t * D + d];
          }
          m[g] = mx;
        }
      }
      // l = 0: nothing attended (no tokens, or every logit -inf): out 0, lse -inf. A NaN l (a NaN or +inf logit)
      // stays NaN in out and lse, as on CUDA.
      for (int g = 0; g < group; ++g) {
        const int64_t row = b * Hq + h * group + g;
        const double inv = l[g] == 0.0 ? 0.0 : 1.0 / l[g];
        for (int d = 0; d < D; ++d)
          op[row * D + d] = static_cast<at::BFloat16>(static_cast<float>(acc[g * D + d] * inv));
        if (lp)
          lp[row] = l[g] == 0.0 ? -std::numeric_limits<float>::infinity() : static_cast<float>(m[g] + std::log(l[g]));
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CPU, m) { m.impl("paged_decode", &paged_decode_cpu); }

}  // namespace zipkv::cpu
