#!/usr/bin/env bash
# Format v5 (zero-aware 12-bit blocks) on the H200: build; the CUDA, format, decode, adversarial and engine GPU tests;
# bench_decode on Llama-3.1-8B and SmolLM2 shapes; bench_format (throughput and the real-KV ratio).
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
cd .box/int && mkdir -p .box && cp -r ../box.sh ../wheels ../data .box/
export PYTHONPATH=$PWD:/tmp/site-x:/tmp/zipkv-site ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1 PYTHONUNBUFFERED=1
bash .box/box.sh build || { tail -30 $OUT/build.log; exit 1; }
timeout 200 python3 -m pytest -q -p no:cacheprovider -k "cuda or decode or format or adversarial or meta_tag" test 2>&1 | tee "$OUT/tests_v5.log" | tail -6
timeout 150 python3 benchmarks/bench_decode.py --out "$OUT" --iters 40 --cases llama:8192:32,llama:8192:64,llama:8192:96,llama:2048:64,smollm2:8192:64 2>&1 | tee "$OUT/bench_decode.log" | tail -8
timeout 80 python3 benchmarks/bench_format.py --out "$OUT" --gib 1 --iters 10 2>&1 | tee "$OUT/bench_format.log" | tail -12
