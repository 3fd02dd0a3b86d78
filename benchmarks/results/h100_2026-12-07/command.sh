#!/usr/bin/env bash
# The GPU box, 2026-12-07 (torch 2.11.0+cu130). Each call ran one script below as .box/runN.sh with carry [".box"]
# (box.sh and the FlashInfer wheels from ../shared, .box/data/real_kv.pt from
# `python benchmarks/dump_real_kv.py --out .box/data/real_kv.pt`).
#   00:25-01:28 UTC: nine calls got no machine (about 750 s of the 1,800 s budget went to failed starts)
#   call 1 (91402de: the producer warpgroup), kind left out, an H100 80GB HBM3: COMMIT=91402de LIMIT=520 bash run39.sh
#                     -> nothing measured: every paged_prefill launch hung (the tests and the benchmark ran into
#                     their timeouts, and so did the probe builds). Cause: the budgets 216 + 80 registers a thread
#                     ask setmaxnreg for 64,768 where the CTA was given 384 x 168 = 64,512 at launch, so the compute
#                     warps' setmaxnreg.inc waited forever. Fixed in f2af5c9 (216 + 72; a static_assert now checks
#                     against the launch registers, not the register file).
#   01:40-01:55 UTC: two more calls got no machine; then 251 s of the budget were left, too little to start one, so
#                     f2af5c9 was never run, and main reverts both commits (580b41a) so that its GPU path stays the
#                     one measured and tested. The lean rebuild (b5eafe0) and the probe builds (2519f9d) followed
#                     offline and are reverted too (ff7df29). To measure all of it in one call (about 8 min on an
#                     H100): make the three patches as run41.sh's header says, then COMMIT=<hash> bash run41.sh; then
#                     the engine tests on whichever is kept.
# Offline (nvcc 13.0, sm_90a, nvdisasm 13.2 from PyPI's nvidia-cuda-nvdisasm): the d-128 producer's rebuild, static
# SASS lines from its cp.async wait to its next copy: f2af5c9 444 (a loop of 2 blocks a turn, 4 turns); with its
# address arithmetic in unsigned ints (shifts with no sign fix-ups) 356; b5eafe0 (that, and the warp's 8 blocks in one
# unrolled line with constant span offsets) 577 for all 8 blocks, ~50 instructions on a compressed block's path where
# f2af5c9 took ~120. No spills at any head dim. The span offsets were checked against tile_offset for every lane, block
# and head dim by a Python model of both.
# ---- .box/run39.sh (its .box/probe.patch: 2519f9d's macros, on 91402de's rebuild loop)
# Producer warpgroup + mbarrier ring (91402de): CUDA prefill tests, bench_prefill --quick with FlashInfer, then probe
# builds (.box/probe.patch: 1 = the producer rebuilds nothing, 2 = the compute warps multiply nothing), then the
# engine and decode CUDA tests.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/tests"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2 ZIPKV_COMMIT=$COMMIT
rm -rf build torch_zipkv/_C*.so; bash .box/box.sh build >/dev/null || { tail -60 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
echo "built at $SECONDS s"
timeout 120 python3 -m pytest test/test_paged_prefill_cuda.py -q -x -p no:cacheprovider -n 8 -rfE 2>&1 \
  | tee "$OUT/tests/prefill.log" | grep -v "Warn\|warn" | tail -12
echo "prefill tests rc=${PIPESTATUS[0]} at $SECONDS s"
timeout 150 python3 benchmarks/bench_prefill.py --out "$OUT" --quick 2>&1 | tee "$OUT/bench_prefill.log" | grep -v "Warn\|warn" | tail -8
echo "bench at $SECONDS s"
git apply .box/probe.patch || exit 1
for pr in 1 2; do
  touch csrc/cuda/paged_prefill.cuh
  NVCC_APPEND_FLAGS="-DZIPKV_PREFILL_PROBE=$pr" bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; break; }
  echo "probe $pr built at $SECONDS s"
  timeout 60 python3 .box/probe_prefill.py probe$pr "$OUT/probe$pr.json" 2>&1 | grep probe
done
git checkout csrc/cuda/paged_prefill.cuh; touch csrc/cuda/paged_prefill.cuh
bash .box/box.sh build >/dev/null; echo "rebuilt at $SECONDS s"
timeout $((${LIMIT:-500} - SECONDS)) python3 -m pytest test/test_engine_cuda.py test/test_decode_cuda.py -q -p no:cacheprovider -n 8 -rfE 2>&1 \
  | tee "$OUT/tests/engine_decode.log" | grep -v "Warn\|warn" | tail -6
