"""Where the engine's steps make the host wait for the device: every synchronizing CUDA call of a load's steps,
counted by step kind (a step that prefills, or decode only) and by the Python frames of torch_zipkv and transformers
that made it. A small random Llama, a load with prefill chunks, a shared prompt prefix (cache hits), compression
calls and requests that end, run once to capture every graph, then again under torch's sync debug mode "warn".

    python benchmarks/profile_engine_syncs.py          # CUDA only

A synchronizing call stalls the host until the device has run out of work, so the next step's launches no longer
overlap this step's kernels (`docs/performance.md`, prefix caching: a constant written by indexing did that).
"""

import collections
import random
import traceback
import warnings

import torch

from bench_e2e import build_model
from bench_hf import TINY
from torch_zipkv.engine import Engine, SamplingParams


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("profile_engine_syncs.py needs a CUDA device")
    eng = Engine(build_model(TINY, torch.device("cuda")), max_kv_bytes=64 << 20, kv_chunk_bytes=256 << 10,
                 prefill_chunk=64, compress_every=2)

    def load(seed: int) -> None:  # 12 requests over an 80-token prefix, finishing one by one
        rng = random.Random(seed)
        prefix = [rng.randrange(512) for _ in range(80)]
        for i in range(12):
            eng.add_request(prefix + [rng.randrange(512) for _ in range(20 + 7 * i)],
                            SamplingParams(max_new_tokens=10 + 3 * i))

    load(1)
    while eng.has_unfinished():
        eng.step()
    load(2)
    calls, steps, kind = collections.Counter(), collections.Counter(), ["?"]

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if "synchronizing" in str(message):  # "called a synchronizing CUDA operation"
            frames = [f for f in traceback.extract_stack()
                      if "torch_zipkv" in f.filename or "transformers" in f.filename][-4:][::-1]
            calls[(kind[0], " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in frames))] += 1

    warnings.showwarning = on_warning
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while eng.has_unfinished():
            kind[0] = "prefill" if eng.scheduler.waiting or any(r.state == "prefill" for r in eng.scheduler.running) \
                else "decode"
            steps[kind[0]] += 1
            eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print("steps:", dict(steps))
    for (k, where), n in calls.most_common(40):
        print(f"{n:5d} {k:8s} {where}")
    print(f"{sum(calls.values())} synchronizing calls")


if __name__ == "__main__":
    main()
