# Where compress_full_pages spends host time: cProfile of decode steps with a call every 8 steps.
#   python benchmarks/profile_cache_host.py [cuda|cpu] [warm-up steps]   (prints the 40 heaviest calls)
import cProfile, pstats, sys, torch
from torch_zipkv import CompressedPagedKVCache
dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
torch.manual_seed(0)
L, B, ctx = 32, 64, 2048
cache = CompressedPagedKVCache(L, 1, 64, device=dev, chunk_bytes=1 << 20, max_bytes=int(L * B * (ctx + 200) * 256 * 1.05) + (64 << 20))
k = torch.randn(ctx, 1, 64).bfloat16().to(dev)
sids = [cache.add_sequence(ctx, 150) for _ in range(B)]
for layer in range(L):
    for i, sid in enumerate(sids):
        cache.append(layer, sid, k[: ctx - i % 16], k[: ctx - i % 16])
cache.compress_full_pages(); cache.compact()
kt = torch.randn(B, 1, 64).bfloat16().to(dev)
def run(n):
    for s in range(n):
        plan = cache.prepare_step(sids)
        for layer in range(L): cache.step_append(layer, plan, kt, kt)
        if s % 8 == 0: cache.compress_full_pages(wait=False)
run(int(sys.argv[2]) if len(sys.argv) > 2 else 17)
pr = cProfile.Profile(); pr.enable(); run(64); pr.disable()
st = pstats.Stats(pr); st.sort_stats("cumulative").print_stats(40)
