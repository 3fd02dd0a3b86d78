#!/usr/bin/env bash
# Session 15, call 3: decode v14 = format v3 + the lazy softmax max (this commit's paged_decode.cuh). Decode tests,
# the full grid (-> grid_v14.json), then v14a (format v3 alone, carried as .box/v14a/) built in the same call and
# measured on a subset of the grid for the A/B (-> subset_v14a.json).
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
t0=$SECONDS
bash .box/box.sh build || exit 1
timeout 150 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -12 | tee -a $OUT/run.log
grep -q " failed" $OUT/run.log && exit 1
echo "tests done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
timeout 260 python3 benchmarks/bench_decode.py --out $OUT/g --iters 100 2>&1 | tail -9 | tee -a $OUT/run.log
mv $OUT/g/bench_decode.json $OUT/grid_v14.json; rmdir $OUT/g
echo "grid done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
cp .box/v14a/cuda/paged_decode.cuh csrc/cuda/ && rm -f $OUT/build.log && bash .box/box.sh build || exit 1
timeout 150 python3 benchmarks/bench_decode.py --out $OUT/a --iters 100 \
  --cases llama:8192:64,llama:8192:32,llama:2048:32,smollm2:8192:64 2>&1 | tail -6 | tee -a $OUT/run.log
mv $OUT/a/bench_decode.json $OUT/subset_v14a.json; rmdir $OUT/a
echo "all done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
