"""Trust ratios by parameter name, for the framework callbacks' logs."""

from __future__ import annotations

import torch
from torch import Tensor

from largebatch.lars.torch import LAMB, LARS, trust_ratios

__all__ = ["named_trust_ratios"]


def _adapted(optimizer: torch.optim.Optimizer) -> list[tuple[int, int, Tensor]]:
    """(group, index, param) of each tensor :func:`trust_ratios` reports, in its order:
    for LARS and LAMB the params with a grad of the groups that take the trust ratio,
    for any other optimizer those of two or more dimensions with a grad."""
    out = []
    for i, group in enumerate(optimizer.param_groups):
        if isinstance(optimizer, (LARS, LAMB)):
            spec = optimizer.spec
            if not spec.make({k: group[k] for k in spec.group_keys[1:]}).adapts:
                continue
        for j, p in enumerate(group["params"]):
            if p.grad is not None and (isinstance(optimizer, (LARS, LAMB)) or p.ndim > 1):
                out.append((i, j, p))
    return out


def named_trust_ratios(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, grad_scale: float = 1.0
) -> dict[str, float]:
    """:func:`~largebatch.torch.trust_ratios` keyed by each tensor's name in ``model``
    (``"group{i}.param{j}"`` for one that ``model`` does not hold), in the same order.

    Examples:
      >>> import torch
      >>> from largebatch.torch import LARS, param_groups
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 2))
      >>> opt = LARS(param_groups(model, 1e-4), lr=1.0)
      >>> model(torch.ones(1, 4)).sum().backward()
      >>> list(named_trust_ratios(opt, model))
      ['0.weight']
    """
    names = {id(p): name for name, p in model.named_parameters()}
    keys = [names.get(id(p), f"group{i}.param{j}") for i, j, p in _adapted(optimizer)]
    ratios = trust_ratios(optimizer, grad_scale)
    if len(ratios) != len(keys):
        raise RuntimeError(f"{len(ratios)} trust ratios for {len(keys)} adapted tensors")
    return dict(zip(keys, ratios))
