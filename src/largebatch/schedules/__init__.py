"""Learning-rate schedules for large-batch training: one factory, the same numbers everywhere.

A schedule is a pure function of the step ``t`` (0, 1, 2, ...)::

    warmup (t < W):   lr = init + (peak - init) * t / W
    after  (W<=t<T):  s = (t - W) / (T - W)
      constant: peak
      poly:     end + (peak - end) * (1 - s)^power
      cosine:   end + (peak - end) * (1 + cos(pi * s)) / 2
      step:     peak * gamma^(number of milestones <= t)
    t >= T:   end  (step: its last value, peak * gamma^len(milestones))

``make_schedule`` returns a :class:`Schedule`: call it with a step to get a float. The
same object drives torch param groups (``largebatch.torch.ScheduleLR``) and, through
``largebatch.jax.make_schedule``, jitted JAX code: one formula (:meth:`Schedule.evaluate`,
written against a NumPy-like module) serves both, so the numbers agree.

References:
  Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour"
  (linear scaling rule, gradual warmup), https://arxiv.org/abs/1706.02677.
  You, Gitman, Ginsburg 2017 (LARS with poly decay, power 2), https://arxiv.org/abs/1708.03888.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["SCHEDULES", "Schedule", "linear_scaling", "make_schedule"]

SCHEDULES = ("constant", "poly", "cosine", "step")


def linear_scaling(base_lr: float, batch_size: int, base_batch_size: int = 256) -> float:
    """The linear scaling rule (Goyal et al. 2017): ``base_lr * batch_size / base_batch_size``.

    >>> linear_scaling(0.1, 8192)
    3.2
    """
    if not base_lr >= 0.0:
        raise ValueError(f"Invalid base_lr: {base_lr} (must be >= 0)")
    if not (isinstance(batch_size, numbers.Integral) and batch_size > 0):
        raise ValueError(f"Invalid batch_size: {batch_size!r} (must be a positive integer)")
    if not (isinstance(base_batch_size, numbers.Integral) and base_batch_size > 0):
        raise ValueError(
            f"Invalid base_batch_size: {base_batch_size!r} (must be a positive integer)"
        )
    return base_lr * batch_size / base_batch_size


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

    def __call__(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"Invalid step: {step} (must be >= 0)")
        return float(self.evaluate(step, np, np.float64))

    def evaluate(self, step: Any, xp: Any, dtype: Any) -> Any:
        """The schedule at ``step``, written against the NumPy-like module ``xp``.

        ``xp`` is ``numpy`` for Python floats and ``jax.numpy`` for traced steps; the
        formula is the same, so the two agree to the precision of ``dtype``.
        """
        t = xp.maximum(xp.asarray(step, dtype=dtype), 0)
        peak, init, end = self.peak_lr, self.init_lr, self.end_lr
        w, total = self.warmup_steps, self.total_steps
        warm = init + (peak - init) * t / max(w, 1)
        s = xp.clip((t - w) / max(total - w, 1), 0.0, 1.0)
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
        return xp.where(t < w, warm, xp.where(t < total, after, final)).astype(dtype)


def _check_nonneg(name: str, value: float) -> None:
    if not (isinstance(value, numbers.Real) and value >= 0.0 and math.isfinite(value)):
        raise ValueError(f"Invalid {name}: {value!r} (must be a finite number >= 0)")


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
      gamma: the factor of each ``step`` decay, in (0, 1].

    Raises:
      ValueError: naming the bad argument, for an unknown name, a negative rate,
        ``total_steps <= 0``, ``warmup_steps`` outside ``[0, total_steps]``, milestones out
        of order or given to a schedule other than ``step``.

    >>> sched = make_schedule("poly", peak_lr=3.2, total_steps=100, warmup_steps=10)
    >>> sched(0), sched(5), sched(10), sched(100)
    (0.0, 1.6, 3.2, 0.0)
    """
    if name not in SCHEDULES:
        raise ValueError(f"Unknown schedule {name!r}; known schedules: {', '.join(SCHEDULES)}")
    if not (isinstance(total_steps, numbers.Integral) and total_steps > 0):
        raise ValueError(f"Invalid total_steps: {total_steps!r} (must be a positive integer)")
    if not (isinstance(warmup_steps, numbers.Integral) and 0 <= warmup_steps <= total_steps):
        raise ValueError(
            f"Invalid warmup_steps: {warmup_steps!r} (must be an integer in "
            f"[0, total_steps={total_steps}])"
        )
    _check_nonneg("peak_lr", peak_lr)
    _check_nonneg("init_lr", init_lr)
    _check_nonneg("end_lr", end_lr)
    if not (isinstance(power, numbers.Real) and power > 0.0 and math.isfinite(power)):
        raise ValueError(f"Invalid power: {power!r} (must be > 0)")
    milestones = tuple(milestones)
    if milestones and name != "step":
        raise ValueError(
            f"milestones={milestones} only apply to the 'step' schedule, not to {name!r}"
        )
    if name == "step":
        if not (isinstance(gamma, numbers.Real) and 0.0 < gamma <= 1.0):
            raise ValueError(f"Invalid gamma: {gamma!r} (must be in (0, 1])")
        previous = warmup_steps - 1
        for m in milestones:
            if not (isinstance(m, numbers.Integral) and previous < m < total_steps):
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
    )
