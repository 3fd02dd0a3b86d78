#!/usr/bin/env bash
# Session 15, call 5 (carry .box/box.sh, .box/gg_b, .box/data; right after call 4): every box test but test_compile
# (the box lacks expecttest), then the SmolLM2 HF tests and the demo on the GPU (.box/gg_b/run.sh, the same file as
# ../smollm2_gpu_h200_v13/run.sh; its logs are in ../smollm2_gpu_h200_v14/).
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
t0=$SECONDS
timeout 220 python3 -m pytest -q -p no:cacheprovider test -k "not smollm2" --ignore=test/test_compile.py 2>&1 \
  | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -20 | tee $OUT/tests.log
echo "tests done at $((SECONDS - t0)) s"
bash .box/gg_b/run.sh
echo "all done at $((SECONDS - t0)) s"
