"""Prefix caching over compressed pages, end to end: time to first token, output tokens/s, requests running at once
and cache hits, for the engine with compression and prefix caching, compression without caching, and caching with
every page raw, under one KV memory budget, each (workload, system) in its own process, one run.

    python benchmarks/bench_prefix.py --out DIR            # H200: Llama-3.1-8B architecture, random BF16 weights
    python benchmarks/bench_prefix.py --out DIR --quick    # GPU smoke run (~2-3 min): fewer, shorter requests
    python benchmarks/bench_prefix.py --out DIR --tiny     # CPU: a tiny random Llama, short prompts, MiB budgets

Workloads (the load and the serving loop are ``python -m torch_zipkv.serve``'s own: ``synthetic_load``,
``chat_follow_up``, ``serve``):
- ``shared``: a shared system prompt: every request is one ``--shared-prefix-len`` (4096) prefix, then
  ``--private-len`` (512) tokens of its own, generating ``--gen-len`` (256) tokens; ``--requests`` (256) arriving as a
  Poisson process of ``--rate`` requests/s;
- ``chat``: ``--conversations`` (64) multi-turn chats of ``--turns`` (4) turns, starting as a Poisson process of the
  same rate; each turn's prompt is the previous turn's prompt, its answer and ``--message-len`` (256) new tokens, and
  arrives when the previous turn finishes; the first turn is ``--first-len`` (1024) tokens.

Systems: ``zipkv+cache`` (compression and prefix caching, the defaults), ``zipkv`` (``prefix_caching=False``),
``raw+cache`` (``compress=False``); asked for by ``--systems``, ``zipkv+cache+reclaim`` (``reclaim=True``). Per
system and workload: TTFT p50 / p99 (from arrival, queueing included, as the
caller of ``step()`` sees it), output tokens/s over the run, the largest decode batch (requests running at once at the
peak), and the prefix cache's hit rate (prompt tokens found / prompt tokens admitted).

Why the prompts run through the model here: ``bench_e2e.py`` injects real-KV-like prompt K/V with ``kv_source``, which
skips the prefill, so it cannot time a prefill, and a ``kv_source`` request never enters the prefix cache (its K/V are
not the model's). Here every prompt token that is not found in the cache is prefilled by the model (the chunked
prefill path, ``--prefill-chunk`` tokens per step over all requests), so TTFT counts the prefill work that caching
saves. The price: the stored K/V are the random-weight model's, not real-KV-like, and those compress about as well
as Gaussian data (close to the format's 0.75), better than real KV (0.77 with format v5, ``bench_e2e``'s injection).
So the speed and TTFT figures are honest, and the capacity ratios against the raw engine come out a little high;
each row reports the mean KV ratio it ran at, so the bar can be read against real KV's.

Each job warms up first with a few requests of the workload's shape (CUDA Graph capture for the small buckets,
allocations), not counted: the figures are the main load's alone (hit counts are the difference of the engine's
totals). Each job also records a per-step trace of its load (``step_trace``: see ``StepTrace``), and with
``ZIPKV_PROFILE_JOB=DIR`` a cProfile of the load's host time into DIR, and with ``ZIPKV_TORCH_PROFILE=DIR`` a
``torch.profiler`` table of steps ``ZIPKV_TORCH_PROFILE_STEPS`` (``first:last``, default ``100:140``) of the load into
DIR: operators and kernels by device time, and the device's busy time against the steps' wall time; with
``ZIPKV_PROFILE_COMPRESS=DIR`` a cProfile of the load's compression and reclaim calls alone (their host time,
``compress_ms`` and ``reclaim_ms`` in the step trace). Writes
bench_prefix.json, bench_prefix.md and bench_prefix.png (if matplotlib is there) into --out.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import pathlib
import pstats
import subprocess
import sys
import tempfile
import time

import torch

from bench_e2e import GiB, build_model, git_commit, jsonable, parse_budget, budget_bytes_fixed, weight_bytes
from bench_hf import LLAMA_8B, TINY

SYSTEMS = {"zipkv+cache": dict(compress=True, prefix_caching=True), "zipkv": dict(compress=True, prefix_caching=False),
           "raw+cache": dict(compress=False, prefix_caching=True),
           # not run unless asked: Engine(reclaim=True), a bounded compaction while requests wait
           "zipkv+cache+reclaim": dict(compress=True, prefix_caching=True, reclaim=True)}
DEFAULT_SYSTEMS = ["zipkv+cache", "zipkv", "raw+cache"]
WORKLOADS = ("shared", "chat")
SIZES = {  # per mode: the workloads' lengths and counts, the budget, the prefill chunk, the engine's compress_every
    "full": dict(shared_prefix_len=4096, private_len=512, gen_len=256, requests=256, conversations=64, turns=4,
                 first_len=1024, message_len=256, rate=16.0, budget="16GiB", prefill_chunk=2048, warmup=4,
                 compress_every=8),
    "quick": dict(shared_prefix_len=4096, private_len=512, gen_len=64, requests=64, conversations=16, turns=3,
                  first_len=1024, message_len=256, rate=32.0, budget="8GiB", prefill_chunk=2048, warmup=2,
                  compress_every=8),
    "tiny": dict(shared_prefix_len=256, private_len=32, gen_len=16, requests=24, conversations=6, turns=3,
                 first_len=64, message_len=32, rate=200.0, budget="4MiB", prefill_chunk=256, warmup=2,
                 compress_every=8),
}


# ---- one job ---------------------------------------------------------------------------------------------------
def load_of(spec: dict, n: int, seed: int):
    """(load, follow_up, requests) of ``spec``'s workload with ``n`` requests (conversations for chat)."""
    from torch_zipkv.serve import chat_follow_up, synthetic_load

    s, vocab = spec["sizes"], spec["model_cfg"]["vocab_size"]
    if spec["workload"] == "shared":
        return (synthetic_load(n, s["private_len"], s["gen_len"], vocab, s["rate"], seed,
                               shared_prefix_len=s["shared_prefix_len"]), None, n)
    return (synthetic_load(n, s["first_len"], s["gen_len"], vocab, s["rate"], seed, turns=s["turns"]),
            chat_follow_up(s["turns"], s["message_len"], vocab, seed), n * s["turns"])


