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
#                     call (about 8 min): COMMIT=<hash> bash run41.sh, which also tests and times lean_rebuild.patch
#                     (below) and, time allowing, the two probe builds; then the engine tests.
# Offline (nvcc 13.0, sm_90a, nvdisasm 13.2 from PyPI's nvidia-cuda-nvdisasm): the d-128 producer's rebuild, static
# SASS lines from its cp.async wait to its next copy: f2af5c9 444 (a loop of 2 blocks a turn, 4 turns); + unsigned.patch
# (address arithmetic in unsigned ints: shifts with no sign fix-ups) 356; + the warp's 8 blocks in one unrolled line
# with constant span offsets (lean_rebuild.patch, which includes unsigned.patch) 577 for all 8 blocks, ~50
# instructions on a compressed block's path where f2af5c9 took ~120. No spills at any head dim. The span offsets were
# checked against tile_offset for every lane, block and head dim by a Python model of both.
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
# One call for the producer-warpgroup kernel (main with 580b41a reverted): a CUDA prefill test subset and
# bench_prefill --quick with FlashInfer; then lean_rebuild.patch (unsigned.patch + each producer warp's blocks in one
# unrolled line) with the same tests and zipkv's times (probe_prefill.py); then, time allowing, the probe builds
# (probe.patch: 1 = the producer rebuilds nothing, 2 = the compute warps multiply nothing). About 8 min on an H100.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/tests"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2 ZIPKV_COMMIT=$COMMIT
SUBSET="mixed_pages or long_queries or real_kv or bad_device or larger_pages"
rm -rf build torch_zipkv/_C*.so; bash .box/box.sh build >/dev/null || { tail -60 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
timeout 80 python3 -m pytest test/test_paged_prefill_cuda.py -q -x -p no:cacheprovider -n 8 -rfE -k "$SUBSET" 2>&1 \
  | tee "$OUT/tests/prefill.log" | grep -v "Warn\|warn" | tail -8
[ "${PIPESTATUS[0]}" = 0 ] || { echo "prefill tests failed at $SECONDS s"; exit 1; }
echo "prefill tests passed at $SECONDS s"
timeout 150 python3 benchmarks/bench_prefill.py --out "$OUT" --quick 2>&1 | tee "$OUT/bench_prefill.log" | grep -v "Warn\|warn" | tail -6
echo "bench at $SECONDS s"
for variant in lean probe1 probe2; do
  [ $SECONDS -lt 430 ] || break
  git checkout -q csrc/cuda/paged_prefill.cuh
  case $variant in
    lean) git apply .box/lean_rebuild.patch; flags="" ;;
    probe*) git apply .box/probe.patch; flags="-DZIPKV_PREFILL_PROBE=${variant#probe}" ;;
  esac
  touch csrc/cuda/paged_prefill.cuh
  NVCC_APPEND_FLAGS="$flags" bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; break; }
  if [ $variant = lean ]; then
    timeout 80 python3 -m pytest test/test_paged_prefill_cuda.py -q -x -p no:cacheprovider -n 8 -rfE -k "$SUBSET" 2>&1 \
      | tee "$OUT/tests/prefill_lean.log" | grep -v "Warn\|warn" | tail -4
  fi
  timeout 60 python3 .box/probe_prefill.py $variant "$OUT/$variant.json" 2>&1 | grep "^$variant"
  echo "$variant at $SECONDS s"
done
git checkout -q csrc/cuda/paged_prefill.cuh
# The patches (unsigned.patch, lean_rebuild.patch, probe.patch) and probe_prefill.py lie beside this file; the scripts
# expect them in .box/.
