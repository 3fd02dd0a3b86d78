"""Small transformers models and the teacher-forced decode loop that the transformers tests share."""

from __future__ import annotations

import torch
import transformers

import demo  # examples/demo.py (conftest puts examples/ on sys.path)


def teacher_forced_logits(model, impl: str, input_ids, attention_mask, forced, cache=None) -> torch.Tensor:
    """examples/demo.py's ``teacher_forced_logits`` with attention ``impl``: float [B, T + 1, vocab]."""
    model.set_attn_implementation(impl)
    return demo.teacher_forced_logits(model, input_ids, attention_mask, forced, cache)


def small_config(arch: str, **overrides):
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    common.update(overrides)
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    if arch == "qwen3":  # q/k norm
        return transformers.Qwen3Config(**common)
    if arch == "qwen2":
        return transformers.Qwen2Config(**common)
    if arch == "mistral":
        return transformers.MistralConfig(**{"sliding_window": None, **common})
    if arch == "gemma3":  # sliding-window and full layers, query_pre_attn_scalar scaling, q/k norm
        return transformers.Gemma3TextConfig(**{"sliding_window": 256, "query_pre_attn_scalar": 64, **common})
    if arch == "gemma2":  # logit softcapping (a cap this small bites on random weights' small logits), sliding layers
        return transformers.Gemma2Config(**{"sliding_window": 256, "query_pre_attn_scalar": 64,
                                            "attn_logit_softcapping": 0.1, **common})
    raise ValueError(arch)


def small_model(arch: str, **overrides):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(small_config(arch, **overrides), dtype=torch.bfloat16).eval()


def padded_batch(gen, lengths, total_new):
    L = max(lengths)
    ids = torch.randint(0, 512, (len(lengths), L), generator=gen)
    mask = torch.zeros(len(lengths), L, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, L - n:] = 1
    return ids, mask, torch.randint(0, 512, (len(lengths), total_new), generator=gen)


