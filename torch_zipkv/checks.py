"""The library's one rule for integer arguments, used by every public entry point (and the per-layer sliding
windows built on it), and the cache's checks of the layers and tensors it is given.

An int is a ``numbers.Integral`` (a Python int, a numpy integer) that is not a ``bool``: ``True`` would otherwise pass
for 1 and ``False`` for 0, and a flag given where a count is meant is a caller's mistake, never a count. The errors
name the argument: TypeError for a wrong type, ValueError for an int out of range. The tensor checks follow the same
policy: TypeError for a wrong type or dtype, ValueError for a wrong shape or device.
"""

from __future__ import annotations

import numbers

import torch

__all__ = ["is_int", "check_int", "check_windows", "check_layer", "check_query", "check_kv"]


def is_int(value) -> bool:
    """Whether ``value`` is an int under the library's rule: ``numbers.Integral`` and not ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int | None = None, *, maximum: int | None = None,
              optional: bool = False) -> None:
    """TypeError unless ``value`` is an int (or None, when ``optional``); ValueError outside
    [``minimum``, ``maximum``]. Messages start with ``name``."""
    if optional and value is None:
        return
    if minimum is not None and maximum is not None:
        want = f"an int in [{minimum}, {maximum}]"
    elif minimum is not None:
        want = f"an int >= {minimum}"
    elif maximum is not None:
        want = f"an int <= {maximum}"
    else:
        want = "an int"
    if optional:
        want = f"None or {want}"
    if not is_int(value):
        raise TypeError(f"{name} must be {want}, got {type(value).__name__} {value!r}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name} must be {want}, got {value!r}")


def check_windows(sliding_window, num_layers: int) -> list[int | None]:
    """``sliding_window`` (None, an int >= 1, or one such entry per layer) as one entry per layer, checked."""
    expected = f"sliding_window must be None, an int >= 1, or one such entry per layer ({num_layers})"
    if sliding_window is None or is_int(sliding_window):
        windows = [sliding_window] * num_layers
    else:
        try:
            windows = list(sliding_window)
        except TypeError:
            raise TypeError(f"{expected}, got {type(sliding_window).__name__} {sliding_window!r}") from None
    if len(windows) != num_layers:
        raise ValueError(f"{expected}, got {sliding_window!r}")
    for w in windows:
        if w is not None and not is_int(w):
            raise TypeError(f"{expected}, got an entry {type(w).__name__} {w!r}")
        if w is not None and w < 1:
            raise ValueError(f"{expected}, got {sliding_window!r}")
    return [None if w is None else int(w) for w in windows]


def check_layer(layer, num_layers: int) -> None:
    """``layer`` an int in [0, ``num_layers``)."""
    if not is_int(layer):
        raise TypeError(f"layer must be an int in [0, {num_layers}), got {type(layer).__name__} {layer!r}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be an int in [0, {num_layers}), got {layer!r}")


def check_query(q, num_kv_heads: int, head_dim: int, device: torch.device, rows: str) -> None:
    """``q`` bf16 [``rows``, k * num_kv_heads, head_dim] on ``device`` (``rows`` names the first dimension)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype != torch.bfloat16:
        raise TypeError(f"q must be bfloat16, got {q.dtype}")
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be bf16 [{rows}, k * {num_kv_heads}, {head_dim}], got {tuple(q.shape)}")
    if q.device != device:
        raise ValueError(f"q must be on {device}, got {q.device}")


def check_kv(k, v, num_kv_heads: int, head_dim: int, device: torch.device) -> int:
    """``k``, ``v`` bf16 [n, num_kv_heads, head_dim] of one shape on ``device``; returns n."""
    if (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dtype == v.dtype == torch.bfloat16
            and k.shape == v.shape and k.dim() == 3 and k.shape[1] == num_kv_heads and k.shape[2] == head_dim
            and k.device == v.device == device):
        return k.shape[0]  # the decode-step path: one test, then the detailed messages below only on error
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must be bfloat16, got {t.dtype}")
        if t.dim() != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be [n, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} must be on {device}, got {t.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    return k.shape[0]
