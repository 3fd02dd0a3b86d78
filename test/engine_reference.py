"""The engine tests' oracle: transformers' own greedy ``generate`` (its default cache) one request at a time, and the
rule for where a different rounding of the same math may pick another token (a bf16 tie, as test_hf.py defines it)."""

from __future__ import annotations

import copy

import torch


def bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (test_hf.py's rule): 0.125 for logits in [16, 32), 0.25 in [32, 64)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp(min=1e-30))) - 7)


class Reference:
    """Greedy tokens and logits of ``model.generate`` with transformers' default cache, one prompt at a time (SDPA,
    or eager for a model without SDPA such as Gemma 2), remembered per prompt."""

    def __init__(self, model):
        self.model = model
        self.memo: dict[tuple, tuple[list[int], torch.Tensor]] = {}

    @torch.no_grad()
    def __call__(self, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
        key = tuple(prompt)
        if key not in self.memo or len(self.memo[key][0]) < new_tokens:
            model = self.model
            before = model.config._attn_implementation
            # SDPA has no logit soft cap: transformers 5.17 still lets Gemma 2 run SDPA without its cap
            capped = getattr(model.config.get_text_config(), "attn_logit_softcapping", None)
            model.set_attn_implementation("sdpa" if model._supports_sdpa and not capped else "eager")
            try:
                ids = torch.tensor([prompt], device=model.device)
                # No EOS: the engine stops only at the request's stop tokens, and min_new_tokens would mask EOS's
                # logit (a different argmax than the raw logits). An explicit mask: generate would otherwise mask
                # every prompt token equal to the pad token.
                saved = copy.deepcopy(model.generation_config)
                model.generation_config.eos_token_id = None  # (a None passed to generate means "the default")
                try:
                    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                         do_sample=False, output_logits=True, return_dict_in_generate=True,
                                         pad_token_id=0)
                finally:
                    model.generation_config = saved
                assert out.sequences.shape[1] == len(prompt) + new_tokens
            finally:
                model.set_attn_implementation(before)
            self.memo[key] = (out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0].float().cpu())
        tokens, logits = self.memo[key]
        return tokens[:new_tokens], logits[:new_tokens]

    def check(self, prompt: list[int], got: list[int], ulps: int = 1) -> None:
        """``got`` (greedy tokens of the engine) equals the reference up to the first bf16 tie of the reference,
        where the texts may part: a margin of at most ``ulps`` bf16 steps (1: the same math rounded differently; a
        compiled forward, whose fused kernels keep intermediates in fp32 where eager rounds each op to bf16, parts
        within a few)."""
        ref, logits = self(prompt, len(got))
        for i, (a, b) in enumerate(zip(got, ref)):
            if a != b:
                top2 = logits[i].topk(2).values
                assert top2[0] - top2[1] <= ulps * bf16_step(top2[1]), (
                    f"token {i} is {a}, the reference's {b}, where the reference's margin was "
                    f"{float(top2[0] - top2[1])} at {float(top2[0])} (not a bf16 tie); got {got}, reference {ref}")
                return
