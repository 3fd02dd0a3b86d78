// Host-side argument checks shared by the CPU and CUDA kernels. They read only shapes, dtypes, devices and strides
// (never tensor contents), so they cost no device sync; every message names the op and the argument.
//
// Error policy (docs/api.md, Errors): a wrong dtype raises TypeError (TORCH_CHECK_TYPE); a wrong shape, size, device,
// contiguity, alignment or value raises ValueError (TORCH_CHECK_VALUE), and so does bad content of an argument found
// by a CPU kernel (page ids, page tables, meta rows). The fake kernels in torch_zipkv/ops.py make the same checks.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <string>

#include "format.h"

namespace zipkv {

constexpr int kMaxGroup = 16;  // paged_decode: query heads per kv head (at most two MMA N tiles of 8)

// The supported head dims as torch_zipkv.format.HEAD_DIMS prints them, "(64, 128, 256)", for messages.
inline std::string head_dims_text() {
  std::string s;
  for (int d : kHeadDims) s += (s.empty() ? "(" : ", ") + std::to_string(d);
  return s + ")";
}

// A dtype as Python prints it ("torch.bfloat16"): the kernels' messages are the fake kernels' word for word.
inline std::string dtype_name(at::ScalarType dtype) { return "torch." + std::string(c10::getDtypeNames(dtype).first); }

inline void check_tensor(const at::Tensor& t, const char* op, const char* name, at::ScalarType dtype, int64_t dim,
                         const at::Device& device, bool contiguous = true) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "zipkv.", op, ": ", name, " must be ", dtype_name(dtype), ", got ",
                   dtype_name(t.scalar_type()));
  TORCH_CHECK_VALUE(t.dim() == dim, "zipkv.", op, ": ", name, " must have ", dim, " dims, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == device, "zipkv.", op, ": ", name, " must be on ", device,
                    " (like the other tensors), got ", t.device());
  TORCH_CHECK_VALUE(!contiguous || t.is_contiguous(), "zipkv.", op, ": ", name, " must be contiguous");
}

// Fresh tensors are; an odd slice or view need not be. The CUDA kernels move these tensors in 16-byte words.
inline void check_aligned(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "zipkv.", op, ": ", name,
                    " must start at a 16-byte aligned address (a fresh tensor, not an odd slice)");
}

inline void check_geometry(const char* op, int64_t page_size, int64_t head_dim) {
  TORCH_CHECK_VALUE(page_size > 0 && page_size % kTileTokens == 0 && page_size <= kMaxPageSize, "zipkv.", op,
                    ": page_size must be a multiple of ", kTileTokens, " in [", kTileTokens, ", ", kMaxPageSize,
                    "], got ", page_size);
  TORCH_CHECK_VALUE(head_dim_supported(head_dim), "zipkv.", op, ": head_dim must be one of ", head_dims_text(),
                    ", got ", head_dim);
}

// data: uint8 [capacity] (16-byte aligned); meta: int32 [num_pages, 2, num_kv_heads, meta_words].
inline void check_storage(const char* op, const at::Tensor& data, const at::Tensor& meta, int64_t page_size,
                          int64_t head_dim, int64_t num_kv_heads) {
  const at::Device device = data.device();
  check_tensor(data, op, "data", at::kByte, 1, device);
  check_tensor(meta, op, "meta", at::kInt, 4, device);
  check_aligned(data, op, "data");
  const int words = meta_words(static_cast<int>(page_size), static_cast<int>(head_dim));
  TORCH_CHECK_VALUE(meta.size(1) == 2 && meta.size(2) == num_kv_heads && meta.size(3) == words, "zipkv.", op,
                    ": meta must have shape [num_pages, 2, ", num_kv_heads, ", ", words, "] for page_size ", page_size,
                    " and head_dim ", head_dim, ", got ", meta.sizes());
  TORCH_CHECK_VALUE(meta.size(0) < (int64_t{1} << 31), "zipkv.", op, ": meta has too many pages for int32 page ids");
}

