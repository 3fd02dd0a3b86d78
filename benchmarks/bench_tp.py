"""Tensor-parallel decode: TP 1 against TP 2 of one model on the compressed cache, with KV that compresses and KV
that does not.

    python benchmarks/bench_tp.py --save-model DIR                      # once: random Llama-3.1-8B-shape weights
    torchrun --nproc-per-node 1 benchmarks/bench_tp.py --model DIR --out OUT/tp1
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --model DIR --out OUT/tp2
    python benchmarks/bench_tp.py --compare OUT/tp1 OUT/tp2 --out DIR2  # DIR2/bench_tp.json: the ratios
    (--tiny --device cpu: a CPU smoke run of the same code, gloo)

Each run loads the model with transformers' own tensor parallelism (``from_pretrained(..., tp_plan="auto")`` when
there is more than one rank) and measures, on every rank in step:
- ``tokens``: greedy tokens of one ``--context``-token prompt (``torch_zipkv.generate``, eager), with the gap
  between the two best logits at each step, so the comparison can tell a BF16 tie from a difference;
- ``largest_batch``: requests of ``--context`` + ``--new`` tokens admitted into ``--kv-fraction`` of the memory
  free after the weights (each filled with its context, compressed, before the next is asked for); capacity is
  agreed across ranks, so every rank counts the same;
- ``ms_per_step`` at each ``--batch``: a decode step from a cache already holding ``--context`` random tokens per
  sequence (as bench_hf.py), ``cache.begin_step()`` on the host, the step compiled with ``--compile``
  (reduce-overhead: CUDA Graphs). Median over ``--steps``.
Both with "compressed" KV (Gaussian: nearly every block compresses) and "raw" KV (2% exact zeros: every block stays
raw, the same code path storing 16 bits per value). Rank 0 writes bench_tp.json into --out.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
import transformers

import torch_zipkv
from torch_zipkv.distributed import all_min
from torch_zipkv.integrations.transformers import ZipKVCache, cache_kwarg

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072)
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)


def kv_tokens(kind: str, n: int, heads: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v bf16 [n, heads, head_dim]: Gaussian ("compressed"), or with 2% exact zeros ("raw": a zero leaves its
    512-value block raw, and 0.98**512 < 1e-4 of blocks escape one)."""
    k, v = torch.randn(2, n, heads, head_dim, device=device).to(torch.bfloat16)
    if kind == "raw":
        k[torch.rand(k.shape, device=device) < 0.02] = 0
        v[torch.rand(v.shape, device=device) < 0.02] = 0
    return k, v


def fill(cache: ZipKVCache, batch: int, ctx: int, new: int, kind: str) -> None:
    """``batch`` sequences of ``ctx`` tokens in every layer, as a prefill leaves them (full pages compressed)."""
    kv = cache.kv
    seq_ids = [kv.add_sequence(prompt_len=ctx, max_new_tokens=new) for _ in range(batch)]
    for layer in range(kv.num_layers):
        for sid in seq_ids:
            kv.append(layer, sid, *kv_tokens(kind, ctx, kv.num_kv_heads, kv.head_dim, kv.device))
    cache.adopt(seq_ids)  # the batch, ctx tokens each: the next model call is a decode step
    kv.compress_full_pages()


def largest_batch(model, ctx: int, new: int, kind: str, max_bytes: int) -> tuple[int, float]:
    """Requests of ctx + new tokens admitted one after another (each filled and compressed first) into max_bytes;
    and the stored/raw ratio at the end."""
    cache = ZipKVCache.from_model(model, max_bytes=max_bytes, max_new_tokens=new)
    kv, n = cache.kv, 0
    while kv.capacity(ctx, new).requests >= 1:  # agreed across ranks: every rank leaves the loop together
        sid = kv.add_sequence(prompt_len=ctx, max_new_tokens=new)
        for layer in range(kv.num_layers):
            kv.append(layer, sid, *kv_tokens(kind, ctx, kv.num_kv_heads, kv.head_dim, kv.device))
        kv.compress_full_pages()
        n += 1
    ratio = kv.stats()["ratio"]
    del cache, kv
    return n, ratio


def ms_per_step(model, batch: int, ctx: int, steps: int, kind: str, compile_mode, sync) -> float:
    cache = ZipKVCache.from_model(model, batch_size=batch, max_length=ctx + steps + 8, max_new_tokens=steps + 8)
    fill(cache, batch, ctx, steps + 8, kind)
    device = cache.kv.device
    token = torch.zeros(batch, 1, dtype=torch.long, device=device)
    kw = {cache_kwarg(model): cache}

    def forward(token, position):
        return model(input_ids=token, position_ids=position, use_cache=True, **kw).logits[:, -1]

    fn = torch.compile(forward, mode=compile_mode, fullgraph=True) if compile_mode else forward
    times = []
    with torch.no_grad():
        for i in range(steps + 3):  # 3 warm-up steps, which also compile
            sync()
            t = time.perf_counter()
            cache.begin_step()
            fn(token, torch.full((batch, 1), ctx + i, device=device))
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def greedy(model, ctx: int, new: int, device) -> dict:
    """Greedy tokens of one random ctx-token prompt and the gap between the two best logits at each step."""
    ids = torch.randint(0, model.config.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(0)).to(device)
    tokens, logits = torch_zipkv.generate(model, ids, max_new_tokens=new, return_logits=True)
    top = logits[0].float().topk(2).values
    return {"tokens": tokens[0, ctx:].tolist(), "top2_gap": (top[:, 0] - top[:, 1]).tolist()}


