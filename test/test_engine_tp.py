"""The serving engine under tensor parallelism on CPU: 2 ranks under ``torchrun`` (gloo) load a tiny Llama with
transformers' ``tp_plan="auto"`` and run the engine's scenarios in one launch (``engine_tp_worker.py``); the tests
here check each rank's record against oracles computed in this process: transformers' ``generate`` with its default
cache, one prompt at a time, and the single-process engine.

The model is test_tp.py's (random, 2 KV heads: 1 per rank), and the prompts are chosen for the model in hand
(:func:`choose_prompts`): every greedy choice of the reference leads the second by more than 2% of its logit (several
bf16 steps), so equal tokens mean the same computation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

from torch_zipkv.engine import Engine, SamplingParams  # noqa: E402

import engine_tp_worker as worker  # noqa: E402
from test_tp import clear_greedy, launch_2_ranks, rank_env, save_model  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(models dir, out dir, [rank 0's record, rank 1's record]) of one 2-rank launch of every scenario."""
    root = tmp_path_factory.mktemp("engine_tp")
    models, out = root / "models", root / "out"
    out.mkdir()
    save_model(models / "llama", 3)
    choose_prompts(models)
    return models, out, launch_2_ranks("engine_tp_worker.py", models, out)


def choose_prompts(models: Path) -> None:
    """For each of the worker's LENGTHS, the first seed whose prompt alone has clear greedy choices (test_tp.py's
    rule) for the saved model, which depends on the torch release's random stream; written for the ranks to read."""
    model = transformers.AutoModelForCausalLM.from_pretrained(models / "llama", dtype=torch.bfloat16).eval()
    chosen, seed = [], 100
    for n in worker.LENGTHS:
        while True:
            seed += 1
            assert seed < 1000, "no clear prompt among seeds 101-999"
            ids = torch.tensor([worker.prompt(n, seed)])
            if clear_greedy(model, ids, torch.ones_like(ids), worker.NEW, pad_token_id=0, eos_token_id=None)[1]:
                chosen.append(ids[0].tolist())
                break
    (models / worker.PROMPTS_FILE).write_text(json.dumps(chosen))


@pytest.fixture(scope="module")
def reference(run):
    """Greedy tokens of each prompt with transformers' default cache, single process, after checking that every
    choice is clear."""
    model = transformers.AutoModelForCausalLM.from_pretrained(run[0] / "llama", dtype=torch.bfloat16).eval()
    want = []
    for p in worker.prompts(run[0]):
        ids = torch.tensor([p])
        tokens, clear = clear_greedy(model, ids, torch.ones_like(ids), worker.NEW, pad_token_id=0, eos_token_id=None)
        assert clear, "a greedy choice is near a tie"
        want.append(tokens[0][len(p):])
    return want


def scenario(run, name: str) -> list[dict]:
    records = [rank[name] for rank in run[2]]
    for r, rec in enumerate(records):
        assert "exception" not in rec, f"rank {r}:\n{rec['exception']}"
    return records


def finals(log: list) -> dict[int, tuple[list[int], str]]:
    """Each request's tokens (concatenated over the steps' outputs) and finish reason, from a record's log."""
    tokens, reasons = {}, {}
    for outs in log:
        for rid, new, finished, reason in outs:
            tokens.setdefault(rid, []).extend(new)
            if finished:
                assert rid not in reasons, f"request {rid} finished twice"
                reasons[rid] = reason
    assert set(reasons) == set(tokens) | set(reasons), "a request reported tokens but never finished"
    return {rid: (tokens.get(rid, []), reasons[rid]) for rid in reasons}


def test_staggered_arrivals_and_chunked_prefill_give_the_single_process_tokens(run, reference):
    records = scenario(run, "staggered")
    assert records[0]["log"] == records[1]["log"]  # every rank reports the same outputs at the same steps
    got = finals(records[0]["log"])
    assert got == {i: (reference[i], "length") for i in range(4)}
    # The single-process engine, same schedule: the same tokens.
    model = transformers.AutoModelForCausalLM.from_pretrained(run[0] / "llama", dtype=torch.bfloat16).eval()
    eng = Engine(model, max_kv_bytes=512 << 10, kv_chunk_bytes=8192, prefill_chunk=16, compress_every=2)
    outs = eng.generate(worker.prompts(run[0]), SamplingParams(max_new_tokens=worker.NEW))
    assert [o.token_ids for o in outs] == reference


