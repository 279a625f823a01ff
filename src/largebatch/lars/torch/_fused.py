"""The fused path's glue: torch tensors and groups in, one call of the Triton kernels.

One call takes every group of an optimizer, so a step's launch count does not grow with
the number of groups and LAMB's global gradient norm spans all of them. The kernels
(``largebatch.lars.kernels``) advance each param's step count, and the optimizer's count
of applied steps, on the device unless GradScaler's ``found_inf`` skips the step.
"""

from __future__ import annotations

from typing import Any, overload

import torch
from torch import Tensor

from largebatch.lars.spec import OptimizerSpec
from largebatch.lars.torch._paths import list_names


def fused_group(spec: OptimizerSpec, tensors: dict[str, list], hyper: dict[str, Any], lr: Tensor) -> Any:
    """One ``FusedGroup`` from a group's lists (keyed by ``_paths.list_names``), its
    hyperparameters (the spec's names) and its lr on the device. Built here only, for
    ``_paths.run``."""
    from largebatch.lars.kernels import FusedGroup

    _params, _grads, *state, _masters, _steps = list_names(spec)
    return FusedGroup(
        params=tensors["params"], grads=tensors["grads"], masters=tensors["masters"],
        state={key: tensors[name] for key, name in zip(spec.state, state)},
        steps=tensors["state_steps"], lr=lr, hyper={k: hyper[k] for k in spec.group_keys[1:]},
    )


def check_group(spec: OptimizerSpec, i: int, hyper: dict[str, Any]) -> None:
    """Group ``i``'s hyperparameters as the fused kernels take them (LAMB's eps > 0 among
    them), checked before the optimizer creates any state."""
    from largebatch.lars.kernels.plan import check_hyper

    check_hyper(spec, i, {k: hyper[k] for k in spec.group_keys[1:]})


@overload
def fused_step(spec: OptimizerSpec, groups: list, *, counter: Tensor,
               found_inf: Tensor | None, **kwargs: Any) -> Tensor: ...
@overload
def fused_step(spec: OptimizerSpec, groups: list, *, counter: None,
               found_inf: Tensor | None, **kwargs: Any) -> None: ...
def fused_step(spec: OptimizerSpec, groups: list, *, counter: Tensor | None,
               found_inf: Tensor | None, **kwargs: Any) -> Tensor | None:
    """One step of the kernels on ``groups``; returns ``counter``, moved to the params'
    device if it was elsewhere (it is counted where the kernels run). ``kwargs`` go to the
    kernels' entry (``reduce_norms``/``reduce_global`` for sharded params). Nothing here
    reads a device value on the host: the skip is decided on the device, also when no
    param has a grad."""
    from largebatch.lars import kernels

    step = {"LARS": kernels.fused_lars_step_, "LAMB": kernels.fused_lamb_step_}[spec.name]
    groups = [g for g in groups if g.params]
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
    step(groups, counter=counter, found_inf=found_inf, **kwargs)
    return counter


def device_lr(lr: float | Tensor, device: torch.device, buffers: dict | None = None,
              key: Any = None) -> Tensor:
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
