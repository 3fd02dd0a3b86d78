#!/usr/bin/env bash
# Session 10 run 4: decode v9 full grid (README table), sanitizers on small cases, HF GPU generate (CUDA Graphs).
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
bash .box/box.sh build || exit 1
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH}
export ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
timeout 120 python3 -m pytest -q -p no:cacheprovider test/test_hf.py -k "cuda" 2>&1 | tee $OUT/test_hf.log | grep -E "passed|failed|FAILED|Error" | head -10
for tool in memcheck racecheck; do
  echo "== compute-sanitizer $tool"
  timeout 100 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py -k "sliding_window and 128 and (7 or 100) or pages_before_the_window or soft_cap or garbage or bad_device" 2>&1 | tee "$OUT/sanitizer_$tool.log" | tail -3
done
timeout 240 python3 benchmarks/bench_decode.py --out $OUT --iters 100 2>&1 | tail -12
