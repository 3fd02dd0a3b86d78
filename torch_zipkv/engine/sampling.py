"""Sampling on the device for a whole batch at once, with a per-request seed whose draws do not depend on the batch.

Each row samples with the Gumbel-max trick: ``argmax(logits / T + g)`` with ``g = -log(-log(u))`` draws exactly from
``softmax(logits / T)``. The uniforms ``u`` come from a counter-based hash of (the request's seed, the token's
position, the vocabulary index), not from a stateful generator, so a request's draws are the same whatever batch it
runs in and in whichever order requests arrive; and the whole batch samples with a fixed number of kernels and no
host sync. Greedy rows (temperature 0) take the argmax of the raw logits, as ``model.generate`` does.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (int64 tensors holding 32-bit values; constants < 2**31 keep products in int64)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x2C1B3C6D) & _M32
    return x ^ (x >> 16)


def seed32(seed: int) -> int:
    """A request's seed (any Python int) folded to the 32 bits the device hash takes."""
    seed = int(seed) & ((1 << 64) - 1)
    return ((seed & _M32) ^ (seed >> 32) * 0x9E3779B1) & _M32


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [B, vocab] standard Gumbel noise, a pure function of (seed, position, vocab index)."""
    row = _mix(seeds ^ _mix((positions & _M32) + 0x3C6EF372))  # [B]
    cols = (torch.arange(vocab, device=seeds.device, dtype=torch.int64) * 0x1B873593) & _M32
    x = _mix(row[:, None] ^ cols[None, :])
    u = ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1): 24 bits, exact in float32
    return -torch.log(-torch.log(u))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           seeds: torch.Tensor, positions: torch.Tensor, *, any_sampled: bool, any_filtered: bool) -> torch.Tensor:
    """Next tokens (int64 [B]) from ``logits`` [B, vocab].

    Per row: ``temperature`` float32 [B] (0: greedy), ``top_k`` int64 [B] (0: off), ``top_p`` float32 [B] (1: off),
    ``seeds`` int64 [B] (32-bit values), ``positions`` int64 [B] (the position of the token being sampled).
    ``any_sampled`` / ``any_filtered`` are host flags (some row samples / some row has top-k or top-p) that skip the
    work nobody needs; they never change a row's result."""
    greedy = logits.argmax(-1)
    if not any_sampled:
        return greedy
    scores = logits.float()
    safe_t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    # Less the row's max before dividing: every score is <= 0, so no temperature (SamplingParams keeps it a normal
    # float32) overflows one to +inf, and the most likely tokens stay at exactly 0.
    scores = (scores - scores.amax(-1, keepdim=True)) / safe_t[:, None]
    if any_filtered:
        vals, order = scores.sort(-1, descending=True)
        rank = torch.arange(vals.shape[-1], device=vals.device)[None, :]
        keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
        probs = torch.softmax(vals, -1)
        keep &= (probs.cumsum(-1) - probs) < top_p[:, None]
        keep |= rank == 0  # the most likely token is always kept (top_p that rounds to 0 in float32 is greedy)
        scores = torch.empty_like(scores).scatter_(-1, order, vals.masked_fill(~keep, float("-inf")))
    sampled = (scores + gumbel_noise(seeds, positions, scores.shape[-1])).argmax(-1)
    return torch.where(temperature > 0, sampled, greedy)
