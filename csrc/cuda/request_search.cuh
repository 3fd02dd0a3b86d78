// Which request a CTA's unit of work belongs to, for the kernels whose grid comes from shapes alone (paged_prefill's
// two: tiles of query tokens, slots of query rows). Request b owns ceil(q_len_b x rows_per_token / rows_per_unit)
// consecutive units in request order, q_len clamped to [0, nnz_q] as the host's bound on the grid assumes; the unit
// is found by a prefix sum over qo_indptr, 32 requests a step, by one warp alone (no barrier).
#pragma once

#include <cstdint>

namespace zipkv::cuda {

struct RequestUnit {
  int request;           // -1: past the last unit
  int64_t index, count;  // the unit's place among the request's units, and their number
};

__device__ __forceinline__ RequestUnit find_request_unit(const int32_t* qo_indptr, int batch, int nnz_q,
                                                         int rows_per_token, int rows_per_unit, int64_t unit,
                                                         int lane) {
  int64_t base = 0;
  for (int b0 = 0; b0 < batch; b0 += 32) {
    const int b = b0 + lane;
    int64_t n = 0;
    if (b < batch) {
      const int64_t q_len = int64_t{__ldg(qo_indptr + b + 1)} - __ldg(qo_indptr + b);
      n = (min(max(q_len, int64_t{0}), int64_t{nnz_q}) * rows_per_token + rows_per_unit - 1) / rows_per_unit;
    }
    int64_t incl = n;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int64_t y = __shfl_up_sync(0xFFFFFFFFu, incl, o);
      if (lane >= o) incl += y;
    }
    const int64_t excl = base + incl - n;
    const unsigned mine = __ballot_sync(0xFFFFFFFFu, n > 0 && unit >= excl && unit < excl + n);
    if (mine) {
      const int src = __ffs(mine) - 1;
      const int64_t first = __shfl_sync(0xFFFFFFFFu, excl, src), count = __shfl_sync(0xFFFFFFFFu, n, src);
      return {b0 + src, unit - first, count};
    }
    base += __shfl_sync(0xFFFFFFFFu, incl, 31);
  }
  return {-1, 0, 0};
}

}  // namespace zipkv::cuda
