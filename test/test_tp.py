"""Tensor parallelism on CPU: 2 ranks under ``torchrun`` (gloo) load tiny Llama models with transformers' own
``from_pretrained(..., tp_plan="auto")``, each rank keeps a compressed cache of its own KV heads, and the ranks agree
on what fits. One launch of ``tp_worker.py`` runs every scenario (starting 2 processes costs most of the time) and
records what each rank saw; the tests here check it against a single-process run of the same model with
transformers' default cache, computed in this process.

The Llama model is random, and so depends on the torch release's random stream; the prompts are chosen for the model
in hand (:func:`choose_prompts`, before the ranks start): over every generated token of the reference the best logit
leads the second by more than 2% (several BF16 steps), so token equality means the same computation, not a lucky
tie.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import torch_zipkv  # noqa: E402
from torch_zipkv import CompressedPagedKVCache  # noqa: E402

import tp_worker  # noqa: E402

HERE = Path(__file__).parent


def save_model(path: Path, seed: int, **overrides) -> None:
    config = dict(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=512, initializer_range=0.2)
    config.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**config), dtype=torch.bfloat16)
    model.save_pretrained(path)


def rank_env(gpus: str = "") -> dict:
    """The environment of a rank process. CPU and gloo by default: on a GPU machine transformers would bind each rank
    to a GPU of its own."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": gpus,
            "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")])}


def launch_2_ranks(worker: str, models: Path, out: Path, *args: str, gpus: str = "") -> list[dict]:
    """Runs test/<worker> on 2 ranks under torchrun; returns each rank's record (out/rank<r>.json)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / worker), str(models), str(out), *args]
    proc = subprocess.run(cmd, env=rank_env(gpus), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """(models dir, [rank 0's record, rank 1's record]) of one 2-rank launch of every scenario."""
    root = tmp_path_factory.mktemp("tp")
    models, out = root / "models", root / "out"
    out.mkdir()
    save_model(models / "llama", 3)  # 2 KV heads: 1 per rank
    save_model(models / "uneven", 0, hidden_size=384, num_attention_heads=6, num_key_value_heads=3)  # 1.5 per rank
    choose_prompts(models)
    return models, launch_2_ranks("tp_worker.py", models, out)


def scenario(tp_run, name: str) -> list[dict]:
    """Each rank's record of scenario ``name``; fails with the rank's traceback if it raised."""
    records = [rank[name] for rank in tp_run[1]]
    for r, rec in enumerate(records):
        assert "exception" not in rec, f"rank {r}:\n{rec['exception']}"
    return records


def clear_greedy(model, ids, mask, new: int, **generate_kw) -> tuple[list, bool]:
    """Greedy tokens of ``model`` with transformers' default cache, and whether every choice is clear: the best logit
    leads the second by more than 2% of its size at every step, for every row."""
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, **generate_kw)
    clear = True
    for logits in out.logits:
        top = logits.float().topk(2).values
        clear &= bool(((top[:, 0] - top[:, 1]) / top[:, 0].abs()).min() > 0.02)
    return out.sequences.tolist(), clear


def choose_prompts(models: Path) -> None:
    """The first prompt batch (tp_worker.prompt_batch) whose greedy choices are clear for the saved model, both
    rows together and row 0 alone (what the scenarios generate); written for the ranks to read."""
    model = transformers.AutoModelForCausalLM.from_pretrained(models / "llama", dtype=torch.bfloat16).eval()
    for seed in range(1, 200):
        ids, mask = tp_worker.prompt_batch(seed)
        if all(clear_greedy(model, ids[rows], mask[rows], tp_worker.NEW)[1] for rows in (slice(None), slice(0, 1))):
            (models / tp_worker.PROMPTS_FILE).write_text(json.dumps({"seed": seed}))
            return
    raise AssertionError("no prompt batch of seeds 1-199 has clear greedy choices for this model")


def reference(models: Path, rows: slice = slice(None)) -> list:
    """Greedy tokens of the single-process model with transformers' default cache on the chosen prompts, after
    checking that every choice is clear (see the module docstring)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(models / "llama", dtype=torch.bfloat16).eval()
    ids, mask = tp_worker.prompts(models)
    tokens, clear = clear_greedy(model, ids[rows], mask[rows], tp_worker.NEW)
    assert clear, "a greedy choice is near a tie"
    return tokens


