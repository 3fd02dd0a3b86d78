# ncu target: Llama-shape decode on compressed pages (bench_decode's random data) at 2K x 32, 2K x 64, 8K x 64.
import sys, torch, torch_zipkv
sys.path.insert(0, "benchmarks")
from bench_decode import store
g = torch.Generator().manual_seed(0)
Hq, H, D, P = 32, 8, 128, 16
for ctx, B in ((2048, 32), (2048, 64), (8192, 64)):
    n = B * ctx // P
    kv = torch.randn(n, 2, P, H, D, generator=g).to(torch.bfloat16).cuda()
    indptr = torch.arange(0, n + 1, ctx // P, dtype=torch.int32, device="cuda")
    indices = torch.randperm(n, generator=g).to(torch.int32).cuda()
    last = torch.full((B,), P, dtype=torch.int32, device="cuda")
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda()
    ckv = store(kv, True)
    torch_zipkv.paged_decode(q, ckv, indptr, indices, last)
    torch.cuda.synchronize()
    del kv, ckv
