#!/usr/bin/env bash
# Decode at d 64 on the H200 box, 2026-12-02 (torch 2.11.0+cu130, FlashInfer 0.6.12), two calls:
# 1. decode v19 (commit ed436ea: format.h decode_high_bytes takes sel >> 16 by IMAD.HI) against v18 (main, 1b38812,
#    in .box/v18) and v4 (621e3e3, in .box/int), each `git archive`d and built in place: v19 tests (tests_v19.log),
#    bench_decode v19, v18, v4, v19 again (../bench_decode_v19_h200.json), then compute-sanitizer on v19 (clean;
#    the kept kernel's run is in ../sanitizers/).
# 2. ncu of the d-64 kernel, v18 against v4 (ncu_v18.txt, ncu_v4.txt; ncu_summary.txt side by side).
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a ZIPKV_WITH_CUDA=1 PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/zipkv-site .box/wheels/*.whl 2>/dev/null
ROOT=$PWD; export ZIPKV_REAL_KV=$ROOT/.box/data/real_kv.pt
( python3 setup.py build_ext --inplace -j 8 > /tmp/build_v19.log 2>&1; echo "v19 build rc=$? $SECONDS s" ) &
( cd .box/v18 && python3 setup.py build_ext --inplace -j 4 > /tmp/build_v18.log 2>&1; echo "v18 build rc=$? $SECONDS s" ) &
( cd .box/int && python3 setup.py build_ext --inplace -j 4 > /tmp/build_v4.log 2>&1; echo "v4 build rc=$? $SECONDS s" ) &
wait
X=/tmp/site-x:/tmp/zipkv-site
CASES=smollm2:8192:64,llama:8192:64,llama:2048:32
PYTHONPATH=$ROOT:$X timeout 90 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py test/test_adversarial_format.py test/test_decode.py test/test_meta_tag.py 2>&1 | tee "$OUT/tests_v19.log" | tail -2
b() { (cd $1 && PYTHONPATH=$PWD:$X timeout 100 python3 benchmarks/bench_decode.py --out /tmp/$2 --iters 60 --cases $CASES 2>&1 | tail -4; cp /tmp/$2/bench_decode.json "$OUT/bench_decode_$2_h200.json"; echo "$2 done $SECONDS s") }
b $ROOT v19; b $ROOT/.box/v18 v18; b $ROOT/.box/int v4; b $ROOT v19b
K="matches_reference and 64 or six_warp_ctas or split_and_unsplit and 64 or sliding_window and 64 and 7 or garbage or graph or all_raw or every_raw_block_pattern or real_kv_mixed"
for tool in memcheck racecheck; do
  [ $SECONDS -lt 470 ] || { echo "no time for $tool"; continue; }
  PYTHONPATH=$ROOT:$X timeout $((560 - SECONDS)) compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py \
    -k "$K" 2>&1 | tail -12 > "$OUT/$tool.log"; tail -n 3 "$OUT/$tool.log"; echo "$tool $SECONDS s"
done

# call 2
ROOT=$PWD
( cd .box/v18 && python3 setup.py build_ext --inplace -j 8 > /tmp/build_v18.log 2>&1; echo "v18 build rc=$? $SECONDS s" ) &
( cd .box/int && python3 setup.py build_ext --inplace -j 8 > /tmp/build_v4.log 2>&1; echo "v4 build rc=$? $SECONDS s" ) &
wait
set -f
S="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section InstructionStats --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,regex:sm__inst_executed_pipe_.*\\.avg\\.pct_of_peak_sustained_active,smsp__inst_executed.sum"
for t in v18 int; do
  (cd .box/$t && cp $ROOT/benchmarks/results/decode_d64_h200/ncu_target.py ncu_d64.py && PYTHONPATH=$PWD timeout 200 ncu --clock-control none -k regex:paged_decode_kernel --launch-skip 2 --launch-count 1 $S python3 ncu_d64.py > "$OUT/ncu_$t.txt" 2>&1; echo "$t ncu rc=$? $SECONDS s")
done
for t in v18 int; do echo "== $t"; grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Executed Ipc A|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Instructions  |Stall|DRAM Throughput|Shared Memory Config|Dynamic Shared|stalled|pipe_|inst_executed.sum" "$OUT/ncu_$t.txt" | cut -c1-120; done
