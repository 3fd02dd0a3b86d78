#!/usr/bin/env bash
# Session 10 run 8 (experiment): d 128 at 3 CTAs/SM (committed) against 2 CTAs/SM (24 KB rings: 3 raw tiles per warp).
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt
C=llama:2048:32,llama:8192:64
bash .box/box.sh build || exit 1
timeout 100 python3 benchmarks/bench_decode.py --out $OUT/ctas3 --iters 100 --no-flashinfer --cases $C 2>&1 | tail -5
sed -i 's/D == 128 ? 3 : 1, kTwo/D == 128 ? 2 : 1, kTwo/' csrc/cuda/paged_decode_launch.cuh && grep -c "D == 128 ? 2 : 1, kTwo" csrc/cuda/paged_decode_launch.cuh
bash .box/box.sh build || exit 1
timeout 100 python3 benchmarks/bench_decode.py --out $OUT/ctas2 --iters 100 --no-flashinfer --cases $C 2>&1 | tail -5
