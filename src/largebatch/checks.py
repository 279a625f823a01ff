"""Checks of user-given arguments, with one message format for the whole package: each
returns the value as the type it stands for, or raises an error naming the argument and its
value (``Invalid warmup_steps: -1 (must be an integer >= 0)``). A bool is never taken for a
number. LARS's and LAMB's hyperparameters have their own spec (``largebatch.lars.spec``),
whose messages read the same. This module imports no framework."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

__all__ = ["AxisName", "axis_name", "choice", "integer", "number"]

AxisName = str | tuple[str, ...] | None  # the mesh axes of a collective (JAX)
_AXIS_RULE = "must be None, a non-empty str or a non-empty tuple of distinct non-empty str"


def integer(name: str, value: Any, least: int = 0) -> int:
    """``value`` as an int: a Python or NumPy integer (not a bool) of at least ``least``.

    >>> integer("workers", 4, least=1)
    4
    """
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= least:
        return int(value)
    raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= {least})")


def number(name: str, value: Any, low: float = 0.0, *, strict: bool = True, high: float = math.inf) -> float:
    """``value`` as a float: a finite real number (not a bool) above ``low`` (``strict``)
    or at least ``low``, and at most ``high``."""
    rule = f"a finite number {'>' if strict else '>='} {low:g}"
    if high != math.inf:
        rule += f" and <= {high:g}"
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            x = float(value)
        except OverflowError:  # an int too large for a float
            x = math.inf
        if math.isfinite(x) and (x > low if strict else x >= low) and x <= high:
            return x
    raise ValueError(f"Invalid {name}: {value!r} (must be {rule})")


def choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices``.

    >>> choice("form", "ring", ("allgather", "two_phase"))
    Traceback (most recent call last):
      ...
    ValueError: Invalid form: 'ring' (must be one of allgather, two_phase)
    """
    if isinstance(value, str) and value in choices:
        return value
    raise ValueError(f"Invalid {name}: {value!r} (must be one of {', '.join(choices)})")


def axis_name(name: str, value: Any) -> AxisName:
    """``value`` as mesh axis names: None, a non-empty str, or a non-empty tuple of distinct
    non-empty strs; a TypeError (not a str) or ValueError (empty, repeated) naming it."""
    if value is None:
        return None
    names = value if isinstance(value, tuple) else (value,)
    if not isinstance(value, (str, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"Invalid {name}: {value!r} ({_AXIS_RULE})")
    if not names or not all(names) or len(set(names)) != len(names):
        raise ValueError(f"Invalid {name}: {value!r} ({_AXIS_RULE})")
    return value
