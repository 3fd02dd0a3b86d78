// CPU helpers that move one block between a page in natural layout and the format's position order, and turn a bad
// meta row into an error that names the page, K|V and head.
#pragma once

#include <ATen/ATen.h>

#include <cstring>
#include <ios>

#include "../format.h"

namespace zipkv::cpu {

// page: one page [2][page_size][num_kv_heads][head_dim] (uint16 bit patterns); block b of stream (is_v, head).
inline int64_t natural_index(int page_size, int num_kv_heads, int head_dim, int is_v, int head, int b, int tok,
                             int dim) {
  const int spans = head_dim / kBlockDims;
  const int token = (b / spans) * kTileTokens + tok, d = (b % spans) * kBlockDims + dim;
  return ((static_cast<int64_t>(is_v) * page_size + token) * num_kv_heads + head) * head_dim + d;
}

inline void gather_block(const uint16_t* page, int page_size, int num_kv_heads, int head_dim, int is_v, int head, int b,
                         uint16_t* v) {
  for (int tok = 0; tok < kTileTokens; ++tok)
    for (int dim = 0; dim < kBlockDims; ++dim)
      v[position(is_v, tok, dim)] = page[natural_index(page_size, num_kv_heads, head_dim, is_v, head, b, tok, dim)];
}

// Block b of the K (is_v 0) or V half of a page: ``half`` points at that half's [page_size, heads, dim] values.
inline void scatter_block(const uint16_t* v, int page_size, int num_kv_heads, int head_dim, int is_v, int head, int b,
                          uint16_t* half) {
  for (int tok = 0; tok < kTileTokens; ++tok)
    for (int dim = 0; dim < kBlockDims; ++dim)
      half[natural_index(page_size, num_kv_heads, head_dim, 0, head, b, tok, dim)] = v[position(is_v, tok, dim)];
}

// Row of meta [num_pages, 2, num_kv_heads, words] for stream (page, is_v, head).
inline const int32_t* meta_row(const at::Tensor& meta, int64_t page, int is_v, int head) {
  return meta.data_ptr<int32_t>() + ((page * 2 + is_v) * meta.size(2) + head) * meta.size(3);
}

// Validates meta[page][is_v][head] against data and the call's geometry (read_stream) and raises ValueError naming
// the row, and for a row written with another geometry the arguments that gave the call's (geometry_args, e.g.
// "its page_size and q.shape[2]"), when it is not usable; returns the stream's block descriptors.
inline const uint8_t* read_stream_or_throw(const char* op, const char* geometry_args, const at::Tensor& data,
                                           const at::Tensor& meta, int64_t page, int is_v, int head, int page_size,
                                           int head_dim, int64_t* start, int* nbytes) {
  const int32_t* row = meta_row(meta, page, is_v, head);
  const int status = read_stream(row, page_size, head_dim, data.numel(), start, nbytes);
  if (status == kStreamOk) return row_descriptors(row);
  const auto tag = static_cast<uint32_t>(row[1]);
  TORCH_CHECK_VALUE(status != kStreamOtherGeometry, "zipkv.", op, ": meta[", page, ", ", is_v ? "V" : "K", ", head ",
                    head, "] was written for page_size ", ((tag >> 8) & 0xFF) * kTileTokens, " and head_dim ",
                    (tag & 0xFF) * kBlockDims, ", not the call's page_size ", page_size, " and head_dim ", head_dim,
                    " (", geometry_args, "): the wrong geometry, or meta of other storage");
  TORCH_CHECK_VALUE(status != kStreamOtherVersion, "zipkv.", op, ": meta[", page, ", ", is_v ? "V" : "K", ", head ",
                    head, "] is not a row of format version ", kFormatVersion, " (its tag word is 0x", std::hex, tag,
                    std::dec, ": a row of another version, or corrupted)");
  const char* what = status == kStreamMissing         ? "holds no stream (page never stored)"
                     : status == kStreamBadDescriptor ? "has an invalid block descriptor (corrupted)"
                                                      : "points past the end of data (corrupted, or the wrong data)";
  TORCH_CHECK_VALUE(false, "zipkv.", op, ": meta[", page, ", ", is_v ? "V" : "K", ", head ", head, "] ", what);
}

// Raises ValueError unless 0 <= id < num_pages.
inline void check_page_id(const char* op, const char* name, int64_t i, int64_t id, int64_t num_pages) {
  TORCH_CHECK_VALUE(id >= 0 && id < num_pages, "zipkv.", op, ": ", name, "[", i, "] = ", id, " is out of range [0, ",
                    num_pages, ")");
}

// Checks the page table of paged_decode and paged_prefill (int32 kv_indptr [batch + 1], kv_indices,
// kv_last_page_len [batch]) against kv_indices' length and num_pages, raising ValueError naming the entry. kv_indices
// may be longer than the table (a buffer of fixed size, so a captured step keeps one shape): entries from
// kv_indptr[batch] on are never read.
inline void check_page_table(const char* op, const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                             const at::Tensor& kv_last_page_len, int page_size, int64_t num_pages) {
  const int64_t batch = kv_last_page_len.size(0), nnz = kv_indices.size(0);
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  const int32_t* indices = kv_indices.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(indptr[0] == 0, "zipkv.", op, ": kv_indptr[0] must be 0, got ", indptr[0]);
  TORCH_CHECK_VALUE(indptr[batch] <= nnz, "zipkv.", op, ": kv_indptr[", batch, "] = ", indptr[batch],
                    " exceeds kv_indices.numel() = ", nnz);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK_VALUE(indptr[b + 1] >= indptr[b], "zipkv.", op, ": kv_indptr must be non-decreasing, but ",
                      "kv_indptr[", b + 1, "] = ", indptr[b + 1], " < kv_indptr[", b, "] = ", indptr[b]);
    TORCH_CHECK_VALUE(indptr[b + 1] == indptr[b] || (last[b] >= 1 && last[b] <= page_size), "zipkv.", op,
                      ": kv_last_page_len[", b, "] = ", last[b], " must be in [1, page_size = ", page_size, "]");
  }
  for (int64_t i = 0; i < indptr[batch]; ++i) check_page_id(op, "kv_indices", i, indices[i], num_pages);
}