def run(args) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device if args.device == "cpu" else f"cuda:{local}")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # tp_plan= directly: deprecated in 5.24, the 5.17 spelling
        kw = {"tp_plan": "auto"} if world > 1 else {"device_map": str(device)}
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, **kw).eval()
    torch_zipkv.enable(model)
    rank = dist.get_rank() if dist.is_initialized() else 0
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    compile_mode = None if args.compile == "none" or device.type == "cpu" else args.compile
    result = {"benchmark": "bench_tp", "command": " ".join(sys.argv), "tp": world, "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "transformers": transformers.__version__, "compile": compile_mode,
              "context": args.context, "new": args.new, "kv_heads_per_rank": None, "runs": {}}
    result["greedy"] = greedy(model, args.context, args.new, device)
    for kind in ("compressed", "raw"):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            max_bytes = int(torch.cuda.mem_get_info(device)[0] * args.kv_fraction)
        else:
            max_bytes = args.kv_bytes
        if world > 1:  # one budget for all ranks: the least free memory
            max_bytes = all_min([max_bytes], dist.group.WORLD, device)[0]
        n, ratio = largest_batch(model, args.context, args.new, kind, max_bytes)
        row = {"kv_bytes_per_rank": max_bytes, "largest_batch": n, "ratio": ratio, "ms_per_step": {}}
        for batch in args.batch:
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                ms = ms_per_step(model, batch, args.context, args.steps, kind, compile_mode, sync)
            except Exception as e:  # a sharded model that does not compile here still gets its eager figure
                if compile_mode is None:
                    raise
                row.setdefault("compile_error", f"{type(e).__name__}: {e}"[:2000])
                torch._dynamo.reset()
                ms = ms_per_step(model, batch, args.context, args.steps, kind, None, sync)
                row.setdefault("eager_batches", []).append(batch)
            row["ms_per_step"][batch] = ms
            if rank == 0:
                print(f"TP {world}, {kind}: batch {batch}, context {args.context}: {ms:.2f} ms/step "
                      f"({batch / ms * 1e3:.0f} tok/s)", flush=True)
        result["runs"][kind] = row
        if rank == 0:
            print(f"TP {world}, {kind}: largest batch {n} in {max_bytes / 2**30:.1f} GiB per rank (ratio {ratio:.3f})",
                  flush=True)
    result["kv_heads_per_rank"] = ZipKVCache.from_model(model, batch_size=1, max_length=16).kv.num_kv_heads
    if rank == 0 and args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_tp.json").write_text(json.dumps(result, indent=1) + "\n")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def compare(one: pathlib.Path, two: pathlib.Path, out: pathlib.Path | None) -> None:
    a, b = (json.loads((d / "bench_tp.json").read_text()) for d in (one, two))
    rows = {}
    for kind in ("compressed", "raw"):
        ra, rb = a["runs"][kind], b["runs"][kind]
        rows[kind] = {"largest_batch": [ra["largest_batch"], rb["largest_batch"]],
                      "largest_batch_ratio": rb["largest_batch"] / max(1, ra["largest_batch"]),
                      "tok_s": {k: [int(k) / ra["ms_per_step"][k] * 1e3, int(k) / rb["ms_per_step"][k] * 1e3]
                                for k in ra["ms_per_step"]},
                      "speedup": {k: ra["ms_per_step"][k] / rb["ms_per_step"][k] for k in ra["ms_per_step"]}}
    ta, tb = a["greedy"]["tokens"], b["greedy"]["tokens"]
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    tokens = {"equal": ta == tb, "first_difference": first,
              "tp1_top2_gap_there": None if first is None else a["greedy"]["top2_gap"][first]}
    result = {"benchmark": "bench_tp", "tp1": a, "tp2": b, "tokens": tokens, "rows": rows,
              "bars": {"tp2_decode_speedup_compressed_ge_1.6": all(v >= 1.6 for v in
                                                                      rows["compressed"]["speedup"].values()),
                       "tp2_largest_batch_ge_2x": rows["compressed"]["largest_batch_ratio"] >= 2}}
    print(json.dumps({"tokens": tokens, "rows": rows, "bars": result["bars"]}, indent=1))
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_tp.json").write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=pathlib.Path)
    p.add_argument("--save-model", type=pathlib.Path, help="write random weights of the model shape here and stop")
    p.add_argument("--compare", type=pathlib.Path, nargs=2, metavar=("TP1_DIR", "TP2_DIR"))
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny model (CPU smoke run)")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--new", type=int, default=32, help="new tokens per request (greedy run and admission)")
    p.add_argument("--batch", type=int, nargs="+", default=[32])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kv-fraction", type=float, default=0.85, help="of the GPU memory free after the weights")
    p.add_argument("--kv-bytes", type=int, default=64 << 20, help="per rank, on CPU")
    p.add_argument("--compile", default="reduce-overhead", help="torch.compile mode of the step; 'none': eager")
    args = p.parse_args()
    if args.compare:
        return compare(*args.compare, args.out)
    if args.save_model:
        torch.manual_seed(0)
        with torch.device(args.device):
            model = transformers.AutoModelForCausalLM.from_config(
                transformers.LlamaConfig(**(TINY if args.tiny else LLAMA_8B)), dtype=torch.bfloat16)
        model.save_pretrained(args.save_model)
        return
    run(args)


if __name__ == "__main__":
    main()
