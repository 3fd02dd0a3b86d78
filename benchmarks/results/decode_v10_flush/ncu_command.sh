#!/usr/bin/env bash
# Session 11 run 6: ncu of zipkv v10 (compressed, raw) and FlashInfer TC at 8K x 64: DRAM, L2 and its breakdown.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
bash .box/box.sh build >/dev/null || exit 1
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH}
M=dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_read.sum,lts__t_requests_op_read.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__d_sectors.avg.pct_of_peak_sustained_elapsed,lts__t_tag_requests.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active
timeout 400 ncu --clock-control none -k regex:"paged_decode_kernel|Prefill|Decode" --section SpeedOfLight --section MemoryWorkloadAnalysis --metrics $M python3 .box/profile_fi.py > $OUT/ncu_fi.txt 2>&1
grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|L2 Cache Throughput|Mem Busy|Max Bandwidth|L2 Hit|dram__|lts__|sm__warps|gpu__time" $OUT/ncu_fi.txt | cut -c1-160 | head -80