inline void check_index(const char* op, const char* name, const at::Tensor& t, int64_t n, const at::Device& device) {
  check_tensor(t, op, name, at::kInt, 1, device);
  TORCH_CHECK_VALUE(t.size(0) == n, "zipkv.", op, ": ", name, " must have ", n, " entries, got ", t.size(0));
}

// The arena's bump pointer: int64 [2] = {next free byte, end of usable bytes}.
inline void check_cursor(const char* op, const at::Tensor& cursor, const at::Device& device) {
  check_tensor(cursor, op, "cursor", at::kLong, 1, device);
  TORCH_CHECK_VALUE(cursor.size(0) == 2, "zipkv.", op, ": cursor must be int64 [2] = {next, end}, got shape ",
                    cursor.sizes());
}

// kv: bf16 [n, 2, page_size, num_kv_heads, head_dim] (compress input or decompress output). kv_apart: also the
// transpose(0, 1) of a contiguous [2, n, page_size, num_kv_heads, head_dim] tensor (every K, then every V: what a
// dense attention over the pages reads).
inline void check_pages(const char* op, const char* name, const at::Tensor& kv, const at::Device& device,
                        bool kv_apart = false) {
  check_tensor(kv, op, name, at::kBFloat16, 5, device, !kv_apart);
  TORCH_CHECK_VALUE(!kv_apart || kv.is_contiguous() || kv.transpose(0, 1).is_contiguous(), "zipkv.", op, ": ", name,
                    " must be contiguous, or the transpose(0, 1) of a contiguous [2, n, page_size, num_kv_heads, ",
                    "head_dim] tensor (K and V apart)");
  TORCH_CHECK_VALUE(kv.size(1) == 2, "zipkv.", op, ": ", name,
                    " must be [n, 2, page_size, num_kv_heads, head_dim] with K and V stacked on dim 1, got ",
                    kv.sizes());
  TORCH_CHECK_VALUE(kv.size(3) >= 1, "zipkv.", op, ": ", name, " must have num_kv_heads >= 1 (dim 3), got ",
                    kv.sizes());
  check_geometry(op, kv.size(2), kv.size(4));
}

// Everything of compress_pages that can be checked without reading device memory.
inline void check_compress_args(const at::Tensor& kv, const at::Tensor& page_ids, const at::Tensor& data,
                                const at::Tensor& meta, const at::Tensor& cursor) {
  const char* op = "compress_pages";
  check_pages(op, "kv", kv, data.device());
  check_storage(op, data, meta, kv.size(2), kv.size(4), kv.size(3));
  check_index(op, "page_ids", page_ids, kv.size(0), data.device());
  check_cursor(op, cursor, data.device());
}

inline void check_decompress_args(const at::Tensor& data, const at::Tensor& meta, const at::Tensor& page_ids,
                                  const at::Tensor& out) {
  const char* op = "decompress_pages";
  check_pages(op, "out", out, data.device(), /*kv_apart=*/true);
  check_storage(op, data, meta, out.size(2), out.size(4), out.size(3));
  check_index(op, "page_ids", page_ids, out.size(0), data.device());
}

inline void check_append_args(const at::Tensor& k, const at::Tensor& v, const at::Tensor& page_ids,
                              const at::Tensor& slots, int64_t page_size, const at::Tensor& data,
                              const at::Tensor& meta) {
  const char* op = "append_kv";
  check_tensor(k, op, "k", at::kBFloat16, 3, data.device());
  check_tensor(v, op, "v", at::kBFloat16, 3, data.device());
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), "zipkv.append_kv: v must have the shape of k ", k.sizes(), ", got ",
                    v.sizes());
  check_geometry(op, page_size, k.size(2));
  check_storage(op, data, meta, page_size, k.size(2), k.size(1));
  check_index(op, "page_ids", page_ids, k.size(0), data.device());
  check_index(op, "slots", slots, k.size(0), data.device());
}

