"""Decode over a shared prompt prefix (GPU): paged_decode on compressed against raw pages when every request's first
pages are the same page ids, as prefix caching makes them, against the same shape with no page shared.

    python benchmarks/bench_shared_decode.py --out DIR [--iters 30]

Why: with caching on, bench_prefix's shared-prompt load decodes 4,096 shared + 768 own tokens per request, and the
compressed engine's steps took longer than the raw engine's with the same work (docs/performance.md, prefix
caching). A shared prefix is 16 MiB a layer at the Llama-3.1-8B attention shape, small enough to stay in the 50 MB
L2 while the batch reads it, so decode there may no longer be bound by HBM, where fewer bytes are what compression
buys. This measures the decode kernel alone on that page table. Llama-3.1-8B attention shape, page 16, real-like
pages (every 16 x 64 stream from SmolLM2's real cache: $ZIPKV_REAL_KV or the model package), private pages in random
order; L2 flushed before every timed call, variants round-robin, medians (bench_decode.py's time_round_robin).
Also the engine's decode with prefix caching on the shared layout (``shared_*_once``: torch_zipkv.shared_prefix, the
shared pages attended once for every row, then each row's own pages, merged), eager and, as the engine runs it, in a
CUDA Graph (``shared_*_once_graph``), whole and by part (``_prefix``: the prefix rebuilt once and attended by every
row, ``_own``, ``_merge``). Writes bench_shared_decode.json into --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import sys

import numpy as np
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_decode as bd  # noqa: E402  (timing, real-like pages, storage)
from bench_projections import graph_of  # noqa: E402

import torch_zipkv  # noqa: E402
from torch_zipkv import format as fmt  # noqa: E402
from torch_zipkv.shared_prefix import TENSORS as SHARED_TENSORS  # noqa: E402
from torch_zipkv.shared_prefix import (SharedTables, attend_prefix, attend_shared, merge_parts,  # noqa: E402
                                       own_table, shared_prefix_tables)

PAGE = bd.PAGE


def page_table(batch: int, shared: int, own: int, gen, device="cuda"):
    """Every request reads the same `shared` tokens' pages first (page ids 0 ..), then `own` tokens of its own pages
    (random ids after the shared ones): indptr, indices, last_page_len, the number of distinct pages, and each row's
    page ids (host)."""
    s, o = shared // PAGE, own // PAGE
    private = (torch.randperm(batch * o, generator=gen) + s).to(torch.int32).view(batch, o)
    prefix = torch.arange(s, dtype=torch.int32).expand(batch, s)
    rows = torch.cat([prefix, private], 1)
    indptr = torch.arange(0, batch * (s + o) + 1, s + o, dtype=torch.int32, device=device)
    last = torch.full((batch,), PAGE, dtype=torch.int32, device=device)
    return indptr, rows.flatten().to(device), last, s + batch * o, [r.numpy() for r in rows]


def shared_pass(pages: list, shape: dict, device="cuda"):
    """The engine's shared-prefix pass for rows of these page ids (torch_zipkv.shared_prefix, as prepare_step lays
    it out): its SharedTables and the rows' own page tables."""
    full = np.array([len(p) for p in pages])
    t = shared_prefix_tables(pages, full, len(pages), shape["Hkv"], PAGE, shape["D"])
    indptr = np.r_[0, np.cumsum(full)].astype(np.int32)
    own = own_table(indptr, np.concatenate(pages).astype(np.int32), t.pop("skip"))
    dev = [torch.from_numpy(np.ascontiguousarray(t[k])).to(device) for k in SHARED_TENSORS]
    tables = SharedTables(*dev, rows=len(pages), sharing_rows=t["sharing_rows"], shared_pages=t["shared_pages"])
    own_dev = [torch.from_numpy(a).to(device) for a in own]
    return tables, (*own_dev, torch.full((len(pages),), PAGE, dtype=torch.int32, device=device))


_COMPILED_PASS = torch.compile(attend_shared, fullgraph=True)  # as the engine's compiled step runs it


