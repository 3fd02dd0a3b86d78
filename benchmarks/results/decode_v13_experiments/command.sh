#!/usr/bin/env bash
# Session 14, run on the code of commit ffc1090 (branch v13-six-warp-ctas before its plan was recalibrated; its
# experiment switches ZIPKV_DECODE_WARPS / ZIPKV_DECODE_SPLITS were then removed, so this script needs that commit):
# d 128 CTAs of 6 warps, 2 per SM, beside 4 warps, 3 per SM. On the H200 box (carry .box), in one call:
# the decode tests with the plan's choice and with 6 warps forced, sanitizers on the 6-warp kernel, then the sweep of
# warps x split counts (-> plan_sweep.json).
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
t0=$SECONDS
bash .box/box.sh build || exit 1
timeout 100 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 | tail -2 | tee -a $OUT/run.log
ZIPKV_DECODE_WARPS=6 timeout 100 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 | tail -2 | tee -a $OUT/run.log
grep -q " failed" $OUT/run.log && exit 1
for tool in memcheck racecheck; do
  ZIPKV_DECODE_WARPS=6 timeout 70 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
    test/test_decode_cuda.py -k "sliding_window and 128 and (7 or 100) or garbage or graph or all_raw or every_raw_block_pattern and 128" \
    2>&1 | tail -12 > "$OUT/sanitizer_six_warps_$tool.log"; tail -1 "$OUT/sanitizer_six_warps_$tool.log" | tee -a $OUT/run.log
done
echo "checks done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
timeout 300 python3 benchmarks/results/decode_v13_experiments/plan_sweep.py $OUT/sweep 2>&1 | tail -130 > $OUT/sweep.log
echo "all done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
