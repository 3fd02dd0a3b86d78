# H200, 2026-12-02/03. Variants of the pair loop, each tree built beside the others; every variant timed in its own process.
# call0 (.box/call_o.sh): base = main 7200f27 (4 CTAs/SM); pairA = all-compressed pairs at 4 CTAs/SM, refill before
#   both softmaxes (66 B of spills); pairB = the same at 3 CTAs/SM; baseC = main at 3 CTAs/SM.
# call1 (.box/call_p.sh): base; pairA = pairs at 4 CTAs/SM with the refill between the two softmaxes (18 B of
#   spills); pairB = the same at 3 CTAs/SM.
# call2 (.box/call_r.sh): base; comp = all-compressed pairs at 3 CTAs/SM (v21 but for a cleanup of the pair code:
#   8 SASS instructions fewer in 06c1a6c); pairs = all-compressed and all-raw pairs.
# The trees: git worktrees of main with the edits described; .box/base = main.

#!/usr/bin/env bash
# d 64 pair-of-tiles loop: main (.box/base), pairs at 4 CTAs/SM (this tree), pairs at 3 (.box/pairB), main at 3
# (.box/baseC); SmolLM2 shapes and one d-128 shape, no FlashInfer; then the decode tests on this tree.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0a ZIPKV_WITH_CUDA=1 PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
ROOT=$PWD; export ZIPKV_REAL_KV=$ROOT/.box/data/real_kv.pt
for t in $ROOT $ROOT/.box/base $ROOT/.box/pairB $ROOT/.box/baseC; do
  ( cd $t && MAX_JOBS=4 python3 setup.py build_ext --inplace -j 4 > build.log 2>&1; echo "$t build rc=$? $SECONDS s" ) &
done
wait
X=/tmp/site-x
CASES=smollm2:8192:64,smollm2:2048:32,smollm2:2048:128,llama:8192:64
b() { (cd $1 && PYTHONPATH=$PWD:$X timeout 100 python3 benchmarks/bench_decode.py --no-flashinfer --out /tmp/$2 --iters 60 --cases $CASES 2>&1 | tail -5; cp /tmp/$2/bench_decode.json "$OUT/bench_decode_$2.json"; echo "$2 done $SECONDS s") }
b $ROOT/.box/base base; b $ROOT pairA; b $ROOT/.box/pairB pairB; b $ROOT/.box/baseC baseC; b $ROOT/.box/base base2; b $ROOT pairA2
PYTHONPATH=$ROOT:$X timeout 150 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 | tee "$OUT/tests_pairA.log" | tail -4
echo "all $SECONDS s"

#!/usr/bin/env bash
# d 64 pair-of-tiles loop with fewer spills: main (.box/base), pairs at 4 CTAs/SM (this tree), pairs at 3
# (.box/pairB); SmolLM2 shapes and one d-128 shape, no FlashInfer; then the decode tests on this tree.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0a ZIPKV_WITH_CUDA=1 PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
ROOT=$PWD; export ZIPKV_REAL_KV=$ROOT/.box/data/real_kv.pt
for t in $ROOT $ROOT/.box/base $ROOT/.box/pairB; do
  ( cd $t && MAX_JOBS=5 python3 setup.py build_ext --inplace -j 5 > build.log 2>&1; echo "$t build rc=$? $SECONDS s" ) &
done
wait
X=/tmp/site-x
CASES=smollm2:8192:64,smollm2:2048:32,smollm2:2048:128,smollm2:8192:16,llama:8192:64
b() { (cd $1 && PYTHONPATH=$PWD:$X timeout 100 python3 benchmarks/bench_decode.py --no-flashinfer --out /tmp/$2 --iters 60 --cases $CASES 2>&1 | tail -6; cp /tmp/$2/bench_decode.json "$OUT/bench_decode_$2.json"; echo "$2 done $SECONDS s") }
b $ROOT/.box/base base; b $ROOT pairA; b $ROOT/.box/pairB pairB; b $ROOT/.box/base base2; b $ROOT pairA2; b $ROOT/.box/pairB pairB2
PYTHONPATH=$ROOT:$X timeout 150 python3 -m pytest -q -x -p no:cacheprovider test/test_decode_cuda.py 2>&1 | tee "$OUT/tests_pairA.log" | tail -4
echo "all $SECONDS s"

#!/usr/bin/env bash
# d 64 pairs: main (.box/base), all-compressed pairs only (.box/compOnly), all-compressed and all-raw pairs (this
# tree), all at 3 CTAs/SM but main; no FlashInfer.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0a ZIPKV_WITH_CUDA=1 PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
ROOT=$PWD; export ZIPKV_REAL_KV=$ROOT/.box/data/real_kv.pt
for t in $ROOT $ROOT/.box/base $ROOT/.box/compOnly; do
  ( cd $t && MAX_JOBS=5 python3 setup.py build_ext --inplace -j 5 > build.log 2>&1; echo "$t build rc=$? $SECONDS s" ) &
done
wait
X=/tmp/site-x
CASES=smollm2:8192:64,smollm2:2048:32,smollm2:2048:128,smollm2:8192:16,smollm2:32768:8
b() { (cd $1 && PYTHONPATH=$PWD:$X timeout 100 python3 benchmarks/bench_decode.py --no-flashinfer --out /tmp/$2 --iters 60 --cases $CASES 2>&1 | grep -v wrote | tail -5; cp /tmp/$2/bench_decode.json "$OUT/bench_decode_$2.json"; echo "$2 done $SECONDS s") }
b $ROOT/.box/base base; b $ROOT/.box/compOnly comp; b $ROOT pairs; b $ROOT/.box/base base2; b $ROOT/.box/compOnly comp2; b $ROOT pairs2
echo "all $SECONDS s"
