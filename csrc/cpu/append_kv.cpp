// CPU kernel of zipkv::append_kv: write new tokens' K and V into raw blocks of open pages.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../checks.h"
#include "stream.h"

namespace zipkv::cpu {
namespace {

void append_kv_cpu(const at::Tensor& k, const at::Tensor& v, const at::Tensor& page_ids, const at::Tensor& slots,
                   int64_t page_size, at::Tensor& data, const at::Tensor& meta) {
  check_append_args(k, v, page_ids, slots, page_size, data, meta);
  const int64_t n = k.size(0), num_pages = meta.size(0);
  const int P = page_size, H = k.size(1), D = k.size(2), spans = D / kBlockDims;
  const int32_t* ids = page_ids.data_ptr<int32_t>();
  const int32_t* slot = slots.data_ptr<int32_t>();
  // Validate every target before writing anything, so a bad call leaves the cache untouched.
  for (int64_t i = 0; i < n; ++i) {
    check_page_id("append_kv", "page_ids", i, ids[i], num_pages);
    TORCH_CHECK_VALUE(slot[i] >= 0 && slot[i] < P, "zipkv.append_kv: slots[", i, "] = ", slot[i],
                      " is out of range [0, ", P, ")");
    for (int is_v = 0; is_v < 2; ++is_v)
      for (int h = 0; h < H; ++h) {
        int64_t off;
        int nbytes;
        const uint8_t* desc = read_stream_or_throw("append_kv", "its page_size and k.shape[2]", data, meta, ids[i],
                                                   is_v, h, P, D, &off, &nbytes);
        for (int b = (slot[i] / kTileTokens) * spans; b < (slot[i] / kTileTokens + 1) * spans; ++b)
          TORCH_CHECK_VALUE(desc[b] == kDescRaw, "zipkv.append_kv: page ", ids[i], " (page_ids[", i,
                            "]) is compressed; tokens can only be appended to open (raw) pages");
      }
  }
  // Two tokens for one (page, slot) would race in the parallel writes below (and on CUDA): refuse them, naming both.
  std::vector<std::pair<int64_t, int64_t>> targets(n);  // (page * P + slot, i), sorted: duplicates are neighbours
  for (int64_t i = 0; i < n; ++i) targets[i] = {int64_t{ids[i]} * P + slot[i], i};
  std::sort(targets.begin(), targets.end());
  for (int64_t j = 1; j < n; ++j) {
    const int64_t a = targets[j - 1].second, b = targets[j].second;
    TORCH_CHECK_VALUE(targets[j].first != targets[j - 1].first, "zipkv.append_kv: page_ids[", a, "], slots[", a,
                      "] and page_ids[", b, "], slots[", b, "] both target page ", ids[b], ", slot ", slot[b],
                      "; each (page, slot) may be written once per call");
  }
  const uint16_t* src[2] = {reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                            reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>())};
  uint8_t* base = data.data_ptr<uint8_t>();
  at::parallel_for(0, n * 2 * H, 16, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const int64_t i = s / (2 * H);
      const int is_v = (s / H) % 2, h = s % H, tok = slot[i] % kTileTokens;
      const int32_t* row = meta_row(meta, ids[i], is_v, h);
      const int64_t stream = int64_t{row[0]} * kStreamAlign;
      for (int span = 0; span < spans; ++span) {
        const int b = (slot[i] / kTileTokens) * spans + span;
        // Earlier blocks of the page may be compressed (a larger page filled tile by tile): use the real offset.
        auto* block = reinterpret_cast<uint16_t*>(base + stream + block_offset(row_descriptors(row), b));
        for (int dim = 0; dim < kBlockDims; ++dim)
          block[raw_index(position(is_v, tok, dim))] = src[is_v][(i * H + h) * D + span * kBlockDims + dim];
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CPU, m) { m.impl("append_kv", &append_kv_cpu); }

}  // namespace zipkv::cpu
