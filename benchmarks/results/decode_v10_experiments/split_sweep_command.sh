#!/usr/bin/env bash
# Session 11 run 5: split-count sweep at 2K x 64, 8K x 32, 8K x 64 (temporary ZIPKV_SPLITS override, box only).
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
sed -i 's|  p.num_splits = plan_splits(\(.*\));|  p.num_splits = plan_splits(\1);\n  if (const char* e = std::getenv("ZIPKV_SPLITS")) p.num_splits = std::atoi(e);|' csrc/cuda/paged_decode.cu
sed -i 's|#include <ATen/ATen.h>|#include <ATen/ATen.h>\n#include <cstdlib>|' csrc/cuda/paged_decode.cu
grep -n "ZIPKV_SPLITS" csrc/cuda/paged_decode.cu
bash .box/box.sh build || exit 1
timeout 150 python3 .box/split_sweep.py 2>&1 | tail -40
