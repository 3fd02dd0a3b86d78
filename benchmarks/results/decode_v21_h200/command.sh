# H200, 2026-12-03. Decode v21 = commit 06c1a6c (the measured tree differed only in comments); main = 7200f27;
# version 4 = 621e3e3. The trees sit in .box/ (.box/base, .box/v4) beside this one; carried with carry ['.box'].
# Records: ../bench_decode_h200.json (v21 with FlashInfer, same process), bench_decode_v18_main.json,
# bench_decode_v4.json, bench_decode_v21_smollm2.json (second v21 process), tests_v21.log.
#!/usr/bin/env bash
# Decode v21 (d 64: pairs of all-compressed tiles, 3 CTAs/SM): the full grid against FlashInfer (this tree); main
# (.box/base) on the same grid and version 4 (.box/v4, 621e3e3) on SmolLM2 8K x 64 without FlashInfer; GPU tests.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export TORCH_CUDA_ARCH_LIST=9.0a ZIPKV_WITH_CUDA=1 PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/zipkv-site .box/wheels/*.whl 2>/dev/null
ROOT=$PWD; export ZIPKV_REAL_KV=$ROOT/.box/data/real_kv.pt
for t in $ROOT $ROOT/.box/base $ROOT/.box/v4; do
  ( cd $t && MAX_JOBS=5 python3 setup.py build_ext --inplace -j 5 > build.log 2>&1; echo "$t build rc=$? $SECONDS s" ) &
done
wait
X=/tmp/site-x:/tmp/zipkv-site
( cd $ROOT && PYTHONPATH=$ROOT:$X timeout 330 python3 benchmarks/bench_decode.py --out /tmp/v21 --iters 60 2>&1 | grep -v wrote | tail -9; cp /tmp/v21/bench_decode.json "$OUT/bench_decode_h200.json"; echo "v21 done $SECONDS s" )
( cd .box/base && PYTHONPATH=$PWD:$X timeout 100 python3 benchmarks/bench_decode.py --no-flashinfer --out /tmp/v18 --iters 60 2>&1 | grep -v wrote | tail -8; cp /tmp/v18/bench_decode.json "$OUT/bench_decode_v18_main.json"; echo "main done $SECONDS s" )
( cd .box/v4 && PYTHONPATH=$PWD:$X timeout 60 python3 benchmarks/bench_decode.py --no-flashinfer --out /tmp/v4 --iters 60 --cases smollm2:8192:64,smollm2:2048:32 2>&1 | grep -v wrote | tail -3; cp /tmp/v4/bench_decode.json "$OUT/bench_decode_v4.json"; echo "v4 done $SECONDS s" )
( cd $ROOT && PYTHONPATH=$ROOT:$X timeout 60 python3 benchmarks/bench_decode.py --no-flashinfer --out /tmp/v21b --iters 60 --cases smollm2:8192:64,smollm2:2048:32 2>&1 | grep -v wrote | tail -3; cp /tmp/v21b/bench_decode.json "$OUT/bench_decode_v21_smollm2.json"; echo "v21 again done $SECONDS s" )
PYTHONPATH=$ROOT:$X timeout 120 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py test/test_cuda.py 2>&1 | tee "$OUT/tests_v21.log" | tail -3
echo "all $SECONDS s"
