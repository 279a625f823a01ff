"""``ScheduleLR``: drive torch param groups from a :class:`largebatch.schedules.Schedule`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import numpy as np
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["ScheduleLR"]


class _CountsSteps(Protocol):
    """An optimizer that counts the steps it applied (largebatch LARS/LAMB)."""

    num_steps: int


def _checked_lr(group: int, step: int, value: Any) -> float:
    """``value`` as a float, or a ValueError naming the group, the step and the value."""
    try:
        lr = float(value)
    except (TypeError, ValueError, RuntimeError):
        lr = math.nan
    if isinstance(value, (bool, np.bool_)) or not (lr >= 0.0 and math.isfinite(lr)):
        raise ValueError(
            f"Invalid lr from the schedule of param group {group} at step {step}: {value!r} "
            f"(must be a finite number >= 0)"
        )
    return lr


class ScheduleLR(LRScheduler):
    """Sets every param group's lr to ``schedule(step)``.

    The constructor applies step 0; each ``.step()`` advances one, after
    ``optimizer.step()``, as with every torch scheduler. ``schedule`` is one callable
    for all groups, or a sequence with one per group.

    ``follow_optimizer=True`` reads the step from the optimizer instead of counting calls:
    ``optimizer.num_steps`` (LARS and LAMB count only the steps they applied), so a step
    skipped by ``torch.amp.GradScaler`` on overflow does not advance the schedule.

    Examples:
      >>> import torch
      >>> from largebatch.torch import LARS, make_schedule
      >>> w = torch.nn.Parameter(torch.ones(3))
      >>> opt = LARS([w], lr=0.0)
      >>> sched = ScheduleLR(opt, make_schedule("poly", peak_lr=3.2, total_steps=10,
      ...                                       warmup_steps=2))
      >>> for _ in range(2):
      ...     (w ** 2).sum().backward(); opt.step(); opt.zero_grad(); sched.step()
      >>> opt.param_groups[0]["lr"]
      3.2

    A group whose ``lr`` is a Tensor (the fused, graph-capturable path) is updated in
    place. A schedule that gives a negative, NaN or infinite lr (or no number) raises a
    ValueError naming the group, the step and the value, before any group is written.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        schedule: Callable[[int], float] | Sequence[Callable[[int], float]],
        *,
        follow_optimizer: bool = False,
        last_epoch: int = -1,
    ) -> None:
        n_groups = len(optimizer.param_groups)
        if isinstance(schedule, (list, tuple)):
            schedules: list[Callable[[int], float]] = list(schedule)
        else:
            schedules = [cast("Callable[[int], float]", schedule)] * n_groups
        if len(schedules) != n_groups:
            raise ValueError(f"Expected one schedule per param group ({n_groups}), got {len(schedules)}")
        for i, s in enumerate(schedules):
            if not callable(s):
                raise ValueError(f"Schedule {i} is not callable: {s!r}")
        if follow_optimizer and not hasattr(optimizer, "num_steps"):
            raise ValueError(
                f"follow_optimizer=True needs an optimizer with a num_steps count "
                f"(largebatch LARS/LAMB), not {type(optimizer).__name__}"
            )
        self.schedules = schedules
        self.follow_optimizer = follow_optimizer
        super().__init__(optimizer, last_epoch)

    def _schedule_step(self) -> int:
        if self.follow_optimizer:
            return cast(_CountsSteps, self.optimizer).num_steps
        return self.last_epoch

    def get_lr(self) -> list[float | Tensor]:
        step = self._schedule_step()
        return [_checked_lr(i, step, s(step)) for i, s in enumerate(self.schedules)]

    def state_dict(self) -> dict[str, Any]:
        """The scheduler's counters; the schedules themselves are configuration, not state."""
        return {k: v for k, v in self.__dict__.items() if k not in ("optimizer", "schedules")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.__dict__.update({k: v for k, v in state_dict.items() if k != "schedules"})
