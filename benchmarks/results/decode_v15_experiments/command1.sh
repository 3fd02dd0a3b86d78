#!/usr/bin/env bash
# Session 16, call 1 (carry .box: box.sh, FlashInfer wheels, data/real_kv.pt from
# `python benchmarks/dump_real_kv.py --out .box/data/real_kv.pt`): build the experiment variants, run the decode tests
# on the two candidate variants, the variant sweep, then the full grid (round-robin bench) on the variant the sweep
# ranks first by the geometric mean of its paired speedups (bit 8, the no-fence diagnostic, excluded).
# Ran at cb34fa0 (the variants in csrc; variants.patch here is that diff). The bench then rotated its order and had no
# GPU spin before each call (both changed for call 2).
set -uo pipefail
export OUT=${OUT:-/tmp/zipkv-out}; mkdir -p $OUT
export PYTHONPATH=/tmp/zipkv-site${PYTHONPATH:+:$PYTHONPATH} ZIPKV_REAL_KV=.box/data/real_kv.pt ZIPKV_REQUIRE_CUDA_BUILD=1
t0=$SECONDS
bash .box/box.sh build || exit 1
echo "built at $((SECONDS - t0)) s" | tee -a $OUT/run.log
for e in 7 3; do
  ZIPKV_DECODE_EXP=$e timeout 100 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 \
    | grep -E "^(FAILED|ERROR|E  )|passed|failed" | tail -6 | sed "s/^/exp $e: /" | tee -a $OUT/run.log
done
echo "tests done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
timeout 200 python3 benchmarks/results/decode_v15_experiments/variant_sweep.py --out $OUT --iters 100 2>&1 \
  | grep -v Warning | tee -a $OUT/run.log
echo "sweep done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
best=$(python3 - <<'PY'
import json, math, os
rows = json.load(open(os.environ["OUT"] + "/variant_sweep.json"))["cases"]
score = {}
for r in rows:
    for k, x in r.get("paired_vs_tc", {}).items():
        v = int(k.split("/")[1])
        if not v & 8:
            score.setdefault(v, []).append(math.log(x))
print(max(score, key=lambda v: sum(score[v]) / len(score[v])) if score else 0)
PY
)
echo "grid on variant $best" | tee -a $OUT/run.log
ZIPKV_DECODE_EXP=$best timeout 260 python3 benchmarks/bench_decode.py --out $OUT/g --iters 100 2>&1 | tail -9 | tee -a $OUT/run.log
mv $OUT/g/bench_decode.json $OUT/grid_exp$best.json; rmdir $OUT/g
echo "all done at $((SECONDS - t0)) s" | tee -a $OUT/run.log
