#!/usr/bin/env bash
# Session 12 run 1: decode v11 (format v2 raw layout + per-stream kinds) with ring units of streams (v11b, default)
# and of whole tiles (v11a, ZIPKV_DECODE_UNITS=1): GPU tests on v11b, then a bench subset of each in one call.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
t0=$SECONDS
bash .box/box.sh build || exit 1
echo "build done at $((SECONDS - t0)) s"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py test/test_cuda.py test/test_decode.py 2>&1 | tee $OUT/test.log | grep -E "passed|failed|FAILED|Error|assert" | head -20
echo "tests done at $((SECONDS - t0)) s"
grep -q " failed" $OUT/test.log && exit 1
C=llama:2048:64,llama:8192:32,llama:8192:64,smollm2:8192:64
timeout 170 python3 benchmarks/bench_decode.py --out $OUT/units2 --iters 100 --cases $C 2>&1 | tee $OUT/units2.log | tail -6
echo "bench 1 done at $((SECONDS - t0)) s"
ZIPKV_DECODE_UNITS=1 timeout 120 python3 benchmarks/bench_decode.py --out $OUT/units1 --iters 100 --no-flashinfer --cases $C 2>&1 | tee $OUT/units1.log | tail -6
echo "all done at $((SECONDS - t0)) s"
