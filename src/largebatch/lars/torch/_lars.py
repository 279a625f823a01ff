"""LARS for torch: the optimizer, its functional and the four paths of its update."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from largebatch.lars.spec import LARS_SPEC, LarsHyperparams, as_flag
from largebatch.lars.torch import _compiled, _sharded, _step
from largebatch.lars.torch._base import LayerwiseOptimizer
from largebatch.lars.torch._common import norm, safe_ratio, stacked_norms, unscaled, weights, write_back
from largebatch.lars.torch._group import Bodies, GroupStep

Number = float | Tensor  # a float, or a 0-dim tensor in a compiled body
Norm = Callable[[Tensor], Tensor]


def lars(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    masters: list[Tensor | None],
    state_steps: list[Tensor],
    *,
    foreach: bool | None = None,
    fused: bool | None = None,
    compiled: bool | None = None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    lr: float | Tensor,
    momentum: float,
    weight_decay: float,
    trust_coefficient: float,
    eps: float,
    nesterov: bool,
    trust_clip: bool,
    trust_ratio: bool,
    lr_in_momentum: bool = True,
    zero_norm_skip: bool = False,
    decayed_norm: bool = False,
    maximize: bool = False,
) -> None:
    """Functional LARS on one group (see :class:`LARS`); updates its arguments in place.

    ``masters[i]`` is the fp32 master of ``params[i]`` or None; every grad is divided by
    ``grad_scale`` (the GradScaler scale) first and is never written; a nonzero
    ``found_inf`` makes the step a no-op. ``foreach``/``fused``/``compiled`` pick the
    path, as in :class:`LARS` (``largebatch.lars.torch._paths``); ``maximize`` ascends.
    """
    hyper = LARS_SPEC.from_arguments(locals())
    group = GroupStep(
        params=params,
        grads=grads,
        state={"momentum_buffer": momentum_buffers},
        masters=masters,
        steps=state_steps,
        lr=lr,
        hyper=hyper,
        maximize=bool(as_flag("maximize", maximize)),
    )
    _step.run_functional(
        LARS_SPEC,
        BODIES,
        group,
        foreach=foreach,
        fused=fused,
        compiled=compiled,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


def lars_ratio(
    w_norm: Tensor,
    g_norm: Tensor,
    *,
    lr: Any,
    weight_decay: Any,
    trust_coefficient: Any,
    eps: Any,
    trust_clip: bool,
    zero_norm_skip: bool = False,
    decayed_norm: bool = False,
) -> Tensor:
    """The LARS trust ratio from ``||w||`` and the unscaled ``||g||`` (tensors of norms);
    with ``decayed_norm``, ``g_norm`` is ``||g + wd * w||`` and the denominator
    ``||g + wd * w|| + eps`` (optax's ``lars``)."""
    denominator = g_norm + eps if decayed_norm else g_norm + weight_decay * w_norm + eps
    ratio = safe_ratio(trust_coefficient * w_norm, denominator, w_norm, g_norm)
    if trust_clip:
        clipped = torch.clamp(ratio / lr, max=1.0)
        ratio = torch.where(nonzero(w_norm, g_norm), clipped, 1.0) if zero_norm_skip else clipped
    return ratio


def nonzero(w_norm: Tensor, g_norm: Tensor) -> Tensor:
    """Where both norms are nonzero: where ``zero_norm_skip`` adapts and decays."""
    return (w_norm > 0) & (g_norm > 0)


def _decay(weight_decay: Any, w_norm: Tensor, g_norm: Tensor, zero_norm_skip: bool) -> Any:
    """The weight decay a tensor takes: none at a zero norm under ``zero_norm_skip``."""
    if not zero_norm_skip:
        return weight_decay
    return weight_decay * nonzero(w_norm, g_norm).to(w_norm.dtype)  # exact: times 0 or 1


def _direction(g: Tensor, w: Tensor, weight_decay: Any) -> Tensor:
    """``d = g + wd * w`` (``g`` itself at a static zero decay; a 0-dim tensor decay is
    never static)."""
    return g + weight_decay * w if isinstance(weight_decay, Tensor) or weight_decay != 0 else g


def _lars_one(
    *,
    p: Tensor,
    grad: Tensor,
    buf: Tensor,
    master: Tensor | None,
    grad_scale: Tensor | None,
    lr: Number,
    momentum: Number,
    weight_decay: Number,
    trust_coefficient: Number,
    eps: Number,
    nesterov: bool,
    trust_clip: bool,
    trust_ratio: bool,
    lr_in_momentum: bool = True,
    zero_norm_skip: bool = False,
    decayed_norm: bool = False,
    maximize: bool = False,
    differentiable: bool = False,
    norm: Norm = norm,
    plain_norm: Norm = norm,
) -> Tensor | None:
    """LARS on one tensor (``weight_decay`` already the applied one); returns the trust
    ratio it applied (None without one). The numbers are floats, or 0-dim tensors when
    this body runs compiled. ``maximize``: the step ascends (``-grad`` enters, as in
    torch's SGD); ``differentiable``: the weights are read from a copy, since autograd
    keeps what the norm read and ``w`` is written in place."""
    del plain_norm  # LARS's norms are all of inputs: ``norm`` serves
    w = p if master is None else master
    g = unscaled(grad, w, grad_scale)
    if maximize:
        g = -g
    src = w.clone() if differentiable else w  # what the step reads of w
    ratio: Tensor | None = None
    d: Tensor | None = None
    if trust_ratio:
        if decayed_norm:  # the norm of the direction itself (optax)
            d = _direction(g, src, weight_decay)
        w_norm, g_norm = norm(src), norm(g if d is None else d)
        ratio = lars_ratio(
            w_norm,
            g_norm,
            lr=lr,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            trust_clip=trust_clip,
            zero_norm_skip=zero_norm_skip,
            decayed_norm=decayed_norm,
        )
        weight_decay = _decay(weight_decay, w_norm, g_norm, zero_norm_skip)
    if d is None:
        d = _direction(g, src, weight_decay)
    if lr_in_momentum:
        scaled = d * (lr * ratio) if ratio is not None else d * lr
    else:
        scaled = d * ratio if ratio is not None else d.clone()
    buf.mul_(momentum).add_(scaled)
    step = scaled.add_(buf * momentum) if nesterov else buf
    w.sub_(step if lr_in_momentum else step * lr)
    if master is not None:
        p.copy_(master)
    return ratio


def _numbers(group: GroupStep) -> dict[str, Any]:
    """The numbers ``_lars_one`` takes, by its keywords."""
    h = group.hyper
    assert isinstance(h, LarsHyperparams)
    return dict(
        lr=group.lr,
        momentum=h.momentum,
        weight_decay=h.weight_decay,
        trust_coefficient=h.trust_coefficient,
        eps=h.eps,
    )


def _flags(group: GroupStep) -> dict[str, Any]:
    """The flags ``_lars_one`` takes, by its keywords (each set compiles its own graph)."""
    h = group.hyper
    assert isinstance(h, LarsHyperparams)
    return dict(
        nesterov=h.nesterov,
        trust_clip=h.trust_clip,
        trust_ratio=h.trust_ratio,
        lr_in_momentum=h.lr_in_momentum,
        zero_norm_skip=h.zero_norm_skip,
        decayed_norm=h.decayed_norm,
        maximize=group.maximize,
        differentiable=group.differentiable,
    )


def _single_tensor_lars(
    group: GroupStep, grad_scale: Tensor | None, reduce: _sharded.Reducer | None, compiled: bool = False
) -> None:
    flags, numbers = _flags(group), _numbers(group)
    body = _compiled.compiled_body(_lars_one, tuple(sorted(flags.items()))) if compiled else None
    compiled_numbers = dict(zip(numbers, _compiled.as_tensors(*numbers.values()))) if compiled else {}
    lists = zip(group.params, group.grads, group.state["momentum_buffer"], group.masters, group.steps)
    for i, (p, grad, buf, master, step) in enumerate(lists):
        chosen, tensors = _compiled.pick_body(_lars_one, body, dict(p=p, grad=grad, buf=buf, master=master))
        if reduce is not None:  # a sharded param: norms summed over its shards
            _lars_one(**tensors, grad_scale=grad_scale, **numbers, **flags, norm=reduce.norm_of(i))
        elif chosen is _lars_one:
            chosen(**tensors, grad_scale=grad_scale, **numbers, **flags)
        else:
            chosen(**tensors, grad_scale=grad_scale, **compiled_numbers, **flags, **_compiled.COMPILED_NORMS)
        step.add_(1)


def _foreach_lars(group: GroupStep, grad_scale: Tensor | None, reduce: _sharded.Reducer | None) -> None:
    h = group.hyper
    assert isinstance(h, LarsHyperparams)
    params, grads, masters, lr = group.params, group.grads, group.masters, group.lr
    momentum_buffers, momentum = group.state["momentum_buffer"], h.momentum
    if not params:
        return
    wd = h.weight_decay
    ws = weights(params, masters)
    gs: list[Tensor] | tuple[Tensor, ...] = [unscaled(g, w, None) for g, w in zip(grads, ws)]
    if grad_scale is not None:
        gs = torch._foreach_div(gs, grad_scale)
    if group.maximize:
        gs = torch._foreach_neg(gs)
    ratios = None
    ds: list[Tensor] | tuple[Tensor, ...] | None = None
    if h.trust_ratio and h.decayed_norm and wd != 0:  # optax: the norm of d = g + wd * w
        ds = torch._foreach_add(gs, ws, alpha=wd)
    if h.trust_ratio:
        norms = stacked_norms if reduce is None else reduce.norms
        w_norms, g_norms = norms(ws), norms(gs if ds is None else ds)
        ratios = lars_ratio(
            w_norms,
            g_norms,
            lr=lr,
            weight_decay=wd,
            trust_coefficient=h.trust_coefficient,
            eps=h.eps,
            trust_clip=h.trust_clip,
            zero_norm_skip=h.zero_norm_skip,
            decayed_norm=h.decayed_norm,
        )
    if ds is None:  # (with decayed_norm, formed above for its norm)
        if wd == 0:
            ds = gs
        elif ratios is not None and h.zero_norm_skip:  # no decay where a norm is zero
            decays = _decay(wd, w_norms, g_norms, True).unbind()
            ds = torch._foreach_add(gs, torch._foreach_mul(ws, decays))
        else:
            ds = torch._foreach_add(gs, ws, alpha=wd)
    inner = lr if h.lr_in_momentum else 1.0
    if ratios is not None:
        scaled = torch._foreach_mul(ds, (ratios * inner).unbind())
    else:
        scaled = torch._foreach_mul(ds, inner)
    torch._foreach_mul_(momentum_buffers, momentum)
    torch._foreach_add_(momentum_buffers, scaled)
    step: list[Tensor] | tuple[Tensor, ...]
    if h.nesterov:
        torch._foreach_add_(scaled, momentum_buffers, alpha=momentum)
        step = scaled
    else:
        step = momentum_buffers
    torch._foreach_sub_(ws, step if h.lr_in_momentum else torch._foreach_mul(step, lr))
    write_back(params, masters)
    torch._foreach_add_(group.steps, 1)


def _one_tensor_lars(group: GroupStep, grad_scale: Tensor | None, norm: Callable[[Tensor], Tensor]) -> Tensor:
    ratio = _lars_one(
        p=group.params[0],
        grad=group.grads[0],
        buf=group.state["momentum_buffer"][0],
        master=group.masters[0],
        grad_scale=grad_scale,
        **_numbers(group),
        **_flags(group),
        norm=norm,
    )
    group.steps[0].add_(1)
    return torch.ones((), device=group.params[0].device) if ratio is None else ratio


# The unfused paths, for _step.run (the fused one is the kernels).
BODIES = Bodies(
    single_tensor=_single_tensor_lars,
    foreach=_foreach_lars,
    compiled=_compiled.compiled_path(_single_tensor_lars, _foreach_lars),
    one_tensor=_one_tensor_lars,
)


class LARS(LayerwiseOptimizer):
    r"""LARS: SGD with momentum and a layer-wise trust ratio (You, Gitman, Ginsburg 2017).

    For each tensor ``w`` with gradient ``g`` (unscaled) and learning rate ``lr_t``::

        ratio = tc * ||w|| / (||g|| + wd * ||w|| + eps)   (ratio = 1 if ||w|| == 0 or ||g|| == 0)
        ratio = min(ratio / lr_t, 1)                       (trust_clip=True: LARC)
        d     = g + wd * w
        v     = momentum * v + lr_t * ratio * d            (v starts at 0)
        w     = w - v             nesterov: w = w - (momentum * v + lr_t * ratio * d)

    The variant, stated because peer libraries differ on each point:

    - **lr inside the momentum buffer** by default, as the MLPerf ResNet-50 TF reference
      and ``optax.lars`` keep it: when ``lr_t`` changes (warmup, decay) the buffer keeps
      the rates at which past gradients were taken. ``lr_in_momentum=False`` keeps it
      outside, ``v = momentum * v + ratio * d; w -= lr_t * v`` (nesterov: ``w -= lr_t *
      (momentum * v + ratio * d)``), as torch's SGD under apex ``LARC``, NVIDIA's MLPerf
      MXNet LARS (Goyal et al.'s momentum correction) and timm's ``Lars`` do; the two
      agree at constant lr.
    - **Denominator** ``||g|| + wd * ||w|| + eps``, as in the paper and timm; ``optax.lars``
      uses ``||g + wd * w|| + eps`` (equal when ``wd = 0``): ``decayed_norm=True``, whose
      zero-norm rule then reads ``||g + wd * w||`` in place of ``||g||``.
    - **Zero-norm rule**: ratio 1 when either norm is zero (fresh zero-initialized
      layers), then the clip and weight decay as elsewhere. ``zero_norm_skip=True`` is
      apex ``LARC``'s rule instead: the gradient passes unchanged (ratio 1, no clip, no
      weight decay).
    - **trust_clip** gives LARC's clipping (apex ``LARC``, timm ``trust_clip``): the local
      rate ``lr_t * ratio`` never exceeds the global one.
    - **Exclusion**: a group with ``trust_ratio=False`` (biases, BatchNorm) gets ratio 1:
      momentum SGD with the group's weight decay. :func:`param_groups` gives it none, as
      MLPerf's reference does; NVIDIA's MLPerf LARS decays the classifier's bias.

    The hyperparameters, their defaults and valid values are ``largebatch.lars.spec.LARS_SPEC``.

    Args:
        params: params or param groups. Group keys: ``lr``, ``weight_decay``,
            ``trust_ratio`` and every keyword below but ``foreach``/``fused``/``compiled``
            and ``differentiable``/``capturable``.
        lr: the global learning rate: a float, or a one-element Tensor (the fused path
            reads an fp32 one on the params' device in place, without a copy).
        momentum: the momentum coefficient, in [0, 1).
        weight_decay: ``wd`` >= 0, inside the trust ratio.
        trust_coefficient: ``tc`` > 0 (0.001 in the paper).
        eps: At least 0; added to the trust-ratio denominator.
        nesterov: Nesterov momentum (needs momentum > 0).
        trust_clip: LARC clipping.
        trust_ratio: adapt the group; False gives ratio 1 (weight decay still applies).
        lr_in_momentum: ``True``: ``v = momentum * v + lr * ratio * d; w -= v``;
            ``False``: ``v = momentum * v + ratio * d; w -= lr * v``.
        zero_norm_skip: where ``||w||`` or ``||g||`` is 0, leave the gradient as it is
            (apex ``LARC``); ``False``: ratio 1, then the clip and weight decay.
        decayed_norm: ``ratio = tc * ||w|| / (||g + wd * w|| + eps)``, 1 where ``||w||`` or
            ``||g + wd * w||`` is 0 (``optax.lars``); not with ``zero_norm_skip``.
        master_weights: keep fp32 master copies of fp16/bf16 params in the state.
        foreach: ``None`` or ``True``: ``torch._foreach_*`` ops; ``False``: a per-tensor loop.
        fused: ``None``: the Triton kernels when every param is on CUDA and triton imports
            (and neither ``foreach`` nor ``compiled`` is True); ``True``: always (CPU
            tensors need ``TRITON_INTERPRET=1``).
        compiled: the per-tensor update through ``torch.compile`` (a norm kernel and one
            fused elementwise kernel per tensor: the fast CPU path). ``None``: for CPU
            models of ``COMPILE_MIN_NUMEL`` (2**20) elements or more; the first step compiles.
        maximize: ascend: the step takes ``-grad`` where it takes ``grad``, then goes on as
            usual (torch's ``SGD(maximize=True)``), on every path.
        differentiable: take the step with autograd on, so that a graph runs through it
            (torch's meaning); the single-tensor path only: ``foreach``, ``fused`` or
            ``compiled`` set True with it is a ValueError.
        capturable: state that the step must be capturable in a CUDA graph: every count
            on the device, nothing read on the host. The fused path only (it always is);
            any other path, as chosen for these params, is a ValueError naming it.

    Examples:
        >>> from largebatch.torch import LARS, param_groups
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = LARS(param_groups(model, weight_decay=5e-5), lr=1.0)
        >>> model(torch.randn(8, 4)).square().mean().backward()
        >>> opt.step()

    References:
        You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks",
        https://arxiv.org/abs/1708.03888.
    """

    spec = LARS_SPEC
    bodies = BODIES

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1.0,
        *,
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
        master_weights: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        compiled: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        capturable: bool = False,
    ) -> None:
        hyper = LARS_SPEC.from_arguments(locals())
        super().__init__(
            params,
            lr,
            hyper,
            master_weights=master_weights,
            foreach=foreach,
            fused=fused,
            compiled=compiled,
            maximize=maximize,
            differentiable=differentiable,
            capturable=capturable,
        )
