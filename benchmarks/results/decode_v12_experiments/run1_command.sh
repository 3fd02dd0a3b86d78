#!/usr/bin/env bash
# Session 13 run 1: decode v12 candidates, one build each, same call. Working tree = ring positions in registers +
# one straight line per raw-block pattern (v12_ring_switch): decode tests, then a subset with FlashInfer; then the
# other variants (HEAD v11, ring only, ring + early release, ring + early release + patterns) on the same subset.
# The variant headers it copies in were working copies, not commits: v12_base = `git show 4a68b53:csrc/cuda/paged_decode.cuh`
# (v11); v12_ring = v12 (1e7bd91) without early release and pair lines; v12_early = v12 without pair lines;
# v12_early_switch / v12_ring_switch = those with whole-stream pattern lines (whole_stream_patterns.patch on v12_early);
# v12_pairs = v12 as committed in 1e7bd91.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
t0=$SECONDS
C=llama:2048:64,llama:8192:32,llama:8192:64,smollm2:8192:64
bash .box/box.sh build || exit 1
echo "build done at $((SECONDS - t0)) s"
timeout 100 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 | tee $OUT/test.log | grep -E "passed|failed|FAILED|Error|assert" | head -20
echo "tests done at $((SECONDS - t0)) s"
grep -q " failed" $OUT/test.log && exit 1
timeout 120 python3 benchmarks/bench_decode.py --out $OUT/ring_switch --iters 100 --cases $C 2>&1 | tee $OUT/ring_switch.log | tail -6
echo "bench ring_switch done at $((SECONDS - t0)) s"
for v in base ring early early_switch; do
  cp .box/v12_$v.cuh csrc/cuda/paged_decode.cuh
  bash .box/box.sh build >/dev/null || exit 1
  timeout 90 python3 benchmarks/bench_decode.py --out $OUT/$v --iters 100 --no-flashinfer --cases $C 2>&1 | tee $OUT/$v.log | tail -5
  echo "bench $v done at $((SECONDS - t0)) s"
done
