"""The fused path: every group of a step in one call of the Triton kernels
(``largebatch.lars.kernels``), which count the steps on the device unless GradScaler's
``found_inf`` skips the step."""

from __future__ import annotations

from typing import Any, overload

import torch
from torch import Tensor

from largebatch.lars.spec import Hyperparams, LambHyperparams
from largebatch.lars.torch._group import GroupStep


def check(hyper: Hyperparams, group: int) -> None:
    """What the kernels need beyond the spec (LAMB's eps > 0), checked when a fused
    group's hyperparameters are made, before any state exists."""
    from largebatch.lars.kernels.plan import check_fused

    check_fused(hyper, group)


@overload
def step(
    groups: list[GroupStep],
    *,
    counter: Tensor,
    found_inf: Tensor | None,
    lr_buffers: dict | None = None,
    **kwargs: Any,
) -> Tensor: ...
@overload
def step(
    groups: list[GroupStep],
    *,
    counter: None,
    found_inf: Tensor | None,
    lr_buffers: dict | None = None,
    **kwargs: Any,
) -> None: ...
def step(
    groups: list[GroupStep],
    *,
    counter: Tensor | None,
    found_inf: Tensor | None,
    lr_buffers: dict | None = None,
    **kwargs: Any,
) -> Tensor | None:
    """One step of the kernels on ``groups`` (each with params); returns ``counter``,
    moved to the params' device if it was elsewhere (it is counted where the kernels
    run). ``kwargs`` go to the kernels' entry (``grad_scale``, ``max_grad_norm``,
    ``reduce_norms``/``reduce_global`` for sharded params). Nothing here reads a device
    value on the host: the skip is decided on the device, also when no param has a grad."""
    from largebatch.lars import kernels

    if not groups:  # nothing to update: count the step unless GradScaler skips it
        if counter is None:
            return counter
        if found_inf is None:
            return counter.add_(1)
        if counter.device != found_inf.device and found_inf.device.type != "cpu":
            counter = counter.to(found_inf.device, non_blocking=True)
        return counter.add_(found_inf.reshape(()) == 0)
    device = groups[0].params[0].device
    if counter is not None and counter.device != device:
        counter = counter.to(device, non_blocking=True)
    fused = [
        kernels.FusedGroup(
            params=g.params,
            grads=g.grads,
            masters=g.masters,
            state=g.state,
            steps=g.steps,
            lr=device_lr(g.lr, device, lr_buffers, g.key),
            hyper=g.hyper,
        )
        for g in groups
    ]
    if isinstance(groups[0].hyper, LambHyperparams):
        kernels.fused_lamb_step_(fused, counter=counter, found_inf=found_inf, **kwargs)
    else:
        kernels.fused_lars_step_(fused, counter=counter, found_inf=found_inf, **kwargs)
    return counter


def device_lr(
    lr: float | Tensor, device: torch.device, buffers: dict | None = None, key: Any = None
) -> Tensor:
    """``lr`` as an fp32 0-dim tensor on ``device``: ``lr`` itself when it is one (the
    CUDA-graph-friendly way, read in place), else a buffer filled with it, kept in
    ``buffers[key]`` so that the kernels' lr address table stays valid between steps."""
    if isinstance(lr, Tensor) and lr.device == device and lr.dtype == torch.float32 and lr.numel() == 1:
        return lr.reshape(())
    buffer = None if buffers is None else buffers.get(key)
    if buffer is None or buffer.device != device:
        buffer = torch.zeros((), dtype=torch.float32, device=device)
        if buffers is not None:
            buffers[key] = buffer
    if not isinstance(lr, Tensor) or lr.device.type == "cpu":  # read on the host: no wait
        return buffer.fill_(lr if not isinstance(lr, Tensor) else lr.reshape(()))
    return buffer.copy_(lr.reshape(()))
