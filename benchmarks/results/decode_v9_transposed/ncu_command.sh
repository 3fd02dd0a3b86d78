#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"; export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH}
bash .box/box.sh build >/dev/null || exit 1
ncu --clock-control none -k regex:paged_decode_kernel --section SpeedOfLight --section Occupancy --section LaunchStats \
  --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis \
  python3 .box/profile_decode.py > "$OUT/ncu.txt" 2>&1
grep -E "paged_decode_kernel|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Issued Ipc|No Eligible|Executed Instructions  |Registers Per|Block Limit|Stall|stall|Issue Slot|One or More|Avg. Active Threads|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth|Dynamic Shared" "$OUT/ncu.txt" | head -90
