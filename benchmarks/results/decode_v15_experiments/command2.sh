#!/usr/bin/env bash
# Session 16, call 2 (carry .box: box.sh, FlashInfer wheels, data/real_kv.pt): decode v14 (the variants of call 1
# reverted) with the bench's new method (random order each round, a GPU spin before each timed call): the decode
# tests, the baseline-context diagnostic, then the full grid.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
t0=$SECONDS
bash .box/box.sh build || exit 1
timeout 100 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 \
  | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -6 | tee -a $OUT/run.log
echo "tests done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
timeout 150 python3 benchmarks/results/decode_v15_experiments/baseline_context.py --out $OUT 2>&1 | grep -v Warn | tee -a $OUT/run.log
echo "diagnostic done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
timeout 280 python3 benchmarks/bench_decode.py --out $OUT/g --iters 100 2>&1 | tail -9 | tee -a $OUT/run.log
mv $OUT/g/bench_decode.json $OUT/grid_v14_padded.json; rmdir $OUT/g
echo "all done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
