// CUDA kernel of zipkv::compress_pages, one pass over the input: each CTA encodes whole streams, learns where its
// bytes go through a decoupled look-back over the CTAs before it (ordered by a ticket, so the layout is the CPU
// kernel's: streams back to back from cursor[0]), then writes. No host sync: capturable in a CUDA Graph.
// (docs/decode-kernel.md has the versions and what each measured.)
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "../checks.h"
#include "block_io.cuh"
#include "smem_limit.cuh"

namespace zipkv::cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarp;
constexpr int kBlocksPerCta = 32;  // whole streams, up to this many blocks (one stream if a stream has more)
// Look-back status words: flag in the top 2 bits, a byte count in the low 62.
constexpr uint64_t kFlagAggregate = uint64_t{1} << 62, kFlagPrefix = uint64_t{2} << 62, kValueMask = kFlagAggregate - 1;

struct Scratch {        // zeroed before each launch
  unsigned int ticket;  // next CTA ticket
  unsigned int pad;
  uint64_t status[1];  // [num_ctas]
};

// Exclusive prefix of CTA `ticket` (bytes from the start of data), publishing its own inclusive prefix. Called by
// one whole warp: each round reads the status of 32 predecessors at once, summing aggregates back to the nearest
// inclusive prefix (decoupled look-back), so the chain costs a few L2 round trips, not one per predecessor.
__device__ int64_t look_back(Scratch* scratch, unsigned int ticket, int64_t aggregate, int64_t first_offset, int lane) {
  auto publish = [&](uint64_t word) {
    if (lane == 0) atomicExch(reinterpret_cast<unsigned long long*>(&scratch->status[ticket]), word);
  };
  if (ticket == 0) {
    publish(kFlagPrefix | (first_offset + aggregate));
    return first_offset;
  }
  publish(kFlagAggregate | aggregate);
  const volatile uint64_t* status = scratch->status;
  int64_t exclusive = 0;
  for (int64_t j = static_cast<int64_t>(ticket) - 1;;) {
    const int64_t idx = j - lane;  // lane 0 is the nearest predecessor
    const uint64_t s = idx >= 0 ? status[idx] : kFlagPrefix;
    const unsigned pending = __ballot_sync(0xffffffffu, s == 0);
    const unsigned prefix = __ballot_sync(0xffffffffu, (s & kFlagPrefix) != 0);
    const unsigned stop = prefix & (0u - prefix);  // nearest lane holding an inclusive prefix
    const unsigned upto = stop ? (stop | (stop - 1)) : 0xffffffffu;
    if (pending & upto) continue;  // a nearer predecessor has not published yet: it holds an earlier ticket, so runs
    int64_t v = ((upto >> lane) & 1) ? static_cast<int64_t>(s & kValueMask) : 0;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    exclusive += v;
    if (stop) break;
    j -= kWarp;
  }
  publish(kFlagPrefix | (exclusive + aggregate));
  return exclusive;
}

