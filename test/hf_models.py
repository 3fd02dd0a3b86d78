"""Small transformers models and the teacher-forced decode loop that the transformers tests share."""

from __future__ import annotations

import torch
import transformers

from torch_zipkv.integrations.transformers import cache_kwarg


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as generate() makes them for a left-padded batch."""
    return (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


@torch.no_grad()
def teacher_forced_logits(model, impl: str, input_ids, attention_mask, forced, cache=None) -> torch.Tensor:
    """Last-position logits of the prefill, then of one decode step per column of ``forced`` [B, T] (the fed tokens),
    with attention ``impl`` and ``cache`` (default DynamicCache): float [B, T + 1, vocab]."""
    model.set_attn_implementation(impl)
    cache = {cache_kwarg(model): cache if cache is not None else transformers.DynamicCache(config=model.config)}
    mask, pos = attention_mask, positions(attention_mask)
    out = [model(input_ids=input_ids, attention_mask=mask, position_ids=pos, **cache).logits[:, -1]]
    for t in range(forced.shape[1]):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        pos = pos[:, -1:] + 1
        out.append(model(input_ids=forced[:, t:t + 1], attention_mask=mask, position_ids=pos, **cache).logits[:, -1])
    return torch.stack(out, 1).float()


def small_config(arch: str, **overrides):
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=512)
    common.update(overrides)
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


