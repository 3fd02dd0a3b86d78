#!/usr/bin/env bash
# Session 13, decode v12 on the H200 box (carry .box: box.sh, FlashInfer wheels, data/real_kv.pt from
# `python benchmarks/dump_real_kv.py --out .box/data/real_kv.pt`).
# Run 3: the full grid with FlashInfer (-> ../bench_decode_h200.json), every test but the SmolLM2-model ones and
# test_compile.py (the box has no expecttest), sanitizers on small decode cases, then compress/decompress
# throughput under format v2 (-> ../bench_format_h200.json). At most 8 files come back from $OUT.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
t0=$SECONDS
bash .box/box.sh build || exit 1
timeout 200 python3 benchmarks/bench_decode.py --out $OUT/grid --iters 100 2>&1 | tail -9 | tee -a $OUT/run.log
echo "grid done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
timeout 200 python3 -m pytest -q -p no:cacheprovider test -k "not smollm2" --ignore=test/test_compile.py 2>&1 | tail -4 | tee -a $OUT/run.log
echo "tests done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
for tool in memcheck racecheck; do
  timeout 70 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py \
    -k "sliding_window and 128 and (7 or 100) or pages_before_the_window or soft_cap or garbage or graph or all_raw or real_kv or every_raw_block_pattern and 128" \
    2>&1 | tail -12 > "$OUT/sanitizer_$tool.log"; tail -2 "$OUT/sanitizer_$tool.log" | tee -a $OUT/run.log
done
echo "sanitizers done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
timeout 80 python3 benchmarks/bench_format.py --out $OUT/format 2>&1 | tail -12 | tee -a $OUT/run.log
echo "all done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
# Run 4 (a fresh machine, same commit): the full grid again (-> grid_run4.json), then 2K x 64 three more times
# (-> repeat_2k64_*.json): the spread between calls on the case nearest its bars.
timeout 200 python3 benchmarks/bench_decode.py --out $OUT/grid --iters 100 2>&1 | tail -9 | tee -a $OUT/run.log
for r in 1 2 3; do
  timeout 60 python3 benchmarks/bench_decode.py --out $OUT/r$r --iters 100 --cases llama:2048:64 2>&1 | tail -1 | tee -a $OUT/run.log
done