inline void check_window_left(const char* op, int64_t window_left) {
  TORCH_CHECK_VALUE(window_left >= -1 && window_left < (int64_t{1} << 31), "zipkv.", op, ": window_left must be -1 ",
                    "(no window) or a token count in [0, 2^31), got ", window_left);
}

// q's heads in GQA groups of 1-16 per kv head (num_kv_heads: meta's, -1 when meta has the wrong rank).
inline void check_group(const char* op, int64_t num_qo_heads, int64_t num_kv_heads) {
  TORCH_CHECK_VALUE(num_kv_heads > 0 && num_qo_heads % num_kv_heads == 0, "zipkv.", op, ": q has ", num_qo_heads,
                    " heads, not a multiple of meta's ", num_kv_heads, " kv heads");
  const int64_t group = num_qo_heads / num_kv_heads;
  TORCH_CHECK_VALUE(group >= 1 && group <= kMaxGroup, "zipkv.", op, ": q's GQA group size (num_qo_heads / ",
                    "num_kv_heads) must be in [1, ", kMaxGroup, "], got ", group);
}

// sm_scale and logits_soft_cap are checked as the kernels use them, after narrowing to float32 (a double that passes
// "> 0" can round to 0.0f, one that is finite to inf): the CPU kernel takes float(sm_scale) and float(cap); the CUDA
// kernel works in base 2 with float(sm_scale) * log2(e), float(cap) * log2(e) and float(sm_scale / cap). Each of
// those must be finite (and the scale and cap > 0), or the output turns NaN or the cap silently off. A negative or
// zero sm_scale is refused too: a softmax scale is positive, and anything else is almost surely a mistake.
constexpr float kLog2eF = 1.4426950408889634f;  // float32 log2(e), as the CUDA kernel's kLog2e

inline void check_scale_and_cap(const char* op, double sm_scale, double logits_soft_cap) {
  const float scale = static_cast<float>(sm_scale);
  TORCH_CHECK_VALUE(std::isfinite(scale) && scale > 0.f && std::isfinite(scale * kLog2eF), "zipkv.", op,
                    ": sm_scale must be > 0 and finite as a float32, and so must sm_scale * log2(e) (sm_scale at most ",
                    "about 2.36e38), got ", sm_scale);
  const float cap = static_cast<float>(logits_soft_cap);
  TORCH_CHECK_VALUE(logits_soft_cap == 0.0 || (std::isfinite(cap) && cap > 0.f && std::isfinite(cap * kLog2eF) &&
                                               std::isfinite(static_cast<float>(sm_scale / logits_soft_cap))),
                    "zipkv.", op, ": logits_soft_cap must be 0 (off) or a finite cap > 0 as a float32, with cap * ",
                    "log2(e) and sm_scale / cap finite as float32 too, got ", logits_soft_cap);
}

// What paged_decode and paged_prefill check first: the scalars, q [rows, num_qo_heads, head_dim], the storage and
// the GQA group.
inline void check_query_and_storage(const char* op, const at::Tensor& q, const at::Tensor& data, const at::Tensor& meta,
                                    int64_t page_size, double sm_scale, int64_t window_left, double logits_soft_cap) {
  check_window_left(op, window_left);
  check_scale_and_cap(op, sm_scale, logits_soft_cap);
  const at::Device device = data.device();
  check_tensor(q, op, "q", at::kBFloat16, 3, device);
  check_geometry(op, page_size, q.size(2));
  const int64_t num_kv_heads = meta.dim() == 4 ? meta.size(2) : -1;
  check_storage(op, data, meta, page_size, q.size(2), num_kv_heads);
  check_group(op, q.size(1), num_kv_heads);
}