class StepTrace:
    """Per-step records of an engine's load, to tell where a step's time goes: the host's wall time of each
    ``step()`` call, the part of it spent waiting for the device (``read_back``: the step before's tokens), the decode
    rows and prefill tokens it launched, whether it called compress_full_pages (and the host time the call took) or ran
    the shared-prefix pass, and on CUDA the device's time from this step's first launch to the next step's (an event
    at each step's start: the GPU's timeline per step, idle gaps included)."""

    def __init__(self, engine, profile_name: str | None = None):
        self.engine, self.rows = engine, []
        self._profile_to = os.environ.get("ZIPKV_TORCH_PROFILE")  # a folder: a torch.profiler table of some steps
        first, last = os.environ.get("ZIPKV_TORCH_PROFILE_STEPS", "100:140").split(":")
        self._profile_steps, self._profile_name, self._profiler = (int(first), int(last)), profile_name, None
        runner = engine.runner
        self._decode, self._prefill, self._read_back = runner.decode, runner.prefill, runner.read_back
        runner.decode, runner.prefill, runner.read_back = self._traced_decode, self._traced_prefill, self._traced_rb
        self._step = engine.step
        engine.step = self._traced_step
        self._compress, self._compact = engine.kv.compress_full_pages, engine.kv.compact
        engine.kv.compress_full_pages, engine.kv.compact = self._traced_compress, self._traced_compact
        self.compress_profile = cProfile.Profile() if os.environ.get("ZIPKV_PROFILE_COMPRESS") else None
        self._cur = None
        self._cuda = engine.device.type == "cuda"

    def _traced_decode(self, batch):
        self._cur["decode_rows"] = len(batch)
        return self._decode(batch)

    def _traced_prefill(self, chunks):
        self._cur["prefill_tokens"] += sum(n for _, _, n in chunks)
        return self._prefill(chunks)

    def _host_ms(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) and its host time (ms; the device may wait for it), inside the compression profile
        if one is kept."""
        t = time.perf_counter()
        if self.compress_profile is not None:
            self.compress_profile.enable()
        out = fn(*args, **kwargs)
        if self.compress_profile is not None:
            self.compress_profile.disable()
        return out, (time.perf_counter() - t) * 1e3

    def _traced_compress(self, *args, **kwargs):
        self._cur["compress_round"] = True
        out, self._cur["compress_ms"] = self._host_ms(self._compress, *args, **kwargs)
        return out

    def _traced_compact(self, *args, **kwargs):  # the engine's bounded compaction (reclaim=True)
        out, ms = self._host_ms(self._compact, *args, **kwargs)
        self._cur["reclaim_ms"] += ms
        return out

    def _traced_rb(self, in_flight):
        t = time.perf_counter()
        out = self._read_back(in_flight)
        self._cur["wait_ms"] += (time.perf_counter() - t) * 1e3
        return out

    def _traced_step(self):
        e = self.engine
        self._cur = {"decode_rows": 0, "prefill_tokens": 0, "wait_ms": 0.0,
                     "compress_round": False, "compress_ms": 0.0, "reclaim_ms": 0.0}
        shared = e.runner.shared_steps
        if self._cuda:
            self._cur["event"] = torch.cuda.Event(enable_timing=True)
            self._cur["event"].record()
        if self._profile_to and len(self.rows) == self._profile_steps[0]:
            self._start_profile()
        t = time.perf_counter()
        outs = self._step()
        self._cur["wall_ms"] = (time.perf_counter() - t) * 1e3
        self._cur["shared_pass"] = e.runner.shared_steps > shared
        self.rows.append(self._cur)
        if self._profiler is not None and len(self.rows) == self._profile_steps[1]:
            self._write_profile()
        return outs

    def _start_profile(self) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self._cuda else [])
        self._profiler = torch.profiler.profile(activities=acts)
        self._profiler.__enter__()
        self._profile_t0 = time.perf_counter()

    def _write_profile(self) -> None:
        """The profiled steps' table: what ran (operators, kernels) by device time, then by host time; the device's
        busy time (kernels and copies, summed) against the steps' wall time; the steps' rows and prefill tokens."""
        if self._cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._profile_t0
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        first, last = self._profile_steps
        steps = self.rows[first:last]
        events = prof.key_averages()
        device_us = sum(getattr(e, "self_device_time_total", 0.0) for e in events)
        lines = [f"steps {first}..{last - 1} of the load: wall {wall * 1e3:.1f} ms, device busy "
                 f"{device_us / 1e3:.1f} ms (self device time summed, as the table's total)",
                 "per step (wall ms, decode rows, prefill tokens, compression call, shared-prefix pass): " +
                 "; ".join(f"{r['wall_ms']:.1f}/{r['decode_rows']}/{r['prefill_tokens']}/{int(r['compress_round'])}"
                           f"/{int(r['shared_pass'])}" for r in steps), ""]
        if self._cuda:
            lines.append(events.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=70))
        lines.append(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
        name = f"torch_profile_{self._profile_name or 'job'}.txt"
        pathlib.Path(self._profile_to).mkdir(parents=True, exist_ok=True)
        pathlib.Path(self._profile_to, name).write_text("\n".join(lines))

    def summary(self) -> dict:
        """The records as columns (``gpu_ms``: to the next step's start; the last step's is None), and means of
        wall, wait and device time over the steps that decoded, split by whether they also prefilled, and each of
        those by whether the step ran a compression call (what a call costs: the same kind of step with and
        without one)."""
        if self._cuda and self.rows:
            torch.cuda.synchronize()
            events = [r.pop("event") for r in self.rows]
            for r, a, b in zip(self.rows, events, events[1:] + [None]):
                r["gpu_ms"] = a.elapsed_time(b) if b is not None else None
        cols = {k: [r.get(k) for r in self.rows] for k in
                ("wall_ms", "wait_ms", "gpu_ms", "decode_rows", "prefill_tokens", "compress_round", "compress_ms",
                 "reclaim_ms", "shared_pass")}

        def mean(rows, key):
            vals = [r[key] for r in rows if r.get(key) is not None]
            return sum(vals) / len(vals) if vals else None

        groups = {"decode_only": [r for r in self.rows if r["decode_rows"] and not r["prefill_tokens"]],
                  "decode_and_prefill": [r for r in self.rows if r["decode_rows"] and r["prefill_tokens"]]}
        for g in list(groups):
            groups[g + ", compression call"] = [r for r in groups[g] if r["compress_round"]]
            groups[g + ", no call"] = [r for r in groups[g] if not r["compress_round"]]
        means = {g: {"steps": len(rows), **{k: mean(rows, k) for k in ("wall_ms", "wait_ms", "gpu_ms", "compress_ms",
                                                                         "reclaim_ms", "decode_rows",
                                                                         "prefill_tokens")}}
                 for g, rows in groups.items()}
        return {"columns": cols, "means": means}


def write_cprofile(prof: cProfile.Profile, path: pathlib.Path) -> None:
    """A cProfile's heaviest calls, by cumulative time and by own time, as text at ``path``."""
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.getvalue())