def test_each_rank_holds_and_compresses_its_own_kv_heads(run):
    records = scenario(run, "staggered")
    for rec in records:
        assert rec["kv_heads"] == 1 and rec["group"]  # 2 KV heads over 2 ranks; the cache agrees over the ranks
        assert rec["largest_batch"] >= 2  # requests decoded together while others prefilled
    for rec in records:
        assert any(stored < raw for stored, raw in rec["kv"])  # full pages compressed between steps
    assert records[0]["kv"] != records[1]["kv"]  # different heads, compressed on their rank


def test_requests_and_aborts_from_rank_0_reach_every_rank(run, reference):
    records = scenario(run, "follower")
    assert records[0]["aborts"] == {"running": True, "waiting": True}
    assert records[1]["log"] == records[0]["log"]  # rank 1 made no call, yet saw every request and abort
    got = finals(records[1]["log"])
    assert got[1][1] == "abort" and 0 < len(got[1][0]) < worker.NEW  # aborted while running
    assert got[3] == ([], "abort")  # aborted while waiting
    for i in (0, 2):
        assert got[i] == (reference[i], "length")
    # Calls made on every rank afterwards agree too (rank 1 drew the seeds of rank 0's seedless requests).
    assert records[0]["sampled"] == records[1]["sampled"] and len(records[0]["sampled"]) == 6


def test_admission_agrees_when_one_rank_has_less_room(run, reference):
    records = scenario(run, "admission")
    alone = [rec["capacity_alone"] for rec in records]
    assert alone[0] >= 4 and alone[1] == 1  # rank 0 alone would run all four at once
    for rec in records:
        assert rec["capacity_agreed"] == 1  # every rank takes rank 1's room
        assert max(len(ids) for ids in rec["running"]) == 1
    assert records[0]["running"] == records[1]["running"]  # the same requests admitted at the same steps
    assert records[0]["log"] == records[1]["log"]
    assert finals(records[0]["log"]) == {i: (reference[i], "length") for i in range(4)}


def test_prefix_caching_finds_and_evicts_the_same_pages_on_every_rank(run, reference):
    """What a request finds in the prefix cache depends on token ids and host state only, and eviction on the most any
    rank needs: the ranks find the same pages (or one rank's step would fail the state check), even though only rank
    1 is short of room; the tokens are transformers' own."""
    records = scenario(run, "prefix")
    assert records[0]["found"] == records[1]["found"] and records[0]["cached"] == records[1]["cached"]
    assert records[0]["found"][1] == 32  # the second run of a 40-token prompt finds its 2 full pages
    for i, tokens in zip((0, 0, 1, 2, 3, 0), records[0]["tokens"]):
        assert tokens == reference[i]
    assert records[1]["tokens"] == records[0]["tokens"]


def test_ranks_that_disagree_raise_on_every_rank(run):
    for rec in scenario(run, "mismatch"):
        assert "ranks [1] called add_request / abort differently from rank 0" in rec["error"]
    for rec in scenario(run, "diverged"):
        assert "tensor-parallel ranks [1] disagree with rank 0 on the engine's state" in rec["error"]


def test_serve_under_torchrun(run):
    records = scenario(run, "serve")
    rows = [json.loads(line) for line in (run[1] / "serve.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(5))
    assert all(r["output_len"] == 6 == len(r["token_ids"]) and r["finish_reason"] == "length" for r in rows)
    for rec in records:
        assert rec["summary"]["requests"] == 5 and rec["summary"]["generated_tokens"] == 30
    # Only rank 0 shows the progress bar and prints the summary.
    assert "30 tokens in" in records[0]["stdout"] and "tok/s" in records[0]["stderr"]
    assert records[1]["stdout"] == "" and "tok/s" not in records[1]["stderr"]


def test_serve_tp_flag_starts_torchrun(run, tmp_path):
    """``python -m torch_zipkv.serve --tp 2`` outside torchrun starts it: rank 0 alone writes and prints."""
    out = tmp_path / "results.jsonl"
    proc = subprocess.run([sys.executable, "-m", "torch_zipkv.serve", "--tp", "2", "--model", str(run[0] / "llama"),
                           "--num-prompts", "3", "--prompt-len", "20", "--gen-len", "4", "--device", "cpu",
                           "--max-kv-bytes", str(16 << 20), "--no-progress", "--out", str(out)],
                          env=rank_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["output_len"] for r in rows] == [4, 4, 4]
    assert proc.stdout.count("12 tokens in") == 1


def test_serve_tp_must_match_torchrun(monkeypatch):
    from torch_zipkv import serve

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        serve.main(["--tp", "4"])