// One CTA: whole streams, up to kWarps x kMaxBlocksPerWarp blocks. The input goes straight to shared memory with
// cp.async (all of the CTA's loads in flight at once, no registers held), each warp staging its blocks; a warp reads
// each block back twice with ldmatrix (exponent range, then encode), which costs shared-memory bandwidth, not HBM.
// Every per-element step works on packed words (two values, or four bytes, per instruction) and the index
// arithmetic is done once per block by one lane: the kernel issues few enough instructions to keep up with HBM.
// Compressing, a CTA learns where its bytes go from the CTAs before it (look-back, in ticket order); storing raw,
// every size is known, so it goes straight to its place and the last CTA to finish advances the cursor.
template <int kMaxBlocksPerWarp>
__global__ void __launch_bounds__(kThreads)
    compress_pages_kernel(const uint16_t* __restrict__ kv,  // [n, 2, P, H, D]
                          const int32_t* __restrict__ page_ids, bool allow_compress, uint8_t* __restrict__ data,
                          int64_t data_bytes, int32_t* __restrict__ meta, int64_t num_pages,
                          int64_t* __restrict__ cursor, Scratch* scratch, int64_t num_streams, int P, int H, int D,
                          int words, int streams_per_cta, unsigned int num_ctas) {
  static_assert(kMaxBlocksPerWarp <= kWarp, "one lane describes each of a warp's blocks");
  constexpr int kMaxBlocks = kWarps * kMaxBlocksPerWarp;
  extern __shared__ __align__(16) uint32_t stage[];  // [kWarps][kMaxBlocksPerWarp][kStageWords]
  __shared__ uint8_t desc_s[kMaxBlocks];
  __shared__ int32_t block_off_s[kMaxBlocks + 1];
  __shared__ int64_t stream_start_s[kMaxBlocks + 1];
  __shared__ unsigned int ticket_s;
  __shared__ int64_t base_s, limit_s;

  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (allow_compress) {
    if (threadIdx.x == 0) ticket_s = atomicAdd(&scratch->ticket, 1u);
    __syncthreads();
  }
  const unsigned int ticket = allow_compress ? ticket_s : blockIdx.x;
  const int nb = blocks_per_stream(P, D);
  const int64_t first_stream = static_cast<int64_t>(ticket) * streams_per_cta;
  const int cta_streams =
      static_cast<int>(num_streams - first_stream < streams_per_cta ? num_streams - first_stream : streams_per_cta);
  const int cta_blocks = cta_streams * nb;
  const int warp_blocks = cta_blocks > warp ? (cta_blocks - warp + kWarps - 1) / kWarps : 0;
  auto stage_of = [&](int k) { return stage + (warp * kMaxBlocksPerWarp + k) * kStageWords; };

  // Lane k describes the warp's block k (block warp + 8 k of the CTA): its stream in the CTA, K or V, and where it
  // starts in kv. The other lanes take these by shuffle.
  int my_stream = 0, my_is_v = 0;
  int64_t my_src = 0;
  if (lane < warp_blocks) {
    const int x = warp + kWarps * lane;
    const int64_t stream = first_stream + x / nb;
    my_stream = x / nb;
    my_is_v = static_cast<int>((stream / H) % 2);
    my_src = natural_block_base(stream, x % nb, P, H, D);
  }
  const unsigned v_blocks = __ballot_sync(0xffffffffu, my_is_v);

  // Load.
#pragma unroll
  for (int k = 0; k < kMaxBlocksPerWarp; ++k) {
    if (k >= warp_blocks) break;
    cp_async_block_to_stage(kv + __shfl_sync(0xffffffffu, my_src, k), static_cast<int64_t>(H) * D, stage_of(k), lane);
  }
  cp_async_wait_all();
  __syncwarp();

  // Descriptors from each block's exponent range.
#pragma unroll
  for (int k = 0; k < kMaxBlocksPerWarp; ++k) {
    if (k >= warp_blocks) break;
    uint8_t desc = kDescRaw;
    if (allow_compress) {
      uint32_t w[8];
      load_lane_words(stage_of(k), (v_blocks >> k) & 1, lane, w);
      desc = warp_block_descriptor(w);
    }
    if (lane == 0) desc_s[warp + kWarps * k] = desc;
  }
  __syncthreads();

  // Layout of this CTA's bytes (a warp scan, two blocks per lane), then its place after all earlier CTAs (warp 0).
  if (warp == 0) {
    static_assert(kMaxBlocks <= 2 * kWarp, "two blocks per lane in the offset scan");
    const int a = 2 * lane < cta_blocks ? block_bytes(desc_s[2 * lane]) : 0;
    const int b = 2 * lane + 1 < cta_blocks ? block_bytes(desc_s[2 * lane + 1]) : 0;
    int incl = a + b;
#pragma unroll
    for (int o = 1; o < kWarp; o *= 2) {
      const int y = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += y;
    }
    const int excl = incl - a - b;
    if (2 * lane <= cta_blocks) block_off_s[2 * lane] = excl;
    if (2 * lane + 1 <= cta_blocks) block_off_s[2 * lane + 1] = excl + a;
    const int32_t total = __shfl_sync(0xffffffffu, incl, kWarp - 1);
    // Read the cursor before publishing (compressing) or counting this CTA done (raw): the last CTA rewrites
    // cursor[0] only after every CTA has done either.
    const int64_t next = cursor[0], end = cursor[1];
    int64_t base;
    if (allow_compress) {
      base = look_back(scratch, ticket, total, next, lane);
    } else {
      base = next + first_stream * int64_t{nb} * kRawBlockBytes;
    }
    const bool sane = next >= 0 && next % kStreamAlign == 0 && next <= end && end <= data_bytes;
    bool last = ticket == num_ctas - 1;
    if (!allow_compress && lane == 0) {
      __threadfence();
      last = atomicAdd(&scratch->ticket, 1u) == num_ctas - 1;
    }
    __syncwarp();
    if (lane == 0) {
      base_s = base;
      // A cursor the CPU kernel would reject ({next, end} out of order, past data, or next unaligned) stores nothing.
      limit_s = sane ? end : -1;
      if (last && sane) {
        cursor[0] = allow_compress ? base + total : next + num_streams * int64_t{nb} * kRawBlockBytes;
      }
    }
    for (int s = lane; s <= cta_streams; s += kWarp) stream_start_s[s] = base + block_off_s[s * nb];
  }
  __syncthreads();

  // Write: only streams that end within the usable bytes are stored.
#pragma unroll
  for (int k = 0; k < kMaxBlocksPerWarp; ++k) {
    if (k >= warp_blocks) break;
    const int x = warp + kWarps * k, s = __shfl_sync(0xffffffffu, my_stream, k);
    if (stream_start_s[s + 1] > limit_s) continue;
    uint8_t* dst = data + base_s + block_off_s[x];
    const uint8_t desc = desc_s[x];
    uint32_t w[8];
    load_lane_words(stage_of(k), (v_blocks >> k) & 1, lane, w);
    if (desc == kDescRaw) {  // the lane's words 0-3 in the first half, 4-7 in the second (format.h raw_index)
      reinterpret_cast<uint4*>(dst)[lane] = make_uint4(w[0], w[1], w[2], w[3]);
      reinterpret_cast<uint4*>(dst + kRawHalfBytes)[lane] = make_uint4(w[4], w[5], w[6], w[7]);
    } else {
      uint4 low;
      uint2 codes;
      encode_lane(w, desc, &low, &codes);
      reinterpret_cast<uint4*>(dst)[lane] = low;
      reinterpret_cast<uint2*>(dst + kLowBytes)[lane] = codes;
    }
  }
  // Meta rows: one thread per stream.
  if (threadIdx.x < cta_streams) {
    const int s = threadIdx.x;
    const int64_t stream = first_stream + s;
    const int64_t page = page_ids[stream / (2 * H)];
    if (page < 0 || page >= num_pages) return;  // the CPU kernel raises; here the row cannot be written at all
    int32_t* row = meta + ((page * 2 + (stream / H) % 2) * H + stream % H) * words;
    const bool stored = stream_start_s[s + 1] <= limit_s;
    row[0] = stored ? static_cast<int32_t>(stream_start_s[s] / kStreamAlign) : kNoStream;
    row[1] = meta_tag(P, D);
    for (int w = kMetaHeaderWords; w < words; ++w) {
      uint32_t packed = 0;
      for (int j = 0; j < 4; ++j) {
        const int b = 4 * (w - kMetaHeaderWords) + j;
        if (b < nb) packed |= static_cast<uint32_t>(desc_s[s * nb + b]) << (8 * j);
      }
      row[w] = static_cast<int32_t>(packed);
    }
  }
}