def run_job(spec: dict, report: dict) -> None:
    from torch_zipkv.engine import Engine
    from torch_zipkv.serve import serve

    device = torch.device(spec["device"])
    t = time.perf_counter()
    model = build_model(spec["model_cfg"], device)
    report["weight_bytes"] = weight_bytes(model)
    budget = budget_bytes_fixed(spec["sizes"]["budget"])
    engine = Engine(model, max_kv_bytes=budget, prefill_chunk=spec["sizes"]["prefill_chunk"],
                    compress_every=spec["sizes"]["compress_every"], cuda_graphs=device.type == "cuda",
                    **SYSTEMS[spec["system"]])
    report.update(budget_bytes=budget, kv_bytes_total=engine.stats()["kv_bytes_total"],
                  setup_s=time.perf_counter() - t)
    if spec["sizes"]["warmup"]:  # one turn each, tokens other than the load's
        serve(engine, load_of(spec, spec["sizes"]["warmup"], seed=1)[0], progress=False)
    before = engine.stats()
    compiles = _dynamo_graphs()
    load, follow_up, total = load_of(spec, spec["sizes"]["requests" if spec["workload"] == "shared" else
                                                    "conversations"], seed=0)
    job_name = f"{spec['workload']}_{spec['system'].replace('+', '_')}"
    trace = StepTrace(engine, job_name)
    profile_to = os.environ.get("ZIPKV_PROFILE_JOB")  # a folder: the load's host profile (cProfile), per job
    if profile_to:
        prof = cProfile.Profile()
        prof.enable()
    summary = serve(engine, load, total=total, progress=False, follow_up=follow_up)
    if profile_to:
        prof.disable()
        write_cprofile(prof, pathlib.Path(profile_to, f"profile_{job_name}.txt"))
    if trace.compress_profile is not None:
        write_cprofile(trace.compress_profile,
                       pathlib.Path(os.environ["ZIPKV_PROFILE_COMPRESS"], f"profile_compress_{job_name}.txt"))
    after = engine.stats()
    report["step_trace"] = trace.summary()
    found, prefilled = (after[k] - before[k] for k in ("prefix_cached_tokens", "prefilled_tokens"))
    report.update(
        requests=summary["requests"], elapsed_s=summary["elapsed_s"],
        output_tokens_per_s=summary["output_tokens_per_s"], ttft_s=summary["ttft_s"], tpot_s=summary["tpot_s"],
        largest_batch=summary["largest_batch"], steps=after["steps"] - before["steps"],
        kv_ratio_mean=summary["kv_ratio_mean"], prefix_cached_tokens=found, prefilled_tokens=prefilled,
        prefix_hits=after["prefix_hits"] - before["prefix_hits"],
        shared_prefix_steps=after["shared_prefix_steps"] - before["shared_prefix_steps"],
        prefix_hit_rate=found / (found + prefilled) if found + prefilled else 0.0, cuda_graphs=after["cuda_graphs"],
        # Inside the load, not the warm-up: compilation and graph capture (seconds), and graphs dynamo compiled.
        decode_setup_s_in_load=after["decode_setup_s"] - before["decode_setup_s"],
        dynamo_graphs_in_load=_dynamo_graphs() - compiles)
    if device.type == "cuda":
        report["max_memory_allocated"] = torch.cuda.max_memory_allocated()


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def child_main(spec_path: str) -> None:
    spec = json.loads(pathlib.Path(spec_path).read_text())
    out = pathlib.Path(spec["result_path"])
    report = {"system": spec["system"], "workload": spec["workload"]}
    if spec["device"] == "cpu":
        torch.set_num_threads(spec["threads"])
    else:
        report["device_name"] = torch.cuda.get_device_name(torch.device(spec["device"]))
    try:
        run_job(spec, report)
    except Exception as e:
        import traceback

        traceback.print_exc()
        report["error"] = f"{type(e).__name__}: {e}"
    out.write_text(json.dumps(jsonable(report), indent=1))


