"""The engine on a GPU: decode steps replayed as CUDA Graphs (batch buckets with padded rows, tables of several
widths), against transformers' own greedy generate on the same GPU, up to bf16 ties."""

from __future__ import annotations

import copy
import random

import pytest

pytest.importorskip("transformers")

from torch_zipkv import shared_prefix  # noqa: E402
from torch_zipkv.engine import Engine, SamplingParams  # noqa: E402

from conftest import require_smollm2, requires_cuda  # noqa: E402
from engine_reference import Reference  # noqa: E402
from hf_models import small_model  # noqa: E402
from test_engine import prompts_of, run_all  # noqa: E402
from test_engine_prefix import shared_prefix_arrivals, shared_prompts  # noqa: E402

pytestmark = requires_cuda

ARCHS = {"llama": {}, "gemma3": {"sliding_window": 16}, "gemma2": {"sliding_window": 16}}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_graphs_match_generate(arch):
    """Eleven requests arriving over the first steps (batches of 1 to 11 rows: buckets 1, 2, 4, 8 and 16 with padded
    rows), prompts and outputs crossing pages and windows: greedy tokens are transformers' own; the pad sequence
    still holds its one token (padded rows wrote only its slots, which no length counts)."""
    model = small_model(arch, **ARCHS[arch]).cuda()
    ref = Reference(model)
    rng = random.Random(1)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 60))] for _ in range(11)]
    new = [rng.randint(1, 40) for _ in prompts]
    eng = Engine(model, max_kv_bytes=64 << 20, kv_chunk_bytes=256 << 10, prefill_chunk=32, compress_every=2)
    assert eng.stats()["cuda_graphs"] == 0
    ids, finals, step = [], {}, 0
    while len(ids) < len(prompts) or eng.has_unfinished():
        if len(ids) < len(prompts):
            ids.append(eng.add_request(prompts[len(ids)], SamplingParams(max_new_tokens=new[len(ids)])))
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
        step += 1
    for rid, prompt, n in zip(ids, prompts, new):
        assert finals[rid].finish_reason == "length" and len(finals[rid].token_ids) == n
        ref.check(prompt, finals[rid].token_ids)
    assert eng.stats()["cuda_graphs"] >= 3
    assert eng.kv.seq_len(0, eng.runner.pad_seq) == 1 and eng.kv.seq_ids == [eng.runner.pad_seq]


def test_graphs_replay_deterministically_with_sampling():
    """Seeded sampling and greedy requests side by side: two engines with CUDA Graphs give the same tokens (replays are
    deterministic and the seeds fix the draws), the greedy ones are transformers' own up to ties, and an eager engine
    agrees with the graphs' greedy tokens up to ties too (the graphs pad rows and round the table's width, so a
    kernel may round differently)."""
    model = small_model("llama").cuda()
    ref = Reference(model)
    rng = random.Random(2)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(5, 40))] for _ in range(5)]
    params = [SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=i) if i % 2 else
              SamplingParams(max_new_tokens=20) for i in range(5)]
    runs = []
    for graphs in (True, True, False):
        eng = Engine(model, max_kv_bytes=32 << 20, kv_chunk_bytes=256 << 10, cuda_graphs=graphs)
        runs.append([o.token_ids for o in eng.generate(prompts, params)])
        assert eng.stats()["cuda_graphs"] >= (1 if graphs else 0)
    assert runs[0] == runs[1]
    for i in range(0, 5, 2):
        ref.check(prompts[i], runs[0][i])
        ref.check(prompts[i], runs[2][i])


