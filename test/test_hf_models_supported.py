"""Which transformers models the compressed cache serves, decided up front: ``torch_zipkv.enable``,
``ZipKVCache.from_model`` / ``kv_geometry``, ``torch_zipkv.generate`` and the engine refuse a model the cache cannot
serve with "this model type is not supported: <model_type> ...", before anything runs; they used to take some of them
and fail later (every decode step of a GQA group above 16, the first forward of an encoder-decoder model as a
"prefill into a non-empty ZipKVCache") or with an AttributeError (Mamba). Tiny random models, built on CPU."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch_zipkv  # noqa: E402
from torch_zipkv.integrations.transformers import ZipKVCache, check_model, kv_geometry  # noqa: E402
from torch_zipkv.ops import MAX_GROUP  # noqa: E402

from hf_models import padded_batch, small_config, small_model, teacher_forced_logits  # noqa: E402


def causal_lm(config, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def gqa(num_heads: int):
    """Llama with ``num_heads`` query heads over one KV head: a GQA group of ``num_heads``."""
    return causal_lm(small_config("llama", num_attention_heads=num_heads, num_key_value_heads=1))


def mamba():
    return causal_lm(transformers.MambaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2))


def t5():
    config = transformers.T5Config(vocab_size=512, d_model=64, d_kv=64, d_ff=128, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).to(torch.bfloat16).eval()


def qwen3_next():  # linear-attention (Gated DeltaNet) layers beside full attention ones
    return causal_lm(transformers.Qwen3NextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, num_experts=2, num_experts_per_tok=1,
        linear_num_value_heads=2, linear_num_key_heads=2))


def deepseek_v3():  # multi-head latent attention: keys of qk_nope + qk_rope dims, head_dim the rope part
    return causal_lm(transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=128, intermediate_size=128, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2, num_experts_per_tok=1, n_group=1,
        topk_group=1, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
        first_k_dense_replace=2))


UNSUPPORTED = {  # name: (model, what the message says after "this model type is not supported: ")
    "gqa group 32": (lambda: gqa(32), r"llama has a GQA group of 32 query heads per KV head \(num_attention_heads="
                                      r"32, num_key_value_heads=1\); paged_decode takes groups of at most 16"),
    "head_dim 96": (lambda: causal_lm(small_config("llama", head_dim=96)),
                    r"llama has head_dim 96, and the compressed format's head_dim must be one of \(64, 128, 256\)"),
    "mamba": (mamba, r"mamba has no attention heads in its text config"),
    "t5": (t5, r"t5 is an encoder-decoder model \(config.is_encoder_decoder\)"),
    "qwen3_next": (qwen3_next, r"qwen3_next has layers of type \['linear_attention'\]"),
    "deepseek_v3": (deepseek_v3, r"deepseek_v3 has qk_head_dim=64 beside head_dim=32"),
    "float32": (lambda: causal_lm(small_config("llama"), torch.float32), r"llama runs in torch.float32; the cache "
                                                                          r"holds bfloat16 K/V"),
}


def refused(why: str):
    return pytest.raises(ValueError, match="^this model type is not supported: " + why)


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_models_are_refused_up_front(name):
    """enable leaves the model as it was; from_model, kv_geometry and generate (for a model switched to "zipkv" by
    hand, as ``from_pretrained(attn_implementation="zipkv")`` does) refuse it before building or running anything."""
    build, why = UNSUPPORTED[name]
    model = build()
    before = model.config._attn_implementation
    with refused(why):
        torch_zipkv.enable(model)
    assert model.config._attn_implementation == before, "enable must refuse before switching the attention"
    with refused(why):
        ZipKVCache.from_model(model, max_length=32)
    with refused(why):
        kv_geometry(model)
    with refused(why):
        check_model(model)
    model.config._attn_implementation = "zipkv"  # what loading with attn_implementation="zipkv" leaves
    with refused(why):
        torch_zipkv.generate(model, torch.zeros(1, 4, dtype=torch.long), max_new_tokens=2)


@pytest.mark.parametrize("name", [n for n in UNSUPPORTED if n != "float32"])  # the engine checks the dtype itself
def test_the_engine_refuses_them_too(name):
    from torch_zipkv.engine import Engine

    build, why = UNSUPPORTED[name]
    with refused(why):
        Engine(build(), max_kv_bytes=1 << 24)


def test_a_gqa_group_of_max_group_decodes(gen):
    """The largest group paged_decode takes is served: 16 query heads per KV head, prefill and 6 decode steps, as
    close to transformers' SDPA as its eager attention is (x1.5, at least 4e-3)."""
    model = gqa(MAX_GROUP)
    torch_zipkv.enable(model)
    ids, mask, forced = padded_batch(gen, [20, 13], 6)
    ref = teacher_forced_logits(model, "sdpa", ids, mask, forced)
    eager = teacher_forced_logits(model, "eager", ids, mask, forced)
    cache = ZipKVCache.from_model(model, batch_size=2, max_length=32, max_new_tokens=8)
    got = teacher_forced_logits(model, "zipkv", ids, mask, forced, cache)
    tol = max(1.5 * float((eager - ref).abs().max()), 4e-3)
    assert float((got - ref).abs().max()) <= tol
    assert cache.kv.num_kv_heads == 1 and cache.stats()["tokens"] == 2 * (20 + 13 + 2 * 6)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2", "mistral", "gemma3", "gemma2"])
def test_supported_architectures_pass(arch):
    """The architectures the other tests run pass the check, and kv_geometry reads their geometry."""
    model = small_model(arch)
    check_model(model)
    assert torch_zipkv.enable(model).config._attn_implementation == "zipkv"
    assert kv_geometry(model)[:3] == (2, 2, 64)
