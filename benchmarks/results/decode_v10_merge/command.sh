#!/usr/bin/env bash
# Session 11 run 4: decode v10 = v9 + split merge as one warp per row (two L2 round trips) launched as a
# programmatic dependent of the decode grid; bench data all-compressible. Tests, sanitizers, the full grid with
# FlashInfer; then v9's merge (patch reversed) on a subset, same call, for the before/after.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
bash .box/box.sh build || exit 1
timeout 120 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py test/test_decode.py test/test_hf.py -k "not smollm2" 2>&1 | tee $OUT/test.log | grep -E "passed|failed|FAILED|Error|assert" | head -20
grep -q " failed" $OUT/test.log && exit 1
for tool in memcheck racecheck; do
  echo "== compute-sanitizer $tool"
  timeout 60 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py -k "sliding_window and 128 and (7 or 100) or pages_before_the_window or soft_cap or garbage or graph" 2>&1 | tee "$OUT/sanitizer_$tool.log" | tail -2
done
timeout 280 python3 benchmarks/bench_decode.py --out $OUT/grid --iters 100 2>&1 | tee $OUT/grid.log | tail -9
git apply -R .box/merge.patch && echo "v9 merge restored"
bash .box/box.sh build || exit 1
timeout 90 python3 benchmarks/bench_decode.py --out $OUT/v9merge --iters 100 --no-flashinfer --cases llama:2048:64,llama:8192:64,llama:8192:96 2>&1 | tail -4
