#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on the decode kernel as of commit 65ced97 (decode v14: format v3, lazy
# softmax max; the kernel has not changed since), small cases: 6-warp CTAs, split and unsplit plans, sliding windows,
# garbage tails, all-raw pages, every raw-block pattern, CUDA Graphs. H200 box, 2026-12-02, torch 2.11.0+cu130.
# .box/box.sh build is pip install --no-build-isolation -e . with TORCH_CUDA_ARCH_LIST=9.0a.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export ZIPKV_REQUIRE_CUDA_BUILD=1
bash .box/box.sh build >/dev/null || exit 1
K="six_warp_ctas or split_and_unsplit and 128 or sliding_window and 128 and 7 or garbage or graph or all_raw or every_raw_block_pattern and 128"
for tool in memcheck racecheck; do
  timeout 75 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py \
    -k "$K" 2>&1 | tail -12 > "$OUT/$tool.log"; tail -3 "$OUT/$tool.log"
done
