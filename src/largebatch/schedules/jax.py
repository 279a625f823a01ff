"""The schedules of :mod:`largebatch.schedules` as optax schedules: callables from the step
count (traced under ``jax.jit``) to the rate. :class:`OptaxSchedule` evaluates the Python
schedule's own formula (:meth:`Schedule.evaluate`) with ``jax.numpy``, so the jitted rate
equals ``schedule(step)`` up to the precision of ``dtype`` (float32 by default); an invalid
traced step gives NaN (docs/design.md §4)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from largebatch import schedules as _schedules
from largebatch.schedules import Schedule, linear_scaling, sqrt_scaling

__all__ = ["OptaxSchedule", "as_optax_schedule", "linear_scaling", "make_schedule", "sqrt_scaling"]


@dataclasses.dataclass(frozen=True)
class OptaxSchedule:
    """``schedule(count) -> jnp scalar``: a :class:`Schedule` evaluated with ``jax.numpy``.

    Frozen and hashable, so it can be a static argument of ``jax.jit``. An array of counts
    gives the rates elementwise; a negative, NaN or infinite count gives NaN.
    """

    schedule: Schedule
    dtype: Any = jnp.float32

    def __call__(self, count: jax.typing.ArrayLike) -> jax.Array:
        kind = jnp.result_type(count)
        if not (jnp.issubdtype(kind, jnp.integer) or jnp.issubdtype(kind, jnp.floating)):
            raise ValueError(f"Invalid step: {count!r} of dtype {kind} (must be an integer or float count)")
        return self.schedule.evaluate(count, jnp, self.dtype)


def as_optax_schedule(schedule: Schedule, dtype: Any = jnp.float32) -> OptaxSchedule:
    """Wrap a :class:`Schedule` (from ``largebatch.schedules.make_schedule``) for optax."""
    if not isinstance(schedule, Schedule):
        raise ValueError(f"Expected a largebatch.schedules.Schedule, got {schedule!r}")
    return OptaxSchedule(schedule, jnp.dtype(dtype))


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
) -> OptaxSchedule:
    """:func:`largebatch.schedules.make_schedule`, returned as an optax schedule.

    Linear warmup from ``init_lr`` to ``peak_lr`` over ``warmup_steps``, then ``constant``,
    ``poly``, ``cosine`` or ``step`` decay until ``total_steps`` (see
    :mod:`largebatch.schedules` for the formulas and the arguments).

    Examples:
      >>> import jax
      >>> sched = make_schedule("poly", peak_lr=3.2, total_steps=100, warmup_steps=10)
      >>> [round(float(jax.jit(sched)(t)), 4) for t in (0, 5, 10, 100)]
      [0.0, 1.6, 3.2, 0.0]
    """
    return as_optax_schedule(
        _schedules.make_schedule(
            name,
            peak_lr=peak_lr,
            total_steps=total_steps,
            warmup_steps=warmup_steps,
            init_lr=init_lr,
            end_lr=end_lr,
            power=power,
            milestones=milestones,
            gamma=gamma,
            offset=offset,
            decay_steps=decay_steps,
        )
    )
