"""One rank of test_tp.py's tensor-parallel run: ``torchrun --nproc-per-node 2 tp_worker.py MODELS_DIR OUT_DIR``.

Loads the models that test_tp.py saved with ``from_pretrained(..., tp_plan="auto")`` (transformers' own tensor
parallelism, gloo on CPU), runs every scenario, and writes what it saw to ``OUT_DIR/rank{r}.json``; test_tp.py
asserts on it. A scenario's exception is recorded, not raised, so the other scenarios still run on every rank (a
rank that stops early would leave the other waiting in a collective).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import torch_zipkv
from torch_zipkv import CacheFullError, CompressedPagedKVCache, ZipKVCache
from torch_zipkv.integrations.transformers import cache_kwarg

NEW = 12  # tokens generated per prompt: the longer prompt crosses a page boundary


def load(path):
    with warnings.catch_warnings():  # tp_plan= directly: deprecated in 5.24, the only spelling in 5.17
        warnings.simplefilter("ignore", FutureWarning)
        return torch_zipkv.enable(transformers.AutoModelForCausalLM.from_pretrained(
            path, tp_plan="auto", dtype=torch.bfloat16)).eval()


PROMPTS_FILE = "prompts.json"  # in the models directory: test_tp.py chooses the prompts, every rank reads them


def prompt_batch(seed: int):
    """2 prompts of 40 and 27 tokens, left-padded: ``(ids, mask)`` [2, 40]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 40), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    return ids, mask


def prompts(models):
    """The batch test_tp.py chose for the model in hand (a :func:`prompt_batch` whose greedy choices are clear)."""
    seed = json.loads((Path(models) / PROMPTS_FILE).read_text())["seed"]
    return prompt_batch(seed)


def caps(kv: CompressedPagedKVCache, prompt_len: int, new: int) -> list[int]:
    c = kv.capacity(prompt_len, new)
    return [c.pages, c.tokens, c.requests]


def generate(models, rank, world):
    model = load(models + "/llama")
    ids, mask = prompts(models)
    out = {}
    cache = ZipKVCache.from_model(model, batch_size=2, max_length=ids.shape[1] + NEW, max_new_tokens=NEW)
    out["kv_heads"] = cache.kv.num_kv_heads
    out["agrees"] = cache.kv.process_group is not None
    out["capacity_before"] = caps(cache.kv, 40, NEW)
    cache_kw = {cache_kwarg(model): cache}
    out["hf_generate"] = model.generate(ids, attention_mask=mask, **cache_kw, max_new_tokens=NEW,
                                        do_sample=False).tolist()
    cache.kv.compress_full_pages()  # places the last round (on CPU, the round a call starts is placed by the next)
    stats = cache.stats()
    out["stored_bytes"], out["raw_bytes"] = stats["stored_bytes"], stats["raw_bytes"]
    out["capacity_after"] = caps(cache.kv, 40, NEW)
    out["zipkv_generate"] = torch_zipkv.generate(model, ids, mask, max_new_tokens=NEW).tolist()
    model.set_attn_implementation("sdpa")  # transformers' own TP path: its default cache and attention
    out["default_cache_tp"] = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False).tolist()
    torch_zipkv.enable(model)
    return out


def compiled(models, rank, world):
    model = load(models + "/llama")
    ids, mask = prompts(models)
    return {"zipkv_generate_compiled": torch_zipkv.generate(model, ids, mask, max_new_tokens=NEW,
                                                            compile=True).tolist()}


def refusal(models, rank, world):
    """Rank 1 gets room for one prompt and its new tokens, rank 0 for two (the test hook: a per-rank budget)."""
    model = load(models + "/llama")
    ids, mask = prompts(models)
    out = {}
    batch = 2 if rank == 0 else 1
    cache = ZipKVCache.from_model(model, batch_size=batch, max_length=40 + NEW, max_new_tokens=NEW)
    # The same budget deciding alone: what this rank would admit by itself.
    alone = CompressedPagedKVCache(2, 1, 64, **CompressedPagedKVCache.raw_sizing(2, 1, 64, batch_size=batch,
                                                                                   max_length=40 + NEW))
    out["capacity_alone"] = caps(alone, 40, NEW)
    out["capacity_agreed"] = caps(cache.kv, 40, NEW)
    cache_kw = {cache_kwarg(model): cache}
    try:
        model.generate(ids, attention_mask=mask, **cache_kw, max_new_tokens=NEW, do_sample=False)
        out["batch_of_2"] = "admitted"
    except CacheFullError as e:
        out["batch_of_2"] = "refused"
        out["message"] = str(e)
    out["sequences_after_refusal"] = cache.stats()["sequences"]
    # One prompt fits every rank: the same cache then runs it.
    out["batch_of_1"] = model.generate(ids[:1], attention_mask=mask[:1], **cache_kw, max_new_tokens=NEW,
                                       do_sample=False).tolist()
    return out


def growth(models, rank, world):
    """Sequences added without a budget for new tokens grow into free room, which runs out on rank 1 first; the
    decode step that cannot open its pages on rank 1 is refused on every rank."""
    group = dist.group.WORLD
    out = {}
    for name, pg in (("alone", None), ("agreed", group)):
        kv = CompressedPagedKVCache(1, 1, 64, max_bytes=(64 if rank == 0 else 40) * 4096 + 4096, chunk_bytes=4096,
                                    max_pages=64, process_group=pg)
        sids = [kv.add_sequence(prompt_len=16) for _ in range(2)]
        for sid in sids:
            kv.append(0, sid, *(torch.ones(16, 1, 64, dtype=torch.bfloat16),) * 2)
        steps = 0
        try:
            while steps < 10_000:
                step = kv.prepare_step(sids)
                kv.step_append(0, step, *(torch.ones(2, 1, 64, dtype=torch.bfloat16),) * 2)
                steps += 1
        except CacheFullError as e:
            out[f"{name}_unit"] = e.unit
        out[f"{name}_steps"] = steps
    return out


def uneven(models, rank, world):
    """3 KV heads cannot split over 2 ranks: transformers cuts k_proj mid-head."""
    model = load(models + "/uneven")
    try:
        ZipKVCache.from_model(model, batch_size=1, max_length=32)
        return {"error": None}
    except ValueError as e:
        return {"error": str(e)}


SCENARIOS = {"generate": generate, "compiled": compiled, "refusal": refusal, "growth": growth, "uneven": uneven}


def run_scenarios(scenarios: dict, call) -> None:
    """The worker's main: argv is ``models out_dir [scenario ...]`` (all by default); ``call(fn, name, models, out_dir,
    rank)`` runs one scenario; each rank writes its records (or a scenario's traceback) to ``out_dir/rank<r>.json``."""
    models, out_dir, *names = sys.argv[1:]
    torch.manual_seed(0)
    if not dist.is_initialized():  # transformers starts it when it loads a model; a scenario may come first
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = {}
    for name in names or scenarios:
        try:
            result[name] = call(scenarios[name], name, models, out_dir, rank)
        except Exception:
            result[name] = {"exception": traceback.format_exc()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    run_scenarios(SCENARIOS, lambda fn, name, models, out_dir, rank: fn(models, rank, dist.get_world_size()))


if __name__ == "__main__":
    main()
