"""LARS or LAMB over a model's params with the package's groups, and its
:class:`~largebatch.schedules.torch.ScheduleLR`: the pair a training framework asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from largebatch.torch import LAMB, LARS, Schedule, ScheduleLR, param_groups

__all__ = ["OPTIMIZERS", "make_optimizer", "optimizer_and_scheduler"]

OPTIMIZERS: dict[str, type[LARS] | type[LAMB]] = {"lars": LARS, "lamb": LAMB}


def make_optimizer(
    model: torch.nn.Module,
    optimizer: str,
    *,
    lr: float,
    weight_decay: float = 0.0,
    exclude: Callable[[str, Tensor], bool] | None = None,
    **kwargs: Any,
) -> LARS | LAMB:
    """``LARS`` or ``LAMB`` (``optimizer``: "lars" or "lamb") over ``model``'s trainable
    params, grouped by :func:`~largebatch.torch.param_groups`: biases and normalization
    params get neither weight decay nor the trust ratio. ``kwargs`` go to the optimizer.

    Raises:
      ValueError: for an ``optimizer`` other than "lars" or "lamb".
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"Unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    groups = param_groups(model, weight_decay, exclude)
    return OPTIMIZERS[optimizer](groups, lr=lr, weight_decay=weight_decay, **kwargs)


def optimizer_and_scheduler(
    model: torch.nn.Module,
    optimizer: str,
    schedule: Schedule,
    *,
    weight_decay: float = 0.0,
    exclude: Callable[[str, Tensor], bool] | None = None,
    **kwargs: Any,
) -> tuple[LARS | LAMB, ScheduleLR]:
    """:func:`make_optimizer` and a :class:`ScheduleLR` that sets every group's rate to
    ``schedule(step)``, ``step`` being the optimizer's count of the steps it applied
    (``follow_optimizer=True``: a step that AMP's GradScaler skips does not advance the
    schedule). Hugging Face's ``Trainer(optimizers=...)`` takes the pair as it is,
    Lightning's ``configure_optimizers`` with ``"interval": "step"``.

    Examples:
      >>> import torch
      >>> from largebatch.schedules import make_schedule
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
      >>> schedule = make_schedule("poly", peak_lr=2.0, total_steps=100, warmup_steps=10)
      >>> opt, sched = optimizer_and_scheduler(model, "lars", schedule, weight_decay=1e-4)
      >>> [len(g["params"]) for g in opt.param_groups], opt.param_groups[0]["lr"]
      ([1, 3], 0.0)
    """
    opt = make_optimizer(
        model, optimizer, lr=schedule.peak_lr, weight_decay=weight_decay, exclude=exclude, **kwargs
    )
    return opt, ScheduleLR(opt, schedule, follow_optimizer=True)