echo "all $SECONDS s"
# ---- .box/run41.sh: call 2 (2026-12-07, 02:45 UTC), kind nvidia-h100-x1, an H100 80GB HBM3, on 594c920:
#   COMMIT=594c920 OUT=$OUT timeout 570 bash .box/run41.sh  (302 s)
#   -> producer (f2af5c9): 71 prefill tests pass; bench_prefill --quick (bench_prefill_producer.json): 512 x 8K x 1
#      481.6 us against FlashInfer's 128.9 (0.268x; main 309 us), batch 8 3,651 against 927 (0.254x), raw 0.283x.
#      lean (b5eafe0): tests pass; 399.2 us (raw 378.1), batch 8 2,990. probe1 (the producer rebuilds nothing):
#      303.8 us; probe2 (the compute warps multiply nothing): 309.5 us (probe_prefill_producer.json). Both sides of
#      the split run alone at about main's whole time, and together at 1.3x it: not kept.
# One call for the prefill experiments, on main (their code reverted in ff7df29) with three patches made here first:
#   git diff ff7df29 f2af5c9 -- csrc > .box/producer.patch   # the producer warpgroup
#   git diff ff7df29 b5eafe0 -- csrc > .box/lean.patch       # the same with the lean rebuild
#   git diff b5eafe0 2519f9d -- csrc > .box/probe.patch      # probe builds, on top of lean.patch
# producer: a CUDA prefill test subset and bench_prefill --quick with FlashInfer; lean: the same tests and zipkv's
# times (probe_prefill.py); then, time allowing, the probe builds (1: the producer rebuilds nothing; 2: the compute
# warps multiply nothing). About 8 min on an H100.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/tests"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2 ZIPKV_COMMIT=$COMMIT
export PYTHONPATH=/tmp/zipkv-site:$PWD
SUBSET="mixed_pages or long_queries or real_kv or bad_device or larger_pages"
rm -rf build torch_zipkv/_C*.so
for variant in producer lean probe1 probe2; do
  [ $SECONDS -lt 430 ] || break
  git checkout -q csrc; rm -f csrc/cuda/mbarrier.cuh
  case $variant in
    producer) git apply .box/producer.patch; flags="" ;;
    lean) git apply .box/lean.patch; flags="" ;;
    probe*) git apply .box/lean.patch .box/probe.patch; flags="-DZIPKV_PREFILL_PROBE=${variant#probe}" ;;
  esac
  touch csrc/cuda/paged_prefill.cuh
  NVCC_APPEND_FLAGS="$flags" bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; break; }
  echo "$variant built at $SECONDS s"
  if [ "$flags" = "" ]; then
    timeout 80 python3 -m pytest test/test_paged_prefill_cuda.py -q -x -p no:cacheprovider -n 8 -rfE -k "$SUBSET" 2>&1 \
      | tee "$OUT/tests/prefill_$variant.log" | grep -v "Warn\|warn" | tail -4
    [ "${PIPESTATUS[0]}" = 0 ] || { echo "$variant: prefill tests failed at $SECONDS s"; continue; }
  fi
  if [ $variant = producer ]; then
    timeout 150 python3 benchmarks/bench_prefill.py --out "$OUT" --quick 2>&1 | tee "$OUT/bench_prefill.log" \
      | grep -v "Warn\|warn" | tail -6
  else
    timeout 60 python3 benchmarks/results/h100_2026-12-07/probe_prefill.py $variant "$OUT/$variant.json" 2>&1 | grep "^$variant"
  fi
  echo "$variant at $SECONDS s"
done
git checkout -q csrc; rm -f csrc/cuda/mbarrier.cuh
# probe_prefill.py lies beside this file.
# ---- .box/run42.sh: call 3, 02:57 UTC, kind nvidia-h200 (an H100 80GB HBM3 came), on 08f7e2f (branch
# exp/prefill-probes-3: main's kernel with ZIPKV_PREFILL_PROBE chosen at launch; bits 1 no rebuild, 2 no copies, 4 no
# MMA or softmax, 8 a third staging buffer; Q unpadded at d 128):  OUT=$OUT timeout 560 bash .box/run42.sh  (220 s)
#   -> probe_main_kernel.json; 512 x 8K x 1, real-like (raw), FlashInfer 130 us in the same run:
#      all 313.9 (293.9); a third stage 317.3; no rebuild 229.2; no copies 249.8; neither (MMA, softmax, barriers):
#      199.0; no MMA or softmax (copies and rebuild): 173.1. Batch 8: 2,330 / 2,375 / 1,743 / 1,897 / 1,448 / 1,318.
#      Tests (subset, 71) pass at probes 0 and 8.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
SUBSET="mixed_pages or long_queries or real_kv or bad_device or larger_pages"
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
for pr in 0 8; do
  ZIPKV_PREFILL_PROBE=$pr timeout 80 python3 -m pytest test/test_paged_prefill_cuda.py -q -x -p no:cacheprovider -n 8 -rfE \
    -k "$SUBSET" 2>&1 | tee "$OUT/tests_probe$pr.log" | grep -v "Warn\|warn" | tail -3
done
timeout 300 python3 .box/probe3.py "$OUT/probe3.json" 0 8 3 11 1 9 4 12 2 2>&1 | grep -v "Warn\|warn" | tail -30
# ---- .box/run43.sh: call 4, 03:33 UTC, kind left out, an H100 80GB HBM3, on c0bb123 (branch exp/prefill-probes-3,
# merged into main's history by 72f3755; bit 16 the lean rebuild at every head_dim, bit 32 the warpgroups half a step
# apart at d 128): OUT=$OUT LIMIT=330 timeout 345 bash .box/run43.sh  (208 s)
#   -> probe_lean_pingpong.json; 512 x 8K x 1 real-like (raw), FlashInfer 130.3-130.8 us in the same run: main 316.1
#      (294.6); lean 289.3 (271.8); lean + half a step apart 274.6 (259.9), 0.475x (0.502x); half a step apart with the
#      old rebuild 386.5 (it spills 20 bytes); half a step apart without rebuild or copies 219.2 (199.0 in step, call
#      3). Batch 8: 2,341 / 2,142 / 2,067 (0.449x) / 2,799 / 1,503, FlashInfer 922-930. test_paged_prefill_cuda.py:
#      168 passed with 16 and with 48. 48 is main's kernel since (the same SASS but for 8 of 7,800 instructions).
#   03:05-03:32 UTC: five calls got no machine (about 780 s); 263 s of the budget were left after call 4.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
SUBSET="mixed_pages or long_queries or real_kv or bad_device or larger_pages"
LIMIT=${LIMIT:-370}
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
for pr in 48 16; do
  ZIPKV_PREFILL_PROBE=$pr timeout 60 python3 -m pytest test/test_paged_prefill_cuda.py -q -x -p no:cacheprovider -n 8 -rfE \
    -k "$SUBSET" 2>&1 | grep -v "Warn\|warn" | tail -2
