"""NumPy ports of the published LARS and LAMB updates, each in its source's own form.

Each port restates one function of one repository (named in its docstring) in this
project's words, in float64, one tensor at a time: the buffers it keeps, where it puts
the learning rate and the weight decay, what it does at a zero norm. A port takes the
params as a list with, for each, whether the source adapts it (``adapt``) and decays it
(``decay``), the source's own split of a model, and runs the given steps; it returns
the params. ``tests/test_sources.py`` runs them against this package's paths with the
keywords of ``largebatch.lars.sources``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Arrays = list[np.ndarray]


def _norm(x: np.ndarray) -> float:
    return float(np.sqrt(np.sum(np.square(x))))


def _corrected(momentum: float, lrs: Sequence[float]) -> list[float]:
    """Goyal et al.'s momentum correction: each step's coefficient on an lr-scaled buffer,
    ``m * lr_t / lr_(t-1)`` (``m`` at the first step)."""
    return [momentum] + [momentum * lr / last for last, lr in zip(lrs, lrs[1:])]


def mlperf_tf_lars(
    params: Arrays,
    grads: Sequence[Arrays],
    lrs: Sequence[float],
    *,
    adapt,
    decay,
    wd: float,
    momentum: float,
    eta: float = 0.001,
    eps: float = 0.0,
) -> Arrays:
    """mlcommons/training, image_classification/tensorflow/official/resnet/
    mlperf_lars_optimizer.py, MLPERF_LARSOptimizer.compute_lr and _resource_apply_dense
    (TF's apply_momentum at rate 1 on ``lr * ratio * (g + wd * w)``): the buffer holds
    lr-scaled steps, here negated, ``mom = m * mom - lr * ratio * (g + wd * w); w +=
    mom``; a param on the skip list takes ``mom = m * mom - lr * g`` (no ratio, no decay).
    A zero norm gives ratio 1, and the decay stays. ``eps`` as given; the TF2 copy
    (image_classification/tensorflow2/lars_optimizer.py) takes the same steps with
    ``eps=1e-7`` where it is given 0."""
    ws, moms = [p.copy() for p in params], [np.zeros_like(p) for p in params]
    for lr, gs in zip(lrs, grads):
        for i, g in enumerate(gs):
            w = ws[i]
            if adapt[i]:
                wn, gn = _norm(w), _norm(g)
                ratio = eta * wn / (gn + wd * wn + eps) if wn > 0 and gn > 0 else 1.0
                scaled = lr * ratio * (g + wd * w)
            else:
                scaled = lr * g
            moms[i] = momentum * moms[i] - scaled
            ws[i] = w + moms[i]
    return ws


def nvidia_mxnet_lars(
    params: Arrays,
    grads: Sequence[Arrays],
    lrs: Sequence[float],
    *,
    adapt,
    decay,
    wd: float,
    momentum: float,
    eta: float = 0.001,
    eps: float = 0.0,
) -> Arrays:
    """mlcommons/training_results_v0.7, NVIDIA/benchmarks/resnet/implementations/mxnet/
    common/fit.py, SGDwFASTLARS._update_impl, with MXNet's multi_lars (the local rate
    ``lr * eta * ||w|| / (||g|| + wd * ||w|| + eps)``, ``lr`` at a zero norm) and
    lars_multi_mp_sgd_mom_update (``mom = m' * mom - lr_i * wd_i * w - lr_i * g; w +=
    mom``), where ``m' = m * lr_t / lr_(t-1)`` from the second update on: Goyal et al.'s
    momentum correction. Decay per param (``wd_i``) apart from LARS: the fc bias."""
    ws, moms = [p.copy() for p in params], [np.zeros_like(p) for p in params]
    for lr, m, gs in zip(lrs, _corrected(momentum, lrs), grads):
        for i in range(len(gs)):
            _mxnet_lars_update(ws, moms, gs, i, lr, m, adapt[i], wd if decay[i] else 0.0, eta, eps)
    return ws


def _mxnet_lars_update(
    ws: Arrays,
    moms: Arrays,
    gs: Arrays,
    i: int,
    lr: float,
    m: float,
    adapt: bool,
    wd_i: float,
    eta: float,
    eps: float,
) -> None:
    """One param's update by multi_lars and lars_multi_mp_sgd_mom_update, in place."""
    w, g = ws[i], gs[i]
    local = lr
    if adapt:
        wn, gn = _norm(w), _norm(g)
        if wn > 0 and gn > 0:
            local = lr * eta * wn / (gn + wd_i * wn + eps)
    moms[i] = m * moms[i] - local * wd_i * w - local * g
    ws[i] = w + moms[i]


