# Box only, on a build of commit ffc1090's paged_decode.cu (the experiment switches ZIPKV_DECODE_WARPS /
# ZIPKV_DECODE_SPLITS, read by the op on every call): 4-warp plan against unsplit 6-warp CTAs on real-KV-like pages
# (bench_decode's SmolLM2 streams) for the d 128 grid shapes v13's plan leaves at 4 warps, where the mixed-stream
# rebuild might gain from 12 resident warps per SM instead of 8.
#   python3 benchmarks/results/decode_v13_experiments/real_like_sweep.py $OUT     -> $OUT/real_like_sweep.json
import json, math, os, sys
import torch
import torch_zipkv
sys.path.insert(0, "benchmarks")
from bench_decode import real_like_pages, real_streams, store, time_cuda

Hq, H, D, P = 32, 8, 128, 16
g = torch.Generator().manual_seed(0)
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
streams = real_streams("cuda")
out = {}
for ctx, B in ((2048, 32), (8192, 32), (2048, 96), (8192, 96), (2048, 64)):
    n = B * ctx // P
    indptr = torch.arange(0, n + 1, ctx // P, dtype=torch.int32, device="cuda")
    indices = torch.randperm(n, generator=g).to(torch.int32).cuda()
    last = torch.full((B,), P, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda()
    ckv = store(real_like_pages(n, H, D, streams, g), True)
    o = torch.empty_like(q)
    fn = lambda: torch_zipkv.paged_decode(q, ckv, indptr, indices, last, sm_scale=1 / math.sqrt(D), out=o)
    for warps, splits in (("4", None), ("6", "1"), ("6", "2"), ("4", None)):
        os.environ["ZIPKV_DECODE_WARPS"] = warps
        os.environ.pop("ZIPKV_DECODE_SPLITS", None)
        if splits:
            os.environ["ZIPKV_DECODE_SPLITS"] = splits
        fn()
        key = f"{ctx}x{B} real_like warps={warps} splits={splits or 'plan'}"
        out.setdefault(key, []).append(time_cuda(fn, 100, flush))
        print(key, out[key], flush=True)
    del ckv
os.makedirs(sys.argv[1], exist_ok=True)
json.dump(out, open(os.path.join(sys.argv[1], "real_like_sweep.json"), "w"), indent=1)
