# ncu target: one Llama-shape 8K x 64 decode on compressed and on raw pages (same values).
import math, sys, torch, torch_zipkv
sys.path.insert(0, "benchmarks")
from bench_decode import store
g = torch.Generator().manual_seed(0)
B, Hq, H, D, ctx, P = 64, 32, 8, 128, 8192, 16
n = B * ctx // P
kv = torch.randn(n, 2, P, H, D, generator=g).to(torch.bfloat16).cuda()
indptr = torch.arange(0, n + 1, ctx // P, dtype=torch.int32, device="cuda")
indices = torch.randperm(n, generator=g).to(torch.int32).cuda()
last = torch.full((B,), P, dtype=torch.int32, device="cuda")
q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda()
for allow in (True, False):
    ckv = store(kv, allow)
    torch_zipkv.paged_decode(q, ckv, indptr, indices, last)
    torch.cuda.synchronize()
