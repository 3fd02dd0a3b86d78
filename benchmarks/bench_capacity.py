"""Capacity benchmark: how many 8K-token requests fit in a KV budget uncompressed vs in CompressedPagedKVCache, and
the host time the cache spends per decode step.

    python benchmarks/bench_capacity.py --out DIR      # Llama-3.1-8B shape, 80 GiB of KV; CPU or GPU, < 1 min
    python benchmarks/bench_capacity.py --only bookkeeping --steps 64   # just the host time per decode step

Requests fit: an admission loop on a real cache. A request is 8192 tokens (prompt 7936 + 256 new, the budget
add_sequence promises at raw size); while ``capacity(prompt, new).requests >= 1`` it is admitted, its prompt is
prefilled in every layer and ``compress_full_pages()`` runs; "uncompressed" is the budget over the raw bytes of a
request (a plain paged cache, no metadata). Every layer and KV head holds the same bytes per token, so the loop runs on
``--sim-layers`` layers and ``--sim-heads`` heads with the budget and chunk size scaled by sim/model (same count,
same chunk granularity), and all requests share one prompt's KV. Data: Gaussian ("random", ~0.76) and real-KV-like
pages ("real_kv": each 16 x 128 stream is two 16 x 64 streams of SmolLM2-135M's KV over English text, from all 30
layers, so every block is a real block; ~0.79; skipped without the model).

Bookkeeping: ``--batch`` sequences of ``--context`` tokens in a cache of the model's layer count (1 KV head, d 64: the
host work does not depend on heads or dims), then decode steps, two ways: ``prepare_step`` once (every layer's new
pages and the shared page table) and per layer only ``step_append`` (the op), as a decode loop or a CUDA Graph
drives it; and the per-layer API (``append`` + ``page_table`` per layer). Every ``--compress-every`` steps
``compress_full_pages(wait=False)`` runs, as ZipKVCache's decode loop calls it (staggered lengths: ~1/16 of the
sequences fill a page in every layer each step; each call places the previous call's round and starts one);
"prepare_step_wait" repeats the planned run with ``wait=True`` (a device sync per call). Reported: host µs per step
for all layers (median over steps), the part spent inside the ``append_kv`` calls (the kernel on CPU, its launch on
GPU: what any paged cache pays), the difference (the cache's bookkeeping, including the calls that lead to the op),
``prepare_step`` alone; ``compress_full_pages`` per call (median) and per step (its mean over all steps: the
amortized cost), the part of a call inside its ``decompress_pages`` / ``compress_pages`` calls (the compression
itself on CPU, their launches on GPU) and the rest (bookkeeping, index copies, the sync if waiting); and
``host_us_per_step``: the step's median plus compression per step. Writes bench_capacity.json into --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))  # smollm2.py: real KV

from torch_zipkv import CompressedPagedKVCache, ops

GiB = 1 << 30


def request_kv(kind: str, tokens: int, heads: int, head_dim: int, gen: torch.Generator):
    """k, v bf16 [tokens, heads, head_dim] of one prompt: Gaussian, or pages rebuilt from SmolLM2's real streams."""
    if kind == "random":
        x = torch.randn(2, tokens, heads, head_dim, generator=gen).to(torch.bfloat16)
        return x[0], x[1]
    import smollm2 as realkv

    real = realkv.real_kv(2048, page_size=16)  # [30, 128, 2, 16, 3, 64]
    half = real.shape[-1]
    pages = tokens // 16
    out = []
    for kv in (0, 1):  # K streams from K, V streams from V
        pool = real[:, :, kv].permute(0, 1, 3, 2, 4).reshape(-1, 16, half)  # every (layer, page, head) stream
        idx = torch.randint(0, pool.shape[0], (pages, heads, head_dim // half), generator=gen)
        s = pool[idx]  # [pages, heads, parts, 16, half]
        out.append(s.permute(0, 3, 1, 2, 4).reshape(tokens, heads, head_dim).contiguous())
    return out[0], out[1]


def requests_that_fit(args, kind: str, compress: bool, device) -> dict:
    scale = args.sim_layers / args.layers * args.sim_heads / args.kv_heads
    cache = CompressedPagedKVCache(args.sim_layers, args.sim_heads, args.head_dim, device=device,
                                   max_bytes=int(args.budget_gib * GiB * scale),
                                   chunk_bytes=int(args.chunk_mib * (1 << 20) * args.sim_heads / args.kv_heads))
    prompt = args.request_tokens - args.new_tokens
    k, v = (t.to(device) for t in request_kv(kind, prompt, args.sim_heads, args.head_dim,
                                              torch.Generator().manual_seed(0)))
    admitted = 0
    while cache.capacity(prompt, args.new_tokens).requests >= 1:
        sid = cache.add_sequence(prompt, args.new_tokens)
        for layer in range(args.sim_layers):
            cache.append(layer, sid, k, v)
        if compress:
            cache.compress_full_pages()
        admitted += 1
    st = cache.stats()
    return {"requests": admitted, "ratio": st["ratio"], "fragmentation": st["fragmentation"],
            "arena_bytes": cache.data.numel(), "meta_bytes": st["meta_bytes"]}


def bookkeeping(args, device) -> dict:
    L, B = args.layers, args.batch
    cache = CompressedPagedKVCache(L, 1, 64, device=device, chunk_bytes=1 << 20,
                                   max_bytes=int(L * B * (args.context + args.steps + 64) * 256 * 1.05) + (64 << 20))
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, args.context, 1, 64, generator=gen).to(torch.bfloat16).to(device)
    sids = [cache.add_sequence(args.context, args.steps + 16) for _ in range(B)]
    for layer in range(L):
        for i, sid in enumerate(sids):  # staggered lengths: pages fill on different steps, as in a real batch
            cache.append(layer, sid, k[: args.context - i % 16], v[: args.context - i % 16])
    cache.compress_full_pages()  # the prompts: prefill work, not timed
    cache.compact()  # the open pages sit one per chunk after the prompts left their slots: gather them
    kt = torch.randn(B, 1, 64, generator=gen).to(torch.bfloat16).to(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    # Seconds spent inside the ops the cache calls: the kernel (CPU) or its launch (GPU).
    in_op = dict.fromkeys(("append_kv", "compress_pages", "decompress_pages"), 0.0)
    originals = {name: getattr(ops, name) for name in in_op}

    def timed(name):
        def call(*a, **kw):
            t = time.perf_counter()
            out = originals[name](*a, **kw)
            in_op[name] += time.perf_counter() - t
            return out
        return call

    def run(planned: bool, wait: bool = False):
        step_s, op_s, prepare_s, compress_s, calls_s, compress_op_s, pages = [], [], [], [], [], [], []
        for step in range(args.steps):
            sync()
            for name in in_op:
                in_op[name] = 0.0
            t0 = time.perf_counter()
            if planned:  # one plan for every layer, then per layer only the op
                plan = cache.prepare_step(sids)
                prepare_s.append(time.perf_counter() - t0)
                for layer in range(L):
                    cache.step_append(layer, plan, kt, kt)
            else:  # the per-layer API: each layer plans its own append and page table (memoized across layers)
                for layer in range(L):
                    cache.append(layer, sids, kt, kt)
                    cache.page_table(layer, sids)
            t1 = time.perf_counter()
            if step % args.compress_every == 0:
                pages.append(cache.compress_full_pages(wait))
                calls_s.append(time.perf_counter() - t1)
                compress_op_s.append(in_op["compress_pages"] + in_op["decompress_pages"])
            compress_s.append(time.perf_counter() - t1)
            step_s.append(t1 - t0)
            op_s.append(in_op["append_kv"])
        med = lambda xs: statistics.median(xs[2:]) * 1e6  # noqa: E731  (first steps warm the memos)
        per_call = lambda xs: statistics.median(xs[1:]) * 1e6  # noqa: E731  (the first call warms them)
        amortized = statistics.mean(compress_s[args.compress_every:]) * 1e6  # whole periods after the first call
        book = [s - o for s, o in zip(step_s, op_s)]
        return {"step_us": med(step_s), "inside_append_kv_us": med(op_s), "bookkeeping_us_per_step": med(book),
                "bookkeeping_us_per_layer": med(book) / L, "prepare_step_us": med(prepare_s) if planned else None,
                "compress_every": args.compress_every, "compress_call_us": per_call(calls_s),
                "compress_pages_per_call": statistics.median(pages[1:]),
                "compress_inside_ops_us": per_call(compress_op_s),
                "compress_rest_us": per_call([c - o for c, o in zip(calls_s, compress_op_s)]),
                "compress_full_pages_us_per_step": amortized,
                "host_us_per_step": med(step_s) + amortized}

    for name in in_op:
        setattr(ops, name, timed(name))
    try:
        per_layer, planned, planned_wait = run(False), run(True), run(True, wait=True)
    finally:
        for name, op in originals.items():
            setattr(ops, name, op)
    return {"layers": L, "batch": B, "context": args.context, "steps": args.steps,
            "prepare_step": planned, "prepare_step_wait": planned_wait, "per_layer_append": per_layer}


def fit_report(args, device) -> dict:
    """Requests that fit: uncompressed, compressed (random and real-KV-like data), never compressed; printed."""
    raw_request = args.request_tokens * args.layers * args.kv_heads * args.head_dim * 2 * 2
    result = {"budget_gib": args.budget_gib, "request_tokens": args.request_tokens, "new_tokens": args.new_tokens,
              "simulated": {"layers": args.sim_layers, "kv_heads": args.sim_heads},
              "uncompressed_requests": int(args.budget_gib * GiB // raw_request), "fit": {}}
    print(f"{args.budget_gib:g} GiB of KV, {args.layers} layers x {args.kv_heads} KV heads x d {args.head_dim}, "
          f"requests of {args.request_tokens} tokens ({raw_request / GiB:.2f} GiB raw each)")
    print(f"  uncompressed paged cache: {result['uncompressed_requests']} requests")
    for kind in ("random", "real_kv"):
        t = time.perf_counter()
        try:
            fit = requests_that_fit(args, kind, True, device)
        except (ModuleNotFoundError, FileNotFoundError) as e:
            print(f"  {kind}: skipped ({e})")
            continue
        fit["gain"] = fit["requests"] / result["uncompressed_requests"]
        result["fit"][kind] = fit
        print(f"  zipkv, {kind:8s}: {fit['requests']} requests ({fit['gain']:.2f}x), stored/raw {fit['ratio']:.3f}, "
              f"fragmentation {fit['fragmentation']:.3f} ({time.perf_counter() - t:.1f} s)")
    fit = requests_that_fit(args, "random", False, device)
    result["fit"]["never_compressed"] = fit
    print(f"  zipkv, never compressed: {fit['requests']} requests (metadata and chunk rounding cost)")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--budget-gib", type=float, default=80.0, help="KV memory budget of the whole model")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--sim-layers", type=int, default=1)
    p.add_argument("--sim-heads", type=int, default=2)
    p.add_argument("--chunk-mib", type=float, default=4.0, help="chunk size at the model's shape")
    p.add_argument("--request-tokens", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=None, help="bookkeeping context (default 8192 on GPU, 2048 CPU)")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--compress-every", type=int, default=8, help="decode steps between compress_full_pages calls "
                   "(ZipKVCache's default); 1: every step")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--only", choices=("fit", "bookkeeping"), help="run one part (default: both)")
    args = p.parse_args()
    device = torch.device(args.device)
    args.context = args.context or (8192 if device.type == "cuda" else 2048)

    result = {"command": "python " + " ".join(sys.argv), "device": str(device), "torch": torch.__version__,
              "model": {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim}}
    if args.only != "bookkeeping":
        result.update(fit_report(args, device))
    if args.only != "fit":
        if device.type == "cpu":
            torch.set_num_threads(1)  # a 64-token append is too small to share; OpenMP barriers stall on a busy box
        bk = bookkeeping(args, device)
        result["bookkeeping"] = bk
        for name, r in (("prepare_step + per-layer append_kv", bk["prepare_step"]),
                        ("the same, compress_full_pages(wait=True)", bk["prepare_step_wait"]),
                        ("per-layer append + page_table", bk["per_layer_append"])):
            print(f"decode step, batch {bk['batch']}, {bk['layers']} layers, context {bk['context']}, {name}: "
                  f"{r['step_us']:.0f} µs/step, of which inside append_kv {r['inside_append_kv_us']:.0f} µs -> "
                  f"bookkeeping {r['bookkeeping_us_per_step']:.0f} µs ({r['bookkeeping_us_per_layer']:.1f} µs/layer"
                  + (f"; prepare_step alone {r['prepare_step_us']:.0f} µs)" if r["prepare_step_us"] else ")"))
            print(f"  compress_full_pages every {r['compress_every']} steps: {r['compress_call_us']:.0f} µs/call for "
                  f"{r['compress_pages_per_call']:.0f} pages (inside (de)compress_pages "
                  f"{r['compress_inside_ops_us']:.0f} µs, the rest {r['compress_rest_us']:.0f} µs) = "
                  f"{r['compress_full_pages_us_per_step']:.0f} µs/step; "
                  f"host total {r['host_us_per_step']:.0f} µs/step")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_capacity.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
