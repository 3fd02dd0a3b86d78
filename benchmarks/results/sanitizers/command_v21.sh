#!/usr/bin/env bash
# compute-sanitizer racecheck on decode v21's d-64 pair loop (commit 06c1a6c): mixed pages at d 64 for every group
# size, raw / compressed / mixed storage at every head_dim, split and unsplit plans at d 64, real-KV mixed pages.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a ZIPKV_WITH_CUDA=1 PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
export ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt PYTHONPATH=$PWD:/tmp/site-x
python3 setup.py build_ext --inplace -j 16 > /tmp/build.log 2>&1 || { tail -20 /tmp/build.log; exit 1; }
echo "build $SECONDS s"
K="matches_reference and 64 or identical_bits or split_and_unsplit and 64 or real_kv_mixed"
timeout 130 compute-sanitizer --tool racecheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py \
  -k "$K" 2>&1 | tail -12 > "$OUT/racecheck_v21.log"; tail -4 "$OUT/racecheck_v21.log"
echo "all $SECONDS s"

# then, on the same machine (the build kept):
timeout 100 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py -k "$K" 2>&1 | tail -12 > "$OUT/memcheck_v21.log"