done
timeout 120 python3 .box/probe3.py "$OUT/probe3b.json" 0 16 48 32 35 2>&1 | grep -v "Warn\|warn" | tail -12
for pr in 16 48; do
  left=$((LIMIT - SECONDS)); [ $left -gt 30 ] || break
  ZIPKV_PREFILL_PROBE=$pr timeout $left python3 -m pytest test/test_paged_prefill_cuda.py -q -p no:cacheprovider -n 8 -rfE \
    2>&1 | tee "$OUT/tests_full_probe$pr.log" | grep -v "Warn\|warn" | tail -3
done
# probe3.py lies beside this file.
# ---- .box/run45.sh: call 5, 04:40 UTC (later the same day; two calls before it got no machine,
# 04:29 and 04:31), kind left out, an H100 80GB HBM3, on ab5c7a7 (branch exp/prefill-probes-4, merged into main's
# history): main's kernel with probe builds chosen at launch (d 128, no soft cap; ZIPKV_PREFILL_PROBE bits 1 no
# rebuild, 2 no copies, 4 no softmax, 8 no P V, 16 no S, 32 no barrier, 64 the warpgroups in step, 128 the planner's
# three idle warps start the copies, 256 sixteen warps: eight of them copy and rebuild while the compute warps only
# multiply, one barrier a step). Probe 0's SASS is main's kernel's, instruction for instruction.
#   git checkout ab5c7a7 && OUT=$OUT timeout 570 bash .box/run45.sh   (274 s; .box/probe3.py = probe3.py here,
#   .box/ncu_prefill.py = ../h100_2026-12-06/ncu_prefill.py)
#   -> test_prefill_engine_landed.log (test_paged_prefill_cuda.py and test_engine_cuda.py on main's kernel: 175
#      passed, 1 skipped); probe_split.json (512 x 8K x 1 real-like, FlashInfer 128.3-129.7 us in the same run: main
#      290.0; 128 329.9; 3 210.5; 7 196.7; 11 201.4; 19 206.5; 35 260.3; 67 199.3; 99 268.8; 64 287.3; 12 197.6;
#      1 214.7; 2 246.4; batch 8 alike); the subset of 71 prefill tests passes with 128 and with 256;
#      probe_split_16warps.json (0 287.8; 256 354.2; 259 215.7; 284 250.5); ncu_stalls.md (the landed kernel's
#      profile, summarized from the SASS source page: the report itself is not kept).
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
SUBSET="mixed_pages or long_queries or real_kv or bad_device or larger_pages"
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
echo "built at $SECONDS s"
timeout 90 python3 -m pytest test/test_paged_prefill_cuda.py test/test_engine_cuda.py -q -p no:cacheprovider -n 8 -rfE \
  2>&1 | tee "$OUT/tests.log" | grep -v "Warn\|warn" | tail -3
ZIPKV_PREFILL_PROBE=128 timeout 45 python3 -m pytest test/test_paged_prefill_cuda.py -q -p no:cacheprovider -n 8 -rfE \
  -k "$SUBSET" 2>&1 | grep -v "Warn\|warn" | tail -2
echo "tested at $SECONDS s"
timeout 150 python3 .box/probe3.py "$OUT/probe4.json" 0 128 3 7 11 19 35 67 99 64 12 1 2 2>&1 | grep -v "Warn\|warn" | tail -26
echo "timed at $SECONDS s"
ZIPKV_PREFILL_PROBE=256 timeout 45 python3 -m pytest test/test_paged_prefill_cuda.py -q -p no:cacheprovider -n 8 -rfE \
  -k "$SUBSET" 2>&1 | grep -v "Warn\|warn" | tail -2
[ "${PIPESTATUS[0]}" = 0 ] && timeout 60 python3 .box/probe3.py "$OUT/probe4_split.json" 0 256 259 284 2>&1 \
  | grep -v "Warn\|warn" | tail -8
echo "split at $SECONDS s"
timeout 120 ncu --clock-control none --set full --import-source no -k regex:paged_prefill -s 2 -c 1 -o $OUT/prefill \
  python3 .box/ncu_prefill.py > $OUT/ncu.log 2>&1; tail -2 $OUT/ncu.log
