"""Requests at once over a long load: a burst of requests over one shared prompt prefix, far more than fit, served to
the end by the engine, and the decode rows of its steps in steady state (the middle of the load: the first wave
admitted, requests finishing and new ones taking their room), for the raw engine, the compressed engine, and the
compressed engine with ``reclaim=True`` (a bounded compaction while requests wait).

    python benchmarks/bench_long_load.py --out DIR          # CPU, a tiny random Llama, ~5 min on 2 cores

A compressed engine can only run more requests than a raw one at the same memory if the bytes compression saves come
back as room: a page compressed in place (no packed chunk to go to) saves nothing, and a finished request's compressed
pages leave holes in packed chunks that only compaction reclaims. The peak (``largest_batch``) comes early, before
any request finished; the steady state is what a long serving load sees. Scaled like the shared-prompt load of
``bench_prefix.py`` (a request's own pages about a third of a chunk's layer share, 64 raw pages a chunk): 150
requests of a 1,024-token prefix + 512 tokens of their own, 256 generated, in 32 MiB of KV (about 40 such requests
raw). Writes bench_long_load.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import time

import torch

from bench_e2e import build_model
from bench_hf import TINY
from torch_zipkv.engine import Engine, SamplingParams

SYSTEMS = {"raw": dict(compress=False), "zipkv": dict(compress=True),
           "zipkv, reclaim": dict(compress=True, reclaim=True)}


def run(system: str, requests: int, budget: int, device: torch.device) -> dict:
    eng = Engine(build_model(TINY, device), max_kv_bytes=budget, kv_chunk_bytes=512 << 10, prefill_chunk=2048,
                 compress_every=8, prefix_caching=True, **SYSTEMS[system])
    rng = random.Random(0)
    prefix = [rng.randrange(TINY["vocab_size"]) for _ in range(1024)]
    for _ in range(requests):
        eng.add_request(prefix + [rng.randrange(TINY["vocab_size"]) for _ in range(512)],
                        SamplingParams(max_new_tokens=256))
    rows, frag, t = [], [], time.perf_counter()
    while eng.has_unfinished():
        eng.step()
        rows.append(len(eng.scheduler.decoding()))
        frag.append(eng.kv.stats()["fragmentation"])
    middle = slice(len(rows) // 5, 3 * len(rows) // 5)  # after the first wave's admission, before the drain
    return {"system": system, "steps": len(rows), "largest_batch": max(rows),
            "steady_rows": sum(rows[middle]) / len(rows[middle]),
            "steady_fragmentation": sum(frag[middle]) / len(frag[middle]), "kv_ratio": eng.kv.stats()["ratio"],
            "wall_s": time.perf_counter() - t}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True)
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--budget-mib", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    jobs = [run(s, args.requests, args.budget_mib << 20, torch.device(args.device)) for s in SYSTEMS]
    raw = jobs[0]["steady_rows"]
    for j in jobs:
        j["steady_rows_vs_raw"] = j["steady_rows"] / raw
        print(f"{j['system']:>18}: steady {j['steady_rows']:.1f} rows ({j['steady_rows_vs_raw']:.3f}x raw), peak "
              f"{j['largest_batch']}, fragmentation {j['steady_fragmentation']:.3f}, {j['steps']} steps")
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"benchmark": "bench_long_load", "command": "python benchmarks/bench_long_load.py " +
              " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "torch": torch.__version__, "jobs": jobs}
    (args.out / "bench_long_load.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
