#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on the decode kernel of format v5 (commit 1b38812, decode v18: d 64's
# tables in the tile record), 26 small cases: mixed pages at d 64 for 8 group sizes, 6-warp CTAs, split and unsplit
# plans, sliding windows, garbage tails, all-raw pages, every raw-block pattern (d 64, 128, 256), CUDA Graphs, real-KV
# mixed pages (zero-aware, 12-bit and raw blocks). H100 box (sm_90, the same build as the H200s), 2026-12-02, torch
# 2.11.0+cu130.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a ZIPKV_WITH_CUDA=1 PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
export ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt PYTHONPATH=$PWD:/tmp/site-x
python3 setup.py build_ext --inplace -j 16 > /tmp/build.log 2>&1 || { tail -20 /tmp/build.log; exit 1; }
K="matches_reference and 64 or six_warp_ctas or split_and_unsplit and 64 or sliding_window and 64 and 7 or garbage or graph or all_raw or every_raw_block_pattern or real_kv_mixed"
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py \
    -k "$K" 2>&1 | tail -12 > "$OUT/$tool.log"; tail -3 "$OUT/$tool.log"
done
