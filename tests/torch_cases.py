"""Shared inputs for the torch optimizer tests: awkward shapes, runners for ours and the spec."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from largebatch.lars import reference

# A zero tensor, a size-1 tensor, sizes that are not a multiple of any block, a zero-size one.
AWKWARD_SHAPES = [(7, 5), (1,), (1025,), (3, 4, 5), (17,), (0,), (64, 33)]
ZERO_PARAM = 4  # index of the all-zero param
ZERO_GRAD = 2  # index of the param whose grad is zero at every step

# rtol, atol per dtype, for params and state against the float64 spec.
TOLERANCE = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (2e-5, 2e-6),
    torch.bfloat16: (2e-2, 2e-3),
    torch.float16: (4e-3, 4e-4),
}


def make_problem(shapes: Sequence[tuple[int, ...]], steps: int, seed: int = 0):
    """Float64 params and a gradient sequence, with the zero param and zero grad in place."""
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s) for s in shapes]
    grads = [[rng.standard_normal(s) * 0.1 for s in shapes] for _ in range(steps)]
    if len(shapes) > ZERO_PARAM:
        params[ZERO_PARAM] = np.zeros(shapes[ZERO_PARAM])
    if len(shapes) > ZERO_GRAD:
        for g in grads:
            g[ZERO_GRAD] = np.zeros(shapes[ZERO_GRAD])
    return params, grads


def split(items: list, n_excluded: int) -> list[list]:
    """Two groups: the first ``len - n_excluded`` items, then the rest."""
    cut = len(items) - n_excluded
    return [items[:cut], items[cut:]]


def run_torch(
    cls,
    params_np: list[np.ndarray],
    grads_np: list[list[np.ndarray]],
    *,
    dtype: torch.dtype,
    group_opts: Sequence[dict],
    sizes: Sequence[int],
    lrs: Sequence[float],
    **kwargs,
):
    """Run ``cls`` over the steps; returns the params and optimizer (groups cut by ``sizes``)."""
    params = [torch.tensor(p, dtype=dtype, requires_grad=True) for p in params_np]
    groups, start = [], 0
    for size, opts in zip(sizes, group_opts):
        groups.append({"params": params[start : start + size], **opts})
        start += size
    opt = cls(groups, lr=lrs[0], **kwargs)
    for lr, step_grads in zip(lrs, grads_np):
        for group in opt.param_groups:
            group["lr"] = lr
        for p, g in zip(params, step_grads):
            p.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return params, opt


def run_reference_lars(params, grads, *, group_opts, sizes, lrs, **kwargs):
    params = [p.copy() for p in params]
    bufs = [np.zeros_like(p) for p in params]
    for lr, step_grads in zip(lrs, grads):
        start = 0
        for size, opts in zip(sizes, group_opts):
            sl = slice(start, start + size)
            opts = dict(opts)
            enabled = opts.pop("trust_ratio", True)
            new_p, new_b = reference.lars_step(
                params[sl], step_grads[sl], bufs[sl], lr=lr, trust_ratio_enabled=enabled,
                **{**kwargs, **opts},
            )
            params[sl], bufs[sl] = new_p, new_b
            start += size
    return params, bufs


def run_reference_lamb(params, grads, *, group_opts, sizes, lrs, max_grad_norm=None, **kwargs):
    params = [p.copy() for p in params]
    ms = [np.zeros_like(p) for p in params]
    vs = [np.zeros_like(p) for p in params]
    for t, (lr, step_grads) in enumerate(zip(lrs, grads), start=1):
        divisor = reference.lamb_grad_divisor(step_grads, max_grad_norm)
        start = 0
        for size, opts in zip(sizes, group_opts):
            sl = slice(start, start + size)
            opts = dict(opts)
            enabled = opts.pop("trust_ratio", True)
            params[sl], ms[sl], vs[sl] = reference.lamb_step(
                params[sl], step_grads[sl], ms[sl], vs[sl], step=t, lr=lr,
                trust_ratio_enabled=enabled, grad_divisor=divisor, **{**kwargs, **opts},
            )
            start += size
    return params, ms, vs


def assert_close(actual: Sequence[torch.Tensor], expected: Sequence[np.ndarray], dtype, what="param"):
    rtol, atol = TOLERANCE[dtype]
    for i, (a, e) in enumerate(zip(actual, expected)):
        a64 = a.detach().double().numpy()
        np.testing.assert_allclose(
            a64, e, rtol=rtol, atol=atol, err_msg=f"{what} {i} of shape {e.shape} differs"
        )
