"""Trust ratios for telemetry: those LARS and LAMB would apply, or the LARS ratio of any
other optimizer's params as a diagnostic; as a list or by parameter name, each read on
the host once."""

from __future__ import annotations

import torch
from torch import Tensor

from largebatch.lars.spec import LARS_SPEC
from largebatch.lars.torch import _sharded
from largebatch.lars.torch._common import ParamNames, param_names
from largebatch.lars.torch._lamb import LAMB
from largebatch.lars.torch._lars import LARS, lars_ratio


def trust_ratios(optimizer: torch.optim.Optimizer, grad_scale: float = 1.0) -> list[float]:
    """The trust ratios of ``optimizer``'s adapted tensors, for telemetry, in group order.

    LARS and LAMB: the ratios their next step would apply (``optimizer.trust_ratios``).
    Any other optimizer (SGD, as a diagnostic): the LARS ratio at the spec's default
    ``trust_coefficient`` and ``eps`` and the group's ``weight_decay``, for every param
    of two or more dimensions with a grad (biases and normalization params left out).
    Gathered on the device, read on the host once.
    """
    _, ratios = trust_ratio_tensor(optimizer, grad_scale)
    return ratios.tolist() if ratios.numel() else []


def named_trust_ratios(
    optimizer: torch.optim.Optimizer, names: ParamNames = None, grad_scale: float = 1.0
) -> dict[str, float]:
    """:func:`trust_ratios` by parameter name (one host read). ``names``: a module, a
    mapping of names to params, or None for the names the param groups carry
    (``torch.optim`` keeps them when given ``model.named_parameters()``)."""
    params, ratios = trust_ratio_tensor(optimizer, grad_scale)
    name_of = param_names(optimizer.param_groups, names)
    keys = [name_of(p) for p in params]
    return dict(zip(keys, ratios.tolist() if ratios.numel() else []))


@torch.no_grad()
def trust_ratio_tensor(
    optimizer: torch.optim.Optimizer, grad_scale: float = 1.0
) -> tuple[list[Tensor], Tensor]:
    """The params :func:`trust_ratios` reports and their ratios as one tensor on the
    device (nothing read on the host)."""
    if isinstance(optimizer, (LARS, LAMB)):
        return optimizer.trust_ratio_tensor(grad_scale)
    params: list[Tensor] = []
    out: list[Tensor] = []
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None or p.ndim <= 1:
                continue
            (ws, gs), _ = _sharded.local(([p.detach()], [p.grad]))  # FSDP2: the local blocks
            w, g = ws[0].float(), gs[0].float() / grad_scale
            w_norm = _sharded.whole_norm(p, w, on_device=True)
            g_norm = _sharded.whole_norm(p, g, on_device=True)
            ratio = lars_ratio(
                w_norm,
                g_norm,
                lr=group["lr"],
                weight_decay=group.get("weight_decay", 0.0),
                trust_coefficient=LARS_SPEC.defaults["trust_coefficient"],
                eps=LARS_SPEC.defaults["eps"],
                trust_clip=False,
            )
            params.append(p)
            out.append(ratio if ratio.device == device else ratio.to(device))
    return params, torch.stack(out) if out else torch.zeros(0, device=device)
