"""Session 16: does FlashInfer's measured time depend on what ran before it, or on host launch overhead?

In call 1's variant sweep FlashInfer TC took 583.7 µs at 8K x 64 (162.0 at 2K x 64, 123.7 for SmolLM2) where the grid
of the same call gave 491.5 (134.2, 110.6); there it always followed a zipkv call, in the grid another FlashInfer call.
For each case this times FlashInfer TC and zipkv (random pages) with the read flush, with and without a GPU spin
between the flush and the start event (which keeps host launch overhead out of the timing), alone and right after
the other kernel, and the host time of one call of each (no sync).

    python benchmarks/results/decode_v15_experiments/baseline_context.py --out DIR
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import bench_decode as bd  # noqa: E402

import torch_zipkv  # noqa: E402


def timed(fn, before, flush, pad, iters):
    ts = []
    for i in range(iters + 3):
        if before is not None:
            flush.max()
            before()
        flush.max()
        if pad:
            torch.cuda._sleep(pad)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        if i >= 3:
            ts.append(s.elapsed_time(e) * 1e3)
    return ts


def host_us(fn, iters=50):
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--cases", default="llama:8192:64,llama:2048:64,smollm2:8192:64,llama:8192:32")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    shapes = {"llama": bd.LLAMA, "smollm2": bd.SMOLLM2}
    rows = []
    # the flush alone, for scale
    fl = timed(lambda: flush.max(), None, flush, 0, 20)
    print(f"flush.max() alone: {statistics.median(fl):.1f} us", flush=True)
    for c in a.cases.split(","):
        sname, ctx, batch = c.split(":")
        shape, ctx, batch = shapes[sname], int(ctx), int(batch)
        indptr, indices, last, q, kv = bd.case_inputs(shape, ctx, batch, gen)
        ckv = bd.store(kv, True)
        out = torch.empty_like(q)
        z = lambda: torch_zipkv.paged_decode(q, ckv, indptr, indices, last, out=out)  # noqa: E731
        w = bd.flashinfer_wrappers(indptr, indices, last, shape, "cuda")[0]["flashinfer_tc"]
        f = lambda: w.run(q, kv)  # noqa: E731
        z(), f()
        row = {"case": c, "host_us": {"flashinfer_tc": host_us(f), "zipkv": host_us(z)}, "us": {}}
        for name, fn, other in (("flashinfer_tc", f, z), ("zipkv", z, f)):
            for after in (False, True):
                for pad in (0, bd.PAD_CYCLES):
                    key = f"{name}{' after other' if after else ''}{' padded' if pad else ''}"
                    ts = timed(fn, other if after else None, flush, pad, a.iters)
                    row["us"][key] = {"median": statistics.median(ts), "min": min(ts), "max": max(ts), "all": ts}
        rows.append(row)
        print(f"{c}: host us FI {row['host_us']['flashinfer_tc']:.1f}, zipkv {row['host_us']['zipkv']:.1f}", flush=True)
        for k, v in row["us"].items():
            print(f"  {k:32} median {v['median']:8.1f}  min {v['min']:8.1f}  max {v['max']:8.1f}", flush=True)
        del ckv, kv
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "baseline_context.json").write_text(json.dumps({"command": "python " + " ".join(sys.argv),
                                                             "flush_us": statistics.median(fl), "cases": rows}))


if __name__ == "__main__":
    main()
