#!/usr/bin/env bash
# Session 14, decode v13 (6-warp CTAs where 4-warp ones end in a partial wave) on the H200 box (carry .box: box.sh,
# FlashInfer wheels, data/real_kv.pt from `python benchmarks/dump_real_kv.py --out .box/data/real_kv.pt`).
# Run 1: the full grid with FlashInfer (-> ../bench_decode_h200.json), every test but the SmolLM2-model ones and
# test_compile.py (the box has no expecttest), sanitizers on small decode cases and on the 6-warp test, then
# 2K x 64 and 8K x 64 twice more (-> repeat_*.json). At most 8 files come back from $OUT.
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
  timeout 80 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py \
    -k "six_warp_ctas and 4 or sliding_window and 128 and (7 or 100) or garbage or graph or all_raw or every_raw_block_pattern and 128" \
    2>&1 | tail -12 > "$OUT/sanitizer_$tool.log"; tail -2 "$OUT/sanitizer_$tool.log" | tee -a $OUT/run.log
done
echo "sanitizers done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
for r in 1 2; do
  timeout 60 python3 benchmarks/bench_decode.py --out $OUT/r$r --iters 100 --cases llama:2048:64,llama:8192:64 2>&1 | tail -2 | tee -a $OUT/run.log
  mv $OUT/r$r/bench_decode.json $OUT/repeat_$r.json; rmdir $OUT/r$r
done
echo "all done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
