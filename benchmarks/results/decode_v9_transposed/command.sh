#!/usr/bin/env bash
# Session 10 run 3: decode v9 (transposed MMAs: tokens in M, heads in N; movmatrix P^T; ex2.approx; cap branch hoisted).
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
bash .box/box.sh build || exit 1
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH}
export ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
timeout 200 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py test/test_decode.py 2>&1 | tee $OUT/test.log | grep -E "passed|failed|FAILED|Error|assert" | head -20
timeout 150 python3 benchmarks/bench_decode.py --out $OUT --iters 100 --cases llama:2048:32,llama:8192:64,llama:8192:96,smollm2:8192:64 2>&1 | tail -12