ncu -i $OUT/prefill.ncu-rep --page details > $OUT/details.txt 2>&1
ncu -i $OUT/prefill.ncu-rep --page source --csv --print-source sass > $OUT/sass.csv 2>&1
grep -i "duration\|Warp Cycles Per Issued\|Issue Slots Busy\|Eligible" $OUT/details.txt | head -12
rm -f "$OUT/gpu.txt" "$OUT/prefill.ncu-rep"
echo "all $SECONDS s"
# 04:47-05:36 UTC: six asks got no machine (five failed starts and one refused ask, about 930 s of the budget): the
# planned call of cb56caf's probes 512 and 1024 with issue 31's saturating load beside them (run47.sh, then run48.sh
# cut to fit) never ran, so issue 31's measurement (run37.sh in ../h100_2026-12-06/command.sh) is still to be made.
# ---- .box/run49.sh: call 6, 05:48 UTC, kind left out, an H100 80GB HBM3, 296 s of the budget left, on 131c7a5
# (branch port/prefill-copier, merged into main's history): the planner warpgroup plans and copies at d 128, its SASS
# that of cb56caf's probe 1024 but for two no-op cp.async waits. LIMIT=225 OUT=$OUT timeout 240 bash .box/run49.sh
# (150 s)
#   -> test_prefill_engine_copier_port.log: 14 failed, 161 passed, 1 skipped. Every failure is NaN output from a CTA
#      of 7 or more chunks (long queries, sliding windows, CUDA Graph replay, a d-128 speculative case): planner warp
#      2's meta phase ran in step 0 for chunk 6, whose words the prologue had loaded, from a page id never loaded, so
#      chunk 6's blocks were refused. planner_schedule_model.py (here) reproduces it at every chunk count >= 7 and
#      finds none with the fix (fcf9830 on the same branch; f6cc75a for the probe branch). The timing (probe3.py, probe
#      0 only) returned nothing: it compares against FlashInfer and stops on the NaN output.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 40 python3 .box/probe3.py "$OUT/probe6.json" 0 2>&1 | grep -v "Warn\|warn" | tail -3
echo "timed at $SECONDS s"
timeout $((${LIMIT:-235} - SECONDS)) python3 -m pytest test/test_paged_prefill_cuda.py test/test_engine_cuda.py -q \
  -p no:cacheprovider -n 8 -rfE 2>&1 | tee "$OUT/tests.log" | grep -v "Warn\|warn" | tail -4
echo "all $SECONDS s"
# ---- .box/run50.sh: its timing ran as call 10 (below, 07:41 UTC, on the machine of call 7), without the tests of
# probe 1024. On f6cc75a (branch exp/prefill-planners: main's kernel with the probe builds of ab5c7a7 plus 512, the
# planner spread over its warpgroup's four warps, and 1024, those warps copying too; fixed as fcf9830): the subset of
# prefill tests on 1024, then 512 x 8K x 1 and x 8 timed for main's kernel (0), 512, 1024 and 515 (512 without
# rebuild or copies: the floor once the planner is spread) with FlashInfer in the same run. Predicted: 515 well under
# 200 us; 1024 290 -> ~250 us.
#   git checkout f6cc75a && OUT=$OUT timeout 300 bash .box/run50.sh
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
SUBSET="mixed_pages or long_queries or real_kv or bad_device or larger_pages or sliding_window or graph"
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
ZIPKV_PREFILL_PROBE=1024 timeout 60 python3 -m pytest test/test_paged_prefill_cuda.py -q -p no:cacheprovider -n 8 -rfE \
  -k "$SUBSET" 2>&1 | tee "$OUT/tests_probe1024.log" | grep -v "Warn\|warn" | tail -2
echo "tested at $SECONDS s"
timeout 90 python3 .box/probe3.py "$OUT/probe_planners.json" 0 512 1024 515 2>&1 | grep -v "Warn\|warn" | tail -8
echo "all $SECONDS s"
# 06:41-07:17 UTC: six asks got no machine (five failed starts, one refused ask: 736 s of the
# 1,800 s budget).
# ---- .box/run51.sh: call 7, 07:28 UTC, kind left out, an H100 80GB HBM3, on 677fd19 (the tip of port/prefill-copier):
# its CUDA prefill and engine tests in full, 512 x 8K x 1 and x 8 against FlashInfer in the same run, then issue 31's
# saturating shared-prompt load with the engine's reclaim on and off (a1907b7's crumb rule is in this tree), in what
# is left of LIMIT:
#   git checkout 677fd19 && COMMIT=677fd19 LIMIT=560 OUT=$OUT timeout 580 bash .box/run51.sh   (561 s)
#   -> test_prefill_engine_copier_port_fixed.log: 175 passed, 1 skipped (the fix holds). The timing returned nothing:
#      probe3.py's first run on a fresh machine took 81 s (call 8), past its 40 s timeout. bench_prefix_saturating_
#      677fd19.json: zipkv+cache+reclaim 4,729 tok/s, TTFT p50 15.4 s; zipkv+cache 5,178 tok/s, 13.9 s (0.913x with
#      reclaim; call 30 of ../h100_2026-12-06 at 47b80fc: 0.906x); peaks 210 and 210; decode rows over steps
#      300-1,300 190.6 and 173.8 (1.10x; 1.10x at 47b80fc); host time in decode-only steps with a compression call:
#      compress 14.8 ms + reclaim 15.9 ms with reclaim on (11.8 + 20.5 at 47b80fc), compress 17.6 ms with it off
#      (14.5). raw+cache did not start before LIMIT. Both zipkv jobs ran the port's prefill kernel.
# Calls 8-10 on the same warm machine, each its command alone:
#   call 8, on 677fd19 (its build from call 7; a try before it without ZIPKV_REAL_KV stopped at once, 12 s, asking
#   for the SmolLM2 package that the probe's default data needs):
#     ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt python3 .box/probe3.py $OUT/probe_port.json 0   (81 s)
#     -> probe_port.json: 314.2 us against FlashInfer's 129.2 (0.411x); batch 8 2,302.8 against 917.3 (0.398x)
#   call 9, on main (9cc31e5), built over call 7's build folder (`bash .box/box.sh build`), then
#     python3 .box/probe3.py $OUT/probe_main_same_machine.json 0   (48 s)
#     -> main's kernel 291.9 against 129.1 (0.442x); batch 8 2,168.4 against 919.6 (0.424x)
#   call 10, on f6cc75a, built the same way, then
#     python3 .box/probe3.py $OUT/probe_planners.json 0 512 1024 515   (55 s)
#     -> probe_planners.json, batch 1 / batch 8 in us (FlashInfer 128.9-129.2 / 911.7-921.8): 0 292.4 / 2,163.3;
#        512 309.8 / 2,227.0; 1024 310.9 / 2,310.9; 515 165.9 / 1,246.5 (no rebuild: its output is not compared)
# Then 202 s of the budget were left: too little to start another machine.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT/sat"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD ZIPKV_COMMIT=$COMMIT
LIMIT=${LIMIT:-560}
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 100 python3 -m pytest test/test_paged_prefill_cuda.py test/test_engine_cuda.py -q -p no:cacheprovider -n 8 -rfE \
  2>&1 | tee "$OUT/tests.log" | grep -v "Warn\|warn" | tail -4
