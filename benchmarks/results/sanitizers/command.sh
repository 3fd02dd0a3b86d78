#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on the decode kernel of format v5 (commit a829b2a, decode v17), small
# cases: 6-warp CTAs, split and unsplit plans, sliding windows, garbage tails, all-raw pages, every raw-block pattern,
# CUDA Graphs, real-KV mixed pages (zero-aware, 12-bit and raw blocks). H200 box, 2026-12-02, torch 2.11.0+cu130.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a ZIPKV_WITH_CUDA=1 PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
export ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt PYTHONPATH=$PWD:/tmp/site-x
python3 setup.py build_ext --inplace -j 16 > /tmp/build.log 2>&1 || { tail -20 /tmp/build.log; exit 1; }
K="six_warp_ctas or split_and_unsplit and 128 or sliding_window and 128 and 7 or garbage or graph or all_raw or every_raw_block_pattern and 128 or real_kv_mixed"
for tool in memcheck racecheck; do
  timeout 150 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py \
    -k "$K" 2>&1 | tail -12 > "$OUT/$tool.log"; tail -3 "$OUT/$tool.log"
done
