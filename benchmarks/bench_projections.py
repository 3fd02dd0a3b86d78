"""Fused projections (GPU): a decode step's q/k/v and gate/up GEMMs as separate products against one product over the
concatenated weights (what ``torch_zipkv.engine.fused_projections`` does), Llama-3.1-8B shapes, all 32 layers' weights
(so each layer's GEMM reads its weights from HBM, as in a step), batch 16 to 128, in the same run.

    python benchmarks/bench_projections.py --out DIR

Each variant runs all 32 layers' products in one CUDA Graph (no launch gaps: what the engine's graphs replay); the
time is the median over ``--iters`` replays, L2 flushed before each. Writes bench_projections.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics

import torch
import torch.nn.functional as F

HIDDEN, Q, KV, INTER, LAYERS = 4096, 4096, 1024, 14336, 32
GROUPS = {"qkv": (Q, KV, KV), "gate_up": (INTER, INTER)}


def graph_of(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_graph(g: torch.cuda.CUDAGraph, flush: torch.Tensor, iters: int) -> float:
    times = []
    for _ in range(iters):
        flush.max()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--batches", type=int, nargs="+", default=[16, 32, 64, 128])
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(256 << 20, dtype=torch.float32, device=dev)  # 1 GiB, far over L2
    rows = []
    for name, splits in GROUPS.items():
        fused = [torch.randn(sum(splits), HIDDEN, dtype=torch.bfloat16, device=dev) * 0.02 for _ in range(LAYERS)]
        parts = [list(w.split(list(splits))) for w in fused]  # views: the same bytes, read as separate products
        for batch in args.batches:
            x = torch.randn(batch, HIDDEN, dtype=torch.bfloat16, device=dev)
            sep = graph_of(lambda: [F.linear(x, w) for layer in parts for w in layer])
            one = graph_of(lambda: [F.linear(x, w) for w in fused])
            t_sep, t_one = time_graph(sep, flush, args.iters), time_graph(one, flush, args.iters)
            nbytes = sum(w.numel() * 2 for w in fused)
            rows.append({"group": name, "batch": batch, "separate_us": t_sep, "fused_us": t_one,
                         "fused_speedup": t_sep / t_one, "weight_bytes": nbytes,
                         "fused_tb_s": nbytes / t_one / 1e6, "separate_tb_s": nbytes / t_sep / 1e6})
            print(f"{name} batch {batch}: separate {t_sep:.0f} us, fused {t_one:.0f} us "
                  f"({t_sep / t_one:.3f}x), {nbytes / t_one / 1e6:.2f} TB/s fused", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "bench_projections", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "layers": LAYERS, "hidden": HIDDEN, "rows": rows}
    (args.out / "bench_projections.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
