// The fields that the attention kernels' Params (decode::Params, prefill::Params) share, set from an op's arguments
// in one place: paged_decode, and paged_prefill for either of its kernels.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace zipkv::cuda {

constexpr float kLog2eHost = 1.4426950408889634f;  // the kernels run the softmax in base 2 (their kLog2e)

template <typename P>
void set_attention_params(P& p, const at::Tensor& q, const at::Tensor& data, const at::Tensor& meta,
                          const at::Tensor& kv_indptr, const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                          int64_t page_size, double sm_scale, at::Tensor& out, const std::optional<at::Tensor>& lse,
                          int64_t window_left, double logits_soft_cap) {
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
  p.Hq = static_cast<int>(q.size(1));
  p.H = static_cast<int>(meta.size(2));
  p.group = p.Hq / p.H;
  p.page_size = static_cast<int>(page_size);
  p.words = static_cast<int>(meta.size(3));
  p.window_left = static_cast<int>(window_left);
  p.scale_log2 = static_cast<float>(sm_scale) * kLog2eHost;
  if (logits_soft_cap > 0.0) {
    p.cap_log2 = static_cast<float>(logits_soft_cap) * kLog2eHost;
    p.scale_cap = static_cast<float>(sm_scale / logits_soft_cap);
  }
}

}  // namespace zipkv::cuda
