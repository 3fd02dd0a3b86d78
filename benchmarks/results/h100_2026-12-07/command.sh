#!/usr/bin/env bash
# The GPU box, 2026-12-07 (torch 2.11.0+cu130). Each call ran one script below as .box/runN.sh with carry [".box"]
# (box.sh and the FlashInfer wheels from ../shared, .box/data/real_kv.pt from
# `python benchmarks/dump_real_kv.py --out .box/data/real_kv.pt`).
#   00:25-01:28 UTC: nine calls got no machine (about 750 s of the 1,800 s budget went to failed starts)
#   call 1 (91402de: the producer warpgroup), kind left out, an H100 80GB HBM3: COMMIT=91402de LIMIT=520 bash run39.sh
#                     -> nothing measured: every paged_prefill launch hung (the tests and the benchmark ran into
#                     their timeouts, and so did the probe builds). Cause: the budgets 216 + 80 registers a thread
#                     ask setmaxnreg for 64,768 where the CTA was given 384 x 168 = 64,512 at launch, so the compute
#                     warps' setmaxnreg.inc waited forever. Fixed in f2af5c9 (216 + 72; a static_assert now checks
#                     against the launch registers, not the register file).
#   01:40-01:55 UTC: two more calls got no machine; then 251 s of the budget were left, too little to start one, so
#                     f2af5c9 was never run, and main reverts both commits (580b41a) so that its GPU path stays the
#                     one measured and tested. To measure it: `git revert 580b41a`, then (about 4 min on an H100)
#                     COMMIT=<hash> LIMIT=345 bash run40.sh -> tests/prefill.log, bench_prefill.json; or all in one
#                     call (about 6 min): run41.sh, which also times unsigned.patch (below: the producer's address
#                     arithmetic unsigned, its rebuild loop 444 -> 356 SASS lines at d 128, no spills) and the two
#                     probe builds; then the engine tests.
# ---- .box/run39.sh
# Producer warpgroup + mbarrier ring (91402de): CUDA prefill tests, bench_prefill --quick with FlashInfer, then probe
# builds (.box/probe.patch: 1 = the producer rebuilds nothing, 2 = the compute warps multiply nothing), then the
# engine and decode CUDA tests.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/tests"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2 ZIPKV_COMMIT=$COMMIT
rm -rf build torch_zipkv/_C*.so; bash .box/box.sh build >/dev/null || { tail -60 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
timeout 120 python3 -m pytest test/test_paged_prefill_cuda.py -q -x -p no:cacheprovider -n 8 -rfE 2>&1 \
  | tee "$OUT/tests/prefill.log" | grep -v "Warn\|warn" | tail -12
echo "prefill tests rc=${PIPESTATUS[0]} at $SECONDS s"
timeout 150 python3 benchmarks/bench_prefill.py --out "$OUT" --quick 2>&1 | tee "$OUT/bench_prefill.log" | grep -v "Warn\|warn" | tail -8
echo "bench at $SECONDS s"
git apply .box/probe.patch || exit 1
for pr in 1 2; do
  touch csrc/cuda/paged_prefill.cuh
  NVCC_APPEND_FLAGS="-DZIPKV_PREFILL_PROBE=$pr" bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; break; }
  echo "probe $pr built at $SECONDS s"
  timeout 60 python3 .box/probe_prefill.py probe$pr "$OUT/probe$pr.json" 2>&1 | grep probe
done
git checkout csrc/cuda/paged_prefill.cuh; touch csrc/cuda/paged_prefill.cuh
bash .box/box.sh build >/dev/null; echo "rebuilt at $SECONDS s"
timeout $((${LIMIT:-500} - SECONDS)) python3 -m pytest test/test_engine_cuda.py test/test_decode_cuda.py -q -p no:cacheprovider -n 8 -rfE 2>&1 \
  | tee "$OUT/tests/engine_decode.log" | grep -v "Warn\|warn" | tail -6
