"""The engine's compiled decode forward (``Engine(compile=True)``: ``torch.compile(fullgraph=True)``, one compilation
for every batch bucket and page-table width, inside the CUDA Graphs on a GPU) and its fused projections: greedy tokens
are transformers' own up to bf16 ties, and once the first decode step has compiled nothing recompiles."""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("transformers")

from torch_zipkv.engine import Engine, SamplingParams  # noqa: E402
from torch_zipkv.engine.fused_projections import FusedLinear, FusedSlice, fuse_projections  # noqa: E402

from conftest import requires_cuda  # noqa: E402
from engine_reference import Reference  # noqa: E402
from hf_models import small_model  # noqa: E402

COMPILED_ULPS = 4  # inductor keeps bf16 intermediates in fp32 (engine_reference.Reference.check)
ARCHS = {"llama": {}, "gemma2": {"sliding_window": 16}, "qwen2": {}}  # plain; soft cap + windows; q/k/v biases


def serve_arrivals(eng: Engine, prompts, new) -> dict[int, list[int]]:
    """One request added per step (running batches of 1 to len(prompts) rows: several buckets, widths crossing powers
    of two); recompiling after the first decode step raises. Returns each request's tokens."""
    ids, finals, step = [], {}, 0
    while len(ids) < len(prompts) or eng.has_unfinished():
        if len(ids) < len(prompts):
            ids.append(eng.add_request(prompts[len(ids)], SamplingParams(max_new_tokens=new[len(ids)])))
        with torch._dynamo.config.patch(error_on_recompile=eng.runner.graphs.buffers != {}):
            for out in eng.step():
                if out.finished:
                    finals[out.request_id] = out.token_ids
        step += 1
        assert step < 2000
    return [finals[i] for i in ids]


def check_compiled_engine(arch: str, device: str) -> None:
    model = small_model(arch, **ARCHS[arch]).to(device)
    ref = Reference(model)
    rng = random.Random(3)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 60))] for _ in range(11)]
    new = [rng.randint(20, 60) for _ in prompts]
    eng = Engine(model, max_kv_bytes=64 << 20, kv_chunk_bytes=256 << 10, prefill_chunk=32, compress_every=2,
                 compile=True)
    assert eng.runner.compiled
    got = serve_arrivals(eng, prompts, new)
    for prompt, n, tokens in zip(prompts, new, got):
        assert len(tokens) == n
        ref.check(prompt, tokens, ulps=COMPILED_ULPS)
    used = eng.runner.graphs.buffers
    assert len({b for b, _, _ in used}) >= 3 and len({w for _, w, _ in used}) >= 2, sorted(used)  # buckets, widths
    assert min(b for b, _, _ in used) >= 2  # dynamo specializes size 1: no batch-1 bucket
    assert eng.stats()["decode_setup_s"] > 0
    assert eng.kv.seq_ids == [eng.runner.pad_seq]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_compiled_engine_matches_generate_without_recompiling(arch):
    check_compiled_engine(arch, "cpu")


@requires_cuda
@pytest.mark.parametrize("arch", list(ARCHS))
def test_compiled_graphs_match_generate_without_recompiling(arch):
    check_compiled_engine(arch, "cuda")


@requires_cuda
def test_compile_is_the_default_on_cuda():
    eng = Engine(small_model("llama").cuda(), max_kv_bytes=16 << 20)
    assert eng.runner.compiled and eng.runner.graphs.capture
    assert isinstance(eng.model.model.layers[0].self_attn.q_proj, FusedLinear)


def test_eager_is_the_default_on_cpu_and_compile_is_checked():
    model = small_model("llama")
    assert not Engine(model, max_kv_bytes=16 << 20).runner.compiled
    for name in ("compile", "fuse_projections"):
        with pytest.raises(TypeError, match=f"{name} must be None or a bool"):
            Engine(model, max_kv_bytes=16 << 20, **{name: 1})


# ---- fused projections -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "qwen3"])
def test_fused_projections_keep_the_model(arch):
    """q/k/v and gate/up fused in place: the same parameters' bytes (the other projections are views of the fused
    weight), the same logits as the unfused model at bf16 accuracy, eager and compiled."""
    model = small_model(arch)
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 2 * model.config.num_hidden_layers
    assert fuse_projections(fused) == 0  # already fused
    attn = fused.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedLinear) and isinstance(attn.v_proj, FusedSlice)
    base = attn.q_proj.weight
    for m in (attn.k_proj, attn.v_proj):
        assert m.weight.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    ref_attn = model.model.layers[0].self_attn
    assert torch.equal(attn.v_proj.weight, ref_attn.v_proj.weight)
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, 512, (3, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits.float()
        for got in (fused(ids).logits.float(), torch.compile(fused, fullgraph=True)(ids).logits.float()):
            assert (got - want).abs().max() <= 2 ** -6 * want.abs().max()


def test_a_projection_called_on_another_input_computes_its_own():
    """The slice a fused group leaves is for that very input: a call with another tensor (or a second call) computes
    the projection's own product."""
    model = small_model("llama")
    ref = copy.deepcopy(model.model.layers[0].self_attn)
    fuse_projections(model)
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(2, 5, 256, dtype=torch.bfloat16).unbind(0)
    with torch.no_grad():
        assert torch.equal(attn.q_proj(x), ref.q_proj(x))
        assert torch.equal(attn.k_proj(y), ref.k_proj(y))  # not x's slice
        assert torch.equal(attn.v_proj(x), ref.v_proj(x))  # x's slice
        assert torch.equal(attn.v_proj(x), ref.v_proj(x))  # the slice was taken: its own product, the same values


def test_unfusable_groups_are_left_alone():
    model = small_model("llama")
    attn = model.model.layers[0].self_attn
    attn.k_proj = torch.nn.Linear(256, 128, bias=True, dtype=torch.bfloat16)  # a bias where q and v have none
    assert fuse_projections(model) == 2 * model.config.num_hidden_layers - 1
    assert type(attn.q_proj) is torch.nn.Linear
