"""Decode-attention benchmark (GPU): torch_zipkv's fused kernel on compressed / real-KV-like / raw pages against
FlashInfer 0.6.12 (CUDA-core and tensor-core decode) and torch SDPA on contiguous KV, all in the same run.

    python benchmarks/bench_decode.py --out DIR [--iters 100] [--quick]

Method (results and how to reproduce them: docs/performance.md): Llama-3.1-8B attention shape (32 query heads, 8 KV
heads, head_dim 128), page 16, separate KV per request, pages in random order, L2 flushed before every timed call (by
reading a 256 MB buffer), median of --iters CUDA-event timings; context 2048 and 8192 x batch 32/64/96, plus
SmolLM2's own shape (9/3 heads, d 64).
Every variant of a case is timed round-robin (one call of each per round, in a fresh random order each round), so a
slow or fast spell of the GPU lands on all of them alike: FlashInfer moved 2-6% between separate calls, as much as
the gaps we measure (docs/decode-kernel.md, v14, v15). Speedups are ratios of medians; "paired" speedups are medians of
the per-round ratios. Data:
- random:    Gaussian BF16 pages with magnitudes below 2^-8 lifted to +-2^-8, so that every block compresses (the
             issue's "all blocks compressible" case; plain randn leaves ~5% of blocks raw, from rare tiny values).
- real-like: every 16 x 64 K or V stream drawn from SmolLM2-135M's real cache (model package or $ZIPKV_REAL_KV),
             so blocks keep their real compressibility (K blocks with exact zeros are zero-aware where the other
             exponents fit a window of 14, raw otherwise).
- raw:       the random pages stored with every block raw (the worst case for torch_zipkv).
- decompress-then-attend (real-like pages): decompress_pages into a BF16 buffer, then FlashInfer (tensor cores) on
             it, as prior lossless KV codecs do; its bytes are the stored ones read, the BF16 written and read again.
Bytes read: torch_zipkv reads its arena (stored streams) + metadata; the others read raw BF16 KV. "TB/s" is the
bytes actually read per second; "raw TB/s" is BF16 KV delivered per second (raw bytes / time) for every variant.
Writes bench_decode.json into --out. FlashInfer is a baseline only: it is imported here, never by torch_zipkv.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))  # smollm2.py: real KV
import torch.nn.functional as F

import torch_zipkv
from torch_zipkv import format as fmt
from torch_zipkv import ops

# GPU spin before each timed call (~200-400 µs): a guard, as the flush alone (126 µs of GPU time on the H200) already
# outlasts the host time of a call (FlashInfer 25-50 µs, zipkv 8-23 µs; docs/decode-kernel.md, v15).
PAD_CYCLES = 400_000
LLAMA = dict(name="llama3-8b", Hq=32, Hkv=8, D=128)
SMOLLM2 = dict(name="smollm2", Hq=9, Hkv=3, D=64)
PAGE = 16


def time_round_robin(fns: dict, iters: int, flush: torch.Tensor, write_flush: bool = False,
                     pad_cycles: int = PAD_CYCLES) -> dict:
    """µs of each fn() over iters rounds (after 3 untimed ones), L2 flushed (untimed) before every call.

    One round calls every fn once, in a fresh random order, so drifts of the GPU's speed over the case's seconds
    fall on every variant alike, no variant always follows the same other one, and per-round ratios pair calls made
    moments apart. The flush reads a buffer 5x the L2, which leaves L2 holding only clean lines. A flush that writes
    the buffer (zero_(), Triton's do_bench habit) leaves ~50 MB of dirty lines whose write-back then runs inside the
    timed call: 15-50 µs of DRAM time, varying between runs (docs/decode-kernel.md, v10). --write-flush keeps that
    method. A GPU spin of pad_cycles between the flush and the start event keeps the host's launch overhead (Python
    wrappers: FlashInfer's run() takes tens of µs) out of the timing: the GPU is still busy when fn() enqueues.
    """
    names = list(fns)
    times = {n: [] for n in names}
    order = torch.Generator().manual_seed(1)
    for i in range(iters + 3):
        for j in torch.randperm(len(names), generator=order).tolist():
            name = names[j]
            if write_flush:
                flush.zero_()
            else:
                flush.max()
            if pad_cycles:
                torch.cuda._sleep(pad_cycles)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            end.synchronize()
            if i >= 3:
                times[name].append(start.elapsed_time(end) * 1e3)
    return times


def paired_speedup(base: list, other: list) -> float:
    """Median over rounds of base / other (same-round calls)."""
    return statistics.median(b / o for b, o in zip(base, other))


def real_streams(device) -> tuple[torch.Tensor, torch.Tensor]:
    """SmolLM2's K and V streams, bf16 [N, 16, 64] each (every page, layer and head of the saved cache)."""
    path = os.environ.get("ZIPKV_REAL_KV")
    if path:
        kv = torch.load(path, weights_only=True)["kv"]
    else:
        import smollm2 as realkv

        kv = realkv.real_kv(2048, page_size=16)
    assert kv.shape[3] == PAGE and kv.shape[5] == 64, kv.shape
    kv = kv.to(device)  # [layers, pages, 2, 16, H, 64]
    k = kv[:, :, 0].permute(0, 1, 3, 2, 4).reshape(-1, PAGE, 64)
    v = kv[:, :, 1].permute(0, 1, 3, 2, 4).reshape(-1, PAGE, 64)
    return k, v


def real_like_pages(num_pages: int, Hkv: int, D: int, streams, gen) -> torch.Tensor:
    """bf16 [num_pages, 2, 16, Hkv, D] whose every 16 x 64 piece of a stream is a real SmolLM2 stream."""
    parts = []
    for src in streams:
        idx = torch.randint(0, src.shape[0], (num_pages, Hkv, D // 64), generator=gen).to(src.device)
        x = src[idx]  # [pages, Hkv, D/64, 16, 64]
        parts.append(x.permute(0, 3, 1, 2, 4).reshape(num_pages, PAGE, Hkv, D))
    return torch.stack(parts, dim=1)


def compressible_randn(shape, gen) -> torch.Tensor:
    """Gaussian bf16 whose every block compresses: |x| >= 2^-8 keeps a block's exponents within 15 of its smallest
    (randn stays below 2^7)."""
    x = torch.randn(shape, generator=gen)
    floor = 2.0**-8
    return torch.where(x.abs() < floor, torch.copysign(torch.full_like(x, floor), x), x).to(torch.bfloat16)


def store(kv: torch.Tensor, allow_compress: bool) -> torch_zipkv.CompressedKV:
    n, _, P, H, D = kv.shape
    data, meta, cursor = torch_zipkv.empty_storage(n, P, H, D, kv.device)
    ids = torch.arange(n, dtype=torch.int32, device=kv.device)
    chunk = 8192  # bounded staging per call
    for s in range(0, n, chunk):
        ops.compress_pages(kv[s : s + chunk], ids[s : s + chunk], data, meta, cursor, allow_compress=allow_compress)
    used = int(cursor[0])
    assert used <= data.numel()
    return torch_zipkv.CompressedKV(data=data[:used], meta=meta, page_size=P, head_dim=D)


def flashinfer_wrappers(indptr, indices, last, shape, device):
    try:
        import flashinfer
    except ImportError as e:  # the baseline is optional on machines without it
        print(f"FlashInfer not available ({e}); its columns are skipped", file=sys.stderr)
        return {}, None
    out = {}
    for tc in (False, True):
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
        w.plan(indptr, indices, last, shape["Hq"], shape["Hkv"], shape["D"], PAGE, pos_encoding_mode="NONE",
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        out["flashinfer_tc" if tc else "flashinfer_cc"] = w
    return out, flashinfer.__version__


def case_inputs(shape: dict, ctx: int, batch: int, gen, device="cuda"):
    """A case's page table (ctx // PAGE full pages per request, in random order), q and all-compressible pages:
    indptr, indices, last_page_len, q [batch, Hq, D], kv [num_pages, 2, PAGE, Hkv, D]."""
    Hq, Hkv, D = shape["Hq"], shape["Hkv"], shape["D"]
    pages_per_req = ctx // PAGE
    num_pages = batch * pages_per_req
    indptr = torch.arange(0, num_pages + 1, pages_per_req, dtype=torch.int32, device=device)
    indices = torch.randperm(num_pages, generator=gen).to(torch.int32).to(device)  # random page order
    last = torch.full((batch,), PAGE, dtype=torch.int32, device=device)
    q = torch.randn(batch, Hq, D, generator=gen).to(torch.bfloat16).to(device)
    kv = compressible_randn((num_pages, 2, PAGE, Hkv, D), gen).to(device)
    return indptr, indices, last, q, kv


def run_case(shape: dict, ctx: int, batch: int, iters: int, streams, flush, gen, flashinfer: bool,
             write_flush: bool = False) -> dict:
    device = "cuda"
    Hkv, D = shape["Hkv"], shape["D"]
    pages_per_req = ctx // PAGE
    num_pages = batch * pages_per_req
    indptr, indices, last, q, kv = case_inputs(shape, ctx, batch, gen, device)
    scale = 1 / math.sqrt(D)
    raw_bytes = num_pages * fmt.raw_page_bytes(PAGE, Hkv, D)

    row = {"shape": shape["name"], "ctx": ctx, "batch": batch, "raw_kv_bytes": raw_bytes}
    meta_shape = torch.empty(1, 2, Hkv, fmt.meta_words(PAGE, D), dtype=torch.int32, device=device)
    row["plan"] = ops.decode_plan(q, meta_shape, num_pages, PAGE)  # split count and CTA layout of the zipkv cases
    fns, info, outs = {}, {}, {}

    def add(name, fn, nbytes, extra=None):
        fns[name] = fn
        info[name] = {"bytes_read": nbytes, **(extra or {})}

    for name, allow in (("zipkv_random", True), ("zipkv_raw", False)):
        ckv = store(kv, allow)
        out = torch.empty_like(q)
        fn = lambda ckv=ckv, out=out: torch_zipkv.paged_decode(q, ckv, indptr, indices, last, sm_scale=scale, out=out)  # noqa: E731
        fn()
        outs[name] = out
        add(name, fn, ckv.nbytes, {"stored_ratio": ckv.ratio, "compressed_blocks": ckv.compressed_block_fraction})
    wrappers, fi_version = flashinfer_wrappers(indptr, indices, last, shape, device) if flashinfer else ({}, None)
    for name, w in wrappers.items():
        outs[name] = w.run(q, kv)
        add(name, lambda w=w: w.run(q, kv), raw_bytes)
    # torch SDPA on contiguous KV [batch, Hkv, ctx, D], request b's tokens in order.
    tokens = kv[indices.long()].view(batch, pages_per_req, 2, PAGE, Hkv, D)
    k = tokens[:, :, 0].permute(0, 3, 1, 2, 4).reshape(batch, Hkv, ctx, D).contiguous()
    v = tokens[:, :, 1].permute(0, 3, 1, 2, 4).reshape(batch, Hkv, ctx, D).contiguous()
    del tokens
    sdpa = lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)  # noqa: E731
    outs["sdpa"] = sdpa().squeeze(2)
    add("sdpa_contiguous", sdpa, raw_bytes)

    # Real-KV-like pages: same page table, other data.
    kv_real = real_like_pages(num_pages, Hkv, D, streams, gen)
    ckv_real = store(kv_real, True)
    out_real = torch.empty_like(q)
    add("zipkv_real_like", lambda: torch_zipkv.paged_decode(q, ckv_real, indptr, indices, last, sm_scale=scale,
                                                            out=out_real),
        ckv_real.nbytes, {"stored_ratio": ckv_real.ratio, "compressed_blocks": ckv_real.compressed_block_fraction})
    if "flashinfer_tc" in wrappers:
        add("flashinfer_tc_real_like", lambda: wrappers["flashinfer_tc"].run(q, kv_real), raw_bytes)
        # What prior lossless KV codecs do: decompress the pages into a BF16 buffer, then attend with FlashInfer.
        page_ids = torch.arange(num_pages, dtype=torch.int32, device=device)
        staged = torch.empty_like(kv_real)

        def decompress_then_attend():
            ops.decompress_pages(ckv_real.data, ckv_real.meta, page_ids, PAGE, D, out=staged)
            return wrappers["flashinfer_tc"].run(q, staged)

        outs["decompress_then_flashinfer"] = decompress_then_attend()
        outs["flashinfer_tc_real_like"] = wrappers["flashinfer_tc"].run(q, kv_real)
        add("decompress_then_flashinfer_real_like", decompress_then_attend, ckv_real.nbytes + 2 * raw_bytes)

    times = time_round_robin(fns, iters, flush, write_flush)
    results = {}
    for name, ts in times.items():
        us = statistics.median(ts)
        results[name] = {"us": us, "TBps": info[name]["bytes_read"] / us / 1e6, "raw_TBps": raw_bytes / us / 1e6,
                         **info[name]}
    fns.clear()  # free the cases' device tensors before the next shape (the closures hold them)
    k = v = kv_real = ckv_real = None  # noqa: F841
    if "decompress_then_flashinfer" in outs:  # the staged pages are the real ones, bit for bit
        row["decompress_then_flashinfer_equals_flashinfer"] = torch.equal(outs["decompress_then_flashinfer"],
                                                                          outs["flashinfer_tc_real_like"])

    # Sanity: raw and compressed storage of the same values give the same bits; FlashInfer agrees to bf16 rounding.
    row["raw_equals_compressed_bits"] = torch.equal(outs["zipkv_random"], outs["zipkv_raw"])
    row["max_abs_diff_vs_sdpa"] = (outs["zipkv_random"].float() - outs["sdpa"].float()).abs().max().item()
    if "flashinfer_tc" in outs:
        diff = outs["zipkv_random"].float() - outs["flashinfer_tc"].float()
        row["max_abs_diff_vs_flashinfer"] = diff.abs().max().item()
    fi = [results[n]["us"] for n in ("flashinfer_cc", "flashinfer_tc") if n in results]
    if fi:
        best = min(fi)
        for name in ("zipkv_random", "zipkv_raw", "zipkv_real_like"):
            results[name]["speedup_vs_best_flashinfer"] = best / results[name]["us"]
            if "flashinfer_tc" in times:
                results[name]["paired_speedup_vs_flashinfer_tc"] = paired_speedup(times["flashinfer_tc"], times[name])
        if "flashinfer_tc_real_like" in results:
            results["zipkv_real_like"]["speedup_vs_flashinfer_same_data"] = (
                results["flashinfer_tc_real_like"]["us"] / results["zipkv_real_like"]["us"])
        if "decompress_then_flashinfer_real_like" in results:
            staged = results["decompress_then_flashinfer_real_like"]
            staged["speedup_vs_best_flashinfer"] = best / staged["us"]
            real_fused = results["zipkv_real_like"]
            real_fused["speedup_vs_decompress_then_flashinfer"] = staged["us"] / real_fused["us"]
        real = results["zipkv_real_like"]
        # Bar: speedup >= 0.95 x (raw bytes / compressed bytes).
        real["ideal_speedup"] = raw_bytes / real["bytes_read"]
    row["results"] = results
    row["flashinfer_version"] = fi_version
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="two cases only")
    parser.add_argument("--cases", help="instead of the grid: shape:context:batch,... (shape llama or smollm2)")
    parser.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer baseline (JIT-compiles)")
    parser.add_argument("--write-flush", action="store_true", help="flush L2 by writing (leaves dirty lines)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_decode: no GPU, nothing to measure")
        return
    gen = torch.Generator().manual_seed(0)
    flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")  # 5x the 50 MB L2
    streams = real_streams("cuda")
    cases = [(LLAMA, c, b) for c in (2048, 8192) for b in (32, 64, 96)] + [(SMOLLM2, 8192, 64)]
    if args.quick:
        cases = [(LLAMA, 8192, 64), (SMOLLM2, 8192, 64)]
    if args.cases:
        shapes = {"llama": LLAMA, "smollm2": SMOLLM2}
        cases = [(shapes[s], int(c), int(b)) for s, c, b in (x.split(":") for x in args.cases.split(","))]
    rows = []
    hdr = f"{'shape':10} {'ctx':>5} {'bs':>3} | " + " ".join(
        f"{n:>14}" for n in ("zipkv_random", "zipkv_real", "zipkv_raw", "fi_cuda_core", "fi_tensor", "sdpa",
                             "decomp+fi")) + " | speedup rnd/real/raw | paired vs TC"
    print(hdr)
    for shape, ctx, batch in cases:
        row = run_case(shape, ctx, batch, args.iters, streams, flush, gen, not args.no_flashinfer, args.write_flush)
        rows.append(row)
        r = row["results"]
        cell = lambda n: f"{r[n]['us']:8.1f} µs" if n in r else f"{'-':>11}"  # noqa: E731
        sp = lambda n, k="speedup_vs_best_flashinfer": f"{r[n].get(k, float('nan')):.3f}"  # noqa: E731
        pp = lambda n: sp(n, "paired_speedup_vs_flashinfer_tc")  # noqa: E731
        print(f"{shape['name']:10} {ctx:5} {batch:3} | " + " ".join(f"{cell(n):>14}" for n in (
            "zipkv_random", "zipkv_real_like", "zipkv_raw", "flashinfer_cc", "flashinfer_tc", "sdpa_contiguous",
            "decompress_then_flashinfer_real_like")) +
            f" | {sp('zipkv_random')}/{sp('zipkv_real_like')}/{sp('zipkv_raw')}"
            f" | {pp('zipkv_random')}/{pp('zipkv_real_like')}/{pp('zipkv_raw')}", flush=True)
        torch.cuda.empty_cache()
    flush_how = "writing 256 MB (dirty lines)" if args.write_flush else "reading 256 MB (clean lines)"
    result = {
        "benchmark": "bench_decode",
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "iters": args.iters,
        "method": f"median of CUDA-event timings, the variants of a case timed round-robin (random order each "
                  f"round), L2 flushed before each call by {flush_how}, then a GPU spin of {PAD_CYCLES} cycles so "
                  "host launch overhead stays out of the timing, separate KV per request, random page order, page 16",
        "cases": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_decode.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'bench_decode.json'}")


if __name__ == "__main__":
    main()
