#!/usr/bin/env bash
# Session 15, call 1: the box tests of 883426e (decode_plan's CUDA path after the check_group refactor), the DRAM
# probe (dram_probe.py), and ncu --set full of v13 at 8K x 64 (compressed, raw, FlashInfer TC; ncu_target.py of
# decode_v10_flush): details page and the compressed kernel's SASS-level stall samples as text.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
E=benchmarks/results/decode_v14_experiments
t0=$SECONDS
bash .box/box.sh build || exit 1
python3 -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tee -a $OUT/run.log
timeout 120 python3 $E/dram_probe.py $OUT > $OUT/probe.log 2>&1; tail -3 $OUT/probe.log | tee -a $OUT/run.log
echo "probe done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
timeout 150 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py test/test_errors.py test/test_cuda.py \
  test/test_compile.py -k "not smollm2 and not compiled_decode_step and not opcheck" 2>&1 | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -20 | tee -a $OUT/run.log
echo "tests done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
timeout 240 ncu --clock-control none -k regex:"paged_decode_kernel|Prefill|Decode" --set full -f -o /tmp/v13_8k64 \
  python3 benchmarks/results/decode_v10_flush/ncu_target.py > $OUT/ncu_run.log 2>&1; tail -3 $OUT/ncu_run.log | tee -a $OUT/run.log
ncu --import /tmp/v13_8k64.ncu-rep --page details > $OUT/ncu_details.txt 2>&1
ncu --import /tmp/v13_8k64.ncu-rep --page source --csv --print-source sass --launch-count 1 > $OUT/ncu_sass_comp.csv 2>&1
ls -la /tmp/v13_8k64.ncu-rep $OUT | tee -a $OUT/run.log
echo "all done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
