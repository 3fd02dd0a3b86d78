// CPU helpers that move one block between a page in natural layout and the format's position order, and turn a bad
// meta row into an error that names the page, K|V and head.
#pragma once

#include <ATen/ATen.h>

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

inline void scatter_block(const uint16_t* v, int page_size, int num_kv_heads, int head_dim, int is_v, int head, int b,
                          uint16_t* page) {
  for (int tok = 0; tok < kTileTokens; ++tok)
    for (int dim = 0; dim < kBlockDims; ++dim)
      page[natural_index(page_size, num_kv_heads, head_dim, is_v, head, b, tok, dim)] = v[position(is_v, tok, dim)];
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

}  // namespace zipkv::cpu