echo "all $SECONDS s"
# ---- .box/run40.sh (not yet run)
# 91402de's register budgets fixed (setmaxnreg within the CTA's launch registers): a CUDA prefill test subset, then
# bench_prefill --quick with FlashInfer.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/tests"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2 ZIPKV_COMMIT=$COMMIT
rm -rf build torch_zipkv/_C*.so; bash .box/box.sh build >/dev/null || { tail -60 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
timeout 80 python3 -m pytest test/test_paged_prefill_cuda.py -q -x -p no:cacheprovider -n 8 -rfE \
  -k "mixed_pages or long_queries or real_kv or bad_device or larger_pages" 2>&1 \
  | tee "$OUT/tests/prefill.log" | grep -v "Warn\|warn" | tail -8
echo "prefill tests rc=${PIPESTATUS[0]} at $SECONDS s"
timeout $((${LIMIT:-380} - SECONDS)) python3 benchmarks/bench_prefill.py --out "$OUT" --quick 2>&1 | tee "$OUT/bench_prefill.log" | grep -v "Warn\|warn" | tail -8
echo "all $SECONDS s"
# ---- .box/run41.sh (not yet run)
# One call for the producer-warpgroup kernel (main with 580b41a reverted): a CUDA prefill test subset, bench_prefill
# --quick with FlashInfer; then the same tree + unsigned.patch (zipkv only, probe_prefill.py); then the probe builds
# (probe.patch: 1 = the producer rebuilds nothing, 2 = the compute warps multiply nothing). About 6 min on an H100.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/tests"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2 ZIPKV_COMMIT=$COMMIT
rm -rf build torch_zipkv/_C*.so; bash .box/box.sh build >/dev/null || { tail -60 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
timeout 80 python3 -m pytest test/test_paged_prefill_cuda.py -q -x -p no:cacheprovider -n 8 -rfE \
  -k "mixed_pages or long_queries or real_kv or bad_device or larger_pages" 2>&1 \
  | tee "$OUT/tests/prefill.log" | grep -v "Warn\|warn" | tail -8
[ "${PIPESTATUS[0]}" = 0 ] || { echo "prefill tests failed at $SECONDS s"; exit 1; }
echo "prefill tests passed at $SECONDS s"
timeout 150 python3 benchmarks/bench_prefill.py --out "$OUT" --quick 2>&1 | tee "$OUT/bench_prefill.log" | grep -v "Warn\|warn" | tail -6
echo "bench at $SECONDS s"
for variant in unsigned probe1 probe2; do
  git checkout -q csrc/cuda/paged_prefill.cuh
  case $variant in
    unsigned) git apply .box/unsigned.patch; flags="" ;;
    probe*) git apply .box/probe.patch; flags="-DZIPKV_PREFILL_PROBE=${variant#probe}" ;;
  esac
  touch csrc/cuda/paged_prefill.cuh
  NVCC_APPEND_FLAGS="$flags" bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; break; }
  timeout 60 python3 .box/probe_prefill.py $variant "$OUT/$variant.json" 2>&1 | grep "^$variant"
  echo "$variant at $SECONDS s"
