# Split-count sweep (box only, with a temporary ZIPKV_SPLITS override): zipkv on all-compressible and on raw pages.
import json, math, os, subprocess, sys, torch, torch_zipkv
sys.path.insert(0, "benchmarks")
from bench_decode import compressible_randn, store, time_cuda
out = {}
flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
g = torch.Generator().manual_seed(0)
Hq, H, D, P = 32, 8, 128, 16
for ctx, B in ((2048, 64), (8192, 32), (8192, 64)):
    n = B * ctx // P
    kv = compressible_randn((n, 2, P, H, D), g).cuda()
    indptr = torch.arange(0, n + 1, ctx // P, dtype=torch.int32, device="cuda")
    indices = torch.randperm(n, generator=g).to(torch.int32).cuda()
    last = torch.full((B,), P, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda()
    for allow in (True, False):
        ckv = store(kv, allow)
        o = torch.empty_like(q)
        for s in ["plan", "1", "2", "3", "4", "6"]:
            if s == "plan": os.environ.pop("ZIPKV_SPLITS", None)
            else: os.environ["ZIPKV_SPLITS"] = s
            us = time_cuda(lambda: torch_zipkv.paged_decode(q, ckv, indptr, indices, last, out=o), 100, flush)
            key = f"{ctx}x{B} {'comp' if allow else 'raw'} splits={s}"
            out[key] = us
            print(key, f"{us:.1f}", flush=True)
        del ckv
os.environ.pop("ZIPKV_SPLITS", None)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "split_sweep.json"), "w"), indent=1)
