#!/usr/bin/env bash
# Session 11 run 7: decode v10 full grid with the clean (read) L2 flush, then a subset with the old write flush.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt
bash .box/box.sh build >/dev/null || exit 1
timeout 200 python3 benchmarks/bench_decode.py --out $OUT/grid --iters 100 2>&1 | tee $OUT/grid.log | tail -9
timeout 60 python3 benchmarks/bench_decode.py --out $OUT/write_flush --iters 100 --write-flush --cases llama:2048:32,llama:8192:64 2>&1 | tail -3
