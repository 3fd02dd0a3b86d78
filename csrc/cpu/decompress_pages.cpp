// CPU kernel of zipkv::decompress_pages: rebuild pages bit-exactly in natural [2, page_size, heads, dim] order (out's
// page and K|V strides: contiguous, or K and V apart).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../checks.h"
#include "stream.h"

namespace zipkv::cpu {
namespace {

void decompress_pages_cpu(const at::Tensor& data, const at::Tensor& meta, const at::Tensor& page_ids, at::Tensor& out) {
  check_decompress_args(data, meta, page_ids, out);
  const int64_t n = out.size(0), num_pages = meta.size(0);
  const int P = out.size(2), H = out.size(3), D = out.size(4), nb = blocks_per_stream(P, D);
  const int32_t* ids = page_ids.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) check_page_id("decompress_pages", "page_ids", i, ids[i], num_pages);
  const uint8_t* src = data.data_ptr<uint8_t>();
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t page_stride = out.stride(0), kv_stride = out.stride(1);
  at::parallel_for(0, n * 2 * H, 8, [&](int64_t begin, int64_t end) {
    uint16_t v[kBlockValues];
    for (int64_t s = begin; s < end; ++s) {
      const int64_t i = s / (2 * H);
      const int is_v = (s / H) % 2, head = s % H;
      int64_t off;
      int nbytes;
      const uint8_t* desc = read_stream_or_throw("decompress_pages", "out.shape[2] and out.shape[4]", data, meta,
                                                 ids[i], is_v, head, P, D, &off, &nbytes);
      for (int b = 0; b < nb; ++b) {
        decode_block(src + off, desc[b], v);
        scatter_block(v, P, H, D, is_v, head, b, dst + i * page_stride + is_v * kv_stride);
        off += block_bytes(desc[b]);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CPU, m) { m.impl("decompress_pages", &decompress_pages_cpu); }

}  // namespace zipkv::cpu