# ---- the run ---------------------------------------------------------------------------------------------------
def ratio(a, b):
    return a / b if a is not None and b else None


def bars(rows: dict) -> list[dict]:
    """The issue's bars on the shared-prompt load (rows[(workload, system)])."""
    get = lambda system, *keys: _dig(rows.get(("shared", system)), *keys)  # noqa: E731
    checks = [
        ("TTFT p50, zipkv+cache / zipkv", ratio(get("zipkv+cache", "ttft_s", "p50"), get("zipkv", "ttft_s", "p50")),
         "<=", 0.3),
        ("requests at once, zipkv+cache / zipkv", ratio(get("zipkv+cache", "largest_batch"),
                                                        get("zipkv", "largest_batch")), ">=", 4.0),
        ("requests at once, zipkv+cache / raw+cache", ratio(get("zipkv+cache", "largest_batch"),
                                                            get("raw+cache", "largest_batch")), ">=", 1.2),
        ("output tok/s, zipkv+cache / raw+cache", ratio(get("zipkv+cache", "output_tokens_per_s"),
                                                        get("raw+cache", "output_tokens_per_s")), ">=", 1.15)]
    return [{"bar": name, "measured": m, "target": f"{op} {target}",
             "met": None if m is None else (m <= target if op == "<=" else m >= target)}
            for name, m, op, target in checks]