def pass_parts(q, ckv, tables, own, scale) -> dict:
    """The shared-prefix pass whole (``all``; ``compiled``: through torch.compile, which fuses the merge's and the
    layout's small kernels as in the engine's compiled step) and its three parts as callables on fixed buffers:
    ``prefix`` (the prefix's pages rebuilt into BF16 scratch and attended by every row at once), ``own``
    (paged_decode over each row's own pages) and ``merge``."""
    rows, heads = q.shape[0], q.shape[1]
    out_p, lse_p = attend_prefix(q, ckv.data, ckv.meta, PAGE, tables, scale)
    lse_o = torch.empty(rows, heads, dtype=torch.float32, device=q.device)
    out_o = torch.empty_like(q)

    def own_pages():
        torch_zipkv.ops.paged_decode(q, ckv.data, ckv.meta, *own, PAGE, sm_scale=scale, lse=lse_o, out=out_o)

    return {"all": lambda: attend_shared(q, ckv.data, ckv.meta, PAGE, tables, *own, sm_scale=scale),
            "compiled": lambda: _COMPILED_PASS(q, ckv.data, ckv.meta, PAGE, tables, *own, sm_scale=scale),
            "prefix": lambda: attend_prefix(q, ckv.data, ckv.meta, PAGE, tables, scale), "own": own_pages,
            "merge": lambda: merge_parts(out_p, lse_p, out_o, lse_o)}