def test_tokens_equal_the_single_process_default_cache(tp_run):
    want = reference(tp_run[0])
    for rec in scenario(tp_run, "generate"):
        assert rec["default_cache_tp"] == want  # the premise: transformers' own TP run gives these tokens too
        assert rec["hf_generate"] == want  # model.generate(..., cache=ZipKVCache.from_model(model, ...))
        assert rec["zipkv_generate"] == want  # torch_zipkv.generate, eager


def test_compiled_generate_equals_the_single_process_default_cache(tp_run):
    want = reference(tp_run[0])
    for rec in scenario(tp_run, "compiled"):
        assert rec["zipkv_generate_compiled"] == want  # torch.compile(fullgraph=True) of the sharded decode step


def test_each_rank_holds_and_compresses_its_own_kv_heads(tp_run):
    records = scenario(tp_run, "generate")
    for rec in records:
        assert rec["kv_heads"] == 1  # 2 KV heads over 2 ranks, not the config's 2
        assert rec["agrees"]  # from_model took the model's TP group
        assert rec["stored_bytes"] < rec["raw_bytes"]
    # Each rank compressed its own heads: different data, so (here) different stored sizes.
    assert records[0]["stored_bytes"] != records[1]["stored_bytes"]


def test_capacity_is_equal_on_every_rank(tp_run):
    gen = scenario(tp_run, "generate")
    for key in ("capacity_before", "capacity_after"):
        assert gen[0][key] == gen[1][key]
    assert gen[0]["capacity_before"][2] == 2  # sized for the batch: 2 requests of prompt + NEW fit
    refusal = scenario(tp_run, "refusal")
    alone = [rec["capacity_alone"] for rec in refusal]
    assert alone[0] != alone[1]  # the ranks' own budgets differ (the test hook)...
    least = min(alone)
    for rec in refusal:
        assert rec["capacity_agreed"] == least  # ...and every rank reports the least of them


def test_a_rank_that_cannot_fit_a_request_makes_every_rank_refuse_it(tp_run):
    records = scenario(tp_run, "refusal")
    for r, rec in enumerate(records):
        assert rec["capacity_alone"][2] == (2 if r == 0 else 1)  # rank 0 alone would admit the batch of 2
        assert rec["batch_of_2"] == "refused", rec
        assert "every rank refuses" in rec["message"]
        assert rec["sequences_after_refusal"] == 0  # refused whole: nothing admitted on any rank
        assert rec["batch_of_1"] == reference(tp_run[0], slice(0, 1))  # the same cache then runs what fits


def test_growth_beyond_budgets_stops_at_the_same_step_on_every_rank(tp_run):
    records = scenario(tp_run, "growth")
    alone = [rec["alone_steps"] for rec in records]
    assert alone[0] > alone[1]  # rank 1's smaller arena alone would stop first
    for rec in records:
        assert rec["agreed_steps"] == alone[1]
        assert rec["agreed_unit"] == "pages per layer"


def test_kv_heads_that_do_not_split_evenly_are_a_clear_error(tp_run):
    for rec in scenario(tp_run, "uneven"):
        assert rec["error"] is not None
        assert "3 KV heads do not split evenly across 2 tensor-parallel ranks" in rec["error"]
        assert "1.5 heads" in rec["error"]


def test_process_group_of_one_rank_changes_nothing():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        kw = dict(max_bytes=64 * 4096 + 4096, chunk_bytes=4096, max_pages=64)
        alone = CompressedPagedKVCache(1, 1, 64, **kw)
        grouped = CompressedPagedKVCache(1, 1, 64, process_group=dist.group.WORLD, **kw)
        assert grouped.process_group is None  # nothing to agree with
        for cache in (alone, grouped):
            cache.add_sequence(prompt_len=100, max_new_tokens=28)
        assert grouped.capacity(16, 16) == alone.capacity(16, 16)
    finally:
        dist.destroy_process_group()


def test_process_group_must_be_a_process_group():
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup"):
        CompressedPagedKVCache(1, 1, 64, max_bytes=1 << 20, process_group="tp")


def test_unsharded_model_keeps_the_config_head_count():
    from hf_models import small_model

    model = torch_zipkv.enable(small_model("llama"))
    cache = torch_zipkv.ZipKVCache.from_model(model, batch_size=1, max_length=32)
    assert cache.kv.num_kv_heads == 2 and cache.kv.process_group is None