// What they check next: the page table of `batch` requests, out (q's shape) and lse (fp32 [rows, num_qo_heads]).
inline void check_page_table_and_out(const char* op, const at::Tensor& q, int64_t batch, const at::Tensor& kv_indptr,
                                     const at::Tensor& kv_indices, const at::Tensor& kv_last_page_len,
                                     const at::Tensor& out, const std::optional<at::Tensor>& lse) {
  const at::Device device = q.device();
  const int64_t rows = q.size(0), num_qo_heads = q.size(1);
  check_index(op, "kv_indptr", kv_indptr, batch + 1, device);
  check_tensor(kv_indices, op, "kv_indices", at::kInt, 1, device);
  check_index(op, "kv_last_page_len", kv_last_page_len, batch, device);
  check_tensor(out, op, "out", at::kBFloat16, 3, device);
  TORCH_CHECK_VALUE(out.sizes() == q.sizes(), "zipkv.", op, ": out must have q's shape ", q.sizes(), ", got ",
                    out.sizes());
  check_aligned(q, op, "q");
  check_aligned(out, op, "out");
  if (lse.has_value()) {
    check_tensor(*lse, op, "lse", at::kFloat, 2, device);
    TORCH_CHECK_VALUE(lse->size(0) == rows && lse->size(1) == num_qo_heads, "zipkv.", op, ": lse must be [", rows, ", ",
                      num_qo_heads, "], got ", lse->sizes());
  }
}

inline void check_decode_args(const at::Tensor& q, const at::Tensor& data, const at::Tensor& meta,
                              const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                              const at::Tensor& kv_last_page_len, int64_t page_size, double sm_scale,
                              const at::Tensor& out, const std::optional<at::Tensor>& lse, int64_t window_left,
                              double logits_soft_cap) {
  const char* op = "paged_decode";
  check_query_and_storage(op, q, data, meta, page_size, sm_scale, window_left, logits_soft_cap);
  check_page_table_and_out(op, q, q.size(0), kv_indptr, kv_indices, kv_last_page_len, out, lse);
}

// paged_prefill: q [nnz_q, num_qo_heads, head_dim] with qo_indptr int32 [batch + 1] (request b's query tokens are
// q[qo_indptr[b]:qo_indptr[b + 1]]), then paged_decode's page table for those batch requests.
inline void check_prefill_args(const at::Tensor& q, const at::Tensor& qo_indptr, const at::Tensor& data,
                               const at::Tensor& meta, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                               const at::Tensor& kv_last_page_len, int64_t page_size, double sm_scale,
                               const at::Tensor& out, const std::optional<at::Tensor>& lse, int64_t window_left,
                               double logits_soft_cap) {
  const char* op = "paged_prefill";
  check_query_and_storage(op, q, data, meta, page_size, sm_scale, window_left, logits_soft_cap);
  check_tensor(qo_indptr, op, "qo_indptr", at::kInt, 1, data.device());
  TORCH_CHECK_VALUE(qo_indptr.size(0) >= 1, "zipkv.paged_prefill: qo_indptr must have batch + 1 >= 1 entries, got 0");
  check_page_table_and_out(op, q, qo_indptr.size(0) - 1, kv_indptr, kv_indices, kv_last_page_len, out, lse);
}

// decode_plan's arguments (a host query: q and meta are read for their shapes and device only).
inline void check_plan_args(const char* op, const at::Tensor& q, const at::Tensor& meta, int64_t nnz_pages,
                            int64_t page_size, int64_t window_left) {
  check_window_left(op, window_left);
  check_tensor(q, op, "q", at::kBFloat16, 3, q.device());
  check_geometry(op, page_size, q.size(2));
  TORCH_CHECK_VALUE(meta.dim() == 4, "zipkv.", op, ": meta must be [num_pages, 2, num_kv_heads, meta_words], got ",
                    "shape ", meta.sizes());
  check_group(op, q.size(1), meta.size(2));
  TORCH_CHECK_VALUE(nnz_pages >= 0, "zipkv.", op, ": nnz_pages must be >= 0, got ", nnz_pages);
}

}  // namespace zipkv
