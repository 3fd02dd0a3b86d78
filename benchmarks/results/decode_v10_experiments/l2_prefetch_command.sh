#!/usr/bin/env bash
# Session 11 run 3: L2 prefetch of the tile kPrefetchAhead tiles ahead (cp.async.bulk.prefetch.L2), at 2 / 0 / 4;
# bench data now all-compressible. Decode tests on the prefetch-2 build.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
C=llama:2048:32,llama:2048:64,llama:8192:32,llama:8192:64
bash .box/box.sh build || exit 1
timeout 100 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 | tee $OUT/test.log | grep -E "passed|failed|FAILED|Error|assert" | head -20
timeout 150 python3 benchmarks/bench_decode.py --out $OUT/ahead2 --iters 100 --cases $C 2>&1 | tail -6
for a in 0 4; do
  sed -i "s/constexpr int kPrefetchAhead = [0-9]*;/constexpr int kPrefetchAhead = $a;/" csrc/cuda/paged_decode.cuh
  grep -c "kPrefetchAhead = $a;" csrc/cuda/paged_decode.cuh
  bash .box/box.sh build || exit 1
  timeout 100 python3 benchmarks/bench_decode.py --out $OUT/ahead$a --iters 100 --no-flashinfer --cases $C 2>&1 | tail -6
done
