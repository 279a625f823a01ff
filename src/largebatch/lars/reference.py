"""The float64 NumPy statement of LARS and LAMB: the spec every path is tested against.
Readable, slow, pure: each function takes arrays and returns new arrays, never changing its
inputs; ``t`` counts steps from 1. A tensor excluded from adaptation (``trust_ratio=False``)
gets ratio 1 and its group's weight decay. The rules: docs/design.md §2 and the docstrings
of :func:`lars_step`, :func:`lamb_step`; the hyperparameters' names, defaults and valid
values are ``largebatch.lars.spec`` (these functions do not check values)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["lars_step", "lamb_step", "clip_divisor", "global_norm", "safe_ratio"]


def _f64(xs: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(x, dtype=np.float64) for x in xs]


def global_norm(tensors: Sequence[np.ndarray]) -> float:
    """The L2 norm of all tensors taken together."""
    return float(np.sqrt(sum(float(np.sum(np.square(x))) for x in _f64(tensors))))


def safe_ratio(numerator: float, denominator: float, w_norm: float, other_norm: float) -> float:
    """``numerator / denominator``, or 1 where ``w_norm`` or ``other_norm`` is zero."""
    if w_norm == 0.0 or other_norm == 0.0:
        return 1.0
    return numerator / denominator


def lars_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray],
    momentum_buffers: Sequence[np.ndarray],
    *,
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    nesterov: bool = False,
    trust_clip: bool = False,
    trust_ratio: bool = True,
    lr_in_momentum: bool = True,
    zero_norm_skip: bool = False,
    decayed_norm: bool = False,
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """One LARS step on one group; returns ``(new_params, new_momentum_buffers)``.

    LARS (You, Gitman, Ginsburg 2017, https://arxiv.org/abs/1708.03888; by default in the
    form of the MLPerf ResNet-50 TF reference)::

        ratio = tc * ||w|| / (||g|| + wd * ||w|| + eps)     (1 if ||w|| == 0 or ||g|| == 0)
        ratio = min(ratio / lr, 1)                          (only with trust_clip: LARC)
        d = g + wd * w
        v = momentum * v + lr * ratio * d                   (lr inside the momentum buffer)
        w = w - v            nesterov: w = w - (momentum * v + lr * ratio * d)

        lr_in_momentum=False (torch SGD under apex LARC, NVIDIA's MXNet LARS, timm):
        v = momentum * v + ratio * d ;  w = w - lr * v      nesterov: w - lr * (momentum * v + ratio * d)
        zero_norm_skip=True (apex LARC): where ||w|| == 0 or ||g|| == 0, d = g and ratio = 1
        (no clip, no weight decay)
        decayed_norm=True (optax, optax/_src/alias.py lars: add_decayed_weights, then
        scale_by_trust_ratio of optax/_src/transform.py): the norm of the direction itself,
        ratio = tc * ||w|| / (||g + wd * w|| + eps)     (1 if ||w|| == 0 or ||g + wd * w|| == 0)

    ``decayed_norm=True`` is optax's denominator (google-deepmind/optax,
    optax/_src/alias.py ``lars``, whose ``scale_by_trust_ratio`` in
    optax/_src/transform.py takes the norm of the already decayed update):
    ``||g + wd * w|| + eps``, and ratio 1 where ``||w||`` or ``||g + wd * w||`` is 0.
    """
    new_params, new_bufs = [], []
    for w, g, v in zip(_f64(params), _f64(grads), _f64(momentum_buffers)):
        wd = weight_decay
        ratio = 1.0
        if trust_ratio:
            w_norm = float(np.linalg.norm(w))
            g_norm = float(np.linalg.norm(g))
            if zero_norm_skip and (w_norm == 0.0 or g_norm == 0.0):
                wd = 0.0
            else:
                if decayed_norm:  # optax: the norm of the decayed direction
                    other = float(np.linalg.norm(g + wd * w))
                    denominator = other + eps
                else:
                    other, denominator = g_norm, g_norm + wd * w_norm + eps
                ratio = safe_ratio(trust_coefficient * w_norm, denominator, w_norm, other)
                if trust_clip:
                    ratio = min(ratio / lr, 1.0)
        d = g + wd * w
        inner, outer = (lr * ratio, 1.0) if lr_in_momentum else (ratio, lr)
        v = momentum * v + inner * d
        step = momentum * v + inner * d if nesterov else v
        new_params.append(w - outer * step)
        new_bufs.append(v)
    return new_params, new_bufs


def lamb_step(
    params: Sequence[np.ndarray],
    grads: Sequence[np.ndarray],
    exp_avgs: Sequence[np.ndarray],
    exp_avg_sqs: Sequence[np.ndarray],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    trust_ratio: bool = True,
    adam_w_mode: bool = True,
    grad_averaging: bool = True,
    adapt_without_decay: bool = True,
    freeze_step: int | None = None,
    grad_scale: float = 1.0,
) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """One LAMB step on one group; returns ``(new_params, new_exp_avgs, new_exp_avg_sqs)``.

    LAMB (You et al. 2019, https://arxiv.org/abs/1904.00962, Algorithm 2, phi = identity)::

        g = g / max(1, ||all grads|| / max_grad_norm)       (only with max_grad_norm)
        m = b1 * m + (1 - b1) * g ;  v = b2 * v + (1 - b2) * g^2
        r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) (no 1 - b^t without bias_correction)
        u = r + wd * w
        ratio = ||w|| / ||u||                               (1 if ||w|| == 0 or ||u|| == 0)
        w = w - lr * ratio * u

        adam_w_mode=False (apex FusedLAMB's L2 mode): g = g + wd * w before the moments, u = r
        grad_averaging=False (apex, timm): m = b1 * m + g
        adapt_without_decay=False (apex FusedLAMB, timm): ratio 1 where wd == 0

    ``step`` is the step number t >= 1 after this update. Every grad is divided by
    ``grad_scale`` first: the global clipping divisor ``max(1, global_norm /
    max_grad_norm)``, computed over every group (see :func:`clip_divisor`).

    Frozen variance (``freeze_step``, 1-bit LAMB: Li et al. 2021, arXiv:2104.06069,
    Algorithm 1, whose compression stage keeps the variance the warm-up stage ended
    with; 1-bit Adam: Tang et al. 2021, arXiv:2102.02888, §3): at a step t >
    ``freeze_step``, v is not updated and its bias correction stays at t =
    ``freeze_step``, so v_hat stays what it was after that step. m goes on as before.
    """
    b1, b2 = betas
    t2 = step if freeze_step is None else min(step, freeze_step)  # v's own step count
    frozen = t2 < step
    bc1 = 1.0 - b1**step if bias_correction else 1.0
    bc2 = 1.0 - b2**t2 if bias_correction else 1.0
    wd = weight_decay
    adapt = trust_ratio and (adapt_without_decay or wd != 0)
    new_params, new_m, new_v = [], [], []
    for w, g, m, v in zip(_f64(params), _f64(grads), _f64(exp_avgs), _f64(exp_avg_sqs)):
        g = g / grad_scale
        if not adam_w_mode:
            g = g + wd * w
        m = b1 * m + ((1.0 - b1) if grad_averaging else 1.0) * g
        if not frozen:
            v = b2 * v + (1.0 - b2) * g * g
        u = (m / bc1) / (np.sqrt(v / bc2) + eps) + (wd * w if adam_w_mode else 0.0)
        if adapt:
            w_norm = float(np.linalg.norm(w))
            u_norm = float(np.linalg.norm(u))
            ratio = safe_ratio(w_norm, u_norm, w_norm, u_norm)
        else:
            ratio = 1.0
        new_params.append(w - lr * ratio * u)
        new_m.append(m)
        new_v.append(v)
    return new_params, new_m, new_v


def clip_divisor(grads: Sequence[np.ndarray], max_grad_norm: float | None) -> float:
    """``max(1, ||all grads|| / max_grad_norm)``, or 1 when ``max_grad_norm`` is None."""
    if max_grad_norm is None:
        return 1.0
    return max(1.0, global_norm(grads) / max_grad_norm)
