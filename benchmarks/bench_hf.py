"""HF decode speed: a transformers model switched to zipkv against transformers' own fast path, same run.

    python benchmarks/bench_hf.py --out DIR                  # GPU: Llama-3.1-8B architecture, 8K context, batch 16/32
    python benchmarks/bench_hf.py --tiny --device cpu        # CPU smoke run of the same code (tiny model, no graphs)

Both sides decode from a cache already holding ``--context`` tokens per sequence (random BF16 K/V written straight
into the cache: the bar is the decode step, not prefill), random BF16 weights, one new token per sequence per step:
- transformers: StaticCache + SDPA, the step compiled with ``torch.compile(mode="reduce-overhead")`` (CUDA Graphs),
  transformers' fastest decode path (45 ms/step at batch 16, 82 ms/step at batch 32 on the H200 when it was first
  measured; current figures and how to reproduce them: docs/performance.md);
- zipkv: ``torch_zipkv.enable(model)`` + ZipKVCache; per step ``cache.begin_step()`` on the host (compressing full
  pages, planning the step), then the step compiled the same way (``--zipkv-compile``: reduce-overhead by default).
Reported: median ms per step over ``--steps`` (host work included), tokens/s, speedup, and the bytes-read floor
(weights + the KV each step reads, at 4.3 TB/s). Writes bench_hf.json into --out.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

import torch
import transformers

import torch_zipkv
from torch_zipkv.integrations.transformers import ZipKVCache, cache_kwarg

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072)
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
HBM_TBPS = 4.3


def timed_steps(step, steps: int, sync) -> float:
    """Median seconds per call of step(i) over steps calls (after 3 warm-up calls, which also compile)."""
    times = []
    for i in range(steps + 3):
        sync()
        t = time.perf_counter()
        step(i)
        sync()
        if i >= 3:
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_decode(model, cache, batch, ctx, steps, device, compile_mode, sync, before_step=None) -> float:
    """Median seconds per decode step (one token per sequence after ``ctx`` cached ones), the step compiled with
    ``compile_mode`` (eager if None); ``before_step`` runs on the host first and counts toward the step."""
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)

    cache_kw = {cache_kwarg(model): cache}

    def forward(token, position):
        return model(input_ids=token, position_ids=position, use_cache=True, **cache_kw).logits[:, -1]

    fn = torch.compile(forward, mode=compile_mode, fullgraph=True) if compile_mode else forward

    def step(i):
        with torch.no_grad():
            p = ctx + i
            if before_step is not None:
                before_step()
            fn(token, torch.full((batch, 1), p, device=device))

    return timed_steps(step, steps, sync)


def transformers_path(model, batch, ctx, steps, device, compile_mode, sync) -> float:
    cache = transformers.StaticCache(config=model.config, max_cache_len=ctx + steps + 8)
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    with torch.no_grad():  # one token initializes the static tensors; then they hold ctx random tokens
        model(input_ids=token, use_cache=True, **{cache_kwarg(model): cache})
        for layer in cache.layers:
            layer.keys[:, :, :ctx].normal_()
            layer.values[:, :, :ctx].normal_()
            layer.cumulative_length.fill_(ctx)
    return time_decode(model, cache, batch, ctx, steps, device, compile_mode, sync)


def zipkv_path(model, batch, ctx, steps, device, compile_mode, sync) -> tuple[float, dict]:
    torch_zipkv.enable(model)
    cache = ZipKVCache.from_model(model, batch_size=batch, max_length=ctx + steps + 8, max_new_tokens=steps + 8)
    kv = cache.kv
    seq_ids = [kv.add_sequence(prompt_len=ctx, max_new_tokens=steps + 8) for _ in range(batch)]
    for layer in range(kv.num_layers):  # the context, as a prefill would leave it: full pages compressed
        for sid in seq_ids:
            k, v = torch.randn(2, ctx, kv.num_kv_heads, kv.head_dim, device=device).to(torch.bfloat16)
            kv.append(layer, sid, k, v)
    cache.adopt(seq_ids)  # the batch, ctx tokens each: the next model call is a decode step
    kv.compress_full_pages()
    return time_decode(model, cache, batch, ctx, steps, device, compile_mode, sync, cache.begin_step), kv.stats()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--batch", type=int, nargs="+", default=[16, 32])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compile", default="reduce-overhead", help="torch.compile mode for both sides; 'none': eager")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda" and not args.tiny:
        print("bench_hf: the 8B model needs a GPU (use --tiny --device cpu for a smoke run)")
        return
    compile_mode = None if args.compile == "none" else args.compile
    if device.type == "cpu" and compile_mode == "reduce-overhead":
        compile_mode = None  # CUDA Graphs need a GPU
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg = transformers.LlamaConfig(**(TINY if args.tiny else LLAMA_8B))
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    rows = []
    for batch in args.batch:
        model.set_attn_implementation("sdpa")
        torch._dynamo.reset()
        base = transformers_path(model, batch, args.context, args.steps, device, compile_mode, sync)
        torch._dynamo.reset()
        zip_s, stats = zipkv_path(model, batch, args.context, args.steps, device, compile_mode, sync)
        kv_raw = batch * args.context * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * 2
        floor = (weight_bytes + kv_raw) / (HBM_TBPS * 1e12)
        row = {"batch": batch, "context": args.context, "transformers_ms": base * 1e3, "zipkv_ms": zip_s * 1e3,
               "speedup": base / zip_s, "transformers_tok_s": batch / base, "zipkv_tok_s": batch / zip_s,
               "raw_bytes_floor_ms": floor * 1e3, "zipkv_vs_floor": zip_s / floor, "kv_ratio": stats["ratio"]}
        rows.append(row)
        print(f"batch {batch}, context {args.context}: transformers {row['transformers_ms']:.1f} ms/step, zipkv "
              f"{row['zipkv_ms']:.1f} ms/step ({row['speedup']:.2f}x; {row['zipkv_tok_s']:.0f} tok/s); raw-bytes floor "
              f"{row['raw_bytes_floor_ms']:.1f} ms (zipkv at {row['zipkv_vs_floor']:.2f}x of it); KV ratio "
              f"{row['kv_ratio']:.3f}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result = {"benchmark": "bench_hf", "command": "python " + " ".join(sys.argv), "device": str(device),
              "torch": torch.__version__, "transformers": transformers.__version__, "compile": compile_mode,
              "model": "tiny" if args.tiny else "llama-3.1-8b architecture, random bf16 weights", "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_hf.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
