"""The training and evaluation loop of ``largebatch train`` and ``largebatch study``:
:func:`train_epoch` (forward, loss, backward, optimizer and schedule steps) and
:func:`evaluate` (accuracy and mean loss, in chunks). What differs between the two commands
comes in as arguments (docs/design.md §6).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = ["Evaluation", "evaluate", "tensor_chunks", "train_epoch"]

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


class Evaluation(NamedTuple):
    """What :func:`evaluate` returns."""

    accuracy: float  # top-1
    loss: float  # mean cross-entropy, without label smoothing


def train_epoch(
    model: nn.Module,
    batches: Batches,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    micro_batch: int | None = None,
    scaler: torch.amp.GradScaler | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    before_step: Callable[[int], object] | None = None,
    after_step: Callable[[int], object] | None = None,
) -> torch.Tensor:
    """One optimizer step per batch of ``batches`` (``(x, y)`` on the model's device);
    returns the sum of the steps' losses, a tensor on the model's device (not synced).

    ``micro_batch``: split each batch into micro-batches of that size and accumulate
    their gradients (each micro-batch's loss divided by their number, so a step's
    gradient is that of the batch's mean loss); ``no_sync`` (``ddp.no_sync``) then holds
    back the gradient all-reduce of every micro-batch but the last. ``scaler``: a
    ``torch.amp.GradScaler`` scales the loss and steps the optimizer.
    """
    loss_sum = torch.zeros((), device=next(model.parameters()).device)
    for step, (x, y) in enumerate(batches):
        parts = list(zip(x.split(micro_batch), y.split(micro_batch))) if micro_batch else [(x, y)]
        for k, (xm, ym) in enumerate(parts):
            sync = k == len(parts) - 1  # DDP all-reduces at the last micro-batch only
            with contextlib.nullcontext() if sync or no_sync is None else no_sync():
                loss = loss_fn(model(xm).float(), ym) / len(parts)
                (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_sum += loss.detach()
        if before_step is not None:
            before_step(step)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if after_step is not None:
            after_step(step)
    return loss_sum


def tensor_chunks(x: torch.Tensor, y: torch.Tensor, size: int) -> Batches:
    """``(x, y)`` in chunks of ``size`` rows, for :func:`evaluate`."""
    return zip(x.split(size), y.split(size))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    chunks: Batches,
    *,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    world: int = 1,
) -> Evaluation:
    """Top-1 accuracy and mean cross-entropy of ``model`` (in eval mode, then back to train
    mode) over ``chunks`` of ``(x, y)``, moved to ``device`` (``x`` also to ``dtype``).
    With ``world > 1`` each process gives its own shard of the data set, and the counts
    are summed over the processes (an all-reduce), so every process gets the whole score."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # correct, seen, loss sum
    for xb, yb in chunks:
        xb, yb = xb.to(device, dtype), yb.to(device)
        logits = model(xb)
        totals[0] += (logits.argmax(1) == yb).sum()
        totals[1] += len(yb)
        totals[2] += F.cross_entropy(logits.float(), yb, reduction="sum").double()
    if world > 1:
        dist.all_reduce(totals)
    model.train()
    return Evaluation(float(totals[0] / totals[1]), float(totals[2] / totals[1]))
