"""python -m torch_zipkv.serve: a synthetic load on a small saved model, JSONL text prompts on SmolLM2, and bad input:
every bad argument and every bad line of --prompts is one line on stderr and exit status 2, before the model loads
wherever its config suffices; --out keeps what was served; a request the engine refuses is reported and the rest
served."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from conftest import require_smollm2  # noqa: E402
from hf_models import small_model  # noqa: E402

from torch_zipkv import serve  # noqa: E402
from torch_zipkv.engine import Engine, SamplingParams  # noqa: E402

CONTEXT = 512  # small_model's max_position_embeddings and vocab_size
VOCAB = 512


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama saved as a transformers directory (no tokenizer): vocabulary and context of 512."""
    path = tmp_path_factory.mktemp("tiny") / "model"
    small_model("llama").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    """The tiny Llama with a context of 100000 tokens: a prompt can then be longer than a small KV cache holds."""
    path = tmp_path_factory.mktemp("long") / "model"
    small_model("llama", max_position_embeddings=100000).save_pretrained(path)
    return str(path)


@pytest.fixture
def no_load(monkeypatch):
    """Fails the test if the CLI loads the model: what it checks must be checked before."""
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(serve, "load_model", load_model)


def run_cli(argv, capsys) -> tuple[int | str | None, str, str]:
    """serve.main(argv) that must exit: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exc:
        serve.main(argv)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def messages(err: str) -> list[str]:
    """The lines of stderr as a terminal shows them (what follows a line's last carriage return: a progress bar
    redraws itself over one line), less blank ones and transformers' progress bar of the weights' load."""
    shown = (line.rsplit("\r", 1)[-1] for line in err.split("\n"))
    return [line for line in shown if line.strip() and "Loading weights" not in line]


def write_lines(path, lines) -> str:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_synthetic_load_on_a_saved_model(tiny, tmp_path, capsys):
    """Six requests arriving at 200/s on a tiny Llama saved as a transformers directory: every request's line in
    --out has exactly --gen-len tokens and its latencies; the summary counts them; the progress bar shows the live
    numbers."""
    out = tmp_path / "results.jsonl"
    summary = serve.main(["--model", tiny, "--num-prompts", "6", "--prompt-len", "20", "--gen-len", "5",
                          "--arrival-rate", "200", "--max-kv-bytes", str(16 << 20), "--prefill-chunk", "16",
                          "--out", str(out), "--device", "cpu"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]  # in the order they finished
    assert sorted(r["index"] for r in rows) == list(range(6))
    for r in rows:
        assert r["prompt_len"] == 20 and r["output_len"] == 5 == len(r["token_ids"])
        assert r["finish_reason"] == "length"
        assert 0 <= r["ttft_s"] <= r["latency_s"] and r["tpot_s"] > 0
    assert summary["requests"] == 6 and summary["refused"] == 0 and summary["generated_tokens"] == 30
    assert 1 <= summary["largest_batch"] <= 6 and summary["ttft_s"]["p50"] > 0
    captured = capsys.readouterr()
    assert "30 tokens in" in captured.out and "time to first token" in captured.out
    assert "tok/s" in captured.err and "KV ratio" in captured.err and "queue" in captured.err


def test_shared_prefix_and_chat_loads_find_cached_pages(tiny, tmp_path, capsys):
    """Requests over two shared prefixes start from each other's pages; a 3-turn chat's later turns hold the earlier
    turn and its answer and start from its pages; --no-prefix-caching finds nothing. The summary says so."""
    common = ["--model", tiny, "--gen-len", "5", "--max-kv-bytes", str(16 << 20), "--prefill-chunk", "16",
              "--device", "cpu", "--no-progress"]
    shared = serve.main(common + ["--num-prompts", "8", "--prompt-len", "4", "--shared-prefix-len", "40",
                                  "--num-prefixes", "2", "--arrival-rate", "50"])
    assert shared["requests"] == 8 and shared["prefix_hits"] >= 1 and shared["prefix_cached_tokens"] >= 32
    printed = capsys.readouterr().out
    assert "prompt tokens found (hit rate" in printed and "decode steps attended to shared pages once" in printed
    out = tmp_path / "chat.jsonl"
    chat = serve.main(common + ["--num-prompts", "2", "--prompt-len", "20", "--turns", "3", "--out", str(out)])
    rows = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == list(range(6)) and chat["requests"] == 6
    for conversation in (0, 3):
        for turn in (1, 2):
            before, now = rows[conversation + turn - 1], rows[conversation + turn]
            assert now["prompt_len"] == before["prompt_len"] + 5 + 20
    assert chat["prefix_hits"] == 4 and chat["prefix_cached_tokens"] >= 4 * 16
    off = serve.main(common + ["--num-prompts", "2", "--prompt-len", "20", "--turns", "2", "--no-prefix-caching"])
    assert off["requests"] == 4 and off["prefix_cached_tokens"] == 0 and not off["prefix_caching"]
    assert "prefix caching off" in capsys.readouterr().out


def _unwritable(tmp_path) -> str:
    """A path --out cannot write: in a read-only directory, or (as root, whom modes do not stop) a /proc file."""
    if os.geteuid() == 0:
        return "/proc/version"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return str(locked / "results.jsonl")


# (argv after --model TINY --device cpu, the text the one error line must hold). {tmp}: the test's directory.
BAD_ARGUMENTS = [
    (["--num-prompts", "0"], "--num-prompts must be an int >= 1, got 0"),
    (["--num-prompts", "many"], "argument --num-prompts: invalid int value: 'many'"),
    (["--prompt-len", "-1"], "--prompt-len must be an int >= 1, got -1"),
    (["--gen-len", "0"], "--gen-len must be an int >= 1, got 0"),
    (["--prompt-len", "400", "--gen-len", "200"], "--prompt-len 400 + --gen-len 200 = 600 exceeds the model's "
                                                  f"context of {CONTEXT} tokens"),
    (["--shared-prefix-len", "-1"], "--shared-prefix-len must be an int >= 0, got -1"),
    (["--num-prefixes", "0"], "--num-prefixes must be an int >= 1, got 0"),
    (["--turns", "0"], "--turns must be an int >= 1, got 0"),
    (["--num-prefixes", "3"], "--num-prefixes 3 needs --shared-prefix-len"),
    (["--prompts", "{tmp}/empty.jsonl", "--turns", "2", "--num-prefixes", "2", "--shared-prefix-len", "8"],
     "--shared-prefix-len, --num-prefixes, --turns: shape the synthetic load, not --prompts"),
    (["--turns", "3", "--prompt-len", "100", "--gen-len", "100"], "--turns 3 x (--prompt-len 100 + --gen-len 100) = "
                                                                  f"600 exceeds the model's context of {CONTEXT}"),
    (["--shared-prefix-len", "500"], "--shared-prefix-len 500 + --prompt-len 256 + --gen-len 64 = 820 exceeds"),
    (["--arrival-rate", "0"], "--arrival-rate must be > 0"),
    (["--arrival-rate=-inf"], "--arrival-rate must be > 0"),
    (["--arrival-rate", "nan"], "--arrival-rate must be > 0"),
    (["--arrival-rate", "1e-300"], "--arrival-rate 1e-300: 32 requests would take about 3.2e+301 s to arrive"),
    (["--arrival-rate", "1", "--num-prompts", str(10**30)], "--arrival-rate 1: 10000000000000000000000000000"
                                                            "00 requests would take"),
    (["--max-kv-bytes", "0"], "--max-kv-bytes must be an int >= 1, got 0"),
    (["--max-kv-bytes", str(1 << 80)], f"--max-kv-bytes {1 << 80} is more than the"),
    (["--memory-fraction", "0.5"], "--memory-fraction is a fraction of the free GPU memory: it needs --device cuda"),
    (["--memory-fraction", "1.5"], "--memory-fraction must be in (0, 1], got 1.5"),
    (["--memory-fraction", "nan"], "--memory-fraction must be in (0, 1], got nan"),
    (["--max-kv-bytes", "1000", "--memory-fraction", "0.5"], "argument --memory-fraction: not allowed with "
                                                             "argument --max-kv-bytes"),
    (["--max-batch", "0"], "--max-batch must be an int in [1, 65536], got 0"),
    (["--max-batch", str(10**12)], "--max-batch must be an int in [1, 65536]"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be an int >= 1, got 0"),
    (["--seed", "-1"], "--seed must be an int in [0, 18446744073709551615], got -1"),
    (["--seed", str(2**64)], "--seed must be an int in [0, 18446744073709551615]"),
    (["--tp", "0"], "--tp must be an int >= 1, got 0"),
    (["--tp", "4"], "--tp 4: each rank holds a share of the model's 2 KV heads"),
    (["--device", "tpu"], "--device must be cpu or cuda[:N], got 'tpu'"),
    (["--device", "cuda:x"], "--device must be cpu or cuda[:N], got 'cuda:x'"),
    (["--out", "{tmp}"], "--out {tmp} is a directory"),
    (["--out", "{tmp}/missing/results.jsonl"], "--out {tmp}/missing/results.jsonl: its directory {tmp}/missing "
                                               "does not exist"),
    (["--out", "{unwritable}"], "--out {unwritable}: cannot write it"),
    (["--prompts", "{tmp}"], "--prompts {tmp} is a directory"),
    (["--prompts", "{tmp}/missing.jsonl"], "--prompts {tmp}/missing.jsonl: no such file"),
    (["--prompts", "{tmp}/empty.jsonl"], "--prompts {tmp}/empty.jsonl holds no requests"),
    (["--model", "{tmp}/missing"], "--model must be a transformers model directory or a .gguf file"),
    (["--model", "{tmp}"], "--model {tmp}: not a transformers model directory"),
]
if not torch.cuda.is_available():
    BAD_ARGUMENTS.append((["--device", "cuda"], "--device cuda: no CUDA GPU is available here"))


@pytest.mark.parametrize("argv, message", BAD_ARGUMENTS, ids=[" ".join(a) for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_are_one_line_and_exit_2_before_the_load(argv, message, tiny, tmp_path, capsys, no_load):
    """Every bad argument: exit status 2 and one line on stderr naming it, no traceback, and the model never loaded
    (no_load fails the test if it is); a path checked for --out is left as it was."""
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    names = {"tmp": str(tmp_path), "unwritable": _unwritable(tmp_path) if "{unwritable}" in argv else ""}
    argv = [a.format(**names) for a in argv]
    code, out, err = run_cli(["--model", tiny, "--device", "cpu", *argv], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("python -m torch_zipkv.serve: error: ") and message.format(**names) in err, err
    assert not (tmp_path / "missing").exists()


def test_bad_arguments_found_at_the_load_are_one_line_and_exit_2_before_serving(tiny, long_context, tmp_path, capsys):
    """What only the loaded model can say is still one line and exit 2, before anything is served: a KV budget too
    small for the model's pages, text prompts for a model without a tokenizer, and synthetic requests larger than
    the whole KV cache (they all have one size, so none could be served)."""
    prompts = write_lines(tmp_path / "text.jsonl", ['{"prompt_ids": [1, 2]}', '{"prompt": "hello"}', "",
                                                    '{"prompt": "again", "max_new_tokens": 3}'])
    cases = [
        ([tiny, "--max-kv-bytes", "1"], "python -m torch_zipkv.serve: error: --max-kv-bytes 1: the engine cannot "
                                        "build its KV cache with it"),
        ([tiny, "--prompts", prompts], f"{prompts}:2: a text prompt needs a tokenizer, and --model {tiny} has none; "
                                       "give prompt_ids (text prompts on lines 2, 4)"),
        ([long_context, "--prompt-len", "30000", "--gen-len", "2", "--max-kv-bytes", str(16 << 20)],
         "python -m torch_zipkv.serve: error: --prompt-len 30000 + --gen-len 2: the engine refuses the requests"),
    ]
    for argv, message in cases:
        code, out, err = run_cli(["--model", *argv, "--device", "cpu"], capsys)
        assert code == 2 and out == "" and "Traceback" not in err
        assert len(messages(err)) == 1 and messages(err)[0].startswith(message), err


def test_a_prompts_file_is_checked_whole_before_the_load(tiny, tmp_path, capsys, no_load):
    """Every bad line of --prompts gets one line FILE:LINE: message, in order, and nothing else is printed; exit 2
    and the model never loaded. Sampling fields are SamplingParams' own checks, with its words."""

    def sampling_error(**fields) -> str:
        with pytest.raises((TypeError, ValueError)) as exc:
            SamplingParams(**fields)
        return str(exc.value)

    fields = "the fields are prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed"
    lines = [  # (the line, what its error says, or None for a good line)
        ('{"prompt_ids": [1, 2, 3]}', None),
        ('{"prompt_ids": [1, 2, 3],, "top_k": 2}', "invalid JSON: Expecting property name enclosed in double quotes "
                                                   "at column 26"),
        ('{"prompt_ids": "1,2,3"}', 'prompt_ids must be a non-empty list of token ids (ints), got a string "1,2,3"'),
        ('{"prompt_ids": []}', "prompt_ids must be a non-empty list of token ids (ints), got a list []"),
        ('{"prompt_ids": [1, true]}', "prompt_ids[1] must be a token id (an int >= 0), got a boolean true"),
        ('{"prompt_ids": [1.0]}', "prompt_ids[0] must be a token id (an int >= 0), got a number 1.0"),
        ('{"prompt_ids": [3, -1]}', "prompt_ids[1] must be a token id (an int >= 0), got a number -1"),
        ('{"prompt": 5}', "prompt must be a non-empty string, got a number 5"),
        ('{"prompt": ""}', 'prompt must be a non-empty string, got a string ""'),
        ('{"prompt": "a", "prompt_ids": [1]}', "give 'prompt' (text) or 'prompt_ids' (token ids), not both"),
        ('{"top_k": 3}', "a line needs 'prompt' (text) or 'prompt_ids' (token ids)"),
        ("[1, 2]", "a line must be a JSON object"),
        ("null", "a line must be a JSON object"),
        ('{"prompt_ids": [1], "max_tokens": 5, "stop": ["x"]}', f"unknown fields 'max_tokens', 'stop'; {fields}"),
        ('{"prompt_ids": [1], "prompt_ids": [2]}', "field 'prompt_ids' is given twice"),
        ('{"prompt_ids": [1], "max_new_tokens": 0}', sampling_error(max_new_tokens=0)),
        ('{"prompt_ids": [1], "max_new_tokens": "5"}', sampling_error(max_new_tokens="5")),
        ('{"prompt_ids": [1], "max_new_tokens": true}', sampling_error(max_new_tokens=True)),
        ('{"prompt_ids": [1], "temperature": -1}', sampling_error(temperature=-1)),
        ('{"prompt_ids": [1], "top_k": 1.5}', sampling_error(top_k=1.5)),
        ('{"prompt_ids": [1], "top_p": 0}', sampling_error(top_p=0)),
        ('{"prompt_ids": [1], "seed": "x"}', sampling_error(seed="x")),
        ('{"prompt_ids": [1, 512]}', f"prompt_ids holds ids outside the model's vocabulary [0, {VOCAB}): [512]"),
        (json.dumps({"prompt_ids": [1] * 500, "max_new_tokens": 13}),
         f"prompt_ids (500 tokens) + max_new_tokens (13) = 513 exceeds the model's context of {CONTEXT}"),
        ('{"prompt": "text", "max_new_tokens": 512}', "max_new_tokens (512) leaves no room for a prompt in the "
                                                      f"model's context of {CONTEXT} tokens"),
        ("", None),
        ('{"prompt": "caf\\u00e9", "temperature": 0.5, "top_k": 4, "top_p": 0.9, "seed": 7}', None),
    ]
    path = write_lines(tmp_path / "requests.jsonl", [line for line, _ in lines])
    with open(path, "ab") as f:
        f.write(b'{"prompt": "\xff"}\n')  # not UTF-8
    want = [f"{path}:{n}: {message}" for n, (_, message) in enumerate(lines, 1) if message is not None]
    want.append(f"{path}:{len(lines) + 1}: not UTF-8 text (byte 0xff at byte 13)")
    code, out, err = run_cli(["--model", tiny, "--device", "cpu", "--prompts", path], capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    got = err.splitlines()
    assert len(got) == len(want), err
    for g, w in zip(got, want):
        assert g.startswith(w), (g, w)


def test_a_prompts_file_is_utf8_with_a_bom_whatever_the_locale(tiny, tmp_path):
    """Under LC_ALL=C (ASCII as Python's default encoding, UTF-8 mode off), a file starting with a BOM and holding
    non-ASCII text is read: the BOM line and the text line pass, the bad third line alone is reported, on one line
    with its number; exit 2, no traceback (the process as a user starts it)."""
    path = tmp_path / "requests.jsonl"
    path.write_bytes("\ufeff".encode() + '{"prompt_ids": [1, 2]}\n{"prompt": "café ☕"}\n{"prompt_ids": [1], '
                     '"stop": "é"}\n'.encode())
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0", "PYTHONIOENCODING": ""}
    proc = subprocess.run([sys.executable, "-m", "torch_zipkv.serve", "--model", tiny, "--device", "cpu",
                           "--prompts", str(path)], capture_output=True, env=env, timeout=300, check=False)
    err = proc.stderr.decode("ascii", "backslashreplace")
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.splitlines() == [f"{path}:3: unknown field 'stop'; the fields are prompt, prompt_ids, max_new_tokens, "
                                "temperature, top_k, top_p, seed"], err


class _FailingEngine(Engine):
    """An engine whose step fails once some request has finished: a failure in the middle of a run."""

    def step(self):
        if getattr(self, "_finished_seen", False):
            raise RuntimeError("the device fell over")
        outs = super().step()
        self._finished_seen = any(o.finished for o in outs)
        return outs


def test_out_keeps_the_requests_served_before_a_failure(tiny, tmp_path, monkeypatch, capsys):
    """--out gets each request's line as it finishes, flushed: when the run fails part way, the requests that
    finished before are in the file, whole, and the others are not."""
    monkeypatch.setattr(serve, "Engine", _FailingEngine)
    prompts = write_lines(tmp_path / "requests.jsonl", [json.dumps({"prompt_ids": [1, 2, 3], "max_new_tokens": n})
                                                        for n in (2, 40, 40)])
    out = tmp_path / "results.jsonl"
    with pytest.raises(RuntimeError, match="the device fell over"):
        serve.main(["--model", tiny, "--device", "cpu", "--prompts", prompts, "--out", str(out), "--no-progress",
                    "--max-kv-bytes", str(16 << 20)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["line"], r["output_len"], r["finish_reason"]) for r in rows] == [(0, 1, 2, "length")]


def test_a_request_the_engine_refuses_is_reported_and_the_rest_served(long_context, tmp_path, capsys):
    """A request longer than the whole KV cache (which only the built engine knows): one stderr line FILE:LINE:
    refused by the engine, an --out line with finish reason "refused"; the requests before and after it are served,
    the summary counts it, and the module's exit status is 1."""
    lines = [json.dumps({"prompt_ids": [1, 2], "max_new_tokens": 3}),
             json.dumps({"prompt_ids": [1] * 30000, "max_new_tokens": 2}),
             json.dumps({"prompt_ids": [3, 4], "max_new_tokens": 2})]
    prompts = write_lines(tmp_path / "requests.jsonl", lines)
    out = tmp_path / "results.jsonl"
    summary = serve.main(["--model", long_context, "--device", "cpu", "--prompts", prompts, "--out", str(out),
                          "--no-progress", "--max-kv-bytes", str(16 << 20)])
    captured = capsys.readouterr()
    refusals = [m for m in messages(captured.err) if "refused" in m]
    assert len(refusals) == 1 and refusals[0].startswith(f"{prompts}:2: refused by the engine: prompt_ids (30000 "
                                                         "tokens) + max_new_tokens (2) needs"), captured.err
    rows = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert {i: (r["line"], r["finish_reason"]) for i, r in rows.items()} == {0: (1, "length"), 1: (2, "refused"),
                                                                             2: (3, "length")}
    assert "more than the whole KV cache holds" in rows[1]["error"] and rows[2]["output_len"] == 2
    assert summary["requests"] == 2 and summary["refused"] == 1 and summary["generated_tokens"] == 5
    assert "2 requests, 1 refused" in captured.out
    assert serve.exit_status(summary) == 1 and serve.exit_status({**summary, "refused": 0}) == 0


def test_the_synthetic_load_is_made_as_it_is_served():
    """A load of 10**18 requests takes nothing up front: its first requests come at once, each with its own random
    prompt and a later arrival; at rate inf all arrive at 0."""
    load = serve.synthetic_load(10**18, 4, 2, VOCAB, 10.0, seed=3)
    first = list(itertools.islice(load, 3))
    assert [r["index"] for r in first] == [0, 1, 2]
    assert all(len(r["prompt"]) == 4 and all(0 <= t < VOCAB for t in r["prompt"]) for r in first)
    assert first[0]["prompt"] != first[1]["prompt"] and 0 < first[0]["arrival"] < first[1]["arrival"]
    assert first[0]["params"] == SamplingParams(max_new_tokens=2)
    at_once = itertools.islice(serve.synthetic_load(10**18, 4, 2, VOCAB, float("inf"), seed=3), 3)
    assert [r["arrival"] for r in at_once] == [0.0] * 3


def test_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "torch_zipkv.serve", "--help"], capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "--arrival-rate" in proc.stdout and "--no-compress" in proc.stdout
    assert "exit status 2" in proc.stdout and "1 to 65536" in proc.stdout


