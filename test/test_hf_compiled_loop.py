"""A decode loop compiled the natural way: ``torch.compile(fullgraph=True)`` around the model call, with the cache
held by a module global, a closure or an object attribute. Once the first step has compiled, no step recompiles
(``torch._dynamo.config.error_on_recompile``): a decode step reads no Python value that changes from step to step,
and its page table keeps its shape. Each compiled step's logits are checked against the same step run eagerly on a
second cache fed the same tokens."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_zipkv  # noqa: E402
from torch_zipkv.integrations.transformers import ZipKVCache, cache_kwarg  # noqa: E402

from conftest import requires_cuda  # noqa: E402
from hf_models import small_model  # noqa: E402

PROMPT = 20
CACHE = None  # the module-level holder: the loop a script writes


class Decoder:
    """The loop a class writes: the cache is an attribute."""

    def __init__(self, model, cache):
        self.model, self.cache = model, cache

    def step(self, token, position):
        return self.model(input_ids=token, position_ids=position, use_cache=True,
                          **{cache_kwarg(self.model): self.cache}).logits[:, -1]


def global_step(model):
    def step(token, position):
        out = model(input_ids=token, position_ids=position, use_cache=True, **{cache_kwarg(model): CACHE})
        return out.logits[:, -1]
    return step


def compiled_step(holder: str, model, cache, mode):
    """The decode step as the user writes it, cache held by ``holder``, compiled with ``fullgraph=True``."""
    global CACHE
    if holder == "global":
        CACHE = cache
        fn = global_step(model)
    elif holder == "closure":
        def fn(token, position):
            return model(input_ids=token, position_ids=position, use_cache=True,
                         **{cache_kwarg(model): cache}).logits[:, -1]
    else:
        fn = Decoder(model, cache).step
    return torch.compile(fn, fullgraph=True, mode=mode)


def model_for(arch: str, device: str):
    # Gemma 3: sliding and full layers, with a 16-token window that the loop runs far past.
    window = {"sliding_window": 16} if arch == "gemma3" else {}
    return torch_zipkv.enable(small_model(arch, max_position_embeddings=2048, **window).to(device))


@torch.no_grad()
def run_loop(arch: str, holder: str, steps: int, *, device: str = "cpu", mode: str | None = None) -> None:
    """Prefill ``PROMPT`` tokens of 2 sequences into two caches, then ``steps`` decode steps: one cache through the
    compiled step (``cache.begin_step()`` before each), the other eagerly, both fed the compiled step's greedy
    tokens. Raises on any recompile after the first compiled step; checks every step's logits and the caches."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = model_for(arch, device)
    caches = [ZipKVCache.from_model(model, batch_size=2, max_length=PROMPT + steps, max_new_tokens=steps)
              for _ in range(2)]
    ids = torch.randint(0, 512, (2, PROMPT), device=device)
    for cache in caches:
        logits = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1]
    fn = compiled_step(holder, model, caches[0], mode)
    token = logits.argmax(-1, keepdim=True)
    position = torch.full((2, 1), PROMPT, device=device)
    worst = 0.0
    for t in range(steps):
        caches[0].begin_step()
        with torch._dynamo.config.patch(error_on_recompile=t > 0):
            got = fn(token, position).clone()  # a CUDA Graph's output is rewritten by the next replay
        want = model(input_ids=token, position_ids=position, use_cache=True,
                     **{cache_kwarg(model): caches[1]}).logits[:, -1]
        worst = max(worst, float((got.float() - want.float()).abs().max()))
        token, position = got.argmax(-1, keepdim=True), position + 1
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    if mode == "reduce-overhead":  # really replayed as CUDA Graphs, not skipped
        assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        assert counters["inductor"]["cudagraph_recorded_non_static_inputs"] > 0, "no CUDA Graph was recorded"
    # Inductor's fused kernels round bf16 differently from eager ones, and both feed the same tokens: logits stay close.
    assert worst < 0.05, worst
    for cache in caches:
        assert int(cache.get_seq_length()) == PROMPT + steps  # positions advanced inside the compiled graph too
        cache.kv.compress_full_pages()
        stats = cache.stats()
        assert stats["sequences"] == 2 and stats["stored_bytes"] < stats["raw_bytes"]
    assert caches[0].stats()["tokens"] == caches[1].stats()["tokens"]
    for layer in range(model.config.num_hidden_layers):
        k0, _ = caches[0].kv.gather(layer, caches[0].seq_ids[1])
        k1, _ = caches[1].kv.gather(layer, caches[1].seq_ids[1])
        window = caches[0].kv.sliding_window[layer]
        assert k0.shape[0] == k1.shape[0] == (PROMPT + steps if window is None else k0.shape[0])
        assert window is None or k0.shape[0] < PROMPT + steps  # a sliding layer dropped the pages before its window


@pytest.mark.parametrize("holder", ["global", "closure", "attribute"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_compiled_loop_never_recompiles(arch, holder):
    """64 steps: four page boundaries, compressions every 8 steps, and for Gemma 3 pages freed behind the window."""
    run_loop(arch, holder, 64)


def test_thousand_compiled_steps_never_recompile():
    run_loop("llama", "global", 1000)


@requires_cuda
@pytest.mark.parametrize("holder", ["global", "closure", "attribute"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_cuda_graph_loop_never_recompiles(arch, holder):
    """The same loops replayed as CUDA Graphs (mode="reduce-overhead") on the GPU."""
    run_loop(arch, holder, 64, device="cuda", mode="reduce-overhead")


@requires_cuda
def test_thousand_cuda_graph_steps_never_recompile():
    run_loop("llama", "global", 1000, device="cuda", mode="reduce-overhead")
