#!/usr/bin/env bash
# build + compiled-engine GPU tests + bench_e2e --quick (compiled, fused) on the box
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt
step=${1:-all}
if [ "$step" = all ] || [ "$step" = build ]; then
  bash .box/box.sh build || exit 1
fi
if [ "$step" = all ] || [ "$step" = test ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider -x test/test_engine_compile.py test/test_engine_cuda.py -rfE 2>&1 | tee "$OUT/test_engine_gpu.log" | tail -15
fi
if [ "$step" = all ] || [ "$step" = bench ]; then
  shift || true
  python3 benchmarks/bench_e2e.py --out "$OUT" --quick --systems zipkv raw --time-limit ${E2E_LIMIT:-280} "$@" 2>&1 | tee "$OUT/bench_e2e.log" | grep -v "^\s*$" | tail -40
fi
echo "all $SECONDS s"
