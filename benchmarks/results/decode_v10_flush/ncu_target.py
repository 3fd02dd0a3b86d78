# ncu target: 8K x 64 Llama shape: zipkv on all-compressible and on raw pages, FlashInfer TC on the same raw pages.
import sys, torch, torch_zipkv
sys.path.insert(0, "benchmarks")
from bench_decode import compressible_randn, store
import flashinfer
g = torch.Generator().manual_seed(0)
B, Hq, H, D, ctx, P = 64, 32, 8, 128, 8192, 16
n = B * ctx // P
kv = compressible_randn((n, 2, P, H, D), g).cuda()
indptr = torch.arange(0, n + 1, ctx // P, dtype=torch.int32, device="cuda")
indices = torch.randperm(n, generator=g).to(torch.int32).cuda()
last = torch.full((B,), P, dtype=torch.int32, device="cuda")
q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16).cuda()
for allow in (True, False):
    ckv = store(kv, allow)
    torch_zipkv.paged_decode(q, ckv, indptr, indices, last)
    torch.cuda.synchronize()
    del ckv
w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"), "NHD",
                                                  use_tensor_cores=True)
w.plan(indptr, indices, last, Hq, H, D, P, pos_encoding_mode="NONE", q_data_type=torch.bfloat16,
       kv_data_type=torch.bfloat16)
w.run(q, kv)
torch.cuda.synchronize()
