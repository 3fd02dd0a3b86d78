#!/usr/bin/env bash
# Session 15, call 2: format v3 (a lane's words in mma A-operand order; no register moves before the HMMAs).
# Every box test but the SmolLM2-model ones on v3, then the same subset of the grid on v3 and on v13 (the format.h,
# block_io.cuh and paged_decode.cuh of 883426e, carried as .box/v13_base/), one after the other in this call.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
CASES=llama:8192:64,llama:8192:32,llama:2048:64,llama:2048:32,smollm2:8192:64
t0=$SECONDS
bash .box/box.sh build || exit 1
timeout 220 python3 -m pytest -q -p no:cacheprovider test -k "not smollm2" --ignore=test/test_compile.py 2>&1 \
  | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -20 | tee -a $OUT/run.log
echo "tests done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
timeout 100 python3 benchmarks/bench_decode.py --out $OUT/a --iters 100 --cases $CASES 2>&1 | tail -7 | tee -a $OUT/run.log
mv $OUT/a/bench_decode.json $OUT/subset_v14.json; rmdir $OUT/a
echo "v14 subset done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
cp .box/v13_base/format.h csrc/format.h && cp .box/v13_base/cuda/*.cuh csrc/cuda/ && rm -f $OUT/build.log
bash .box/box.sh build || exit 1
timeout 100 python3 benchmarks/bench_decode.py --out $OUT/b --iters 100 --cases $CASES 2>&1 | tail -7 | tee -a $OUT/run.log
mv $OUT/b/bench_decode.json $OUT/subset_v13.json; rmdir $OUT/b
echo "all done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