def nvidia_mxnet_lars_chunked(
    params: Arrays,
    grads: Sequence[Arrays],
    lrs: Sequence[float],
    *,
    adapt,
    decay,
    dtypes: Sequence[str],
    aggregate_num: int,
    wd: float,
    momentum: float,
    eta: float = 0.001,
    eps: float = 0.0,
) -> Arrays:
    """The same update as MXNet runs it: ``Updater.__call__`` (apache/mxnet,
    python/mxnet/optimizer/optimizer.py, with aggregation) groups a step's params by
    ``dtypes``, in the order each dtype first appears, and calls the optimizer on
    ``aggregate_num`` params at a time; each call is one ``SGDwFASTLARS._update_impl``,
    whose ``_get_lrs`` sets ``last_lr`` to the previous call's ``cur_lr`` (the first call
    of all: to this one's) before ``cur_lr`` takes the step's rate, and whose momentum is
    ``m * cur_lr / last_lr``. The first call of a step sees the rate change; the others
    see their own step's rate twice and take plain ``m`` on the lr-scaled buffer."""
    ws, moms = [p.copy() for p in params], [np.zeros_like(p) for p in params]
    by_dtype: dict[str, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        by_dtype.setdefault(dtype, []).append(i)
    calls = [
        ids[k : k + aggregate_num] for ids in by_dtype.values() for k in range(0, len(ids), aggregate_num)
    ]
    last_lr = cur_lr = None
    for lr, gs in zip(lrs, grads):
        for call in calls:
            if cur_lr is not None:
                last_lr = cur_lr
            if cur_lr is None:
                last_lr = lr
            cur_lr = lr
            m = momentum * cur_lr / last_lr
            for i in call:
                _mxnet_lars_update(ws, moms, gs, i, lr, m, adapt[i], wd if decay[i] else 0.0, eta, eps)
    return ws


def _torch_sgd(
    w: np.ndarray, d: np.ndarray, buf: np.ndarray | None, lr: float, momentum: float, nesterov: bool
) -> tuple[np.ndarray, np.ndarray]:
    """torch/optim/sgd.py, _single_tensor_sgd with dampening 0 and no weight decay: the
    first buffer is the direction itself, then ``buf = m * buf + d``; ``w -= lr * buf``
    (nesterov: ``lr * (d + m * buf)``)."""
    buf = d.copy() if buf is None else momentum * buf + d
    return w - lr * (d + momentum * buf if nesterov else buf), buf


def apex_larc_sgd(
    params: Arrays,
    grads: Sequence[Arrays],
    lrs: Sequence[float],
    *,
    adapt,
    decay,
    wd: float,
    momentum: float,
    eta: float = 0.02,
    eps: float = 1e-8,
    clip: bool = True,
    nesterov: bool = False,
) -> Arrays:
    """NVIDIA/apex, apex/parallel/LARC.py, LARC.step, around torch.optim.SGD: where both
    norms are nonzero the gradient becomes ``(g + wd * w) * a`` with ``a = eta * ||w|| /
    (||g|| + ||w|| * wd + eps)``, clipped to ``min(a / lr, 1)``; elsewhere it is left as
    it is (no decay); then SGD without weight decay (LARC zeroes it for the inner step)."""
    ws, bufs = [p.copy() for p in params], [None] * len(params)
    for lr, gs in zip(lrs, grads):
        for i, g in enumerate(gs):
            w, wd_i = ws[i], wd if decay[i] else 0.0
            wn, gn = _norm(w), _norm(g)
            assert adapt[i], "LARC adapts every param it is given"
            d = g
            if wn != 0 and gn != 0:
                a = eta * wn / (gn + wn * wd_i + eps)
                if clip:
                    a = min(a / lr, 1.0)
                d = (g + wd_i * w) * a
            ws[i], bufs[i] = _torch_sgd(w, d, bufs[i], lr, momentum, nesterov)
    return ws


def timm_lars(
    params: Arrays,
    grads: Sequence[Arrays],
    lrs: Sequence[float],
    *,
    adapt,
    decay,
    wd: float,
    momentum: float,
    eta: float = 0.001,
    eps: float = 1e-8,
    trust_clip: bool = False,
    nesterov: bool = False,
) -> Arrays:
    """huggingface/pytorch-image-models, timm/optim/lars.py, Lars.step: a group with
    weight decay (timm's param groups give biases and ndim <= 1 params none) is adapted:
    ``d = (g + wd * w) * ratio``, ``ratio = eta * ||w|| / (||g|| + ||w|| * wd + eps)``,
    1 at a zero norm, then ``min(ratio / lr, 1)`` with trust_clip (the fallback too);
    then SGD's momentum with the rate outside the buffer."""
    ws, bufs = [p.copy() for p in params], [None] * len(params)
    for lr, gs in zip(lrs, grads):
        for i, g in enumerate(gs):
            w, wd_i = ws[i], wd if decay[i] else 0.0
            d = g
            if wd_i != 0:
                wn, gn = _norm(w), _norm(g)
                ratio = eta * wn / (gn + wn * wd_i + eps) if wn > 0 and gn > 0 else 1.0
                if trust_clip:
                    ratio = min(ratio / lr, 1.0)
                d = (g + wd_i * w) * ratio
            ws[i], bufs[i] = _torch_sgd(w, d, bufs[i], lr, momentum, nesterov)
    return ws


def optax_lars(
    params: Arrays,
    grads: Sequence[Arrays],
    lrs: Sequence[float],
    *,
    adapt,
    decay,
    wd: float,
    momentum: float,
    eta: float = 0.001,
    eps: float = 0.0,
    nesterov: bool = False,
) -> Arrays:
    """google-deepmind/optax, optax/_src/alias.py, lars: a chain of four transformations
    on each leaf. add_decayed_weights (where the weight-decay mask holds) makes the
    update ``u = g + wd * w``; scale_by_trust_ratio (optax/_src/transform.py, where the
    trust-ratio mask holds) multiplies it by ``eta * ||w|| / (||u|| + eps)``, or by 1
    when ``||w||`` or ``||u||`` is 0; scale_by_learning_rate multiplies by ``-lr``; trace
    keeps ``t = u + m * t`` and passes on ``t`` (nesterov: ``u + m * t`` with the new
    ``t``), which is added to the params."""
    ws, traces = [p.copy() for p in params], [np.zeros_like(p) for p in params]
    for lr, gs in zip(lrs, grads):
        for i, g in enumerate(gs):
            w = ws[i]
            u = g + wd * w if decay[i] else g.copy()
            if adapt[i]:
                wn, un = _norm(w), _norm(u)
                u = u * (eta * wn / (un + eps) if wn != 0 and un != 0 else 1.0)
            u = -lr * u
            traces[i] = u + momentum * traces[i]
            ws[i] = w + (u + momentum * traces[i] if nesterov else traces[i])
    return ws


def _lamb_ratio(w: np.ndarray, u: np.ndarray) -> float:
    wn, un = _norm(w), _norm(u)
    return wn / un if wn > 0 and un > 0 else 1.0


def lamb_authors(
    params: Arrays,
    grads: Sequence[Arrays],
    lrs: Sequence[float],
    *,
    adapt,
    decay,
    wd: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    clip_norm: float = 1.0,
) -> Arrays:
    """fastalgo/imagenet_resnet50_lamb, optimization.py: create_optimizer clips all
    gradients to global norm ``clip_norm`` (``g * c / max(||g||, c)``);
    LAMBOptimizer.apply_gradients keeps Adam's moments without bias correction, ``u = m
    / (sqrt(v) + eps)``, and where weight decay applies ``u += wd * w`` and the ratio
    ``||w|| / ||u||`` (1 at a zero norm); elsewhere ratio 1. ``w -= ratio * lr * u``."""
    ws = [p.copy() for p in params]
    ms, vs = [np.zeros_like(p) for p in params], [np.zeros_like(p) for p in params]
    for lr, gs in zip(lrs, grads):
        total = _norm(np.concatenate([g.ravel() for g in gs]))
        gs = [g * clip_norm / max(total, clip_norm) for g in gs]
        for i, g in enumerate(gs):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            u = ms[i] / (np.sqrt(vs[i]) + eps)
            ratio = 1.0
            if decay[i] and adapt[i]:
                u = u + wd * ws[i]
                ratio = _lamb_ratio(ws[i], u)
            ws[i] = ws[i] - ratio * lr * u
    return ws


def _bias_corrected(m: np.ndarray, v: np.ndarray, t: int, b1: float, b2: float, eps: float) -> np.ndarray:
    return (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)


def apex_fused_lamb(
    params: Arrays,
    grads: Sequence[Arrays],
    lrs: Sequence[float],
    *,
    adapt,
    decay,
    wd: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    max_grad_norm: float = 1.0,
    adam_w_mode: bool = True,
    grad_averaging: bool = True,
    use_nvlamb: bool = False,
) -> Arrays:
    """NVIDIA/apex, apex/optimizers/fused_lamb.py FusedLAMB.step and
    csrc/multi_tensor_lamb.cu, LAMBStage1Functor and LAMBStage2Functor: one global norm
    ``G`` over every grad, ``g / (G / max_grad_norm)`` above the threshold; stage 1, in
    AdamW mode ``u = m_hat / (sqrt(v_hat) + eps) + wd * w``, in L2 mode ``g + wd * w``
    into the moments and no decay in u; ``m = b1 * m + b3 * g`` with ``b3 = 1 - b1``, or
    1 without grad averaging; stage 2 the ratio ``||w|| / ||u||`` only where the decay
    is nonzero, or everywhere with use_nvlamb (1 at a zero norm); ``w -= lr * ratio * u``.
    (timm/optim/lamb.py, Lamb.step, takes the same steps at its defaults.) ``adapt`` is
    not read: the decay decides."""
    ws = [p.copy() for p in params]
    ms, vs = [np.zeros_like(p) for p in params], [np.zeros_like(p) for p in params]
    for t, (lr, gs) in enumerate(zip(lrs, grads), start=1):
        total = _norm(np.concatenate([g.ravel() for g in gs]))
        clip = total / max_grad_norm if total > max_grad_norm else 1.0
        for i, g in enumerate(gs):
            g = g / clip
            wd_i = wd if decay[i] else 0.0
            if not adam_w_mode:
                g = g + wd_i * ws[i]
            ms[i] = b1 * ms[i] + ((1 - b1) if grad_averaging else 1.0) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            u = _bias_corrected(ms[i], vs[i], t, b1, b2, eps) + (wd_i * ws[i] if adam_w_mode else 0.0)
            ratio = _lamb_ratio(ws[i], u) if wd_i != 0 or use_nvlamb else 1.0
            ws[i] = ws[i] - lr * ratio * u
    return ws


def tfa_lamb(
    params: Arrays,
    grads: Sequence[Arrays],
    lrs: Sequence[float],
    *,
    adapt,
    decay,
    wd: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
) -> Arrays:
    """tensorflow/addons, tensorflow_addons/optimizers/lamb.py, LAMB._resource_apply_dense:
    bias-corrected moments, ``u = m_hat / (sqrt(v_hat) + eps)``, ``u += wd * w`` unless
    excluded from weight decay, the ratio ``||w|| / ||u||`` (1 at a zero norm) unless
    excluded from layer adaptation; ``w -= ratio * lr * u``."""
    ws = [p.copy() for p in params]
    ms, vs = [np.zeros_like(p) for p in params], [np.zeros_like(p) for p in params]
    for t, (lr, gs) in enumerate(zip(lrs, grads), start=1):
        for i, g in enumerate(gs):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            u = _bias_corrected(ms[i], vs[i], t, b1, b2, eps)
            if decay[i]:
                u = u + wd * ws[i]
            ratio = _lamb_ratio(ws[i], u) if adapt[i] else 1.0
            ws[i] = ws[i] - ratio * lr * u
    return ws


def goyal_corrected_momentum(
    params: Arrays, grads: Sequence[Arrays], lrs: Sequence[float], *, wd: float, momentum: float
) -> Arrays:
    """Goyal et al. 2017 (arXiv 1706.02677), §3, Remark 2: the buffer of eq. (10) holds
    lr-scaled steps, ``v = m * v + lr * (g + wd * w); w -= v``, and after a change of rate
    it takes the momentum correction ``m * lr_t / lr_(t-1)`` on ``v``."""
    ws, vs = [p.copy() for p in params], [np.zeros_like(p) for p in params]
    for lr, m, gs in zip(lrs, _corrected(momentum, lrs), grads):
        for i, g in enumerate(gs):
            vs[i] = m * vs[i] + lr * (g + wd * ws[i])
            ws[i] = ws[i] - vs[i]
    return ws
