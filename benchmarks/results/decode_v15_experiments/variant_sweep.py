"""Session 16: the decode kernel's experiment variants (ZIPKV_DECODE_EXP bits, paged_decode_kernel's kExp), timed
round-robin with FlashInfer TC in one process, per case on random (all blocks compressed), real-KV-like and raw pages.
The variants were reverted (no gain, benchmarks/NOTES.md v15): run this on a tree with variants.patch applied
(`git apply benchmarks/results/decode_v15_experiments/variants.patch` on cb34fa0's parent, 939ccc2).

    python benchmarks/results/decode_v15_experiments/variant_sweep.py --out DIR [--iters 100] [--variants 0,1,2,3,7,11]

Bits: 1 = an all-compressed tile rebuilds K and V before QK in one basic block (ptxas interleaves V's rebuild with
the QK mma chain); 2 = QK as four mma chains of two (d 128) instead of two of four; 4 = a refresh's global loads
(next block's meta rows and page ids) after the tile issue instead of before its proxy fence; 8 = no proxy fence
(diagnostic only: the fence is required by the memory model). Each variant's output is checked against variant 0's.
"""

import argparse
import json
import os
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import bench_decode as bd  # noqa: E402

import torch_zipkv  # noqa: E402


def case(shape, ctx, batch, variants, iters, streams, flush, gen):
    Hkv, D = shape["Hkv"], shape["D"]
    n = batch * (ctx // bd.PAGE)
    indptr, indices, last, q, kv = bd.case_inputs(shape, ctx, batch, gen)
    data = {"random": bd.store(kv, True), "raw": bd.store(kv, False),
            "real": bd.store(bd.real_like_pages(n, Hkv, D, streams, gen), True)}
    fns, outs = {}, {}
    for kind, ckv in data.items():
        for v in variants:
            out = torch.empty_like(q)

            def fn(ckv=ckv, out=out, v=v):
                os.environ["ZIPKV_DECODE_EXP"] = str(v)
                torch_zipkv.paged_decode(q, ckv, indptr, indices, last, out=out)

            fn()
            fns[f"{kind}/{v}"] = fn
            outs[f"{kind}/{v}"] = out
    wrappers, _ = bd.flashinfer_wrappers(indptr, indices, last, shape, "cuda")
    if "flashinfer_tc" in wrappers:
        fns["flashinfer_tc"] = lambda: wrappers["flashinfer_tc"].run(q, kv)
    times = bd.time_round_robin(fns, iters, flush)
    os.environ["ZIPKV_DECODE_EXP"] = "0"
    row = {"shape": shape["name"], "ctx": ctx, "batch": batch, "us": {k: statistics.median(t) for k, t in times.items()},
           "bytes": {k: c.nbytes for k, c in data.items()}, "raw_bytes": n * 2 * bd.PAGE * Hkv * D * 2}
    if "flashinfer_tc" in times:
        row["paired_vs_tc"] = {k: bd.paired_speedup(times["flashinfer_tc"], t) for k, t in times.items()
                               if k != "flashinfer_tc"}
    # Every variant computes the same attention: variant 0's output to bf16 rounding (other mma chain orders sum in
    # another order), bit for bit where the chains are the same.
    row["max_abs_diff_vs_variant0"] = {k: (o.float() - outs[k.split("/")[0] + "/0"].float()).abs().max().item()
                                       for k, o in outs.items()}
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--variants", default="0,1,2,3,7,11")
    ap.add_argument("--cases", default="llama:8192:64,llama:8192:32,llama:2048:64,llama:2048:32,llama:8192:96,"
                                       "smollm2:8192:64")
    a = ap.parse_args()
    variants = [int(v) for v in a.variants.split(",")]
    gen = torch.Generator().manual_seed(0)
    flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    streams = bd.real_streams("cuda")
    shapes = {"llama": bd.LLAMA, "smollm2": bd.SMOLLM2}
    rows = []
    for c in a.cases.split(","):
        s, ctx, b = c.split(":")
        row = case(shapes[s], int(ctx), int(b), variants, a.iters, streams, flush, gen)
        rows.append(row)
        fi = row["us"].get("flashinfer_tc", float("nan"))
        print(f"{s} {ctx}x{b}: FlashInfer TC {fi:.1f} us", flush=True)
        for kind in ("random", "real", "raw"):
            print(f"  {kind:6} " + "  ".join(
                f"{v}: {row['us'][f'{kind}/{v}']:.1f} ({row.get('paired_vs_tc', {}).get(f'{kind}/{v}', 0):.3f}x)"
                for v in variants), flush=True)
        bad = {k: d for k, d in row["max_abs_diff_vs_variant0"].items() if not d < 2e-2}
        print("  diff vs variant 0: " + ("all within 2e-2" if not bad else f"OFF {bad}"), flush=True)
        torch.cuda.empty_cache()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "variant_sweep.json").write_text(json.dumps(
        {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(), "iters": a.iters,
         "method": "round-robin per case (order rotated each round), read flush, median; paired = median of "
                   "per-round FlashInfer TC / variant", "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
