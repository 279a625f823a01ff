"""LARS or LAMB for Hugging Face's ``Trainer``: :func:`trainer_optimizers` reads the rate,
weight decay, warmup and schedule from ``TrainingArguments`` and returns the
``(optimizer, scheduler)`` pair that ``Trainer(optimizers=...)`` takes."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers import TrainingArguments

from largebatch.integrations.build import optimizer_and_scheduler
from largebatch.torch import LAMB, LARS, Schedule, ScheduleLR, make_schedule

__all__ = ["SCHEDULER_TYPES", "schedule_from_args", "trainer_optimizers"]

# Hugging Face's lr_scheduler_type and the schedule of ours with the same formula.
SCHEDULER_TYPES = {
    "linear": "poly",  # power 1, down to 0
    "polynomial": "poly",  # lr_scheduler_kwargs' power (1) and lr_end (1e-7)
    "cosine": "cosine",  # half a cycle (num_cycles=0.5), down to 0
    "constant": "constant",  # no warmup, whatever warmup_steps says
    "constant_with_warmup": "constant",
}


def schedule_from_args(args: TrainingArguments, total_steps: int | None = None) -> Schedule:
    """Our :class:`~largebatch.schedules.Schedule` with the formula of ``args``'
    ``lr_scheduler_type``: peak ``args.learning_rate``, linear warmup from 0 over
    ``args.get_warmup_steps(total)``, ``total`` = ``args.max_steps`` when set (> 0), else
    ``total_steps``.

    Raises:
      ValueError: for a scheduler type without a counterpart here (``SCHEDULER_TYPES``),
        ``lr_scheduler_kwargs`` it does not take, or no number of steps.
    """
    total = args.max_steps if args.max_steps > 0 else total_steps
    if total is None:
        raise ValueError("args.max_steps is not set: give total_steps (the run's optimizer steps)")
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    if kind not in SCHEDULER_TYPES:
        supported = ", ".join(SCHEDULER_TYPES)
        raise ValueError(f"lr_scheduler_type {kind!r} has no counterpart here; supported: {supported}")
    given = args.lr_scheduler_kwargs or {}
    options = dict(json.loads(given) if isinstance(given, str) else given)  # a str: JSON
    known = {"polynomial": {"power", "lr_end"}, "cosine": {"num_cycles"}}.get(kind, set())
    if set(options) - known or options.get("num_cycles", 0.5) != 0.5:
        raise ValueError(f"lr_scheduler_kwargs {options} not supported for {kind!r} (only {sorted(known)})")
    extra: dict[str, Any] = {"end_lr": args.learning_rate} if kind.startswith("constant") else {}
    if kind in ("linear", "polynomial"):
        extra = {"power": float(options.get("power", 1.0)), "end_lr": 0.0}
        if kind == "polynomial":
            extra["end_lr"] = float(options.get("lr_end", 1e-7))
    return make_schedule(
        SCHEDULER_TYPES[kind],
        peak_lr=args.learning_rate,
        total_steps=total,
        warmup_steps=0 if kind == "constant" else args.get_warmup_steps(total),
        **extra,
    )


def trainer_optimizers(
    model: torch.nn.Module,
    args: TrainingArguments,
    optimizer: str = "lamb",
    *,
    total_steps: int | None = None,
    exclude: Callable[[str, Tensor], bool] | None = None,
    **kwargs: Any,
) -> tuple[LARS | LAMB, ScheduleLR]:
    """``(optimizer, scheduler)`` for ``Trainer(model, args, optimizers=...)``: ``LARS`` or
    ``LAMB`` (``optimizer``) over ``model``'s params grouped by
    :func:`~largebatch.torch.param_groups` with ``args.weight_decay``, stepped by
    :func:`schedule_from_args`. ``kwargs`` go to the optimizer; ``args``' Adam settings
    (``adam_beta1``, ``adam_epsilon``) are not read, so LAMB keeps its own defaults
    unless given. ``total_steps``: the run's optimizer steps where ``args.max_steps`` is
    not set (epochs times batches per epoch over ``gradient_accumulation_steps``).
    """
    schedule = schedule_from_args(args, total_steps)
    return optimizer_and_scheduler(
        model, optimizer, schedule, weight_decay=args.weight_decay, exclude=exclude, **kwargs
    )