void compress_pages_cuda(const at::Tensor& kv, const at::Tensor& page_ids, bool allow_compress, at::Tensor& data,
                         at::Tensor& meta, at::Tensor& cursor) {
  check_compress_args(kv, page_ids, data, meta, cursor);
  const int64_t n = kv.size(0);
  if (n == 0) return;
  const int P = kv.size(2), H = kv.size(3), D = kv.size(4), nb = blocks_per_stream(P, D);
  const int64_t num_streams = n * 2 * H;
  const int streams_per_cta = std::max(1, kBlocksPerCta / nb);
  const int64_t num_ctas = (num_streams + streams_per_cta - 1) / streams_per_cta;
  TORCH_CHECK_VALUE(num_ctas < (int64_t{1} << 31), "zipkv.compress_pages: kv has too many pages for one call");
  const int blocks_per_warp = (streams_per_cta * nb + kWarps - 1) / kWarps;

  const c10::cuda::CUDAGuard guard(data.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor scratch = at::zeros({allow_compress ? 1 + num_ctas : 1}, data.options().dtype(at::kLong));
  auto launch = [&](auto kernel, int max_blocks_per_warp, SmemFlags& smem_set) {
    const int smem = kWarps * max_blocks_per_warp * kStageWords * 4;
    set_smem_limit(kernel, smem, smem_set);  // once per kernel and device (the two kernels have their own flags)
    kernel<<<static_cast<unsigned int>(num_ctas), kThreads, smem, stream>>>(
        reinterpret_cast<const uint16_t*>(kv.data_ptr<at::BFloat16>()), page_ids.data_ptr<int32_t>(), allow_compress,
        data.data_ptr<uint8_t>(), data.numel(), meta.data_ptr<int32_t>(), meta.size(0), cursor.data_ptr<int64_t>(),
        reinterpret_cast<Scratch*>(scratch.data_ptr<int64_t>()), num_streams, P, H, D, meta.size(3), streams_per_cta,
        static_cast<unsigned int>(num_ctas));
  };
  static SmemFlags smem_set4{}, smem_set8{};
  if (blocks_per_warp <= 4) launch(compress_pages_kernel<4>, 4, smem_set4);
  else if (blocks_per_warp <= 8) launch(compress_pages_kernel<8>, 8, smem_set8);
  else
    TORCH_CHECK_VALUE(false, "zipkv.compress_pages: kv's page_size x head_dim is too large (", blocks_per_warp,
                      " blocks per warp)");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(zipkv, CUDA, m) { m.impl("compress_pages", &compress_pages_cuda); }

}  // namespace zipkv::cuda
