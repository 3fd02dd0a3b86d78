#!/usr/bin/env bash
# Session 11 run 2: ncu kernel durations (decode, merge) of main (v9) and the persistent-warp candidate at
# 2K x 32, 2K x 64, 8K x 64 (compressed pages).
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH}
prof() {
  ncu --clock-control none -k regex:"paged_decode_kernel|merge" --section SpeedOfLight --section WarpStateStats \
    --section Occupancy python3 .box/profile_cases.py > "$OUT/ncu_$1.txt" 2>&1
  grep -E "paged_decode_kernel|merge_|Duration|DRAM Throughput|Achieved Occupancy|Warp Cycles Per Issued" "$OUT/ncu_$1.txt" | head -40
}
bash .box/box.sh build >/dev/null || exit 1
prof main
git apply .box/persist.patch && echo "patch applied"
bash .box/box.sh build >/dev/null || exit 1
prof persist