def test_jsonl_text_prompts_on_smollm2(tmp_path, capsys, monkeypatch):
    """The shipped SmolLM2 (the default --model, a GGUF file), text and token-id prompts from a JSONL file: each
    result has its text, and generation stops at EOS or after its max_new_tokens. Its config is read from the GGUF
    file before the weights: an id outside its vocabulary is refused without loading them."""
    require_smollm2()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "The capital of France is", "max_new_tokens": 4}) + "\n" +
                       json.dumps({"prompt_ids": [1, 2, 3, 4], "max_new_tokens": 3}) + "\n")
    out = tmp_path / "results.jsonl"
    summary = serve.main(["--prompts", str(prompts), "--out", str(out), "--device", "cpu",
                          "--max-kv-bytes", str(256 << 20), "--no-progress"])
    rows = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["index"])
    assert [r["output_len"] <= n for r, n in zip(rows, (4, 3))] == [True, True]
    assert all(r["finish_reason"] in ("stop", "length") and isinstance(r["text"], str) for r in rows)
    assert summary["requests"] == 2 and "2 requests" in capsys.readouterr().out

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_ids": [1, 49152]}) + "\n")
    monkeypatch.setattr(serve, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
    code, out, err = run_cli(["--prompts", str(bad), "--device", "cpu"], capsys)
    assert code == 2 and err == f"{bad}:1: prompt_ids holds ids outside the model's vocabulary [0, 49152): [49152]\n"


def test_sampling_params_of_a_line_get_the_tokenizers_eos(tmp_path):
    """With a tokenizer, every request also stops at its EOS (prepare_requests), the line's own fields kept."""

    class Tok:
        eos_token_id = 7

        def __call__(self, text):
            return type("Encoding", (), {"input_ids": [ord(c) % 50 for c in text]})()

    reqs = [{**serve.parse_request(line, 16), "index": i, "line": i + 1, "where": f"f:{i + 1}"}
            for i, line in enumerate(['{"prompt": "hi", "top_k": 3}', '{"prompt_ids": [1, 2], "max_new_tokens": 4}'])]
    serve.prepare_requests("f", reqs, Tok(), serve.ModelLimits(VOCAB, CONTEXT, 2), "m")
    assert reqs[0]["prompt"] == [ord("h") % 50, ord("i") % 50]
    assert reqs[0]["params"] == dataclasses.replace(SamplingParams(max_new_tokens=16, top_k=3), stop_token_ids=(7,))
    assert reqs[1]["params"] == SamplingParams(max_new_tokens=4, stop_token_ids=(7,))
