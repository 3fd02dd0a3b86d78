"""HuggingFace transformers integration: ZipKVCache + "zipkv" attention against transformers' own default path
(DynamicCache + SDPA) as the oracle, on the real SmolLM2 and on small random-weight models of other architectures."""

from __future__ import annotations

import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_zipkv  # noqa: E402
from torch_zipkv.integrations.transformers import ZipKVCache  # noqa: E402  (registers "zipkv")

PAGE = 16
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2():
    from torch_zipkv import realkv

    try:
        realkv.smollm2_gguf_path()
    except ModuleNotFoundError as e:
        if os.environ.get("ZIPKV_REQUIRE_MODEL") == "1":
            raise
        pytest.skip(str(e))
    model, tok = realkv.load_smollm2()
    tok.padding_side = "left"
    return model, tok


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as generate() makes them for a left-padded batch."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


@torch.no_grad()
def teacher_forced_logits(model, impl: str, input_ids, attention_mask, forced, cache=None) -> torch.Tensor:
    """Last-position logits of the prefill, then of one decode step per column of ``forced`` [B, T] (the fed tokens),
    with attention ``impl`` and ``cache`` (default DynamicCache): float [B, T + 1, vocab]."""
    model.set_attn_implementation(impl)
    cache = cache if cache is not None else transformers.DynamicCache(config=model.config)
    mask, pos = attention_mask, positions(attention_mask)
    out = [model(input_ids=input_ids, attention_mask=mask, position_ids=pos, cache=cache).logits[:, -1]]
    for t in range(forced.shape[1]):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        pos = pos[:, -1:] + 1
        out.append(model(input_ids=forced[:, t:t + 1], attention_mask=mask, position_ids=pos, cache=cache).logits[:, -1])
    return torch.stack(out, 1).float()


def zipkv_cache(model, batch, max_length, max_new_tokens):
    return ZipKVCache.from_model(model, batch_size=batch, max_length=max_length, max_new_tokens=max_new_tokens,
                                 page_size=PAGE)


# ---- SmolLM2 (real weights) -----------------------------------------------------------------------------------
PROMPTS = ["Photosynthesis is the process by which plants",
           "Here is a short story about a cat named Tom:",
           "import numpy as np\n\n# Compute the mean of a list of numbers, then print it to the screen\n"]


def test_smollm2_greedy_generate_matches_default(smollm2):
    """model.generate with ZipKVCache + "zipkv" gives transformers' default greedy tokens (64 new, batch of 3
    left-padded prompts, page 16: prompts and outputs cross pages, full pages compress mid-generation). The only
    allowed departure is at a bf16 tie: where the default path's two best logits are within bf16 rounding (ties
    are frequent: logits near 20 have a 0.125 step), any other rounding of the same math can pick the other token,
    transformers' own eager attention included; from there on the texts differ and are not compared."""
    model, tok = smollm2
    inp = tok(PROMPTS, return_tensors="pt", padding=True)
    L = inp.input_ids.shape[1]
    kw = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    model.set_attn_implementation("sdpa")
    ref = model.generate(**inp, **kw)
    cache = zipkv_cache(model, len(PROMPTS), L + NEW_TOKENS, NEW_TOKENS)
    torch_zipkv.enable(model)
    try:
        got = model.generate(**inp, cache=cache, **kw)
    finally:
        model.set_attn_implementation("sdpa")
    ref_logits = torch.stack(ref.logits, 1).float()
    assert got.sequences.shape == ref.sequences.shape == (len(PROMPTS), L + NEW_TOKENS)
    matched = 0
    for b in range(len(PROMPTS)):
        diff = (got.sequences[b, L:] != ref.sequences[b, L:]).nonzero()
        if len(diff):
            step = int(diff[0])
            top2 = ref_logits[b, step].topk(2).values
            assert top2[0] - top2[1] <= 0.125, (
                f"prompt {b}: token {step} differs from the default path where its margin was "
                f"{float(top2[0] - top2[1])} (not a bf16 tie)")
        matched += int(diff[0]) if len(diff) else NEW_TOKENS
    assert matched >= NEW_TOKENS, "fewer than 64 tokens in all agreed before a tie"
    stats = cache.stats()
    assert stats["sequences"] == len(PROMPTS)
    # Every full page but those filled by the last step has been compressed, and compression saved bytes.
    assert stats["tokens"] == model.config.num_hidden_layers * int(inp.attention_mask.sum() + len(PROMPTS) * (NEW_TOKENS - 1))
    assert stats["stored_bytes"] < 0.9 * stats["raw_bytes"]


def test_smollm2_teacher_forced_logits_match_default(smollm2):
    """Fed the default path's own greedy tokens for 64 steps, the "zipkv" path's logits stay within bf16
    tolerance of the default's at every step, and its argmax is the default's token except at bf16 ties. The
    tolerance is what transformers' eager attention itself departs from SDPA by, times 1.5."""
    model, tok = smollm2
    inp = tok(PROMPTS, return_tensors="pt", padding=True)
    L = inp.input_ids.shape[1]
    model.set_attn_implementation("sdpa")
    seq = model.generate(**inp, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    forced = seq[:, L:-1]
    ref = teacher_forced_logits(model, "sdpa", inp.input_ids, inp.attention_mask, forced)
    assert torch.equal(ref.argmax(-1), seq[:, L:]), "the teacher-forced default path must reproduce generate()"
    eager = teacher_forced_logits(model, "eager", inp.input_ids, inp.attention_mask, forced)
    cache = zipkv_cache(model, len(PROMPTS), L + NEW_TOKENS, NEW_TOKENS)
    got = teacher_forced_logits(model, "zipkv", inp.input_ids, inp.attention_mask, forced, cache)
    model.set_attn_implementation("sdpa")
    tol = 1.5 * float((eager - ref).abs().max())
    err = (got - ref).abs().amax(-1)  # [B, steps]
    assert float(err.max()) <= tol, f"zipkv logits off by {float(err.max())}, eager-vs-sdpa tolerance {tol}"
    assert float(err[:, 0].max()) == 0.0, "prefill runs transformers' own SDPA: its logits must be identical"
    top2 = ref.topk(2, -1).values
    tie = (top2[..., 0] - top2[..., 1]) <= 0.125
    agree = got.argmax(-1) == seq[:, L:]
    assert bool((agree | tie).all()), f"argmax departs outside ties at {(~(agree | tie)).nonzero().tolist()}"
    assert cache.stats()["stored_bytes"] < cache.stats()["raw_bytes"]
