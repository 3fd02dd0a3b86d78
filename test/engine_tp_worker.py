"""One rank of test_engine_tp.py's tensor-parallel run: ``torchrun --nproc-per-node 2 engine_tp_worker.py MODELS OUT``.

Loads the tiny Llama that test_engine_tp.py saved with ``from_pretrained(..., tp_plan="auto")`` (gloo on CPU), runs
every scenario of the serving engine and writes what this rank saw to ``OUT/rank{r}.json``. A scenario's exception
is recorded, not raised, so the other scenarios still run on every rank.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import torch

from torch_zipkv import CompressedPagedKVCache, serve
from torch_zipkv.engine import Engine, SamplingParams

from tp_worker import load, run_scenarios

NEW = 12
KV = dict(max_kv_bytes=256 << 10, kv_chunk_bytes=4096)  # 1 KV head per rank: a raw page of a layer is 4 KiB


LENGTHS = (40, 27, 33, 40)  # several 16-token prefill chunks each, and pages that fill and compress
PROMPTS_FILE = "engine_prompts.json"  # in the models directory: test_engine_tp.py chooses them, every rank reads them


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(0, 64, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def prompts(models) -> list[list[int]]:
    """One prompt of each of LENGTHS, as test_engine_tp.py chose them for the model in hand (greedy choices clear)."""
    return json.loads((Path(models) / PROMPTS_FILE).read_text())


def outputs(outs) -> list:
    return [[o.request_id, o.new_token_ids, o.finished, o.finish_reason] for o in outs]


def staggered(models, rank):
    """Every rank makes the same calls: requests arrive at steps 0, 2, 2 and 5, prefilled in chunks of 16."""
    eng = Engine(load(models + "/llama"), prefill_chunk=16, compress_every=2, **KV)
    ps = prompts(models)
    arrivals = {0: [0], 2: [1, 2], 5: [3]}
    log, kv, step = [], [], 0
    while step <= max(arrivals) or eng.has_unfinished():
        for i in arrivals.get(step, []):
            assert eng.add_request(ps[i], SamplingParams(max_new_tokens=NEW)) == i
        log.append(outputs(eng.step()))
        s = eng.stats()
        kv.append([s["kv_bytes_stored"], s["kv_bytes_raw"]])
        step += 1
    return {"log": log, "kv": kv, "kv_heads": eng.kv.num_kv_heads, "group": eng.process_group is not None,
            "largest_batch": eng.stats()["largest_batch"], "cuda_graphs": eng.stats()["cuda_graphs"]}


def follower(models, rank):
    """Only rank 0 adds requests and aborts; rank 1 only steps, and replays rank 0's calls. Request 1 is aborted
    while running, request 3 while waiting (max_batch 2)."""
    eng = Engine(load(models + "/llama"), prefill_chunk=16, max_batch=2, **KV)
    ps = prompts(models)
    log, aborts = [], {}
    for step in range(10):
        if rank == 0:
            if step in (0, 1):
                for i in ((0, 1) if step == 0 else (2, 3)):
                    eng.add_request(ps[i], SamplingParams(max_new_tokens=NEW))
            if step == 8:
                aborts = {"running": eng.abort(1), "waiting": eng.abort(3)}
        log.append(outputs(eng.step()))
    while eng.has_unfinished():
        log.append(outputs(eng.step()))
    # Then every rank makes the same call: a sampled request without a seed draws the same seed on every rank.
    sampled = eng.generate([ps[1]], SamplingParams(max_new_tokens=6, temperature=1.0))[0].token_ids
    return {"log": log, "aborts": aborts, "sampled": sampled}


def admission(models, rank):
    """Rank 1 has room for one request at a time, rank 0 for all four: every rank admits as rank 1 can."""
    budget = 256 << 10 if rank == 0 else 48 << 10
    eng = Engine(load(models + "/llama"), max_kv_bytes=budget, kv_chunk_bytes=4096, prefill_chunk=16)
    alone = CompressedPagedKVCache(2, 1, 64, max_bytes=budget, chunk_bytes=4096, device="cpu")
    out = {"capacity_alone": alone.capacity(40, NEW).requests, "capacity_agreed": eng.kv.capacity(40, NEW).requests}
    for p in prompts(models):
        eng.add_request(p, SamplingParams(max_new_tokens=NEW))
    running, log = [], []
    while eng.has_unfinished():
        log.append(outputs(eng.step()))
        running.append([r.rid for r in eng.scheduler.running])
    out.update(log=log, running=running)
    return out


def prefix(models, rank):
    """Prompts run one after another, the first twice in a row and again at the end, with rank 1's room for one request
    at a time: every rank finds the same cached pages, and evicts the same ones for the requests that need their room
    on rank 1 only."""
    budget = 256 << 10 if rank == 0 else 48 << 10
    eng = Engine(load(models + "/llama"), max_kv_bytes=budget, kv_chunk_bytes=4096, prefill_chunk=16)
    ps = prompts(models)
    tokens, found = [], []
    for i in (0, 0, 1, 2, 3, 0):
        tokens.append(eng.generate([ps[i]], SamplingParams(max_new_tokens=NEW))[0].token_ids)
        found.append(eng.stats()["prefix_cached_tokens"])
    return {"tokens": tokens, "found": found, "cached": eng.kv.stats()["cached_pages"]}


def mismatch(models, rank):
    """Ranks that add different requests: every rank raises the same error at the next step (none waits forever)."""
    eng = Engine(load(models + "/llama"), **KV)
    eng.add_request(prompts(models)[rank], SamplingParams(max_new_tokens=2))
    try:
        eng.step()
        return {"error": None}
    except RuntimeError as e:
        return {"error": str(e)}


def diverged(models, rank):
    """A rank whose engine state differs from rank 0's (simulated): every rank raises at the next step."""
    eng = Engine(load(models + "/llama"), **KV)
    eng.add_request(prompts(models)[0], SamplingParams(max_new_tokens=4))
    eng.step()
    if rank == 1:
        eng._tp.state_digest = b"not rank 0's"
    try:
        eng.step()
        return {"error": None}
    except RuntimeError as e:
        return {"error": str(e)}


def serve_load(models, rank, out_dir):
    """``python -m torch_zipkv.serve``'s main under torchrun: a synthetic load arriving at 100 requests/s."""
    out = os.path.join(out_dir, "serve.jsonl")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        summary = serve.main(["--model", models + "/llama", "--num-prompts", "5", "--prompt-len", "24",
                              "--gen-len", "6", "--arrival-rate", "100", "--max-kv-bytes", str(16 << 20),
                              "--prefill-chunk", "16", "--device", "cpu", "--out", out])
    return {"summary": summary, "stdout": stdout.getvalue(), "stderr": stderr.getvalue()}


SCENARIOS = {"staggered": staggered, "follower": follower, "admission": admission, "prefix": prefix,
             "mismatch": mismatch, "diverged": diverged, "serve": serve_load}


def main():
    run_scenarios(SCENARIOS, lambda fn, name, models, out_dir, rank:
                  fn(models, rank, out_dir) if name == "serve" else fn(models, rank))


if __name__ == "__main__":
    main()
