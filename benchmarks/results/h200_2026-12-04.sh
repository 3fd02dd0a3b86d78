#!/usr/bin/env bash
# The H200 box, 2026-12-04: the ten calls behind bench_prefill_h200.json, bench_projections_h200.json,
# bench_e2e_h200.json, bench_prefix_h200.json and tests_h200/test_gpu_files.log, test_prefill_engine.log,
# test_prefill_kernels.log, test_decode_engine_multi.log, test_refactor.log, test_prefill_tiles.log, and
# bench_shared_decode_h200.json, bench_prefill_tiles_h200.json.
# Each call ran one of the scripts below as .box/runN.sh, with carry [".box"] (box.sh, the FlashInfer wheels, and
# .box/data/real_kv.pt from `python benchmarks/dump_real_kv.py --out .box/data/real_kv.pt`).
#   call 1 (c3b3c75): run1.sh   the GPU test files (307 passed; test_compile.py not collected: no expecttest on the box),
#                               bench_prefill --quick (superseded by call 2), bench_projections
#   call 2 (24a4ee4): run2.sh   paged_prefill and engine GPU tests after the plan change (106 passed), bench_prefill
#   call 3 (7db25d8): run3.sh   bench_e2e at 48GiB (the free-budget jobs ran out of memory: fixed in 00d375a), bench_prefix --quick
#                               (bench_prefix_quick_h200.json, in git history; superseded by calls 5 and 6)
#   call 4 (00d375a): E2E_BUDGETS=free E2E_LIMIT=190 PREFIX_LIMIT=0 bash run3.sh
#   call 5 (5bd754c): WORKLOADS=shared PREFIX_LIMIT=540 bash run4.sh   bench_prefix at full size, the shared prompt
#   call 6 (5bd754c): WORKLOADS=chat PREFIX_LIMIT=540 bash run4.sh     bench_prefix at full size, the chat (a freshly
#                               started box, rebuilt); the two merged into bench_prefix_h200.json
#   call 7 (74f6f6f): run5.sh   paged_prefill's short queries on the decode kernel: the prefill, error and decode GPU
#                               tests (test_prefill_kernels.log: 202 passed, test_compile.py not collected; and
#                               test_decode_engine_multi.log: 90 passed, 1 skipped), bench_prefill --cases speculative
#                               (cut by its timeout after 5 of 6 cases; superseded by call 8)
#   call 8 (708c588): COMMIT=708c588 bash run6.sh   bench_prefill --cases speculative: its cases replace the
#                               speculative rows of bench_prefill_h200.json (the file's note)
#   call 9 (68acd80): COMMIT=68acd80 bash run7.sh   bench_shared_decode (bench_shared_decode_h200.json), then the
#                               prefill, decode and error GPU tests (test_refactor.log: 287 passed)
#   call 10 (7caf12a): COMMIT=7caf12a TESTK="tiles or long or window or cap or pages or real or graph or bad or plan"
#                               BENCH_ARGS=--quick bash run8.sh   the pipelined tile kernel: its paged_prefill GPU tests
#                               (test_prefill_tiles.log: 109 passed), bench_prefill --cases chunked --quick
#                               (bench_prefill_tiles_h200.json)

# ---- .box/run1.sh
# build; the GPU tests of paged_prefill, the engine (compiled, prefix caching), decode and transformers; then
# bench_prefill --quick and bench_projections.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
bash .box/box.sh build || exit 1
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
timeout ${TEST_LIMIT:-260} python3 -m pytest -q -p no:cacheprovider -n 6 -rfE --maxfail=300 \
  test/test_paged_prefill_cuda.py test/test_engine_cuda.py test/test_engine_compile.py test/test_decode_cuda.py \
  test/test_cuda.py test/test_errors.py test/test_hf.py test/test_compile.py test/test_hf_compiled_loop.py \
  2>&1 | tee "$OUT/test_gpu.log" | grep -v "^\s*$" | tail -60
echo "tests done at $SECONDS s"
timeout 120 python3 benchmarks/bench_prefill.py --quick --out "$OUT" 2>&1 | tee "$OUT/bench_prefill.log" | tail -25
timeout 90 python3 benchmarks/bench_projections.py --out "$OUT" 2>&1 | tee "$OUT/bench_projections.log" | tail -12
echo "all $SECONDS s"

# ---- .box/run2.sh
# build; paged_prefill's GPU tests and the engine's; bench_prefill (all cases).
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
bash .box/box.sh build || exit 1
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
timeout 150 python3 -m pytest -q -p no:cacheprovider -n 6 -rfE --maxfail=50 \
  test/test_paged_prefill_cuda.py test/test_engine_cuda.py test/test_hf.py -k "prefill or cuda or Prefill" \
  2>&1 | tee "$OUT/test_gpu.log" | grep -v "^\s*$\|Warning\|warner" | tail -30
