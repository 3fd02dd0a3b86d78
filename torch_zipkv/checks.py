"""The library's one rule for integer arguments, used by every public entry point (and the per-layer sliding
windows built on it).

An int is a ``numbers.Integral`` (a Python int, a numpy integer) that is not a ``bool``: ``True`` would otherwise pass
for 1 and ``False`` for 0, and a flag given where a count is meant is a caller's mistake, never a count. The errors
name the argument: TypeError for a wrong type, ValueError for an int out of range.
"""

from __future__ import annotations

import numbers

__all__ = ["is_int", "check_int", "check_windows"]


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
