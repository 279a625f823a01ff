"""LAMB for torch: the optimizer, its functional and the four paths of its update."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from largebatch.lars.spec import LAMB_SPEC, LambHyperparams, as_flag
from largebatch.lars.torch import _compiled, _sharded, _step
from largebatch.lars.torch._base import LayerwiseOptimizer
from largebatch.lars.torch._common import norm, safe_ratio, stacked_norms, unscaled, weights, write_back
from largebatch.lars.torch._group import Bodies, GroupStep

Number = float | Tensor  # a float, or a 0-dim tensor in a compiled body
Norm = Callable[[Tensor], Tensor]


def lamb(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    masters: list[Tensor | None],
    state_steps: list[Tensor],
    *,
    foreach: bool | None = None,
    fused: bool | None = None,
    compiled: bool | None = None,
    grad_scale: Tensor | None = None,
    found_inf: Tensor | None = None,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    trust_ratio: bool,
    adam_w_mode: bool = True,
    grad_averaging: bool = True,
    adapt_without_decay: bool = True,
    freeze_step: int | None = None,
    maximize: bool = False,
) -> None:
    """Functional LAMB on one group (see :class:`LAMB`); updates its arguments in place.

    Every grad is divided by ``grad_scale`` first (the GradScaler scale, times the global
    clipping divisor ``max(1, ||all grads|| / max_grad_norm)`` when the caller clips) and
    is never written; a nonzero ``found_inf`` makes the step a no-op.
    ``foreach``/``fused``/``compiled`` pick the path, as in :class:`LAMB`; ``maximize``
    ascends.
    """
    hyper = LAMB_SPEC.from_arguments(locals())
    group = GroupStep(
        params=params,
        grads=grads,
        state={"exp_avg": exp_avgs, "exp_avg_sq": exp_avg_sqs},
        masters=masters,
        steps=state_steps,
        lr=lr,
        hyper=hyper,
        maximize=bool(as_flag("maximize", maximize)),
    )
    _step.run_functional(
        LAMB_SPEC,
        BODIES,
        group,
        foreach=foreach,
        fused=fused,
        compiled=compiled,
        grad_scale=grad_scale,
        found_inf=found_inf,
    )


def lamb_ratio(w_norm: Tensor, u_norm: Tensor) -> Tensor:
    """The LAMB trust ratio ``||w|| / ||u||`` (1 where either is zero)."""
    return safe_ratio(w_norm, u_norm, w_norm, u_norm)


def frozen(step: Tensor, freeze_step: int | None) -> bool:
    """Whether v stays as it is at the step count ``t`` (``t > freeze_step``)."""
    return freeze_step is not None and float(step) > freeze_step


def bias_corrections(
    step: Tensor,
    betas: tuple[float, float],
    bias_correction: bool,
    freeze_step: int | None = None,
    on_device: bool = False,
) -> tuple[Any, Any]:
    """``(1 - b1^t, 1 - b2^t')`` at the step count ``t``, ``t' = min(t, freeze_step)``
    (ones without bias correction): floats, the count read on the host; with
    ``on_device``, 0-dim fp64 tensors beside the count, nothing read."""
    if not bias_correction:
        return 1.0, 1.0
    t: Any = step.double() if on_device else float(step)
    if freeze_step:
        t_v = t.clamp(max=freeze_step) if on_device else min(t, freeze_step)
    else:
        t_v = t
    return 1.0 - betas[0] ** t, 1.0 - betas[1] ** t_v


def lamb_direction(
    w: Tensor,
    m: Tensor,
    v: Tensor,
    eps: Number,
    weight_decay: Number,
    bc1: Number,
    bc2: Number,
    differentiable: bool = False,
) -> Tensor:
    """u = (m / bc1) / (sqrt(v / bc2) + eps) + wd * w, a new tensor (``differentiable``:
    formed out of place, for autograd, whose square root keeps its result; the same
    values)."""
    if differentiable:
        u = (m / bc1) / ((v / bc2).sqrt() + eps)
    else:
        u = (m / bc1).div_((v / bc2).sqrt_().add_(eps))
    if isinstance(weight_decay, Tensor) or weight_decay != 0:
        u.add_(w * weight_decay)
    return u


def _lamb_one(
    *,
    p: Tensor,
    grad: Tensor,
    m: Tensor,
    v: Tensor,
    master: Tensor | None,
    grad_scale: Tensor | None,
    lr: Number,
    b1: Number,
    b2: Number,
    eps: Number,
    weight_decay: Number,
    bc1: Number,
    bc2: Number,
    trust_ratio: bool,
    adam_w_mode: bool = True,
    grad_averaging: bool = True,
    freeze: bool = False,
    maximize: bool = False,
    differentiable: bool = False,
    norm: Norm = norm,
    plain_norm: Norm = norm,
) -> tuple[Tensor | float, Tensor | None]:
    """LAMB on one tensor at the bias corrections ``bc1``, ``bc2`` (``weight_decay``
    already the applied one); ``freeze``: v stays as it is. The numbers are floats, or
    0-dim tensors when this body runs compiled. Returns the trust ratio it applied and
    ``||u||`` (None without trust ratio). ``maximize``: ``-grad`` enters (torch's Adam);
    ``differentiable``: nothing autograd keeps is written in place (the weights are read
    from a copy, u is formed and scaled out of place).

    ``norm`` never overflows. ``plain_norm`` (for ``||u||``, which a compiled body then
    forms in the same pass as ``||w||``) may: an infinite ``||u||`` gives ratio 0 and
    leaves ``w`` as it was, for :func:`_lamb_after_overflow` to finish."""
    w = p if master is None else master
    g = unscaled(grad, w, grad_scale)
    if maximize:
        g = -g
    src = w.clone() if differentiable else w  # what the step reads of w
    if not adam_w_mode:  # L2: the decay enters the moments, not u
        g = g + weight_decay * src
    m.mul_(b1).add_(g * (1.0 - b1) if grad_averaging else g)
    if not freeze:
        v.mul_(b2).add_(g * g * (1.0 - b2))
    u = lamb_direction(src, m, v, eps, weight_decay if adam_w_mode else 0.0, bc1, bc2, differentiable)
    u_norm = None
    ratio: Tensor | float
    if trust_ratio:
        w_norm, u_norm = norm(src), plain_norm(u)
        ratio = lamb_ratio(w_norm, u_norm)
    else:
        ratio = 1.0
    w.sub_(u * (lr * ratio) if differentiable else u.mul_(lr * ratio))
    if master is not None:
        p.copy_(master)
    return ratio, u_norm


def _lamb_after_overflow(
    p: Tensor,
    m: Tensor,
    v: Tensor,
    master: Tensor | None,
    lr: Number,
    eps: Number,
    weight_decay: Number,
    bc1: Number,
    bc2: Number,
) -> None:
    # ``weight_decay`` is the one in u: 0 in L2 mode.
    """The update of a tensor whose ``||u||`` overflowed an fp32 sum of squares (finite u,
    ``||u|| > ~1.8e19``: huge weights times weight decay) in the compiled body, which left
    ``w`` unchanged: u again from the new moments, its norm by :func:`norm`."""
    w = p if master is None else master
    u = lamb_direction(w, m, v, eps, weight_decay, bc1, bc2)
    w.sub_(u.mul_(lr * lamb_ratio(norm(w), norm(u))))
    if master is not None:
        p.copy_(master)


def _numbers(group: GroupStep) -> dict[str, Any]:
    """The numbers ``_lamb_one`` takes, by its keywords."""
    h = group.hyper
    assert isinstance(h, LambHyperparams)
    return dict(lr=group.lr, b1=h.betas[0], b2=h.betas[1], eps=h.eps, weight_decay=h.weight_decay)


def _flags(group: GroupStep) -> dict[str, Any]:
    """The flags ``_lamb_one`` takes but ``freeze`` (each set compiles its own graph)."""
    h = group.hyper
    assert isinstance(h, LambHyperparams)
    return dict(
        trust_ratio=h.adapts,
        adam_w_mode=h.adam_w_mode,
        grad_averaging=h.grad_averaging,
        maximize=group.maximize,
        differentiable=group.differentiable,
    )


def _counted(h: LambHyperparams, step: Tensor) -> tuple[float, float, bool]:
    """A tensor's step counted: its bias corrections and whether its v is frozen."""
    step.add_(1)
    bc1, bc2 = bias_corrections(step, h.betas, h.bias_correction, h.freeze_step)
    return bc1, bc2, frozen(step, h.freeze_step)


def _single_tensor_lamb(
    group: GroupStep, grad_scale: Tensor | None, reduce: _sharded.Reducer | None, compiled: bool = False
) -> None:
    h = group.hyper
    assert isinstance(h, LambHyperparams)
    flags, numbers = _flags(group), _numbers(group)
    compiled_numbers = dict(zip(numbers, _compiled.as_tensors(*numbers.values()))) if compiled else {}
    # One compiled body per value of the per-tensor freeze flag (each compiles on first use).
    bodies = (
        {
            f: _compiled.compiled_body(_lamb_one, tuple(sorted({**flags, "freeze": f}.items())))
            for f in (False, True)
        }
        if compiled
        else {}
    )
    lists = zip(
        group.params,
        group.grads,
        group.state["exp_avg"],
        group.state["exp_avg_sq"],
        group.masters,
        group.steps,
    )
    for i, (p, grad, m, v, master, step) in enumerate(lists):
        bc1, bc2, freeze = _counted(h, step)
        chosen, tensors = _compiled.pick_body(
            _lamb_one, bodies.get(freeze), dict(p=p, grad=grad, m=m, v=v, master=master)
        )
        if reduce is not None:  # a sharded param: norms summed over its shards
            sharded_norm = reduce.norm_of(i)
            _lamb_one(
                **tensors,
                grad_scale=grad_scale,
                **numbers,
                bc1=bc1,
                bc2=bc2,
                **flags,
                freeze=freeze,
                norm=sharded_norm,
                plain_norm=sharded_norm,
            )
        elif chosen is _lamb_one:
            chosen(**tensors, grad_scale=grad_scale, **numbers, bc1=bc1, bc2=bc2, **flags, freeze=freeze)
        else:
            bc1_t, bc2_t = _compiled.as_tensors(bc1, bc2)
            _, u_norm = chosen(
                **tensors,
                grad_scale=grad_scale,
                **compiled_numbers,
                bc1=bc1_t,
                bc2=bc2_t,
                **flags,
                freeze=freeze,
                **_compiled.COMPILED_NORMS,
            )
            if u_norm is not None and bool(torch.isinf(u_norm)):  # not NaN: non-finite grads
                u_decay = h.weight_decay if h.adam_w_mode else 0.0
                _lamb_after_overflow(p, m, v, master, numbers["lr"], h.eps, u_decay, bc1, bc2)


def _one_tensor_lamb(group: GroupStep, grad_scale: Tensor | None, norm: Callable[[Tensor], Tensor]) -> Tensor:
    # Nothing read on the host: the bias corrections are tensors beside the count, and a
    # frozen v (past freeze_step) is settled by a second run on copies.
    h = group.hyper
    assert isinstance(h, LambHyperparams)
    step = group.steps[0].add_(1)
    bc1, bc2 = bias_corrections(step, h.betas, h.bias_correction, h.freeze_step, on_device=True)

    def ratio_of(freeze: bool, copy: bool) -> Tensor:
        p, m, v = group.params[0], group.state["exp_avg"][0], group.state["exp_avg_sq"][0]
        if copy:
            p, m, v = p.clone(), m.clone(), v.clone()
        ratio, _ = _lamb_one(
            p=p,
            grad=group.grads[0],
            m=m,
            v=v,
            master=group.masters[0],
            grad_scale=grad_scale,
            **_numbers(group),
            bc1=bc1,
            bc2=bc2,
            **_flags(group),
            freeze=freeze,
            norm=norm,
            plain_norm=norm,
        )
        return ratio if isinstance(ratio, Tensor) else torch.ones((), device=p.device)

    if h.freeze_step is None:
        return ratio_of(False, copy=False)
    frozen_ratio, ratio = ratio_of(True, copy=True), ratio_of(False, copy=False)
    past = step > h.freeze_step  # beside the count: on the CPU off the fused path
    past = past if past.device == ratio.device else past.to(ratio.device, non_blocking=True)
    return torch.where(past, frozen_ratio, ratio)


def _foreach_lamb(group: GroupStep, grad_scale: Tensor | None, reduce: _sharded.Reducer | None) -> None:
    h = group.hyper
    assert isinstance(h, LambHyperparams)
    params, grads, masters, state_steps, lr = group.params, group.grads, group.masters, group.steps, group.lr
    exp_avgs, exp_avg_sqs = group.state["exp_avg"], group.state["exp_avg_sq"]
    if not params:
        return
    betas, eps, wd, freeze_step, adam_w_mode = h.betas, h.eps, h.weight_decay, h.freeze_step, h.adam_w_mode
    b1, b2 = betas
    ws = weights(params, masters)
    gs: list[Tensor] | tuple[Tensor, ...] = [unscaled(g, w, None) for g, w in zip(grads, ws)]
    if grad_scale is not None:
        gs = torch._foreach_div(gs, grad_scale)
    if group.maximize:
        gs = torch._foreach_neg(gs)
    if not adam_w_mode and wd != 0:  # L2: the decay enters the moments, not u
        gs = torch._foreach_add(gs, ws, alpha=wd)
    torch._foreach_add_(state_steps, 1)
    torch._foreach_mul_(exp_avgs, b1)
    torch._foreach_add_(exp_avgs, gs, alpha=1.0 - b1 if h.grad_averaging else 1.0)
    # Each param's own count: params that start late (frozen, then trained) have fewer,
    # and their v may still change when the others' is frozen.
    if freeze_step is None:
        vs, g_vs = exp_avg_sqs, gs
    else:
        live = [i for i, s in enumerate(state_steps) if not frozen(s, freeze_step)]
        vs, g_vs = [exp_avg_sqs[i] for i in live], [gs[i] for i in live]
    if vs:
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, g_vs, g_vs, value=1.0 - b2)
    bc1s, bc2s = zip(*(bias_corrections(s, betas, h.bias_correction, freeze_step) for s in state_steps))
    denom = torch._foreach_div(exp_avg_sqs, list(bc2s))
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    us = torch._foreach_div(exp_avgs, list(bc1s))
    torch._foreach_div_(us, denom)
    if wd != 0 and adam_w_mode:
        torch._foreach_add_(us, ws, alpha=wd)
    if h.adapts:
        norms = stacked_norms if reduce is None else reduce.norms
        coefs = (lamb_ratio(norms(ws), norms(us)) * lr).unbind()
        torch._foreach_mul_(us, coefs)
    else:
        torch._foreach_mul_(us, lr)
    torch._foreach_sub_(ws, us)
    write_back(params, masters)


# The unfused paths, for _step.run (the fused one is the kernels).
BODIES = Bodies(
    single_tensor=_single_tensor_lamb,
    foreach=_foreach_lamb,
    compiled=_compiled.compiled_path(_single_tensor_lamb, _foreach_lamb),
    one_tensor=_one_tensor_lamb,
)


class LAMB(LayerwiseOptimizer):
    r"""LAMB: Adam moments with a layer-wise trust ratio (You et al. 2019, Algorithm 2).

    For each tensor ``w`` with gradient ``g`` (unscaled) at step ``t`` = 1, 2, ...::

        g = g / max(1, ||all grads|| / max_grad_norm)      (only when max_grad_norm is set)
        m = b1 * m + (1 - b1) * g          v = b2 * v + (1 - b2) * g^2  (t > freeze_step: v kept)
        r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t')) + eps)   (t' = min(t, freeze_step);
                                           bias_correction=False: no 1 - b^t)
        u = r + wd * w
        ratio = ||w|| / ||u||              (ratio = 1 if ||w|| == 0 or ||u|| == 0)
        w = w - lr_t * ratio * u

    The variant: phi is the identity, no trust-ratio bounds, eps outside the square
    root, and the weight decay inside ``u``, so it enters the trust ratio's denominator
    ``||u||``. With the defaults it equals ``optax.lamb``. timm's ``Lamb`` is the same
    rule but clips gradients by default (``max_grad_norm=1.0``) and adapts only groups
    with weight decay; NVIDIA apex's ``FusedLAMB`` also clips at a hidden
    ``max_grad_norm=1.0``. Here clipping is off unless asked for, and the global norm
    spans every group. A group with ``trust_ratio=False`` gets ratio 1 and its own weight
    decay (``param_groups`` gives it none: Adam with bias correction).

    The hyperparameters, their defaults and valid values are ``largebatch.lars.spec.LAMB_SPEC``.

    Args:
        params: params or param groups. Group keys: ``lr``, ``betas``, ``eps``,
            ``weight_decay``, ``bias_correction``, ``trust_ratio``, ``adam_w_mode``,
            ``grad_averaging``, ``adapt_without_decay``, ``freeze_step``,
            ``master_weights``, ``maximize``.
        lr: the global learning rate (a float or a one-element Tensor).
        betas: the moments' decay rates ``(b1, b2)``, each in [0, 1).
        eps: At least 0; added to ``sqrt(v_hat)``.
        weight_decay: ``wd`` >= 0, decoupled (added to the Adam direction).
        bias_correction: divide the moments by ``1 - b^t``.
        trust_ratio: adapt the group; False gives ratio 1 (weight decay still applies).
        adam_w_mode: ``True``: ``u = r + wd * w``; ``False``: L2, ``g + wd * w`` enters
            the moments and ``u = r`` (apex ``FusedLAMB(adam_w_mode=False)``).
        grad_averaging: ``True``: ``m = b1 * m + (1 - b1) * g``; ``False``: ``m = b1 * m
            + g`` (apex ``FusedLAMB``, timm ``Lamb``).
        adapt_without_decay: ``True``: the trust ratio wherever ``trust_ratio`` says;
            ``False``: only in groups whose ``weight_decay`` is nonzero (apex ``FusedLAMB``
            without ``use_nvlamb``, timm ``Lamb`` without ``always_adapt``).
        freeze_step: None, or a whole number >= 1: after step ``t = freeze_step`` of a
            param, its ``v`` and ``v``'s bias correction ``1 - b2^freeze_step`` stay as
            they are (the frozen variance of 1-bit LAMB, Li et al. 2021, and 1-bit Adam,
            Tang et al. 2021), while ``m`` goes on. For gradients that arrive sparse in
            time, as AdaComp's (an element sent once every ``k`` steps comes ``k`` times
            larger and would inflate ``v`` about ``k``-fold): freeze at the end of the
            uncompressed warm-up (docs/communication.md).
        max_grad_norm: optimizer-wide global gradient clipping (> 0) or None.
        partitioned: this optimizer holds only some of the model's params and the other
            ranks of the default process group hold the rest, as each rank's optimizer
            under ``torch.distributed.optim.ZeroRedundancyOptimizer``: the global gradient
            norm of ``max_grad_norm`` then sums the squares over every rank (a collective
            in each step, so every rank must step). Not needed for sharded (FSDP2)
            params, whose norms are always summed over their shards.
        master_weights: as in :class:`LARS`.
        foreach: as in :class:`LARS`.
        fused: as in :class:`LARS`.
        compiled: as in :class:`LARS`.
        maximize: as in :class:`LARS` (``-grad`` enters the moments, as in torch's
            ``Adam(maximize=True)``).
        differentiable: as in :class:`LARS`.
        capturable: as in :class:`LARS`.

    References:
        You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
        minutes", https://arxiv.org/abs/1904.00962.
        Li et al. 2021, "1-bit LAMB: Communication Efficient Large-Scale Large-Batch
        Training with LAMB's Convergence Speed", https://arxiv.org/abs/2104.06069.
        Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training
        with Adam's Convergence Speed", https://arxiv.org/abs/2102.02888.
    """

    spec = LAMB_SPEC
    bodies = BODIES
    _extra_state = ("_applied", "max_grad_norm", "partitioned")

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 0.001,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        trust_ratio: bool = True,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        adapt_without_decay: bool = True,
        freeze_step: int | None = None,
        max_grad_norm: float | None = None,
        partitioned: bool = False,
        master_weights: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        compiled: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        capturable: bool = False,
    ) -> None:
        LAMB_SPEC.check({"max_grad_norm": max_grad_norm})
        self.max_grad_norm = max_grad_norm
        self.partitioned = as_flag("partitioned", partitioned)
        if self.partitioned:
            _sharded.check_default_group("partitioned=True")
        hyper = LAMB_SPEC.from_arguments(locals())
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

    def _clip_divisor(
        self, grads: list[Tensor], grad_scale: Tensor | None, on_device: bool = False
    ) -> Tensor | None:
        """The global clipping divisor ``max(1, ||unscaled grads|| / max_grad_norm)``
        (``on_device``: its norms read nothing on the host)."""
        if self.max_grad_norm is None or not (grads or self.partitioned):
            return None
        (grads,), reducer = _sharded.local((grads,))
        if self.partitioned:  # the other ranks hold the other params' grads
            if reducer is not None:
                raise ValueError(
                    "partitioned=True is for whole params (ZeroRedundancyOptimizer); "
                    "sharded (DTensor) params need no option"
                )
            total = _sharded.partitioned_norm(grads, self._device(), on_device=on_device)
        elif reducer is None:
            total = torch.linalg.vector_norm(stacked_norms(grads, on_device=on_device))
        else:
            total = torch.linalg.vector_norm(reducer.norms(grads, on_device=on_device))
        if grad_scale is not None:
            total = total / (grad_scale if grad_scale.device == total.device else grad_scale.to(total.device))
        return torch.clamp(total / self.max_grad_norm, min=1.0)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("partitioned", False)

    def _fused_reductions(self, reducer: _sharded.Reducer | None) -> dict[str, Any]:
        if self.partitioned:
            return {"reduce_global": _sharded.sum_over((None,))}  # None: the default group
        return super()._fused_reductions(reducer)

    def _grad_scale(
        self, grads: list[Tensor], grad_scale: Tensor | None, on_device: bool = False
    ) -> Tensor | None:
        divisor = self._clip_divisor(grads, grad_scale, on_device)
        if grad_scale is not None:
            divisor = grad_scale if divisor is None else divisor * grad_scale
        return divisor
