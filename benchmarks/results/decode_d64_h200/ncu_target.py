# ncu target: SmolLM2's decode shape (9 query / 3 kv heads, d 64), 8K x 64, all-compressible random pages, page 16.
import sys, torch, torch_zipkv
sys.path.insert(0, "benchmarks")
from bench_decode import compressible_randn, store
g = torch.Generator().manual_seed(0)
B, Hq, H, D, ctx, P = 64, 9, 3, 64, 8192, 16
n = B * ctx // P
kv = compressible_randn((n, 2, P, H, D), g).cuda()
indptr = torch.arange(0, n + 1, ctx // P, dtype=torch.int32, device="cuda")
indices = torch.randperm(n, generator=g).to(torch.int32).cuda()
last = torch.full((B,), P, dtype=torch.int32, device="cuda")
q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda()
ckv = store(kv, True)
for _ in range(3):
    torch_zipkv.paged_decode(q, ckv, indptr, indices, last)
torch.cuda.synchronize()
