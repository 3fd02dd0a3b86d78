"""ncu target: paged_prefill at q_len x 8K x batch (argv; Llama-3.1-8B shape, real-like pages), 4 calls."""
import math, sys, pathlib, torch
sys.path.insert(0, "benchmarks")
import bench_decode as bd
import torch_zipkv
gen = torch.Generator().manual_seed(0)
streams = bd.real_streams("cuda")
q_len, ctx, batch = int(sys.argv[1]), 8192, int(sys.argv[2])
Hq, Hkv, D = 32, 8, 128
ppr = ctx // 16; n = batch * ppr
indptr = torch.arange(0, n + 1, ppr, dtype=torch.int32, device="cuda")
indices = torch.randperm(n, generator=gen).to(torch.int32).cuda()
last = torch.full((batch,), 16, dtype=torch.int32, device="cuda")
qo = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda")
q = torch.randn(batch * q_len, Hq, D, generator=gen).to(torch.bfloat16).cuda()
kv = bd.real_like_pages(n, Hkv, D, streams, gen)
ckv = bd.store(kv, True)
out = torch.empty_like(q)
for _ in range(4):
    torch_zipkv.paged_prefill(q, qo, ckv, indptr, indices, last, sm_scale=1 / math.sqrt(D), out=out)
torch.cuda.synchronize()
s, e = torch.cuda.Event(True), torch.cuda.Event(True)
s.record()
for _ in range(20):
    torch_zipkv.paged_prefill(q, qo, ckv, indptr, indices, last, sm_scale=1 / math.sqrt(D), out=out)
e.record(); torch.cuda.synchronize()
print(f"paged_prefill {q_len}x{ctx}x{batch}: {s.elapsed_time(e) / 20 * 1e3:.1f} us (warm L2, back to back)")
