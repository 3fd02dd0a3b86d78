#!/usr/bin/env bash
# Session 12 run 2: decode v11c (tile records in registers, so d 128 rings hold 3 compressed tiles): GPU tests, the
# full grid with FlashInfer; then v11a (shared-memory tile table) on a subset, same call.
# .box/paged_decode_v11a.cuh was `git show 68b46f6:csrc/cuda/paged_decode.cuh`.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
t0=$SECONDS
bash .box/box.sh build || exit 1
echo "build done at $((SECONDS - t0)) s"
timeout 150 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py test/test_cuda.py test/test_decode.py 2>&1 | tee $OUT/test.log | grep -E "passed|failed|FAILED|Error|assert" | head -20
echo "tests done at $((SECONDS - t0)) s"
grep -q " failed" $OUT/test.log && exit 1
timeout 240 python3 benchmarks/bench_decode.py --out $OUT/grid --iters 100 2>&1 | tee $OUT/grid.log | tail -9
echo "grid done at $((SECONDS - t0)) s"
cp .box/paged_decode_v11a.cuh csrc/cuda/paged_decode.cuh && echo "v11a restored"
bash .box/box.sh build || exit 1
C=llama:2048:64,llama:8192:32,llama:8192:64,smollm2:8192:64
timeout 120 python3 benchmarks/bench_decode.py --out $OUT/v11a --iters 100 --no-flashinfer --cases $C 2>&1 | tee $OUT/v11a.log | tail -6
echo "all done at $((SECONDS - t0)) s"