echo "tested at $SECONDS s"
timeout 40 python3 .box/probe3.py "$OUT/probe_port.json" 0 2>&1 | grep -v "Warn\|warn" | tail -3
echo "timed at $SECONDS s"
timeout $((LIMIT - SECONDS)) python3 benchmarks/bench_prefix.py --out "$OUT/sat" --workloads shared \
  --systems zipkv+cache+reclaim zipkv+cache raw+cache --rate 64 --requests 1024 --time-limit $((LIMIT - SECONDS - 5)) \
  2>&1 | grep --line-buffered "shared /\|    decode"
rm -f "$OUT"/*/*.png
echo "all $SECONDS s"
# Later the same day (08:36-09:10 UTC, one H100 80GB HBM3 each call, kind nvidia-h100-x1 unless said; 1,539 s of the
# 1,800 s budget): calls 11-19 below, every one of which got a machine.
# ---- .box/run52.sh: call 11, 08:37 UTC (241 s) -> the CUDA prefill and engine tests pass (191, 1 skipped;
# test_prefill_engine_32cols.log); q_len 8 x 32 at 1.144x zipkv's decode (319.3 against 279.2 us), 8 x 64 at 1.423x
# split 3 ways (789.9 against 555.1); q_len 2 and 4 1.05-1.14x (bench_prefill_speculative_32cols.json). Was:
# short queries of 17-32 rows in one slot of 32 (2a00620, branch
# exp/decode-32cols: four MMA N tiles in the decode kernel's kMulti variant at head_dim <= 128 and group >= 2, Q's
# fragments from shared memory, K and V rebuilt a block at a time; compiled offline with no spills at d 64, 12 bytes
# at d 128, 255 registers; the decode variants' SASS unchanged). Its CUDA prefill and engine tests in full, then the
# speculative cases with zipkv's own decode and FlashInfer in the same run. Predicted: q_len 8 from 2.33-2.38x zipkv's
# decode to ~1.2-1.4x (one pass over the pages for 32 rows, where two slots of 16 each made one; q_len 4 took 1.12x
# with two N tiles); q_len 2 and 4 unchanged. About 6-8 min on an H100:
#   git checkout 2a00620 && OUT=$OUT timeout 560 bash .box/run52.sh
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 150 python3 -m pytest test/test_paged_prefill_cuda.py test/test_engine_cuda.py -q -p no:cacheprovider -n 8 -rfE \
  2>&1 | tee "$OUT/tests.log" | grep -v "Warn\|warn" | tail -4
echo "tested at $SECONDS s"
timeout 300 python3 benchmarks/bench_prefill.py --out "$OUT" --cases speculative --iters 20 2>&1 | grep -v "Warn\|warn" \
  | tail -14
echo "all $SECONDS s"
# ---- .box/run53.sh: call 12, 08:41 UTC (92 s) -> ncu_planner_spread.md: instruction fetch, not issue slots. Was:
# why planning over four warps (probe 512, 309.8 us) is slower than one planner
# warp (292.4 us) when the rebuild runs, though it lowers the floor without it (165.9 against 210.5): Nsight Compute on
# f6cc75a's probes 0 and 512, the same target and sections as call 5. To compare: issue slots busy, the compute warps'
# stall reasons (no_instruction: instruction fetch; selected/not_selected: issue slots), their instructions a chunk.
# About 4 min on an H100 (.box/ncu_prefill.py = ../h100_2026-12-06/ncu_prefill.py):
#   git checkout f6cc75a && OUT=$OUT timeout 400 bash .box/run53.sh
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
for probe in 0 512; do
  ZIPKV_PREFILL_PROBE=$probe timeout 150 ncu --clock-control none --set full --import-source no -k regex:paged_prefill \
    -s 2 -c 1 -o $OUT/prefill_$probe python3 .box/ncu_prefill.py > $OUT/ncu_$probe.log 2>&1
  ncu -i $OUT/prefill_$probe.ncu-rep --page details > $OUT/details_$probe.txt 2>&1
  ncu -i $OUT/prefill_$probe.ncu-rep --page source --csv --print-source sass > $OUT/sass_$probe.csv 2>&1
  grep -i "duration\|Warp Cycles Per Issued\|Issue Slots Busy\|Eligible" $OUT/details_$probe.txt | head -6
  rm -f $OUT/prefill_$probe.ncu-rep
done
echo "all $SECONDS s"
# ---- .box/run54.sh: call 13, 08:43 UTC (52 s), on 169771c (branch exp/short-splits: ZIPKV_PROBE_SPLITS forces the
# short-query split count). .box/probe_splits.py (this folder's, with the case tuple
# ((8, 64, (0, 1, 2, 3)), (8, 32, (0, 1, 2)), (4, 64, (0, 1, 2, 3)), (2, 64, (0, 1, 3))): q_len, batch, split counts,
# 0 = the plan) -> probe_short_splits_forced.json: q_len 8 x 64 639.2 us unsplit against the plan's 3 splits 780.3
# (zipkv's decode 552.4); q_len 4 x 64 607.3 against 625.8; q_len 2 x 64 (8 rows, 3 CTAs per SM) 3 splits best.
#   git checkout 169771c && OUT=$OUT timeout 560 bash .box/run54.sh
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 400 python3 .box/probe_splits.py $OUT/probe_splits.json 2>&1 | grep -v "Warn\|warn"
echo "all $SECONDS s"
# ---- .box/run55.sh: call 14, 08:46 UTC (71 s), on 1556b87 + 169771c (the lockstep wave model up to two waves), case
# tuple ((8, 64, (0, 3)), (8, 48, (0, 1, 2)), (8, 96, (0, 1, 3)), (4, 64, (0, 3)), (2, 64, (0, 2))): the plan and
# decode tests pass (18); the plan now leaves 8 x 64 unsplit (644.0 us) but splits 8 x 48 four ways (628.7, where 2
# splits take 537.1) and 8 x 96 two ways (1,068.8, unsplit 966.3) -> probe_short_splits_two_waves.json.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 120 python3 -m pytest test/test_paged_prefill_cuda.py test/test_decode_cuda.py -q -p no:cacheprovider -k "plan or six_warp" -rfE \
  2>&1 | tee "$OUT/tests.log" | grep -v "Warn\|warn" | tail -3
timeout 300 python3 .box/probe_splits.py $OUT/probe_splits.json 2>&1 | grep -v "Warn\|warn"
echo "all $SECONDS s"
# ---- .box/run56.sh: call 15, 08:49 UTC (113 s), on a69965e + 169771c (the plan as landed on main in 2ceef8d), the
# case tuple in this folder's probe_splits.py: the plan and decode tests pass (18); the plan's split count is the
# fastest or within 0.5% of it at all six shapes (probe_short_splits_lockstep.json); then Nsight Compute on the
# 32-row and 16-row slots (ncu_short_slots.md; target this folder's ncu_short.py).
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 120 python3 -m pytest test/test_paged_prefill_cuda.py test/test_decode_cuda.py -q -p no:cacheprovider -k "plan or six_warp" -rfE \
  2>&1 | tee "$OUT/tests.log" | grep -v "Warn\|warn" | tail -3
timeout 300 python3 .box/probe_splits.py $OUT/probe_splits.json 2>&1 | grep -v "Warn\|warn"
echo "probed at $SECONDS s"
for qb in "8 32" "4 32"; do set -- $qb
  timeout 150 ncu --clock-control none --set full --import-source no -k regex:paged_decode_kernel \
    -s 2 -c 1 -o $OUT/short_$1 python3 .box/ncu_short.py $1 $2 > $OUT/ncu_short_$1.log 2>&1
  ncu -i $OUT/short_$1.ncu-rep --page details > $OUT/details_short_$1.txt 2>&1
  ncu -i $OUT/short_$1.ncu-rep --page source --csv --print-source sass > $OUT/sass_short_$1.csv 2>&1
  grep -i "duration\|Warp Cycles Per Issued\|Issue Slots Busy\|Eligible\|DRAM Throughput" $OUT/details_short_$1.txt | head -7
  rm -f $OUT/short_$1.ncu-rep
done
echo "all $SECONDS s"
# ---- call 16, 08:52 UTC (218 s), on main at 2ceef8d: run52.sh's script unchanged (as .box/run57.sh) -> the CUDA
# prefill and engine tests pass (192, 1 skipped; test_prefill_engine_2ceef8d.log); bench_prefill_speculative.json:
# q_len 2/4/8 at 1.099/1.128/1.128x zipkv's decode at batch 32, 1.050/1.091/1.142x at 64; 2.97-3.76x FlashInfer.
# ---- .box/run58.sh: call 17, 08:56 UTC (87 s), on 2ceef8d: every CUDA test file -> 299 passed, 2 skipped
# (test_cuda_files_2ceef8d.log).
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 420 python3 -m pytest test/test_cuda.py test/test_decode_cuda.py test/test_engine_cuda.py test/test_paged_prefill_cuda.py test/test_engine_tp_cuda.py -q -p no:cacheprovider -n 12 -rfE 2>&1 | tee "$OUT/tests_all.log" | grep -v "Warn\|warn" | tail -8
echo "all $SECONDS s"
# ---- .box/run59.sh: call 18, 08:58 UTC (96 s), kind nvidia-h200 (the warm H100 of call 17 kept it), on 2ceef8d: the
# speculative cases again -> bench_prefill_speculative_repeat.json, within 1.5% of call 16 at every case.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 300 python3 benchmarks/bench_prefill.py --out "$OUT" --cases speculative --iters 20 2>&1 | grep -v "Warn\|warn" \
  | tail -9
echo "all $SECONDS s"
# ---- .box/run60.sh: call 19, 09:06 UTC (211 s), on 308498a (branch exp/prefill-cluster: d 128 CTAs in clusters of 2
# sharing each chunk's rebuild through distributed shared memory), with .box/main_csrc.tar = `git archive main csrc`
# (main's kernels, 2ceef8d) for the same-machine baseline -> test_paged_prefill_cuda.py 185 passed
# (test_prefill_cluster.log); 512 x 8K x 1: the cluster 367.7 us, main 291.9, FlashInfer 130.2-130.4; the cluster's
# batch 8 did not finish inside the probe's 70 s (probe_prefill_cluster.json; a fresh machine's first probe run takes
# ~80 s). Then 261 s of the budget were left.
#   git checkout 308498a && OUT=$OUT timeout 470 bash .box/run60.sh
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 130 python3 -m pytest test/test_paged_prefill_cuda.py -x -q -p no:cacheprovider -n 8 -rfE 2>&1 \
  | tee "$OUT/tests_cluster.log" | grep -v "Warn\|warn" | tail -6
echo "tested at $SECONDS s"
timeout 70 python3 .box/probe3.py $OUT/probe_cluster.json 0 2>&1 | grep -v "Warn\|warn" | tail -3
echo "timed at $SECONDS s"
tar xf .box/main_csrc.tar && bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
echo "main built at $SECONDS s"
timeout 70 python3 .box/probe3.py $OUT/probe_main.json 0 2>&1 | grep -v "Warn\|warn" | tail -3
echo "all $SECONDS s"
# ---- .box/run62.sh: call 20 (2026-12-07, ~09:59 UTC, 295 s), kind nvidia-h200 (an H100 80GB HBM3 came) -> the split
# barrier passes its prefill tests (test_prefill_cluster_split.log: 185) and is no faster: 372.4 us at 512 x 8K x 1
# (probe_cluster_split.json); the probes (probe_cluster_parts.json; their build 0 takes 424.9): 1 364.5, 2 415.7,
# 4 367.1; main 290.6 on the same machine (probe_main_call20.json). Was: the cluster's step
# barrier in two halves (2d1061e, branch exp/prefill-cluster), its CUDA prefill tests and 512 x 8K at batch 1 and 8
# against FlashInfer in the same run; then the same kernel's probes (83f5eb1, ZIPKV_PREFILL_PROBE read at launch: 1
# no copies into the other CTA, 2 no sharing with the cluster barriers kept, 4 the CTA's own barrier in the loop;
# 4-8 bytes of spills at d 128 that 2d1061e does not have), which split the cluster's cost into its barrier and its
# remote stores; then main's kernels (2ceef8d) on the same machine. Call 19 had main at 0.442-0.447x FlashInfer and
# the cluster with a whole barrier a step at 0.354x. About 8 min on an H100; first, here:
#   git archive 83f5eb1 csrc > .box/cluster_probe_csrc.tar; git archive 2ceef8d csrc > .box/main_csrc.tar
#   git checkout 2d1061e && OUT=$OUT timeout 580 bash .box/run62.sh
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 60 python3 -m pytest test/test_paged_prefill_cuda.py -x -q -p no:cacheprovider -n 8 -rfE 2>&1 \
  | tee "$OUT/tests_cluster_split.log" | grep -v "Warn\|warn" | tail -4
echo "tested at $SECONDS s"
timeout 150 python3 .box/probe3.py $OUT/probe_cluster_split.json 0 2>&1 | grep -v "Warn\|warn" | tail -3
echo "timed at $SECONDS s"
tar xf .box/cluster_probe_csrc.tar && bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
echo "probes built at $SECONDS s"
timeout 150 python3 .box/probe3.py $OUT/probe_cluster_parts.json 0 1 2 4 2>&1 | grep -v "Warn\|warn" | tail -8
echo "probed at $SECONDS s"
tar xf .box/main_csrc.tar && bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
echo "main built at $SECONDS s"
timeout 80 python3 .box/probe3.py $OUT/probe_main.json 0 2>&1 | grep -v "Warn\|warn" | tail -3
echo "all $SECONDS s"
# ---- .box/run63.sh: call 21 (~10:06 UTC, 157 s), kind nvidia-h200 (an H100 80GB HBM3 came), on main at dcd5bd2:
# every case of bench_prefill.py with FlashInfer in the same run -> ../bench_prefill_h100.json (chunked 0.41-0.47x
# FlashInfer at every shape, speculative 2.99-3.82x and 1.05-1.17x zipkv's decode, engine TTFT attention 0.857x)
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -f "$OUT/build.log"
echo "built at $SECONDS s"
timeout 480 python3 benchmarks/bench_prefill.py --out "$OUT" 2>&1 | grep -v "Warn\|warn" | tail -25
echo "all $SECONDS s"
# ---- .box/run64.sh: call 22 (~10:13 UTC, 154 s), kind nvidia-h200 (an H100 80GB HBM3 came), on 0e4a197 (branch
# exp/prefill-floor: main's kernel with ZIPKV_PREFILL_PROBE read at launch, d 128: 1 no planning, copies or rebuild,
# the tiles zeroed once; 2 no barrier in the loop; 4 no softmax, P = S packed) -> probe_floor.json: at 512 x 8K x 1
# 0 295.5, 1 144.0, 3 133.2, 5 85.8, 7 88.3 us, FlashInfer 127.8-129.7 (batch 8: 2,178.2, 1,078.7, 998.8, 647.8,
# 639.4 against 917.5-924.4)
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -f "$OUT/build.log"
echo "built at $SECONDS s"
timeout 200 python3 .box/probe3.py $OUT/probe_floor.json 0 1 3 5 7 2>&1 | grep -v "Warn\|warn" | tail -12
echo "all $SECONDS s"
# ---- .box/run65.sh: call 23 (~10:21 UTC, 265 s), kind nvidia-h200 (an H100 80GB HBM3 came), on 5b06de6 (branch
# exp/prefill-merged: ZIPKV_PREFILL_PROBE=16, the merged step; 48, the rebuild woven into the softmax by hand) -> the
# prefill tests pass with each (test_prefill_merged_16.log, _48.log: 185 passed); probe_merged.json at 512 x 8K x 1:
# main 293.2, merged 336.5, woven 371.9 us, FlashInfer 131.1-131.4 (batch 8: 2,142.5, 2,469.6, 2,726.3 against
# 937.7-942.0)
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -f "$OUT/build.log"
echo "built at $SECONDS s"
for pr in 16 48; do
  ZIPKV_PREFILL_PROBE=$pr timeout 60 python3 -m pytest test/test_paged_prefill_cuda.py -x -q -p no:cacheprovider -n 8 \
    -rfE 2>&1 | tee "$OUT/test_prefill_merged_$pr.log" | grep -v "Warn\|warn" | tail -4
  echo "tested $pr at $SECONDS s"
done
timeout 200 python3 .box/probe3.py $OUT/probe_merged.json 0 16 48 2>&1 | grep -v "Warn\|warn" | tail -8
echo "all $SECONDS s"
# ---- .box/run66.sh: call 24 (~10:33 UTC, 80 s), kind nvidia-h200 (an H100 80GB HBM3 came), on 0e4a197 (branch
# exp/prefill-floor) -> ncu_floor.md: Nsight Compute on probes 1 (142.85 us) and 5 (85.02 us); the target is
# ../h100_2026-12-06/ncu_prefill.py as .box/ncu_prefill.py
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
for probe in 1 5; do
  ZIPKV_PREFILL_PROBE=$probe timeout 150 ncu --clock-control none --set full --import-source no -k regex:paged_prefill \
    -s 2 -c 1 -o $OUT/prefill_$probe python3 .box/ncu_prefill.py > $OUT/ncu_$probe.log 2>&1
  ncu -i $OUT/prefill_$probe.ncu-rep --page details > $OUT/details_$probe.txt 2>&1
  ncu -i $OUT/prefill_$probe.ncu-rep --page source --csv --print-source sass > $OUT/sass_$probe.csv 2>&1
  grep -i "duration\|Warp Cycles Per Issued\|Issue Slots Busy\|Eligible" $OUT/details_$probe.txt | head -6
  rm -f $OUT/prefill_$probe.ncu-rep
  echo "probe $probe at $SECONDS s"
done
echo "all $SECONDS s"
# ---- .box/run67.sh (not run: at ~10:50 UTC no machine could be started, and the failed start left 253 s of the
# budget, too little for the ~340 s it needs): 616a532 (branch exp/prefill-micro: wgmma descriptors as two words, one
# add a k-step; the softmax's row maximum and sum in 4 partial chains) timed, its prefill tests, then main on the same
# machine. First, here: git archive main csrc > .box/main_csrc.tar; git checkout 616a532
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 120 python3 .box/probe3.py $OUT/probe_micro.json 0 2>&1 | grep -v "Warn\|warn" | tail -3
echo "timed at $SECONDS s"
timeout 60 python3 -m pytest test/test_paged_prefill_cuda.py -x -q -p no:cacheprovider -n 8 -rfE 2>&1 \
  | tee "$OUT/test_prefill_micro.log" | grep -v "Warn\|warn" | tail -3
echo "tested at $SECONDS s"
tar xf .box/main_csrc.tar && bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
echo "main built at $SECONDS s"
timeout 80 python3 .box/probe3.py $OUT/probe_main_call25.json 0 2>&1 | grep -v "Warn\|warn" | tail -3
echo "all $SECONDS s"
# ---- .box/run68.sh (not run: the 253 s left could not start a machine): the same A/B in one build, on 70e9cfe
# (exp/prefill-micro with main's kernel beside it: ZIPKV_PREFILL_PROBE=99 runs main's), then micro's prefill tests;
# ~240 s on an H100. First, here: git checkout 70e9cfe
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1 ZIPKV_REAL_KV=$PWD/.box/data/real_kv.pt OMP_NUM_THREADS=2
rm -rf build torch_zipkv/_C*.so
bash .box/box.sh build >/dev/null || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/zipkv-site:$PWD
rm -f "$OUT/gpu.txt" "$OUT/build.log"
echo "built at $SECONDS s"
timeout 130 python3 .box/probe3.py $OUT/probe_micro_ab.json 0 99 0 99 2>&1 | grep -v "Warn\|warn" | tail -8
echo "timed at $SECONDS s"
timeout 60 python3 -m pytest test/test_paged_prefill_cuda.py -x -q -p no:cacheprovider -n 8 -rfE 2>&1 \
  | tee "$OUT/test_prefill_micro.log" | grep -v "Warn\|warn" | tail -3
echo "all $SECONDS s"
