"""Prefill-attention benchmark (GPU): torch_zipkv's paged_prefill on real-KV-like, all-compressible and raw pages
against FlashInfer 0.6.12's BatchPrefillWithPagedKVCacheWrapper on the same pages, all in the same run.

    python benchmarks/bench_prefill.py --out DIR [--iters 30] [--quick] [--cases all|chunked|speculative]

Cases (Llama-3.1-8B attention shape: 32 query heads, 8 KV heads, head_dim 128, page 16, causal, separate KV per
request, pages in random order; the query tokens are each request's last q_len tokens, already in its pages):
- chunked prefill: chunks of 512 and 2048 query tokens over 8K and 32K of context, batch 1 and 8;
- speculative verification: q_len 2, 4, 8 over 8K, batch 32 and 64; here also zipkv's own single-token paged_decode
  of the same pages (the bar: prefill <= 1.25x decode) and decompress-then-FlashInfer;
- engine TTFT (attention only): an 8K prompt prefilled in chunks of 512 through a CompressedPagedKVCache, one layer:
  append + paged_prefill (the engine's path) against append + gather + SDPA with an explicit causal mask (the path it
  replaced), each chunk's attention timed with the pages compressed between chunks as the engine does; x 32 layers.
Data as bench_decode.py: real-like (every 16 x 64 stream drawn from SmolLM2's real cache: $ZIPKV_REAL_KV or the model
package), random (every block compressible), raw (the random pages stored raw). L2 flushed before every timed call,
variants round-robin, medians (bench_decode.py's time_round_robin). Writes bench_prefill.json into --out. FlashInfer
is a baseline only: imported here, never by torch_zipkv.
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
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_decode as bd  # noqa: E402  (timing, real-like pages, storage: one method for both benchmarks)

import torch_zipkv  # noqa: E402
from torch_zipkv import format as fmt  # noqa: E402
from torch_zipkv import ops  # noqa: E402

LLAMA = bd.LLAMA
PAGE = bd.PAGE


def flashinfer_prefill(qo_indptr, indptr, indices, last, shape, scale, device):
    try:
        import flashinfer
    except ImportError as e:
        print(f"FlashInfer not available ({e}); its columns are skipped", file=sys.stderr)
        return None, None
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(qo_indptr, indptr, indices, last, shape["Hq"], shape["Hkv"], shape["D"], PAGE, causal=True,
           pos_encoding_mode="NONE", sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return w, flashinfer.__version__


def attention_flops(q_len: int, ctx: int, batch: int, shape: dict) -> float:
    """Causal attention FLOPs (2 GEMMs of 2 flops per MAC) of q_len queries at the end of ctx keys."""
    keys = q_len * (ctx - q_len) + q_len * (q_len + 1) / 2  # each query's visible keys, summed
    return 4.0 * batch * shape["Hq"] * shape["D"] * keys


def run_case(shape: dict, q_len: int, ctx: int, batch: int, iters: int, streams, flush, gen, use_flashinfer: bool):
    device = "cuda"
    Hq, Hkv, D = shape["Hq"], shape["Hkv"], shape["D"]
    pages_per_req = ctx // PAGE
    num_pages = batch * pages_per_req
    indptr = torch.arange(0, num_pages + 1, pages_per_req, dtype=torch.int32, device=device)
    indices = torch.randperm(num_pages, generator=gen).to(torch.int32).to(device)
    last = torch.full((batch,), PAGE, dtype=torch.int32, device=device)
    qo_indptr = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
    q = torch.randn(batch * q_len, Hq, D, generator=gen).to(torch.bfloat16).to(device)
    scale = 1 / math.sqrt(D)
    raw_bytes = num_pages * fmt.raw_page_bytes(PAGE, Hkv, D)
    flops = attention_flops(q_len, ctx, batch, shape)
    kv_rand = bd.compressible_randn((num_pages, 2, PAGE, Hkv, D), gen).to(device)
    kv_real = bd.real_like_pages(num_pages, Hkv, D, streams, gen)
    row = {"shape": shape["name"], "q_len": q_len, "ctx": ctx, "batch": batch, "raw_kv_bytes": raw_bytes,
           "flops": flops}
    fns, info, outs = {}, {}, {}

    def add(name, fn, nbytes, extra=None):
        outs[name] = fn()
        fns[name] = fn
        info[name] = {"bytes_read": nbytes, **(extra or {})}

    stored = {}
    for name, kv, allow in (("zipkv_real_like", kv_real, True), ("zipkv_random", kv_rand, True),
                            ("zipkv_raw", kv_rand, False)):
        ckv = bd.store(kv, allow)
        stored[name] = ckv
        out = torch.empty_like(q)
        add(name, lambda ckv=ckv, out=out: torch_zipkv.paged_prefill(q, qo_indptr, ckv, indptr, indices, last,
                                                                     sm_scale=scale, out=out),
            ckv.nbytes, {"stored_ratio": ckv.ratio})
    row["plan"] = torch_zipkv.prefill_plan(q, qo_indptr, stored["zipkv_real_like"], indices)
    fi_version = None
    if use_flashinfer:
        w, fi_version = flashinfer_prefill(qo_indptr, indptr, indices, last, shape, scale, device)
        if w is not None:
            add("flashinfer_real_like", lambda: w.run(q, kv_real), raw_bytes)
            add("flashinfer_random", lambda: w.run(q, kv_rand), raw_bytes)
            if q_len <= 8:  # what prior lossless KV codecs do: decompress every page, then attend
                page_ids = torch.arange(num_pages, dtype=torch.int32, device=device)
                staged = torch.empty_like(kv_real)
                ckv = stored["zipkv_real_like"]

                def decompress_then_attend():
                    ops.decompress_pages(ckv.data, ckv.meta, page_ids, PAGE, D, out=staged)
                    return w.run(q, staged)

                add("decompress_then_flashinfer_real_like", decompress_then_attend, ckv.nbytes + 2 * raw_bytes)
    if q_len <= 8:  # zipkv's own decode of one token per request over the same pages: the speculative bar
        q1 = q[q_len - 1 :: q_len].contiguous()
        for name in ("zipkv_real_like", "zipkv_raw"):
            ckv, out1 = stored[name], torch.empty_like(q1)
            add(name.replace("zipkv", "zipkv_decode"), lambda ckv=ckv, out1=out1: torch_zipkv.paged_decode(
                q1, ckv, indptr, indices, last, sm_scale=scale, out=out1), ckv.nbytes)

    times = bd.time_round_robin(fns, iters, flush)
    results = {}
    for name, ts in times.items():
        us = statistics.median(ts)
        results[name] = {"us": us, "TBps": info[name]["bytes_read"] / us / 1e6,
                         "TFLOPs": (flops / us / 1e6 if "decode" not in name else None), **info[name]}
    for name in ("zipkv_real_like", "zipkv_random", "zipkv_raw"):
        same = "flashinfer_real_like" if name == "zipkv_real_like" else "flashinfer_random"
        if same in results:
            results[name]["speedup_vs_flashinfer_same_data"] = results[same]["us"] / results[name]["us"]
            results[name]["paired_speedup_vs_flashinfer"] = bd.paired_speedup(times[same], times[name])
        decode = name.replace("zipkv", "zipkv_decode")
        if decode in results:
            results[name]["time_vs_own_decode"] = results[name]["us"] / results[decode]["us"]
    # Sanity: raw and compressed storage of the same values give the same bits; FlashInfer agrees to bf16 rounding.
    row["raw_equals_compressed_bits"] = torch.equal(outs["zipkv_random"], outs["zipkv_raw"])
    if "flashinfer_real_like" in outs:
        ref = outs["flashinfer_real_like"].float()
        row["rel_diff_vs_flashinfer"] = ((outs["zipkv_real_like"].float() - ref).norm() / ref.norm()).item()
    row["results"] = results
    row["flashinfer_version"] = fi_version
    fns.clear()
    return row


def engine_ttft(shape: dict, prompt: int, chunk: int, iters: int, streams, gen) -> dict:
    """Attention share of an 8K prompt's time to first token, chunked, for one layer (x num_layers for the model):
    the engine's path (append, paged_prefill on the pages) against the gather path it replaced (append, gather the
    earlier pages into BF16 scratch, SDPA with an explicit causal mask). Pages compress between chunks."""
    device = "cuda"
    Hq, Hkv, D = shape["Hq"], shape["Hkv"], shape["D"]
    scale = 1 / math.sqrt(D)
    kv_real = bd.real_like_pages(prompt // PAGE, Hkv, D, streams, gen)  # [pages, 2, 16, Hkv, D]
    k_all = kv_real[:, 0].reshape(prompt, Hkv, D)
    v_all = kv_real[:, 1].reshape(prompt, Hkv, D)
    q_all = torch.randn(prompt, Hq, D, generator=gen).to(torch.bfloat16).to(device)

    def gather_path(kv, sid, start, q, k, v):
        old = kv.seq_len(0, sid) > 0
        k_old, v_old = kv.gather(0, sid) if old else (k[:0], v[:0])
        keys, values = torch.cat([k_old, k]), torch.cat([v_old, v])
        kv.append(0, sid, k, v)
        n = q.shape[0]
        q_pos = torch.arange(start, start + n, device=device)[:, None]
        k_pos = torch.arange(0, keys.shape[0], device=device)[None, :]
        mask = (k_pos <= q_pos)[None, None]
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                              values.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                              enable_gqa=True)

    def paged_path(kv, sid, start, q, k, v):
        kv.append(0, sid, k, v)
        return kv.prefill(0, q, sid, sm_scale=scale)

    totals = {"paged_prefill": [], "gather_sdpa": []}
    for i in range(iters + 1):
        for name, path in (("paged_prefill", paged_path), ("gather_sdpa", gather_path)):
            kv = torch_zipkv.CompressedPagedKVCache(1, Hkv, D, page_size=PAGE, max_bytes=4 * prompt * Hkv * D * 2 + (
                64 << 20), device=device)
            sid = kv.add_sequence(prompt_len=prompt)
            total = 0.0
            for start in range(0, prompt, chunk):
                sl = slice(start, start + chunk)
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                path(kv, sid, start, q_all[sl], k_all[sl], v_all[sl])
                b.record()
                b.synchronize()
                total += a.elapsed_time(b) * 1e3
                kv.compress_full_pages()  # between chunks, as the engine's steps do
            if i:
                totals[name].append(total)
            del kv
    res = {name: {"us_one_layer": statistics.median(ts), "us_32_layers": 32 * statistics.median(ts)}
           for name, ts in totals.items()}
    res["paged_prefill"]["time_vs_gather_path"] = res["paged_prefill"]["us_one_layer"] / res["gather_sdpa"][
        "us_one_layer"]
    return {"prompt": prompt, "chunk": chunk, "shape": shape["name"], "results": res}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="three cases and a short TTFT, under a minute")
    parser.add_argument("--no-flashinfer", action="store_true", help="skip the FlashInfer baseline (JIT-compiles)")
    parser.add_argument("--cases", choices=("all", "chunked", "speculative"), default="all",
                        help="chunked: q_len 512 and 2048 and the engine TTFT; speculative: q_len 2-8 only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_prefill: no GPU, nothing to measure")
        return
    gen = torch.Generator().manual_seed(0)
    flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    streams = bd.real_streams("cuda")
    chunked = [(q, c, b) for q in (512, 2048) for c in (8192, 32768) for b in (1, 8)]
    speculative = [(q, 8192, b) for q in (2, 4, 8) for b in (32, 64)]
    cases = {"all": chunked + speculative, "chunked": chunked, "speculative": speculative}[args.cases]
    ttft = dict(prompt=8192, chunk=512, iters=5)
    if args.quick:
        cases = [(512, 8192, 1), (512, 8192, 8), (4, 8192, 32)]
        ttft["iters"] = 2
        args.iters = min(args.iters, 10)
    rows, t = [], None

    def write() -> None:  # after every case: a run cut short still leaves what it measured
        result = {
            "benchmark": "bench_prefill",
            "command": "python " + " ".join(sys.argv),
            "commit": os.environ.get("ZIPKV_COMMIT"),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "iters": args.iters,
            "method": "median of CUDA-event timings, variants of a case round-robin (random order each round), L2 "
                      f"flushed by reading 256 MB before each call, then a GPU spin of {bd.PAD_CYCLES} cycles; causal; "
                      "separate KV per request, random page order, page 16; the query tokens are each request's last "
                      "q_len tokens",
            "cases": rows,
            "engine_ttft": t,
        }
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_prefill.json").write_text(json.dumps(result, indent=1))

    print(f"{'q_len':>5} {'ctx':>6} {'bs':>3} | {'zipkv real':>11} {'zipkv rnd':>11} {'zipkv raw':>11} "
          f"{'fi real':>11} {'decode':>10} | vs FI real/rnd/raw | vs own decode")
    for q_len, ctx, batch in cases:
        row = run_case(LLAMA, q_len, ctx, batch, args.iters, streams, flush, gen, not args.no_flashinfer)
        rows.append(row)
        r = row["results"]
        cell = lambda n: f"{r[n]['us']:8.1f} µs" if n in r else f"{'-':>11}"  # noqa: E731
        sp = lambda n, k="speedup_vs_flashinfer_same_data": f"{r[n].get(k, float('nan')):.3f}"  # noqa: E731
        print(f"{q_len:5} {ctx:6} {batch:3} | {cell('zipkv_real_like'):>11} {cell('zipkv_random'):>11} "
              f"{cell('zipkv_raw'):>11} {cell('flashinfer_real_like'):>11} {cell('zipkv_decode_real_like'):>10} | "
              f"{sp('zipkv_real_like')}/{sp('zipkv_random')}/{sp('zipkv_raw')} | "
              f"{sp('zipkv_real_like', 'time_vs_own_decode')}", flush=True)
        write()
        torch.cuda.empty_cache()
    if args.cases != "speculative":
        t = engine_ttft(LLAMA, ttft["prompt"], ttft["chunk"], ttft["iters"], streams, gen)
        paged, gather = t["results"]["paged_prefill"], t["results"]["gather_sdpa"]
        print(f"engine TTFT attention, 8K prompt in chunks of 512, x32 layers: paged_prefill "
              f"{paged['us_32_layers'] / 1e3:.2f} ms, gather + SDPA {gather['us_32_layers'] / 1e3:.2f} ms "
              f"({paged['time_vs_gather_path']:.3f}x)")
    write()
    print(f"wrote {args.out / 'bench_prefill.json'}")


if __name__ == "__main__":
    main()
