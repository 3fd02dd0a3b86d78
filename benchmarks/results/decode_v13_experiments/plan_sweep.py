# Branch v13-six-warp-ctas, box only: decode time for CTAs of 4 warps (3 per SM) and of 6 warps (2 per SM) at split
# counts 1..4 and the plan's own choice, on all-compressible and on raw pages, for the d 128 shapes of the grid. Uses
# the branch's experiment switches ZIPKV_DECODE_WARPS / ZIPKV_DECODE_SPLITS (read by the op on every call).
#   python3 benchmarks/results/decode_v13_experiments/plan_sweep.py $OUT     -> $OUT/plan_sweep.json
import json, math, os, sys
import torch
import torch_zipkv
sys.path.insert(0, "benchmarks")
from bench_decode import compressible_randn, store, time_cuda

Hq, H, D, P = 32, 8, 128, 16
g = torch.Generator().manual_seed(0)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
out = {}
for ctx, B in ((2048, 64), (2048, 32), (2048, 96), (8192, 32), (8192, 64), (8192, 96)):
    n = B * ctx // P
    kv = compressible_randn((n, 2, P, H, D), g).cuda()
    indptr = torch.arange(0, n + 1, ctx // P, dtype=torch.int32, device="cuda")
    indices = torch.randperm(n, generator=g).to(torch.int32).cuda()
    last = torch.full((B,), P, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda()
    for name, allow in (("compressed", True), ("raw", False)):
        ckv = store(kv, allow)
        o = torch.empty_like(q)
        fn = lambda: torch_zipkv.paged_decode(q, ckv, indptr, indices, last, sm_scale=1 / math.sqrt(D), out=o)
        ref = None
        for warps in ("4", "6"):
            for splits in ("plan", "1", "2", "3", "4"):
                os.environ["ZIPKV_DECODE_WARPS"] = warps
                os.environ.pop("ZIPKV_DECODE_SPLITS", None)
                if splits != "plan":
                    os.environ["ZIPKV_DECODE_SPLITS"] = splits
                fn()
                ref = o.clone() if ref is None else ref
                key = f"{ctx}x{B} {name} warps={warps} splits={splits}"
                out[key] = {"us": time_cuda(fn, 100, flush), "max_diff_vs_first": (o.float() - ref.float()).abs().max().item()}
                print(key, out[key], flush=True)
        del ckv
    del kv
for k in ("ZIPKV_DECODE_WARPS", "ZIPKV_DECODE_SPLITS"):
    os.environ.pop(k, None)
os.makedirs(sys.argv[1], exist_ok=True)
json.dump(out, open(os.path.join(sys.argv[1], "plan_sweep.json"), "w"), indent=1)
