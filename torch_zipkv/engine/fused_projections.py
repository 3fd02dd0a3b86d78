"""Fewer, larger GEMMs: a layer's q/k/v projections become one GEMM, and its MLP's gate/up projections another (as
vLLM's ``QKVParallelLinear`` and ``MergedColumnParallelLinear``), in place and without touching the model's code.

A decode step at batch 32 is a string of skinny GEMMs that read the weights once; the small ones (an 8B Llama's k and
v projections are 1,024 x 4,096) launch too few CTAs to read at the device's full rate, and each pays a launch. One
GEMM over the concatenated weights reads the same bytes in one launch.

In place: the fused weight is one new parameter, and the first projection of a group holds it. The others keep views
of its rows (a row slice of a row-major matrix is contiguous), so memory does not grow. The model's forward is
unchanged: the first projection computes the fused product and leaves each other projection its slice, which that
projection returns when it is called with the very same input tensor (by identity: any other call computes its own
product from its view, so a model that calls them differently stays correct, merely unfused).

Fused: groups of plain ``nn.Linear`` with the same input features, dtype and device, all with or all without bias, on
weights that are ordinary tensors (a tensor-parallel shard's DTensor weights are left alone).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedLinear(nn.Module):
    """The first projection of a fused group: ``F.linear(x, weight, bias)`` over the group's concatenated weights; its
    own slice is returned, the others are left with their :class:`FusedSlice`."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        self.in_features = linears[0].in_features
        self.out_features = linears[0].out_features
        self.splits = [m.out_features for m in linears]
        with torch.no_grad():
            self.weight = nn.Parameter(torch.cat([m.weight for m in linears]), requires_grad=False)
            self.bias = None if linears[0].bias is None else nn.Parameter(torch.cat([m.bias for m in linears]),
                                                                          requires_grad=False)
        self.followers: list[FusedSlice] = []
        start = self.splits[0]
        for n in self.splits[1:]:
            bias = None if self.bias is None else self.bias[start: start + n]
            self.followers.append(FusedSlice(self.weight[start: start + n], bias))
            start += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        first, *rest = y.split(self.splits, dim=-1)
        for f, part in zip(self.followers, rest):
            f.pending = (x, part)
        return first

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, splits={self.splits}, bias={self.bias is not None}"


class FusedSlice(nn.Module):
    """A projection of a fused group other than the first: returns the slice the group's :class:`FusedLinear` left
    for this very input, else its own product. Its weight is a view of the fused parameter, not a parameter."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias  # plain tensors: the fused parameter owns the memory
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] is x:
            return pending[1]
        return F.linear(x, self.weight, self.bias)


def _fusable(linears) -> bool:
    first = linears[0]
    return all(
        type(m) is nn.Linear and type(m.weight) is nn.Parameter and m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        and (m.bias is None or type(m.bias) is nn.Parameter)
        for m in linears)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every group of :data:`GROUPS` in ``model``'s modules, in place; returns how many groups were fused (0 for
    a model whose projections are not plain ``nn.Linear``, or are already fused)."""
    fused = 0
    for module in list(model.modules()):
        for names in GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if any(m is None for m in linears) or not _fusable(linears):
                continue
            lead = FusedLinear(linears)
            for name, m in zip(names, [lead, *lead.followers]):
                setattr(module, name, m)
            fused += 1
    return fused
