"""The learning-rate schedule (:class:`Schedule`: a pure function of the step, one formula
for NumPy and JAX) and its factory, :func:`make_schedule`, which checks every argument.
The formulas: docs/design.md §4."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, SupportsFloat

import numpy as np

from largebatch import checks

__all__ = ["SCHEDULES", "Schedule", "make_schedule"]

SCHEDULES = ("constant", "poly", "cosine", "step")


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_finite(value: SupportsFloat) -> bool:
    """``math.isfinite``, False also for an int too large for a float."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_step(step: Any) -> int | float:
    """``step`` as a Python int or float, or a ValueError naming it."""
    message = f"Invalid step: {step!r} (must be a finite number >= 0)"
    if isinstance(step, (bool, np.bool_)):
        raise ValueError(message)
    if isinstance(step, numbers.Integral):
        value: int | float = int(step)
    elif isinstance(step, numbers.Real):
        value = float(step)
    else:  # a 0-d array: NumPy, concrete JAX, torch
        try:
            array = np.asarray(step)
        except Exception as err:  # a traced JAX value has no concrete number
            raise ValueError(
                f"Invalid step: {step!r} (must be a concrete number; a traced JAX step "
                f"needs largebatch.jax.as_optax_schedule(schedule))"
            ) from err
        if array.shape != () or array.dtype.kind not in "iuf":
            raise ValueError(message)
        value = array.item()
    if not (value >= 0 and _is_finite(value)):
        raise ValueError(message)
    return value


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule: ``schedule(step) -> lr``. Build one with :func:`make_schedule`."""

    name: str
    peak_lr: float
    total_steps: int
    warmup_steps: int = 0
    init_lr: float = 0.0
    end_lr: float = 0.0
    power: float = 2.0
    milestones: tuple[int, ...] = ()
    gamma: float = 0.1
    offset: int = 0
    decay_steps: int | None = None

    def __call__(self, step: int) -> float:
        """The rate at ``step``: a finite number >= 0 (Python, NumPy or concrete JAX scalar).

        Raises:
          ValueError: naming ``step`` when it is negative, NaN, infinite, a bool, not a
            number, not a scalar, or a traced JAX value.
        """
        return float(self.evaluate(_check_step(step), np, np.float64))

    def evaluate(self, step: Any, xp: Any, dtype: Any) -> Any:
        """The schedule at ``step``, written against the NumPy-like module ``xp``.

        ``xp`` is ``numpy`` for Python floats and ``jax.numpy`` for traced steps; the
        formula is the same, so the two agree to the precision of ``dtype``. ``step`` may
        be an array (elementwise). A negative, NaN or infinite step gives NaN: a traced
        step cannot raise, and NaN cannot pass for a rate.
        """
        t = xp.asarray(step, dtype=dtype)
        valid = xp.isfinite(t) & (t >= 0)
        t = t + self.offset
        peak, init, end = self.peak_lr, self.init_lr, self.end_lr
        w, total = self.warmup_steps, self.total_steps
        decay = total - w if self.decay_steps is None else self.decay_steps
        warm = init + (peak - init) * t / max(w, 1)
        s = xp.clip((t - w) / max(decay, 1), 0.0, 1.0)
        if self.name == "constant":
            after, final = peak + 0.0 * t, end
        elif self.name == "poly":
            after, final = end + (peak - end) * (1.0 - s) ** self.power, end
        elif self.name == "cosine":
            after, final = end + (peak - end) * (1.0 + xp.cos(math.pi * s)) / 2.0, end
        else:  # step
            passed = sum(((t >= m).astype(dtype) for m in self.milestones), xp.zeros((), dtype))
            after = peak * self.gamma**passed
            final = peak * self.gamma ** len(self.milestones)
        lr = xp.where(t < w, warm, xp.where(t < total, after, final))
        return xp.where(valid, lr, math.nan).astype(dtype)


def make_schedule(
    name: str,
    *,
    peak_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    init_lr: float = 0.0,
    end_lr: float = 0.0,
    power: float = 2.0,
    milestones: Sequence[int] = (),
    gamma: float = 0.1,
    offset: int = 0,
    decay_steps: int | None = None,
) -> Schedule:
    """Build a schedule: linear warmup from ``init_lr`` to ``peak_lr``, then a decay.

    Args:
      name: one of ``constant``, ``poly``, ``cosine``, ``step``.
      peak_lr: the rate at the end of warmup (usually ``linear_scaling(...)``).
      total_steps: T, the number of steps of the whole run; from T on the rate is ``end_lr``
        (``step``: its last value).
      warmup_steps: W, the length of the linear warmup (0: none); at most ``total_steps``.
      init_lr: the rate at step 0 of the warmup.
      end_lr: the rate that poly and cosine decay to.
      power: the exponent of poly decay (You et al. 2017 use 2).
      milestones: steps (strictly increasing, in ``[warmup_steps, total_steps)``) at which
        the ``step`` schedule multiplies the rate by ``gamma``. Only for ``step``.
      gamma: the factor of each ``step`` decay, in (0, 1] (checked for every schedule).
      offset: an integer >= 0 added to every step before the formula (1: a counter
        that starts at 1, as MXNet's).
      decay_steps: the length of the poly or cosine decay (an integer >= 1); None:
        ``total_steps - warmup_steps``.

    Raises:
      ValueError: naming the bad argument, for an unknown name, a rate that is not a
        finite number >= 0, ``total_steps <= 0``, ``warmup_steps`` outside
        ``[0, total_steps]``, ``power`` not a finite number > 0, ``gamma`` outside (0, 1],
        milestones that are not a sequence of integers, out of order, or given to a
        schedule other than ``step``; and for any bool or ``None`` given as a number.

    Examples:
      >>> sched = make_schedule("poly", peak_lr=3.2, total_steps=100, warmup_steps=10)
      >>> sched(0), sched(5), sched(10), sched(100)
      (0.0, 1.6, 3.2, 0.0)
    """
    if not (isinstance(name, str) and name in SCHEDULES):
        raise ValueError(f"Unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}")
    checks.integer("total_steps", total_steps, 1)
    if not (_is_integer(warmup_steps) and 0 <= warmup_steps <= total_steps):
        raise ValueError(
            f"Invalid warmup_steps: {warmup_steps!r} (must be an integer in [0, total_steps={total_steps}])"
        )
    checks.integer("offset", offset, 0)
    if decay_steps is not None:
        checks.integer("decay_steps", decay_steps, 1)
    for label, rate in (("peak_lr", peak_lr), ("init_lr", init_lr), ("end_lr", end_lr)):
        checks.number(label, rate, 0.0, strict=False)
    checks.number("power", power, 0.0)
    checks.number("gamma", gamma, 0.0, high=1.0)
    if isinstance(milestones, (str, bytes)) or not isinstance(milestones, Iterable):
        raise ValueError(f"Invalid milestones: {milestones!r} (must be a sequence of integers)")
    milestones = tuple(milestones)
    if milestones and name != "step":
        raise ValueError(f"milestones={milestones} only apply to the 'step' schedule, not to {name!r}")
    if name == "step":
        previous = warmup_steps - 1
        for m in milestones:
            if not (_is_integer(m) and previous < m < total_steps):
                raise ValueError(
                    f"Invalid milestone {m!r} in {milestones}: milestones must be strictly "
                    f"increasing integers in [warmup_steps={warmup_steps}, "
                    f"total_steps={total_steps})"
                )
            previous = m
    return Schedule(
        name=name,
        peak_lr=float(peak_lr),
        total_steps=int(total_steps),
        warmup_steps=int(warmup_steps),
        init_lr=float(init_lr),
        end_lr=float(end_lr),
        power=float(power),
        milestones=tuple(int(m) for m in milestones),
        gamma=float(gamma),
        offset=int(offset),
        decay_steps=None if decay_steps is None else int(decay_steps),
    )
