#!/usr/bin/env bash
# Batch 32 at d 128: the plan's layouts forced by ZIPKV_EXPERIMENT_PLAN (experiment build), one call, no FlashInfer.
set -uo pipefail
OUT=${OUT:-/tmp/zipkv-out}; mkdir -p "$OUT"
export MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0a ZIPKV_WITH_CUDA=1 PYTHONUNBUFFERED=1 ZIPKV_REQUIRE_CUDA_BUILD=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site-x .box/whl/*.whl 2>/dev/null
ROOT=$PWD; export ZIPKV_REAL_KV=$ROOT/.box/data/real_kv.pt
python3 setup.py build_ext --inplace -j 16 > /tmp/build.log 2>&1; echo "build rc=$? $SECONDS s"; tail -3 /tmp/build.log
X=/tmp/site-x
CASES=llama:8192:32,llama:2048:32,llama:8192:64
for plan in default 1,6 2,4 2,6 3,4 default; do
  tag=${plan/,/x}
  if [ $plan = default ]; then unset ZIPKV_EXPERIMENT_PLAN; else export ZIPKV_EXPERIMENT_PLAN=$plan; fi
  PYTHONPATH=$ROOT:$X timeout 100 python3 benchmarks/bench_decode.py --no-flashinfer --out /tmp/p_$tag --iters 60 --cases $CASES 2>&1 | tail -4
  cp /tmp/p_$tag/bench_decode.json "$OUT/plan_$tag.json"; echo "$plan done $SECONDS s"
done
echo "all $SECONDS s"

# The experiment build: main at 6160e2d with this patch (not in the tree):
: <<'PATCH'
diff --git a/csrc/cuda/paged_decode.cu b/csrc/cuda/paged_decode.cu
index e0a76fd..17085bf 100644
--- a/csrc/cuda/paged_decode.cu
+++ b/csrc/cuda/paged_decode.cu
@@ -11,6 +11,8 @@
 #include <c10/cuda/CUDAStream.h>
 #include <torch/library.h>
 
+#include <cstdio>
+#include <cstdlib>
 #include <vector>
 
 #include "../checks.h"
@@ -118,6 +120,10 @@ double wave_time(const Shape& x, int splits, int warps) {
 // Only from more CTAs than 4-warp slots (fewer make no partial wave: the split plan was measured there) up to two
 // waves of 6-warp CTAs (over more, uneven finishing blurs the waves and the two layouts measured the same).
 Plan plan_decode(const Shape& x) {
+  if (const char* e = std::getenv("ZIPKV_EXPERIMENT_PLAN")) {  // EXPERIMENT ONLY: "splits,warps"
+    int s = 1, w = 4;
+    if (std::sscanf(e, "%d,%d", &s, &w) == 2) return Plan{s, w};
+  }
   const Plan four{plan_splits(x), 4};
   if (!decode::has_six_warps(x.head_dim, x.group)) return four;
   const int64_t sms = num_sms(x.device);
PATCH