echo "tests done at $SECONDS s"
timeout ${PREFILL_LIMIT:-260} python3 benchmarks/bench_prefill.py ${PREFILL_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench_prefill.log" | tail -30
echo "all $SECONDS s"

# ---- .box/run3.sh
# build; bench_e2e (compressed and raw engines, 48 GiB and the free budget: batch 32, the largest batch, 4 x 8K
# prefills), then bench_prefix --quick.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/e2e" "$OUT/prefix"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt ZIPKV_COMMIT=$(git rev-parse HEAD)
bash .box/box.sh build >/dev/null || exit 1
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
python3 benchmarks/bench_e2e.py --out "$OUT/e2e" --budgets ${E2E_BUDGETS:-48GiB free} --batches 32 --systems zipkv raw \
  --time-limit ${E2E_LIMIT:-330} 2>&1 | tee "$OUT/e2e/bench_e2e.log" | grep -v "^\s*$\|Warning\|warn" | tail -40
echo "e2e done at $SECONDS s"
[ "${PREFIX_LIMIT:-210}" = 0 ] || python3 benchmarks/bench_prefix.py --quick --out "$OUT/prefix" --time-limit ${PREFIX_LIMIT:-210} 2>&1 \
  | tee "$OUT/prefix/bench_prefix.log" | grep -v "^\s*$\|Warning\|warn" | tail -30
echo "all $SECONDS s"

# ---- .box/run4.sh
# build; bench_prefix at full size for the workloads in $WORKLOADS (default: shared), every system, each job in its
# own process, into $OUT/prefix.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/prefix"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_COMMIT=${ZIPKV_COMMIT:-5bd754c}
bash .box/box.sh build >/dev/null || exit 1
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
python3 benchmarks/bench_prefix.py --out "$OUT/prefix" --workloads ${WORKLOADS:-shared} \
  --time-limit ${PREFIX_LIMIT:-540} 2>&1 | tee "$OUT/prefix/bench_prefix.log" | grep -v "^\s*$\|Warning\|warn" | tail -40
echo "all $SECONDS s"

# ---- .box/run5.sh
# build; the GPU tests of paged_prefill (both kernels), decode and the engine; bench_prefill's speculative cases.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/tests"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
bash .box/box.sh build >/dev/null || { tail -60 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
timeout ${T1:-230} python3 -m pytest test/test_paged_prefill_cuda.py test/test_errors.py test/test_compile.py -q \
  -p no:cacheprovider -n 8 -rfE 2>&1 | tee "$OUT/tests/prefill.log" | grep -v "Warn\|warn" | tail -30
echo "prefill tests at $SECONDS s"
timeout ${T2:-150} python3 -m pytest test/test_decode_cuda.py test/test_engine_cuda.py -q -p no:cacheprovider -n 8 \
  -rfE 2>&1 | tee "$OUT/tests/decode.log" | grep -v "Warn\|warn" | tail -12
echo "decode tests at $SECONDS s"
timeout ${T3:-170} python3 benchmarks/bench_prefill.py --out "$OUT" --cases speculative --iters ${ITERS:-20} 2>&1 \
  | tee "$OUT/bench_prefill.log" | grep -v "Warn\|warn" | tail -16
echo "all $SECONDS s"

# ---- .box/run6.sh
# build; bench_prefill's speculative cases (q_len 2, 4, 8 over 8K, batch 32 and 64) with FlashInfer in the same run.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}
export PYTHONUNBUFFERED=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt ZIPKV_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "$COMMIT")
bash .box/box.sh build >/dev/null || { tail -60 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
timeout ${T3:-400} python3 benchmarks/bench_prefill.py --out "$OUT" --cases speculative --iters ${ITERS:-20} 2>&1 \
  | tee "$OUT/bench_prefill.log" | grep -v "Warn\|warn" | tail -16
echo "all $SECONDS s"

# ---- .box/run7.sh
# build; paged_prefill's and decode's GPU tests after the Params/search refactor; bench_shared_decode.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/tests"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2 ZIPKV_COMMIT=$COMMIT
bash .box/box.sh build >/dev/null || { tail -60 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
timeout 60 python3 benchmarks/bench_shared_decode.py --out "$OUT" --iters 20 2>&1 | tee "$OUT/bench_shared_decode.log" \
  | grep -v "Warn\|warn" | tail -8
echo "bench at $SECONDS s"
timeout 120 python3 -m pytest test/test_paged_prefill_cuda.py test/test_decode_cuda.py test/test_errors.py -q \
  -p no:cacheprovider -n 8 -rfE 2>&1 | tee "$OUT/tests/refactor.log" | grep -v "Warn\|warn" | tail -12
echo "all $SECONDS s"

# ---- .box/run8.sh
# build; paged_prefill's GPU tests (the pipelined tile kernel); bench_prefill's chunked cases with FlashInfer.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/tests"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2 ZIPKV_COMMIT=$COMMIT
bash .box/box.sh build >/dev/null || { tail -60 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
timeout ${T1:-150} python3 -m pytest test/test_paged_prefill_cuda.py -q -x -p no:cacheprovider -n 8 -rfE ${TESTK:+-k "$TESTK"} 2>&1 \
  | tee "$OUT/tests/prefill.log" | grep -v "Warn\|warn" | tail -25
echo "tests at $SECONDS s"
timeout ${T2:-200} python3 benchmarks/bench_prefill.py --out "$OUT" --cases chunked --iters ${ITERS:-10} ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench_prefill.log" | grep -v "Warn\|warn" | tail -16
echo "all $SECONDS s"
