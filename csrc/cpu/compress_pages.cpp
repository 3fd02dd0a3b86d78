// CPU kernel of zipkv::compress_pages: choose each block's descriptor, lay the streams out back to back from
// cursor[0], then encode. Same bytes as the CUDA kernel (both use format.h).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../checks.h"
#include "stream.h"

namespace zipkv::cpu {
namespace {

void compress_pages_cpu(const at::Tensor& kv, const at::Tensor& page_ids, bool allow_compress, at::Tensor& data,
                        at::Tensor& meta, at::Tensor& cursor) {
  check_compress_args(kv, page_ids, data, meta, cursor);
  const int64_t n = kv.size(0), num_pages = meta.size(0);
  const int P = kv.size(2), H = kv.size(3), D = kv.size(4), nb = blocks_per_stream(P, D), words = meta.size(3);
  const int32_t* ids = page_ids.data_ptr<int32_t>();
  std::vector<uint8_t> seen(num_pages, 0);
  for (int64_t i = 0; i < n; ++i) {
    check_page_id("compress_pages", "page_ids", i, ids[i], num_pages);
    TORCH_CHECK_VALUE(!seen[ids[i]]++, "zipkv.compress_pages: page_ids holds page ", ids[i], " twice");
  }
  const auto* src = reinterpret_cast<const uint16_t*>(kv.data_ptr<at::BFloat16>());
  const int64_t page_values = int64_t{2} * P * H * D, streams = n * 2 * H;

  // Pass 1: descriptors of every block, stream by stream (stream s = (i * 2 + is_v) * H + head).
  std::vector<uint8_t> desc(streams * nb, kDescRaw);
  if (allow_compress) {
    at::parallel_for(0, streams * nb, 64, [&](int64_t begin, int64_t end) {
      uint16_t v[kBlockValues];
      for (int64_t x = begin; x < end; ++x) {
        const int64_t s = x / nb;
        gather_block(src + (s / (2 * H)) * page_values, P, H, D, (s / H) % 2, s % H, x % nb, v);
        int emin = 255, emax = 0, emin_big = 256;
        for (uint16_t u : v) {
          const int e = exponent_of(u);
          emin = std::min(emin, e), emax = std::max(emax, e);
          if (e >= 2) emin_big = std::min(emin_big, e);
        }
        desc[x] = descriptor_for(emin, emax, emin_big);
      }
    });
  }
  // Layout: streams back to back in order, so the bytes do not depend on threads.
  int64_t* cur = cursor.data_ptr<int64_t>();
  TORCH_CHECK_VALUE(cur[0] >= 0 && cur[0] % kStreamAlign == 0 && cur[0] <= cur[1] && cur[1] <= data.numel(),
                    "zipkv.compress_pages: cursor must hold {next, end} with 0 <= next <= end <= data.numel() and ",
                    "next a multiple of ", kStreamAlign, ", got {", cur[0], ", ", cur[1], "}");
  std::vector<int64_t> start(streams + 1);
  start[0] = cur[0];
  for (int64_t s = 0; s < streams; ++s) start[s + 1] = start[s] + block_offset(&desc[s * nb], nb);
  // A full arena is a state, not a bad argument: RuntimeError (the cache's CacheFullError is one too).
  TORCH_CHECK(start[streams] <= cur[1], "zipkv.compress_pages: data is full: storing ", n, " pages needs ",
              start[streams] - cur[0], " bytes from cursor ", cur[0], " but only ", cur[1] - cur[0], " remain (end ",
              cur[1], ")");

  // Pass 2: encode and write the meta rows.
  uint8_t* dst = data.data_ptr<uint8_t>();
  at::parallel_for(0, streams, 8, [&](int64_t begin, int64_t end) {
    uint16_t v[kBlockValues];
    for (int64_t s = begin; s < end; ++s) {
      const int is_v = (s / H) % 2, head = s % H;
      const uint8_t* d = &desc[s * nb];
      int64_t off = start[s];
      for (int b = 0; b < nb; ++b) {
        gather_block(src + (s / (2 * H)) * page_values, P, H, D, is_v, head, b, v);
        encode_block(v, d[b], dst + off);
        off += block_bytes(d[b]);
      }
      int32_t* row = meta.data_ptr<int32_t>() + ((int64_t{ids[s / (2 * H)]} * 2 + is_v) * H + head) * words;
      std::fill(row, row + words, 0);
      row[0] = static_cast<int32_t>(start[s] / kStreamAlign);
      row[1] = meta_tag(P, D);
      std::copy(d, d + nb, reinterpret_cast<uint8_t*>(row + kMetaHeaderWords));
    }
  });
  cur[0] = start[streams];
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CPU, m) { m.impl("compress_pages", &compress_pages_cpu); }

}  // namespace zipkv::cpu
