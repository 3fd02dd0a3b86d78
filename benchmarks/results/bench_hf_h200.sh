#!/usr/bin/env bash
# bench_hf_h200.json, H200 box, 2026-12-02, commit 2949684: this tree's HF decode step against commit 182cf53's,
# alternating, each run in its own process. .box/old held `git archive 182cf53`; /tmp/site-x the carried wheels.
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site-x PYTHONUNBUFFERED=1
(cd .box/old && python3 setup.py build_ext --inplace -j 16 > "$OUT/old_build.log" 2>&1) || { tail -20 "$OUT/old_build.log"; exit 1; }
for i in 1 2; do
  echo "new $i: $(timeout 140 python3 benchmarks/bench_hf.py --out "$OUT/new$i" --batch 32 --steps 30 2>&1 | tail -1)"
  echo "old $i: $(cd .box/old && PYTHONPATH=$PWD:/tmp/site-x timeout 140 python3 benchmarks/bench_hf.py --out "$OUT/old$i" --batch 32 --steps 30 2>&1 | tail -1)"
done
