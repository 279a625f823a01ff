"""Trust ratios for telemetry: those LARS and LAMB would apply, or the LARS ratio of any
other optimizer's params as a diagnostic."""

from __future__ import annotations

import torch

from largebatch.lars.spec import LARS_SPEC
from largebatch.lars.torch import _sharded
from largebatch.lars.torch._lamb import LAMB
from largebatch.lars.torch._lars import LARS, lars_ratio


@torch.no_grad()
def trust_ratios(optimizer: torch.optim.Optimizer, grad_scale: float = 1.0) -> list[float]:
    """The trust ratios of ``optimizer``'s adapted tensors, for telemetry.

    LARS and LAMB: the ratios their next step would apply (``optimizer.trust_ratios``).
    Any other optimizer (SGD, as a diagnostic): the LARS ratio at the spec's default
    ``trust_coefficient`` and ``eps`` and the group's ``weight_decay``, for every param
    of two or more dimensions with a grad (biases and normalization params left out).
    """
    if isinstance(optimizer, (LARS, LAMB)):
        return optimizer.trust_ratios(grad_scale)
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or p.ndim <= 1:
                continue
            (ws, gs), _ = _sharded.local(([p.detach()], [p.grad]))  # FSDP2: the local blocks
            w, g = ws[0].float(), gs[0].float() / grad_scale
            w_norm, g_norm = _sharded.whole_norm(p, w), _sharded.whole_norm(p, g)
            ratio = lars_ratio(
                w_norm,
                g_norm,
                lr=group["lr"],
                weight_decay=group.get("weight_decay", 0.0),
                trust_coefficient=LARS_SPEC.defaults["trust_coefficient"],
                eps=LARS_SPEC.defaults["eps"],
                trust_clip=False,
            )
            out.append(float(ratio))
    return out
