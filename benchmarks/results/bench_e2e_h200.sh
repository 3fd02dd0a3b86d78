#!/usr/bin/env bash
# bench_e2e on the H200 box, 2026-12-02, commit 1b38812 (format v5): the engine compressed / raw / transformers
# generate_batch, each in its own process, after the build and the engine GPU tests. The engine jobs take ~150 s; the
# rest of --time-limit goes to transformers, whose 8K prefills do not finish inside it (as in every run so far).
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a ZIPKV_WITH_CUDA=1 PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site-x ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt ZIPKV_COMMIT=${ZIPKV_COMMIT:-unknown}
python3 setup.py build_ext --inplace -j 16 > /tmp/build.log 2>&1 || { tail -20 /tmp/build.log; exit 1; }
echo "build $SECONDS s"
timeout 90 python3 -m pytest -q -p no:cacheprovider test/test_engine_cuda.py -rs 2>&1 | tee "$OUT/test_engine_cuda.log" | tail -3
python3 benchmarks/bench_e2e.py --out "$OUT" --time-limit ${E2E_LIMIT:-240} 2>&1 | tee "$OUT/bench_e2e.log" | tail -30
echo "all $SECONDS s"