// Tokens of request b of a checked page table.
inline int64_t request_tokens(const int32_t* indptr, const int32_t* last, int64_t b, int page_size) {
  return indptr[b + 1] == indptr[b] ? 0 : int64_t{indptr[b + 1] - indptr[b] - 1} * page_size + last[b];
}

inline float bf16_to_float(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Decodes stream (page, is_v, head) into vals [page_size][head_dim] as float, raising ValueError for a bad meta row.
inline void decode_stream(const char* op, const at::Tensor& data, const at::Tensor& meta, int64_t page, int is_v,
                          int head, int P, int D, float* vals) {
  const int nb = blocks_per_stream(P, D);
  int64_t off;
  int nbytes;
  const uint8_t* desc =
      read_stream_or_throw(op, "its page_size and q.shape[2]", data, meta, page, is_v, head, P, D, &off, &nbytes);
  uint16_t v[kBlockValues];
  for (int b = 0; b < nb; ++b) {
    decode_block(data.data_ptr<uint8_t>() + off, desc[b], v);
    off += block_bytes(desc[b]);
    const int tok0 = (b / (D / kBlockDims)) * kTileTokens, dim0 = (b % (D / kBlockDims)) * kBlockDims;
    for (int tok = 0; tok < kTileTokens; ++tok)
      for (int dim = 0; dim < kBlockDims; ++dim)
        vals[(tok0 + tok) * D + dim0 + dim] = bf16_to_float(v[position(is_v, tok, dim)]);
  }
}

}  // namespace zipkv::cpu
