#!/usr/bin/env bash
# Session 10 run 9: decode v10 candidate (V rebuilt before the softmax): decode tests, then the 8K x 64 / 2K x 32 subset.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
bash .box/box.sh build || exit 1
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
timeout 60 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 | tee $OUT/test.log | grep -E "passed|failed|FAILED|Error" | head -5
timeout 90 python3 benchmarks/bench_decode.py --out $OUT --iters 100 --cases llama:2048:32,llama:8192:64 2>&1 | tail -4
