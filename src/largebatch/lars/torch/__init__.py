"""LARS and LAMB as ``torch.optim.Optimizer`` subclasses, with their functionals.

Layout, as in ``torch.optim``: the classes validate and hold groups and state; the
functionals :func:`lars` and :func:`lamb` take one group's tensor lists and
hyperparameters. Both resolve the path once (``_paths.resolve``: ``single_tensor``,
``foreach``, ``compiled`` or ``fused``; the optimizers per group, as it is added) and run
the step through one dispatch point, ``_paths.run``, which calls each group's body by
keyword, or takes every group in one call of the Triton kernels on the fused path.

Files: ``_common`` (param groups, checks, norms), ``_paths`` (the path choice and the
compiled path), ``_base`` (what the two optimizers share: state dicts, master weights,
the GradScaler contract), ``_lars`` and ``_lamb`` (each optimizer: class, functional,
paths), ``_fused`` (glue to ``largebatch.lars.kernels``). The hyperparameters are
``largebatch.lars.spec``; the math is ``largebatch.lars.reference`` (docs/design.md §2), and every
path is tested against it.

Mixed precision: with ``master_weights=True``, fp16/bf16 params get an fp32 master copy
in the optimizer state (saved by ``state_dict``); the update runs on the master and the
model's param is rewritten from it. The optimizers follow the ``torch.amp.GradScaler``
contract (``_step_supports_amp_scaling``): gradients are unscaled inside the step
(``p.grad`` is never written) and a step with ``found_inf`` set changes nothing.
"""

from __future__ import annotations

import torch

from largebatch.lars.spec import LARS_SPEC
from largebatch.lars.torch import _sharded
from largebatch.lars.torch._common import default_exclude, param_groups
from largebatch.lars.torch._lamb import LAMB, lamb
from largebatch.lars.torch._lars import LARS, lars, lars_ratio
from largebatch.lars.torch._compiled import COMPILE_MIN_TENSOR
from largebatch.lars.torch._paths import COMPILE_MIN_NUMEL

__all__ = ["LARS", "LAMB", "lars", "lamb", "param_groups", "default_exclude", "trust_ratios",
           "COMPILE_MIN_NUMEL", "COMPILE_MIN_TENSOR"]


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
            ratio = lars_ratio(w_norm, g_norm, lr=group["lr"], weight_decay=group.get("weight_decay", 0.0),
                               trust_coefficient=LARS_SPEC.defaults["trust_coefficient"],
                               eps=LARS_SPEC.defaults["eps"], trust_clip=False)
            out.append(float(ratio))
    return out
