#!/usr/bin/env bash
# Format v5 on the H200 box, 2026-12-02 (torch 2.11.0+cu130): commit a829b2a against v4 (commit 621e3e3, unpacked
# with `git archive` into .box/int), each built in place in its own tree. Three calls on fresh machines.
# -> bench_decode_h200.json (v5; kept as bench_decode_v17_h200.json), bench_decode_v4_h200.json (v4, the same call), bench_format_h200.json (v5),
#    gpu_h200/tests_v5.log (v5's GPU tests).
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a ZIPKV_WITH_CUDA=1 PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/zipkv-site .box/wheels/*.whl 2>/dev/null
ROOT=$PWD; export ZIPKV_REAL_KV=$ROOT/.box/data/real_kv.pt
( python3 setup.py build_ext --inplace -j 16 > /tmp/build_v5.log 2>&1; echo "v5 build rc=$?" ) &
( cd .box/int && python3 setup.py build_ext --inplace -j 16 > /tmp/build_v4.log 2>&1; echo "v4 build rc=$?" ) &
wait
V5="$ROOT:/tmp/site-x:/tmp/zipkv-site"; V4="$ROOT/.box/int:/tmp/site-x:/tmp/zipkv-site"

# call 1: v5's GPU tests
PYTHONPATH=$V5 timeout 150 python3 -m pytest -q -p no:cacheprovider -k "cuda or decode or format or adversarial or meta_tag" test 2>&1 | tee "$OUT/tests_v5.log" | tail -4

# call 2: the decode grid with v5, then with v4; the storage kernels with v5
PYTHONPATH=$V5 timeout 200 python3 benchmarks/bench_decode.py --out /tmp/v5 --iters 60 2>&1 | tee "$OUT/bench_decode_v5.log" | tail -9
(cd .box/int && PYTHONPATH=$V4 timeout 200 python3 benchmarks/bench_decode.py --out /tmp/v4 --iters 60 2>&1 | tee "$OUT/bench_decode_v4.log" | tail -9)
PYTHONPATH=$V5 timeout 90 python3 benchmarks/bench_format.py --out /tmp/f5 2>&1 | tee "$OUT/bench_format_v5.log" | tail -4
cp /tmp/v5/bench_decode.json "$OUT/bench_decode_h200.json"; cp /tmp/v4/bench_decode.json "$OUT/bench_decode_v4_h200.json"
cp /tmp/f5/bench_format.json "$OUT/bench_format_h200.json"

# call 3, commit 9f3d32d (decode v18: d 64's block tables planned into the tile record), against v4 again:
# -> bench_decode_v18_h200.json, bench_decode_v18_v4_h200.json, gpu_h200/tests_v18.log
CASES=smollm2:8192:64,llama:8192:64,llama:2048:32
PYTHONPATH=$V5 timeout 120 python3 -m pytest -q -p no:cacheprovider test/test_decode_cuda.py test/test_adversarial_format.py test/test_decode.py test/test_meta_tag.py 2>&1 | tee "$OUT/tests_v18.log" | tail -3
PYTHONPATH=$V5 timeout 100 python3 benchmarks/bench_decode.py --out /tmp/v5 --iters 60 --cases $CASES 2>&1 | tee "$OUT/bench_decode_v18.log" | tail -4
(cd .box/int && PYTHONPATH=$V4 timeout 100 python3 benchmarks/bench_decode.py --out /tmp/v4 --iters 60 --cases $CASES 2>&1 | tee "$OUT/bench_decode_v4.log" | tail -4)
cp /tmp/v5/bench_decode.json "$OUT/bench_decode_v18_h200.json"; cp /tmp/v4/bench_decode.json "$OUT/bench_decode_v18_v4_h200.json"
