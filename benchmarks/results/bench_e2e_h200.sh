#!/usr/bin/env bash
# bench_e2e on the H200 (engine compressed / raw / transformers generate_batch), after the build and the engine's GPU tests.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site-x:/tmp/zipkv-site ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt PYTHONUNBUFFERED=1 ZIPKV_COMMIT=${ZIPKV_COMMIT:-unknown}
bash .box/box.sh build || { tail -30 $OUT/build.log; exit 1; }
timeout 60 python3 -m pytest -q -p no:cacheprovider test/test_engine_cuda.py -rs 2>&1 | tee "$OUT/test_engine_cuda.log" | tail -4
python3 benchmarks/bench_e2e.py --out "$OUT" --time-limit ${E2E_LIMIT:-420} 2>&1 | tee "$OUT/bench_e2e.log" | tail -40
