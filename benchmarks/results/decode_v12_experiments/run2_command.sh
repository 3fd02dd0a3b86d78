#!/usr/bin/env bash
# Session 13 run 2: decode v12 (ring positions in registers, early release, pair lines for mixed streams at d <= 128):
# decode tests, the full grid with FlashInfer, then the same subset for v12, v12 without pair lines
# (v12_early) and v11 (v12_base), one build each, same call.
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
timeout 100 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 | tee $OUT/test.log | grep -E "passed|failed|FAILED|Error|assert" | head -20
echo "tests done at $((SECONDS - t0)) s"
grep -q " failed" $OUT/test.log && exit 1
timeout 200 python3 benchmarks/bench_decode.py --out $OUT/grid --iters 100 2>&1 | tee $OUT/grid.log | tail -9
echo "grid done at $((SECONDS - t0)) s"
for v in pairs early base; do
  [ $v = pairs ] || { cp .box/v12_$v.cuh csrc/cuda/paged_decode.cuh; bash .box/box.sh build >/dev/null || exit 1; }
  timeout 90 python3 benchmarks/bench_decode.py --out $OUT/$v --iters 100 --no-flashinfer --cases $C 2>&1 | tee $OUT/$v.log | tail -5
  echo "bench $v done at $((SECONDS - t0)) s"
done
mkdir -p $OUT/j; for v in grid pairs early base; do cp $OUT/$v/bench_decode.json $OUT/j/$v.json; done