done
git checkout -q csrc/cuda/paged_prefill.cuh
# ---- .box/unsigned.patch (git apply, on main with 580b41a reverted)
# diff --git a/csrc/cuda/paged_prefill.cuh b/csrc/cuda/paged_prefill.cuh
# index cb7dfd2..1140699 100644
# --- a/csrc/cuda/paged_prefill.cuh
# +++ b/csrc/cuda/paged_prefill.cuh
# @@ -177,8 +177,9 @@ __device__ __forceinline__ float tanh_approx(float x) {
#  // by the row (wgmma.cuh); else rows of kStride.
#  template <int D, int kTileRows = Cfg<D>::kKV>
#  __device__ __forceinline__ int tile_offset(int token, int dim) {
# -  if constexpr (Cfg<D>::kWgmma) {
# -    return (dim / 64) * (kTileRows * 64) + token * 64 + (((dim % 64) / 8) ^ (token % 8)) * 8;
# +  if constexpr (Cfg<D>::kWgmma) {  // unsigned: the divisions are shifts, with no fix-up for a sign
# +    const unsigned t = token, d = dim;
# +    return static_cast<int>((d / 64) * (kTileRows * 64) + t * 64 + (((d % 64) / 8) ^ (t % 8)) * 8);
#    } else {
#      return token * Cfg<D>::kStride + dim;
#    }
# @@ -199,8 +200,10 @@ __device__ __forceinline__ void store_block(uint16_t* tile, int is_v, int lane,
#  template <int D>
#  struct BlockOf {
#    int tile, is_v, span;
# -  __device__ __forceinline__ explicit BlockOf(int j)
# -      : tile(j / (2 * Cfg<D>::kSpans)), is_v((j / Cfg<D>::kSpans) % 2), span(j % Cfg<D>::kSpans) {}
# +  __device__ __forceinline__ explicit BlockOf(int j)  // j >= 0: unsigned, so that each division is a shift
# +      : tile(static_cast<int>(static_cast<unsigned>(j) / (2 * Cfg<D>::kSpans))),
# +        is_v(static_cast<int>(static_cast<unsigned>(j) / Cfg<D>::kSpans % 2)),
# +        span(static_cast<int>(static_cast<unsigned>(j) % Cfg<D>::kSpans)) {}
#  };
#  
#  // The page id of block j of the chunk at c0, loaded ahead of its plan; -1 past the CTA's keys [.., hi).
# ---- .box/probe_prefill.py
# 512 x 8K at batch 1 and 8, zipkv only (real-like and raw pages), for probe builds: prints one line per case.
import sys, json, torch
sys.path.insert(0, "benchmarks")
import bench_prefill as bp, bench_decode as bd
tag = sys.argv[1]
gen = torch.Generator().manual_seed(0)
flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
streams = bd.real_streams("cuda")
out = []
for q, c, b in [(512, 8192, 1), (512, 8192, 8)]:
    row = bp.run_case(bp.LLAMA, q, c, b, 10, streams, flush, gen, False)
    r = row["results"]
    print(tag, q, c, b, {k: round(v["us"], 1) for k, v in r.items()}, flush=True)
    out.append(row)
json.dump(out, open(sys.argv[2], "w"))
# ---- .box/probe.patch (git apply; ZIPKV_PREFILL_PROBE=1: the producer rebuilds nothing, 2: the compute warps multiply nothing)
# diff --git a/csrc/cuda/paged_prefill.cuh b/csrc/cuda/paged_prefill.cuh
# index c3e0d7b..c586099 100644
# --- a/csrc/cuda/paged_prefill.cuh
# +++ b/csrc/cuda/paged_prefill.cuh
# @@ -37,6 +37,9 @@
#  // inconsistent page-table entry (indptr, last_page_len, qo_indptr, q_len > kv_len) turn the request's rows of out
#  // and lse into NaN; no byte outside data is read.
#  #pragma once
# +#ifndef ZIPKV_PREFILL_PROBE
# +#define ZIPKV_PREFILL_PROBE 0
# +#endif
#  
#  #include <cuda_bf16.h>
#  
# @@ -626,7 +629,9 @@ __global__ void __launch_bounds__(kThreads, 1) paged_prefill_kernel(const Params
#  #pragma unroll 2
#        for (int i = 0; i < C::kPerWarp; ++i) {
#          const int j = pw * C::kPerWarp + i;
# +#if ZIPKV_PREFILL_PROBE != 1
#          refused |= rebuild_block<D>(j, chunk_key(ci), kv_len, stage, descs, kv_tile(ci, 0), kv_tile(ci, 1), lane);
# +#endif
#        }
#        if constexpr (C::kWgmma) fence_proxy_async_smem();  // the tiles are read by wgmma
#        issue_chunk(ci + kS);                               // into the staging chunk ci left
# @@ -692,6 +697,10 @@ __global__ void __launch_bounds__(kThreads, 1) paged_prefill_kernel(const Params
#      start_scores<D>(qs, kv_tile(0, 0), warp, lane, s_cur);
#      wgmma_wait_all();
#      fence_registers(s_cur);
# +#if ZIPKV_PREFILL_PROBE == 2
# +    for (int ci = 0; ci < chunks; ++ci) wait_full(ci), release(ci);
# +    if (chunks < 0)
# +#endif
#      for (int ci = 0; ci < chunks; ++ci) {
#        if (ci + 1 < chunks) wait_full(ci + 1);
#        start_scores<D>(qs, kv_tile(ci + 1, 0), warp, lane, s_next);
