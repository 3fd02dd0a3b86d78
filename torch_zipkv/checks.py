"""The library's one rule for integer arguments, used by every public entry point.

An int is a ``numbers.Integral`` (a Python int, a numpy integer) that is not a ``bool``: ``True`` would otherwise pass
for 1 and ``False`` for 0, and a flag given where a count is meant is a caller's mistake, never a count. The errors
name the argument: TypeError for a wrong type, ValueError for an int out of range.
"""

from __future__ import annotations

import numbers

__all__ = ["is_int", "check_int"]


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
