"""Where the cache's host time goes in a decode loop: cProfile of decode steps (prepare_step, one append_kv per layer,
compress_full_pages(wait=False) every 8 steps), batch 64, 32 layers, context 2048, the 40 heaviest calls.

    python benchmarks/profile_cache_host.py [cuda|cpu] [warm-up steps]

Seeded, so the same data compresses to the same sizes each run (placement, and so its cost, depends on them).
"""

import cProfile
import pstats
import sys

import torch

from torch_zipkv import CompressedPagedKVCache

LAYERS, BATCH, CONTEXT, EVERY = 32, 64, 2048, 8


def main() -> None:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    warm_up = int(sys.argv[2]) if len(sys.argv) > 2 else 17
    torch.manual_seed(0)
    cache = CompressedPagedKVCache(LAYERS, 1, 64, device=device, chunk_bytes=1 << 20,
                                   max_bytes=int(LAYERS * BATCH * (CONTEXT + 200) * 256 * 1.05) + (64 << 20))
    k = torch.randn(CONTEXT, 1, 64).bfloat16().to(device)
    sids = [cache.add_sequence(CONTEXT, 150) for _ in range(BATCH)]
    for layer in range(LAYERS):
        for i, sid in enumerate(sids):  # staggered lengths: pages fill on different steps
            cache.append(layer, sid, k[: CONTEXT - i % 16], k[: CONTEXT - i % 16])
    cache.compress_full_pages()
    cache.compact()
    token = torch.randn(BATCH, 1, 64).bfloat16().to(device)

    def run(steps: int) -> None:
        for s in range(steps):
            step = cache.prepare_step(sids)
            for layer in range(LAYERS):
                cache.step_append(layer, step, token, token)
            if s % EVERY == 0:
                cache.compress_full_pages(wait=False)

    run(warm_up)
    profile = cProfile.Profile()
    profile.enable()
    run(64)
    profile.disable()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
