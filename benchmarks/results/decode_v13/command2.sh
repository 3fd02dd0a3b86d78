#!/usr/bin/env bash
# Session 14, run 2 (after the plan's lower bound fix): every test but the SmolLM2-model ones, sanitizers on the
# 6-warp test, the full grid again (-> grid_run2.json); then a build with commit ffc1090's paged_decode.cu (its
# experiment switches; carried as .box/v13_switch/paged_decode.cu) for ../decode_v13_experiments/real_like_sweep.py.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
t0=$SECONDS
bash .box/box.sh build || exit 1
timeout 200 python3 -m pytest -q -p no:cacheprovider test -k "not smollm2" --ignore=test/test_compile.py 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -20 | tee -a $OUT/run.log
echo "tests done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
for tool in memcheck racecheck; do
  timeout 80 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py \
    -k "six_warp_ctas or decode_plan or split_and_unsplit and 128" \
    2>&1 | tail -12 > "$OUT/sanitizer_$tool.log"; tail -2 "$OUT/sanitizer_$tool.log" | tee -a $OUT/run.log
done
echo "sanitizers done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
timeout 200 python3 benchmarks/bench_decode.py --out $OUT/g2 --iters 100 2>&1 | tail -9 | tee -a $OUT/run.log
mv $OUT/g2/bench_decode.json $OUT/grid_run2.json; rmdir $OUT/g2
echo "grid done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
cp .box/v13_switch/paged_decode.cu csrc/cuda/paged_decode.cu && rm $OUT/build.log && bash .box/box.sh build || exit 1
timeout 120 python3 benchmarks/results/decode_v13_experiments/real_like_sweep.py $OUT 2>&1 | tail -25 > $OUT/real_like_sweep.log
echo "all done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
# Run 3 (same commit as this script's final state, after the split-plan test fix; -> run3.log):
#   bash .box/box.sh build && python3 -m pytest -q test/test_decode_cuda.py test/test_errors.py test/test_cuda.py