def run_case(shape: dict, batch: int, shared: int, own: int, iters: int, streams, flush, gen) -> dict:
    Hq, Hkv, D = shape["Hq"], shape["Hkv"], shape["D"]
    q = torch.randn(batch, Hq, D, generator=gen).to(torch.bfloat16).cuda()
    row = {"shape": shape["name"], "batch": batch, "shared_tokens": shared, "own_tokens": own}
    fns, graph_fns, info = {}, {}, {}
    scale = 1 / math.sqrt(D)
    outs = {}
    for layout, sh in (("shared", shared), ("unshared", 0)):
        indptr, indices, last, n, pages = page_table(batch, sh, own + shared - sh, gen)
        kv = bd.real_like_pages(n, Hkv, D, streams, gen)
        for kind, allow in (("compressed", True), ("raw", False)):
            ckv, out = bd.store(kv, allow), torch.empty_like(q)
            name = f"{layout}_{kind}"
            fns[name] = (lambda ckv=ckv, out=out, t=(indptr, indices, last):
                         torch_zipkv.paged_decode(q, ckv, *t, sm_scale=scale, out=out))
            per_token = ckv.nbytes / (n * PAGE)  # stored bytes per token (all layers' pages alike)
            info[name] = {"distinct_pages": n, "stored_bytes": ckv.nbytes,
                          "bytes_read": per_token * batch * (shared + own),  # what the requests read, shared or not
                          "raw_bytes_distinct": n * fmt.raw_page_bytes(PAGE, Hkv, D),
                          "plan": torch_zipkv.decode_plan(q, ckv, indices)}
            outs[name] = fns[name]().clone()
            if layout == "shared":  # the engine's decode with prefix caching: the shared pages attended once
                tables, own_table = shared_pass(pages, shape)
                cname = f"{name}_once"
                fns[cname] = (lambda ckv=ckv, tables=tables, own_table=own_table: attend_shared(
                    q, ckv.data, ckv.meta, PAGE, tables, *own_table, sm_scale=scale))
                info[cname] = {**info[name], "prefix_table": list(tables.prefix_ids.shape), "plan": None}
                outs[cname] = fns[cname]()
                info[cname]["rel_diff_vs_one_call"] = float(((outs[cname].double() - outs[name].double()).norm()
                                                             / outs[name].double().norm()))
                # As the engine runs it, in a CUDA Graph (no launch gaps), whole and by part: the prefix pass, the
                # own pages' decode, and the merge (the eager variant above pays ~15 launches from Python). Captured
                # and timed after the variants above (a run that captured them first timed the unshared rows wrong).
                for part, fn in pass_parts(q, ckv, tables, own_table, scale).items():
                    gname = f"{cname}_graph" if part == "all" else f"{cname}_graph_{part}"
                    graph_fns[gname] = fn
                    info[gname] = {**info[cname]}
    for layout in ("shared", "unshared"):  # the same values stored two ways: the kernels must agree
        a, b = outs[f"{layout}_compressed"].double(), outs[f"{layout}_raw"].double()
        info[f"{layout}_compressed"]["rel_diff_vs_raw"] = float((a - b).norm() / b.norm())
    times = bd.time_round_robin(fns, iters, flush)
    times.update(bd.time_round_robin({k: graph_of(fn).replay for k, fn in graph_fns.items()}, iters, flush))
    results = {}
    for name, ts in times.items():
        us = statistics.median(ts)
        results[name] = {"us": us, "TBps_read": info[name]["bytes_read"] / us / 1e6, **info[name]}
    for c, r in (("shared_compressed", "shared_raw"), ("unshared_compressed", "unshared_raw"),
                 ("shared_compressed_once", "shared_raw_once")):
        results[c]["speedup_vs_raw"] = results[r]["us"] / results[c]["us"]
        results[c]["paired_speedup_vs_raw"] = bd.paired_speedup(times[r], times[c])
    for kind in ("compressed", "raw"):  # the pass against every row reading the shared pages itself
        results[f"shared_{kind}_once"]["speedup_vs_every_row"] = (results[f"shared_{kind}"]["us"]
                                                                   / results[f"shared_{kind}_once"]["us"])
    row["results"] = results
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_shared_decode: no GPU, nothing to measure")
        return
    gen = torch.Generator().manual_seed(0)
    flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    streams = bd.real_streams("cuda")
    rows = []
    print(f"{'batch':>5} {'shared':>6} {'own':>5} | {'shared comp':>11} {'shared raw':>11} {'x':>6} | "
          f"{'once comp':>11} {'once raw':>11} {'x':>6} | {'unshared comp':>13} {'unshared raw':>12} {'x':>6}")
    for batch in (32, 128, 192):
        row = run_case(bd.LLAMA, batch, 4096, 768, args.iters, streams, flush, gen)
        rows.append(row)
        r = row["results"]
        print(f"{batch:5} {4096:6} {768:5} | {r['shared_compressed']['us']:8.1f} µs {r['shared_raw']['us']:8.1f} µs "
              f"{r['shared_compressed']['speedup_vs_raw']:6.3f} | {r['shared_compressed_once']['us']:8.1f} µs "
              f"{r['shared_raw_once']['us']:8.1f} µs {r['shared_compressed_once']['speedup_vs_raw']:6.3f} | "
              f"{r['unshared_compressed']['us']:10.1f} µs "
              f"{r['unshared_raw']['us']:9.1f} µs {r['unshared_compressed']['speedup_vs_raw']:6.3f}", flush=True)
        for kind in ("compressed", "raw"):
            pre = f"shared_{kind}_once_graph"
            print(f"      {kind} pass in a CUDA Graph, µs: " + ", ".join(
                f"{k[len(pre) + 1:] or 'all'} {v['us']:.1f}" for k, v in r.items() if k.startswith(pre)), flush=True)
        torch.cuda.empty_cache()
    result = {"benchmark": "bench_shared_decode", "command": "python " + " ".join(sys.argv),
              "commit": os.environ.get("ZIPKV_COMMIT"), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "iters": args.iters,
              "method": "median of CUDA-event timings, variants round-robin, L2 flushed by reading 256 MB before each "
                        f"call, then a GPU spin of {bd.PAD_CYCLES} cycles; one layer's paged_decode; speedup_vs_raw = "
                        "raw time / compressed time on the same page table and values", "cases": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_shared_decode.json").write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out / 'bench_shared_decode.json'}")


if __name__ == "__main__":
    main()
