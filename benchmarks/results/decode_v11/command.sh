#!/usr/bin/env bash
# Session 12, decode v11 on the H200 box (carry .box: box.sh, FlashInfer wheels, data/real_kv.pt from
# `python benchmarks/dump_real_kv.py --out .box/data/real_kv.pt`).
# Run 5: decode tests, then the full grid with FlashInfer (-> ../bench_decode_h200.json).
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
bash .box/box.sh build || exit 1
timeout 60 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 | tee $OUT/test.log | grep -E "passed|failed"
timeout 220 python3 benchmarks/bench_decode.py --out $OUT/grid --iters 100 2>&1 | tee $OUT/grid.log | tail -9
# Run 6 (same warm machine): sanitizers on small cases, then every test but the SmolLM2-model ones and
# test_compile.py (the box has no expecttest) -> sanitizer_*.log, tests.txt.
for tool in memcheck racecheck; do
  timeout 75 compute-sanitizer --tool $tool --print-limit 5 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py \
    -k "sliding_window and 128 and (7 or 100) or pages_before_the_window or soft_cap or garbage or graph or all_raw or real_kv" \
    2>&1 | tee "$OUT/sanitizer_$tool.log" | tail -2
done
timeout 300 python3 -m pytest -q -p no:cacheprovider test -k "not smollm2" --ignore=test/test_compile.py 2>&1 | tee $OUT/test_all.log | tail -3
# Run 3 measured the same kernel without the tile-wide all-compressed condition (grid_per_stream_kinds_only.json)
# and its SASS: cuobjdump -sass -fun paged_decode_kernel<128,1,3> of `nvcc -cubin` of paged_decode_hd128.cu.