def test_prefix_caching_on_cuda_matches_caching_off_and_generate():
    """Prefix caching under the engine's default GPU decode step (compiled, in CUDA Graphs) and the CUDA paged_prefill:
    prompts over two shared prefixes arriving at random steps give the tokens of caching off and of transformers'
    own generate (up to bf16 ties, as the compiled step rounds); later arrivals hit the cache, and 16-token chunks
    (one page) make every hit's rest a prefill over cached, compressed pages."""
    model = small_model("llama").cuda()
    ref = Reference(model)
    rng = random.Random(5)
    prompts = shared_prompts(rng, prompts_of(rng, [48, 48]), 10)
    arrivals = [(rng.randint(0, 30), p, SamplingParams(max_new_tokens=rng.randint(1, 24))) for p in prompts]
    finals = {}
    for caching in (True, False):
        eng = Engine(model, max_kv_bytes=64 << 20, kv_chunk_bytes=256 << 10, prefill_chunk=16, compress_every=1,
                     prefix_caching=caching)
        outs = run_all(eng, arrivals)
        finals[caching] = {tuple(o[-1].prompt_token_ids): o[-1].token_ids for o in outs.values()}
        stats = eng.stats()
        assert stats["cuda_graphs"] >= 1 and stats["running"] == 0
        assert (stats["prefix_hits"] >= 2 and stats["prefix_cached_tokens"] >= 32) if caching else \
            stats["prefix_hits"] == 0
    for prompt, tokens in finals[True].items():
        ref.check(list(prompt), tokens, ulps=4)
        ref.check(list(prompt), finals[False][prompt], ulps=4)


def test_shared_prefix_decode_in_cuda_graphs_matches_generate(monkeypatch):
    """Requests that hold a 100-token cached prefix at once, under the default GPU decode step (compiled, CUDA
    Graphs): their decode steps attend to the shared pages once (the pass's own graph buffers), and the tokens are
    transformers' own up to bf16 ties, as with caching off."""
    monkeypatch.setattr(shared_prefix, "MIN_SAVED_PAGES", 1)  # a small model's small prefix
    model = small_model("llama").cuda()
    ref = Reference(model)
    arrivals = shared_prefix_arrivals(random.Random(9), 6, 16)
    for caching in (True, False):
        eng = Engine(model, max_kv_bytes=64 << 20, kv_chunk_bytes=256 << 10, prefill_chunk=16, compress_every=1,
                     prefix_caching=caching)
        outs = run_all(eng, arrivals)
        stats = eng.stats()
        assert stats["cuda_graphs"] >= 1 and (stats["shared_prefix_steps"] > 0) == caching, stats
        for o in outs.values():
            ref.check(o[-1].prompt_token_ids, o[-1].token_ids, ulps=4)


def test_decode_steps_never_wait_for_the_device():
    """Decode-only steps in which requests finish (their pages freed, slots zeroed) and every step runs a compression
    call make no synchronizing CUDA call (torch's sync debug mode raises on one): the host queues step after step
    while the device runs. A constant written as ``t[index] = 0`` waited for the device in every step that freed a
    page. A first load of the same shape captures every batch bucket's graph, so the checked load captures none."""
    import torch

    model = small_model("llama").cuda()
    eng = Engine(model, max_kv_bytes=64 << 20, kv_chunk_bytes=256 << 10, prefill_chunk=1024, compress_every=1)
    placed, compress = [], eng.kv.compress_full_pages
    eng.kv.compress_full_pages = lambda wait=True: placed.append(compress(wait=wait)) or placed[-1]

    def load(seed: int) -> None:  # 12 requests, all admitted and prefilled in one step, finishing one by one
        rng = random.Random(seed)
        for i in range(12):
            eng.add_request([rng.randrange(512) for _ in range(20 + 3 * i)], SamplingParams(max_new_tokens=20 + 3 * i))

    load(3)
    while eng.has_unfinished():
        eng.step()
    load(4)
    finished = sum(o.finished for _ in range(2) for o in eng.step())
    assert len(eng.scheduler.running) == 12 and all(r.state == "decode" for r in eng.scheduler.running)
    placed.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while eng.has_unfinished():
            finished += sum(o.finished for o in eng.step())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert finished == 12 and len(placed) > 40 and sum(placed) > 0  # requests ended, pages compressed meanwhile


def test_smollm2_on_cuda_matches_generate():
    """SmolLM2 (real weights) on the GPU: the engine's greedy tokens are transformers' own, up to bf16 ties."""
    model, tok = require_smollm2().load_smollm2()
    model = copy.deepcopy(model).cuda()
    ref = Reference(model)
    prompts = [tok(p).input_ids for p in ("Photosynthesis is the process by which plants",
                                          "Here is a short story about a cat named Tom:",
                                          "import numpy as np\n\n# Compute the mean of a list")]
    eng = Engine(model, max_kv_bytes=256 << 20, prefill_chunk=8)
    for prompt, out in zip(prompts, eng.generate(prompts, SamplingParams(max_new_tokens=48))):
        ref.check(prompt, out.token_ids)