def _dig(row, *keys):
    for k in keys:
        if not isinstance(row, dict) or row.get(k) is None:
            return None
        row = row[k]
    return row


def markdown(result: dict) -> str:
    lines = [f"# bench_prefix: {result['model']}, {result['device_name'] or result['device']}", "",
             f"`{result['command']}` at {result['commit'][:10]}, {result['date']}; KV budget "
             f"{result['sizes']['budget']}", "",
             "| workload | system | TTFT p50 | TTFT p99 | output tok/s | requests at once | hit rate | KV ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for job in result["jobs"]:
        if "error" in job:
            lines.append(f"| {job['workload']} | {job['system']} | error: {job['error']} | | | | | |")
            continue
        ms = lambda q: f"{job['ttft_s'][q] * 1e3:.0f} ms" if job["ttft_s"][q] is not None else "-"  # noqa: E731
        lines.append(f"| {job['workload']} | {job['system']} | {ms('p50')} | {ms('p99')} | "
                     f"{job['output_tokens_per_s']:.0f} | {job['largest_batch']} | {job['prefix_hit_rate']:.3f} | "
                     f"{job['kv_ratio_mean']:.3f} |")
    lines += ["", "| bar (shared prompt) | measured | target | met |", "|---|---|---|---|"]
    for b in result["bars"]:
        m = "-" if b["measured"] is None else f"{b['measured']:.2f}"
        lines.append(f"| {b['bar']} | {m} | {b['target']} | {b['met']} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = [j for j in result["jobs"] if "error" not in j]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (title, value) in zip(axes, (("TTFT p50 (s)", lambda j: j["ttft_s"]["p50"] or 0),
                                         ("output tokens/s", lambda j: j["output_tokens_per_s"]),
                                         ("requests running at once (peak)", lambda j: j["largest_batch"]))):
        for w, workload in enumerate(WORKLOADS):
            for s, system in enumerate(SYSTEMS):
                job = next((j for j in jobs if j["workload"] == workload and j["system"] == system), None)
                if job is not None:
                    ax.bar(w * 4 + s, value(job), color=f"C{s}", label=system if w == 0 else None)
        ax.set_xticks([1, 5], WORKLOADS)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"prefix caching, {result['model_name']}, KV budget {result['sizes']['budget']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--tiny", action="store_true", help="CPU run: a tiny random Llama, short prompts, MiB budgets")
    p.add_argument("--quick", action="store_true", help="GPU smoke run: fewer, shorter requests (~2-3 min)")
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --tiny)")
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=DEFAULT_SYSTEMS)
    p.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    for name in ("shared-prefix-len", "private-len", "gen-len", "requests", "conversations", "turns", "first-len",
                 "message-len", "prefill-chunk", "warmup", "compress-every"):
        p.add_argument(f"--{name}", type=int, default=None, help="default: the mode's (see SIZES)")
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (inf: all at once)")
    p.add_argument("--budget", type=parse_budget, default=None, help="KV budget, e.g. 16GiB (default: the mode's)")
    p.add_argument("--time-limit", type=float, default=570.0, help="seconds for the whole run (later jobs skipped)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per job (CPU runs)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(args.child)

    start = time.perf_counter()
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device == "cpu" and not args.tiny:
        p.error("the 8B model needs a GPU; use --tiny for a CPU run")
    sizes = dict(SIZES["tiny" if args.tiny else "quick" if args.quick else "full"])
    for key in sizes:
        if getattr(args, key, None) is not None:
            sizes[key] = getattr(args, key)
    if sizes["budget"] == "free" or budget_bytes_fixed(sizes["budget"]) is None:
        p.error("--budget wants a size such as 16GiB")
    for key, value in sizes.items():
        if key not in ("budget", "rate") and value < (0 if key == "warmup" else 1):
            p.error(f"--{key.replace('_', '-')} must be >= 1, got {value}")
    cfg = dict(TINY if args.tiny else LLAMA_8B)
    longest = max(sizes["shared_prefix_len"] + sizes["private_len"],
                  sizes["first_len"] + (sizes["turns"] - 1) * (sizes["gen_len"] + sizes["message_len"]))
    if longest + sizes["gen_len"] > cfg["max_position_embeddings"]:
        p.error(f"requests of {longest + sizes['gen_len']} tokens exceed the model's context")
    result = {"benchmark": "bench_prefix", "command": "python " + " ".join(sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "device": device, "device_name": None, "torch": torch.__version__,
              "model": ("tiny random Llama (CPU run)" if args.tiny else
                        "Llama-3.1-8B architecture, random BF16 weights (not trained: speed and capacity only)"),
              "model_name": "tiny random Llama" if args.tiny else "Llama-3.1-8B arch., random BF16",
              "model_config": cfg, "sizes": sizes, "budget_gib": budget_bytes_fixed(sizes["budget"]) / GiB,
              "kv_data": "the random-weight model's own K/V (prompts prefilled through the model)", "jobs": []}
    print(f"bench_prefix: {result['model']}, {device}; sizes {sizes}", flush=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_prefix_"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    deadline = start + args.time_limit
    for i, (workload, system) in enumerate((w, s) for w in args.workloads for s in args.systems):
        job = {"workload": workload, "system": system}
        left = deadline - time.perf_counter()
        if left < 20:
            result["jobs"].append({**job, "error": "skipped: the run's --time-limit was spent"})
            continue
        spec = {**job, "device": device, "model_cfg": cfg, "sizes": sizes, "threads": args.threads,
                "result_path": str(tmp / f"job{i}.json")}
        spec_path = tmp / f"job{i}.spec.json"
        spec_path.write_text(json.dumps(spec))
        t = time.perf_counter()
        try:
            rc = subprocess.run([sys.executable, __file__, "--child", str(spec_path)], env=env, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        path = pathlib.Path(spec["result_path"])
        job.update(json.loads(path.read_text()) if path.is_file() else {})
        job["process_wall_s"] = time.perf_counter() - t
        if rc != 0:
            job.setdefault("error", f"the job's process ended with {rc}")
        result["device_name"] = result["device_name"] or job.get("device_name")
        result["jobs"].append(job)
        print(f"[{time.perf_counter() - start:.0f} s] {workload} / {system}: " +
              (job["error"] if "error" in job else
               f"TTFT p50 {job['ttft_s']['p50']:.3f} s, {job['output_tokens_per_s']:.0f} tok/s, "
               f"{job['largest_batch']} at once, hit rate {job['prefix_hit_rate']:.3f}"), flush=True)
        for group, m in job.get("step_trace", {}).get("means", {}).items():
            print(f"    {group}: {m['steps']} steps" + "".join(
                f", {k} {m[k]:.1f}" for k in ("wall_ms", "wait_ms", "gpu_ms", "compress_ms", "reclaim_ms",
                                               "decode_rows", "prefill_tokens")
                if m[k] is not None), flush=True)
        save(result, args.out, start)
    save(result, args.out, start)
    print("\n" + markdown(result))
    if args.out:
        (args.out / "bench_prefix.md").write_text(markdown(result))
        try:
            plot(result, args.out / "bench_prefix.png")
        except Exception as e:  # the JSON is the result; a missing matplotlib must not lose it
            print(f"bench_prefix: no plot ({type(e).__name__}: {e})")
        print(f"bench_prefix: wrote {args.out / 'bench_prefix.json'} in {result['wall_s']:.0f} s")


def save(result: dict, out: pathlib.Path | None, start: float) -> None:
    """The bars of the jobs so far and the wall time into ``result``, and ``result`` into ``out``/bench_prefix.json:
    after every job, so that a run stopped from outside (a device's time limit) keeps the jobs it finished."""
    result["bars"] = bars({(j["workload"], j["system"]): j for j in result["jobs"] if "error" not in j})
    result["wall_s"] = time.perf_counter() - start
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_prefix.json").write_text(json.dumps(jsonable(result), indent=1) + "\n")


if __name__ == "__main__":
    main()
