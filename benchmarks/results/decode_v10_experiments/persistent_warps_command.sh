#!/usr/bin/env bash
# Session 11 run 1: decode v10 candidate (persistent warps, branch decode-persistent-warps) against main (v9).
# main: build, bench subset. Then the branch's patch: build, decode tests, sanitizers, bench subset.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
C=llama:2048:32,llama:2048:64,llama:8192:32,llama:8192:64,smollm2:8192:64
bash .box/box.sh build || exit 1
timeout 120 python3 benchmarks/bench_decode.py --out $OUT/main --iters 100 --no-flashinfer --cases $C 2>&1 | tail -12
git apply .box/persist.patch && echo "patch applied"
bash .box/box.sh build || exit 1
timeout 150 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 | tee $OUT/test.log | grep -E "passed|failed|FAILED|Error|assert" | head -20
for tool in memcheck racecheck; do
  echo "== compute-sanitizer $tool"
  timeout 80 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py -k "sliding_window and 128 and (7 or 100) or pages_before_the_window or soft_cap or garbage or empty_requests or descending" 2>&1 | tee "$OUT/sanitizer_$tool.log" | tail -3
done
timeout 120 python3 benchmarks/bench_decode.py --out $OUT/persist --iters 100 --no-flashinfer --cases $C 2>&1 | tail -12
