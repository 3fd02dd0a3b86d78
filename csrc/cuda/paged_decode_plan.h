// The decode kernel's launch plan and launch, shared by zipkv::paged_decode (one query token per request) and by
// zipkv::paged_prefill's short queries (the kernel's kMulti variant; paged_prefill.cu says when). Both come from shapes
// alone (paged_decode.cu), so neither op syncs and a captured CUDA Graph replays the same plan.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "paged_decode.cuh"

namespace zipkv::cuda {

struct DecodeLaunch {
  int splits = 1, warps = 4, ctas_per_sm = 0;
};

// The plan for `ctas` CTAs before splitting (batch x kv heads; multi: the slots of cols query rows a batch of even q
// lengths fills, x kv heads) over nnz_pages pages of `batch` requests.
DecodeLaunch plan_decode_launch(int64_t ctas, int64_t batch, int64_t nnz_pages, int64_t page_size, int head_dim,
                                int cols, int64_t window_left, bool multi);

// Launches p under `plan` (p.num_splits is set here, and the split workspace allocated on q's device).
void launch_decode(decode::Params& p, const DecodeLaunch& plan, int head_dim, bool multi, const at::Tensor& q);

}  // namespace zipkv::cuda
