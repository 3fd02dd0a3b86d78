"""python -m torch_zipkv.serve: a synthetic load on a small saved model, and JSONL text prompts on SmolLM2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from torch_zipkv import serve  # noqa: E402

from conftest import require_smollm2  # noqa: E402
from hf_models import small_model  # noqa: E402


def test_synthetic_load_on_a_saved_model(tmp_path, capsys):
    """Six requests arriving at 200/s on a tiny Llama saved as a transformers directory: every request's line in
    --out has exactly --gen-len tokens and its latencies; the summary counts them; the progress bar shows the live
    numbers."""
    small_model("llama").save_pretrained(tmp_path / "model")
    out = tmp_path / "results.jsonl"
    summary = serve.main(["--model", str(tmp_path / "model"), "--num-prompts", "6", "--prompt-len", "20",
                          "--gen-len", "5", "--arrival-rate", "200", "--max-kv-bytes", str(16 << 20),
                          "--prefill-chunk", "16", "--out", str(out), "--device", "cpu"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(6))
    for r in rows:
        assert r["prompt_len"] == 20 and r["output_len"] == 5 == len(r["token_ids"])
        assert r["finish_reason"] == "length"
        assert 0 <= r["ttft_s"] <= r["latency_s"] and r["tpot_s"] > 0
    assert summary["requests"] == 6 and summary["generated_tokens"] == 30
    assert 1 <= summary["largest_batch"] <= 6 and summary["ttft_s"]["p50"] > 0
    captured = capsys.readouterr()
    assert "30 tokens in" in captured.out and "time to first token" in captured.out
    assert "tok/s" in captured.err and "KV ratio" in captured.err and "queue" in captured.err


def test_bad_arguments_exit_with_a_message(tmp_path):
    with pytest.raises(SystemExit):
        serve.main(["--gen-len", "0"])
    with pytest.raises(ValueError, match="--model must be"):
        serve.main(["--model", str(tmp_path / "missing"), "--device", "cpu"])


def test_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "torch_zipkv.serve", "--help"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "--arrival-rate" in proc.stdout and "--no-compress" in proc.stdout


def test_jsonl_text_prompts_on_smollm2(tmp_path, capsys):
    """The shipped SmolLM2 (the default --model), text and token-id prompts from a JSONL file: each result has its
    text, and generation stops at EOS or after its max_new_tokens."""
    require_smollm2()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "The capital of France is", "max_new_tokens": 4}) + "\n" +
                       json.dumps({"prompt_ids": [1, 2, 3, 4], "max_new_tokens": 3}) + "\n")
    out = tmp_path / "results.jsonl"
    summary = serve.main(["--prompts", str(prompts), "--out", str(out), "--device", "cpu",
                          "--max-kv-bytes", str(256 << 20), "--no-progress"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["output_len"] <= n for r, n in zip(rows, (4, 3))] == [True, True]
    assert all(r["finish_reason"] in ("stop", "length") and isinstance(r["text"], str) for r in rows)
    assert summary["requests"] == 2 and "2 requests" in capsys.readouterr().out
