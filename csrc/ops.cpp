// The only TORCH_LIBRARY(zipkv): every schema of the library, with the meaning and shape of each argument.
// Backends add kernels with TORCH_LIBRARY_IMPL in csrc/cpu/*.cpp and csrc/cuda/*.cu; fakes live in
// torch_zipkv/ops.py. Every op but the host queries decode_plan and prefill_plan writes into caller-allocated tensors
// and returns (), so no output shape depends on data and every such op can be captured in a CUDA Graph. The storage
// format is defined in format.h.
#include <Python.h>
#include <torch/library.h>

// Importing torch_zipkv._C runs the static initialisers below; the module itself is empty.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(zipkv, m) {
  // Store full BF16 pages in the byte arena `data`: each (page, K|V, kv_head) stream is appended at data[cursor[0]:]
  // in page, K|V, head order, its blocks compressed where lossless 12-bit coding applies (allow_compress) or raw.
  //   kv        bf16  [n, 2, page_size, num_kv_heads, head_dim]   pages to store (K then V, FlashInfer NHD)
  //   page_ids  int32 [n]                                          meta row written for kv[i]; distinct
  //   data      uint8 [capacity]                                   arena, written from cursor[0]
  //   meta      int32 [num_pages, 2, num_kv_heads, meta_words]     rows of page_ids[i] rewritten
  //   cursor    int64 [2]                                          {next free byte, end of usable bytes};
  //                                                                cursor[0] advances by the bytes stored
  // Streams that would end past cursor[1] are not written and their rows read "no stream" (-1); the CPU kernel
  // raises instead, before writing anything.
  m.def(
      "compress_pages(Tensor kv, Tensor page_ids, bool allow_compress, Tensor(a!) data, Tensor(b!) meta, "
      "Tensor(c!) cursor) -> ()");

  // Rebuild BF16 pages bit-exactly.
  //   data      uint8 [capacity]; meta int32 [num_pages, 2, num_kv_heads, meta_words]
  //   page_ids  int32 [n]
  //   out       bf16  [n, 2, page_size, num_kv_heads, head_dim]   natural (token, head, dim) order
  m.def("decompress_pages(Tensor data, Tensor meta, Tensor page_ids, Tensor(a!) out) -> ()");

  // Write new tokens into open (raw) pages, e.g. one decode step's K and V.
  //   k, v      bf16  [n, num_kv_heads, head_dim]
  //   page_ids  int32 [n]   page of each token; the block that receives it must be stored raw
  //   slots     int32 [n]   slot of each token inside its page, in [0, page_size)
  //   data      uint8 [capacity]; meta int32 [num_pages, 2, num_kv_heads, meta_words] (read only)
  m.def(
      "append_kv(Tensor k, Tensor v, Tensor page_ids, Tensor slots, int page_size, Tensor(a!) data, "
      "Tensor meta) -> ()");

  // Decode attention (one query token per request) over pages stored in data/meta, compressed or raw.
  //   q                 bf16  [batch, num_qo_heads, head_dim]
  //   data, meta        as above
  //   kv_indptr         int32 [batch + 1]   request b owns kv_indices[kv_indptr[b]:kv_indptr[b+1]]
  //   kv_indices        int32 [nnz_pages]   page ids (rows of meta), in token order; may be longer than
  //                                         kv_indptr[batch] (a fixed-size buffer): the rest is never read
  //   kv_last_page_len  int32 [batch]       tokens in each request's last page, in [1, page_size]
  //   sm_scale          softmax scale
  //   out               bf16  [batch, num_qo_heads, head_dim]
  //   lse               fp32  [batch, num_qo_heads]  optional natural-log sum of exp(scaled logits)
  //   window_left       >= 0: attend only to each request's last window_left + 1 tokens (a sliding window;
  //                     pages wholly before it are never read); -1: to every token
  //   logits_soft_cap   > 0: logits become cap * tanh(logits / cap) (Gemma 2); 0: off
  // "Logits" are q.k * sm_scale. A request with no tokens to attend gets out = 0 and lse = -inf.
  m.def(
      "paged_decode(Tensor q, Tensor data, Tensor meta, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor kv_last_page_len, int page_size, float sm_scale, Tensor(a!) out, Tensor(b!)? lse=None, "
      "int window_left=-1, float logits_soft_cap=0.0) -> ()");

  // Attention of many query tokens per request (chunked prefill, prefill into a non-empty cache, speculative
  // verification) over the same pages, FlashInfer's BatchPrefillWithPagedKVCacheWrapper conventions.
  //   q                 bf16  [nnz_q, num_qo_heads, head_dim]
  //   qo_indptr         int32 [batch + 1]   request b's query tokens are q[qo_indptr[b]:qo_indptr[b+1]];
  //                                         qo_indptr[0] = 0, qo_indptr[batch] = nnz_q
  //   data, meta, kv_indptr, kv_indices, kv_last_page_len, page_size, sm_scale, window_left, logits_soft_cap
  //                     as paged_decode; the pages hold the query's own tokens (appended before the call), so
  //                     q_len <= kv_len, and query token i of request b sits at position kv_len - q_len + i
  //   out               bf16  [nnz_q, num_qo_heads, head_dim]
  //   lse               fp32  [nnz_q, num_qo_heads]  optional natural-log sum of exp(scaled logits)
  //   causal            query token at position p attends to keys at positions <= p; false: to every key
  // window_left >= 0 keeps keys at positions >= p - window_left (with or without causal). A query row with no key to
  // attend gets out = 0 and lse = -inf.
  m.def(
      "paged_prefill(Tensor q, Tensor qo_indptr, Tensor data, Tensor meta, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor kv_last_page_len, int page_size, float sm_scale, Tensor(a!) out, Tensor(b!)? lse=None, "
      "bool causal=True, int window_left=-1, float logits_soft_cap=0.0) -> ()");

  // The launch paged_decode makes on a CUDA device for these shapes, without running it (benchmarks, tests, capacity
  // planning): {num_splits, warps per CTA, CTAs per SM}; {0, 0, 0} for an empty batch. q and meta as above (only
  // their shapes and device are read); nnz_pages = kv_indices' length. A host query: it is not for compiled graphs.
  m.def("decode_plan(Tensor q, Tensor meta, int nnz_pages, int page_size, int window_left=-1) -> int[]");

  // The kernel and launch paged_prefill makes on a CUDA device for these shapes, without running it: {kernel (1: the
  // decode kernel's short-query variant, 0: the tile kernel, -1: none for an empty batch), num_splits, warps per CTA,
  // CTAs per SM (0 where not asked), query rows per CTA}. q, qo_indptr and meta as in paged_prefill (only their
  // shapes and device are read); nnz_pages = kv_indices' length. A host query, as decode_plan.
  m.def(
      "prefill_plan(Tensor q, Tensor qo_indptr, Tensor meta, int nnz_pages, int page_size, int window_left=-1) -> "
      "int[]");
}
