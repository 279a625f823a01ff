"""``lars()`` and ``lamb()``: the optax optimizers, as short ``optax.chain``\\ s of optax's
transformations and those of :mod:`largebatch.lars.jax.transforms`.

Defaults, valid values and error messages come from :mod:`largebatch.lars.spec`; the
names follow optax (``learning_rate``; LAMB's betas as ``b1, b2``).
"""

from __future__ import annotations

from typing import Any

import optax

from largebatch import checks
from largebatch.checks import AxisName
from largebatch.lars.jax.masks import Mask, check_masks, mask_and, masked
from largebatch.lars.jax.transforms import (
    ScalarOrSchedule,
    concrete_or_unknown,
    divide_by_global_norm,
    keep_dtypes,
    scale_by_lamb_trust_ratio,
    scale_by_lars_trust_ratio,
    scale_by_uncorrected_adam,
)
from largebatch.lars.spec import LAMB_SPEC, LARS_SPEC
from largebatch.schedules import Schedule
from largebatch.schedules.jax import as_optax_schedule


def _as_optax_schedule(learning_rate: Any) -> ScalarOrSchedule:
    """A :class:`largebatch.schedules.Schedule` becomes its jit-traceable JAX twin."""
    if isinstance(learning_rate, Schedule):
        return as_optax_schedule(learning_rate)
    return learning_rate


def _rate_to_check(learning_rate: Any) -> dict[str, Any]:
    """The spec's ``lr`` entry for ``learning_rate``: none for a schedule (a callable)."""
    return {} if callable(learning_rate) else {"lr": concrete_or_unknown(learning_rate)}


def lars(
    learning_rate: ScalarOrSchedule,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    nesterov: bool = False,
    trust_clip: bool = False,
    weight_decay_mask: Mask = None,
    trust_ratio_mask: Mask = None,
    axis_name: AxisName = None,
    lr_in_momentum: bool = True,
    zero_norm_skip: bool = False,
    decayed_norm: bool = False,
) -> optax.GradientTransformation:
    r"""LARS: SGD with momentum and a layer-wise trust ratio (MLPerf's form).

    Per leaf ``w`` with gradient ``g``, at step ``t``::

        ratio = tc * ||w|| / (||g|| + wd * ||w|| + eps)   (1 if ||w|| == 0 or ||g|| == 0)
        ratio = min(ratio / lr_t, 1)                      (trust_clip: LARC)
        d = g + wd * w
        v = momentum * v + lr_t * ratio * d               (v starts at 0)
        w = w - v            nesterov: w = w - (momentum * v + lr_t * ratio * d)

    The variant: the learning rate sits *inside* the momentum buffer (a change of rate
    affects only new contributions), the trust-ratio denominator is
    ``||g|| + wd * ||w|| + eps`` (not ``||g + wd * w||``), a zero norm gives ratio 1, and
    ``trust_clip`` is LARC's clip (apex, timm), which keeps the local rate at or below
    ``lr_t``. Leaves where ``trust_ratio_mask`` is False get ratio 1; their weight decay
    follows ``weight_decay_mask`` when it is given (NVIDIA's MLPerf LARS decays the
    classifier's bias without adapting it), and is off when it is not (plain momentum
    SGD, as MLPerf's reference); see the package docstring for how the two masks combine.

    ``lr_in_momentum=False`` keeps the rate outside the buffer: ``v = momentum * v +
    ratio * d; w = w - lr_t * v`` (nesterov: ``w - lr_t * (momentum * v + ratio * d)``),
    as torch's SGD under apex LARC, NVIDIA's MLPerf MXNet LARS and timm do.
    ``zero_norm_skip=True`` is apex LARC's zero-norm rule: where ``||w|| == 0`` or
    ``||g|| == 0`` the gradient passes unchanged (ratio 1, no clip, no weight decay).
    ``decayed_norm=True`` is ``optax.lars``'s denominator ``||g + wd * w|| + eps`` (ratio 1
    where ``||w||`` or ``||g + wd * w||`` is 0); it does not combine with ``zero_norm_skip``.

    The chain: ``scale_by_lars_trust_ratio`` (masked) -> ``optax.scale_by_learning_rate``
    -> ``optax.trace``. Differences from ``optax.lars``: optax divides by
    ``||g + wd * w|| + eps`` (``decayed_norm=True``), decays leaves whose trust ratio is
    masked out (pass ``weight_decay_mask``), and has no trust clip. With
    ``decayed_norm=True`` and both masks, or at ``weight_decay=0``, the two give the same
    numbers. timm's ``Lars`` keeps
    the rate outside its buffer (``w -= lr_t * v``) and adapts only with weight decay or
    ``always_adapt=True``; where it adapts, it gives the same numbers at a constant rate.

    Args:
      learning_rate: ``lr_t``: a float >= 0 or a schedule (a callable of the step
        count, e.g. ``largebatch.jax.make_schedule(...)``).
      momentum: the momentum coefficient, in [0, 1).
      weight_decay: ``wd`` >= 0, in two places: the direction ``d = g + wd * w`` and
        the term ``wd * ||w||`` of the trust-ratio denominator.
      trust_coefficient: ``tc`` > 0 (eta in the paper).
      eps: At least 0; added to the trust-ratio denominator.
      nesterov: Nesterov momentum.
      trust_clip: LARC's clipping ``min(ratio / lr_t, 1)``.
      weight_decay_mask: optax mask; False removes weight decay from a leaf. None: decay
        where the trust ratio applies.
      trust_ratio_mask: optax mask; False excludes a leaf (ratio 1; decayed only where
        ``weight_decay_mask`` is given and True). ``exclusion_mask`` gives the usual choice.
      axis_name: None, or the ``jax.shard_map`` mesh axis (a name, or a tuple of names)
        over which the params are sharded; see "Sharded params" below.
      lr_in_momentum: ``True``: the rate inside the buffer; ``False``: outside it.
      zero_norm_skip: apex LARC's zero-norm rule (above).
      decayed_norm: optax's trust-ratio denominator ``||g + wd * w|| + eps`` (above).

    Returns:
      An ``optax.GradientTransformation``; ``update`` needs ``params``.

    Every numeric argument may be a JAX array, traced included (``optax.inject_hyperparams``).

    Sharded params. Under ``jax.jit`` params sharded with ``jax.sharding`` need nothing:
    ``||w||`` and ``||g||`` are norms of whole arrays. Inside ``jax.shard_map`` each
    device sees only its block of a leaf, and a norm of the block would give a wrong
    ratio: there pass ``axis_name``, the mesh axes over which the params are sharded,
    and every norm is formed from the local sums of squares ``psum``-ed over them (its
    overflow-safe pass too), the same on every device. Every leaf that takes the trust
    ratio must then be sharded over all of those axes: a leaf replicated over one of
    them would be counted once per device, its norm ``sqrt(n)`` times too large
    (leaves excluded by ``trust_ratio_mask`` take no norm and may be replicated).
    Leave ``axis_name`` None for replicated, data-parallel params.

    Raises:
      ValueError: naming the value, for a negative rate or weight decay, momentum
        outside [0, 1), ``trust_coefficient <= 0``, ``eps < 0``, a non-finite number,
        ``nesterov=True`` with ``momentum=0``, or ``decayed_norm=True`` with
        ``zero_norm_skip=True``; for an empty ``axis_name`` or one with an empty or
        repeated name.
      TypeError: naming the value, for a non-number (a bool, a string, None) where a
        number belongs, anything but ``True``/``False`` for a flag, or an
        ``axis_name`` that is not None, a str or a tuple of strs.

    Example::

        >>> import jax, jax.numpy as jnp, optax
        >>> from largebatch.jax import lars, exclusion_mask
        >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
        >>> opt = lars(0.1, weight_decay=1e-4, trust_ratio_mask=exclusion_mask)
        >>> state = opt.init(params)
        >>> grads = jax.tree.map(jnp.ones_like, params)
        >>> updates, state = opt.update(grads, state, params)
        >>> params = optax.apply_updates(params, updates)
        >>> round(float(params["b"][0]), 4)  # excluded: plain SGD step, -0.1 * 1
        -0.1

    References:
      You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks",
      https://arxiv.org/abs/1708.03888.
      Goyal et al. 2017 (linear scaling, warmup), https://arxiv.org/abs/1706.02677.
      LARC (the trust clip): NVIDIA apex, ``apex/parallel/LARC.py``.
    """
    check_masks(weight_decay_mask=weight_decay_mask, trust_ratio_mask=trust_ratio_mask)
    checked = LARS_SPEC.check(
        {
            **_rate_to_check(learning_rate),
            "momentum": concrete_or_unknown(momentum),
            "weight_decay": concrete_or_unknown(weight_decay),
            "trust_coefficient": concrete_or_unknown(trust_coefficient),
            "eps": concrete_or_unknown(eps),
            "nesterov": nesterov,  # a flag is never traced: a traced one is a TypeError
            "trust_clip": trust_clip,
            "lr_in_momentum": lr_in_momentum,
            "zero_norm_skip": zero_norm_skip,
            "decayed_norm": decayed_norm,
        },
        names={"lr": "learning_rate"},
    )
    nesterov, trust_clip = checked["nesterov"], checked["trust_clip"]
    lr_in_momentum, zero_norm_skip = checked["lr_in_momentum"], checked["zero_norm_skip"]
    decayed_norm = checked["decayed_norm"]
    axis_name = checks.axis_name("axis_name", axis_name)
    learning_rate = _as_optax_schedule(learning_rate)
    clip = learning_rate if trust_clip else None

    def adapt(wd: Any) -> optax.GradientTransformation:
        return scale_by_lars_trust_ratio(
            wd, trust_coefficient, eps, clip, axis_name, zero_norm_skip, decayed_norm
        )

    # The structure of the chain depends on the masks only, never on a value.
    if weight_decay_mask is None:
        adapted = [masked(adapt(weight_decay), trust_ratio_mask)]
    else:  # decayed where both masks hold; adapted but not decayed where only the first does
        adapted = [
            optax.masked(adapt(weight_decay), mask_and(trust_ratio_mask, weight_decay_mask)),
            optax.masked(adapt(0.0), mask_and(trust_ratio_mask, weight_decay_mask, True)),
        ]
        if trust_ratio_mask is not None:  # decayed but not adapted: g + wd * w, ratio 1
            adapted.append(
                optax.masked(
                    optax.add_decayed_weights(weight_decay),
                    mask_and(weight_decay_mask, trust_ratio_mask, True),
                )
            )
    rate = optax.scale_by_learning_rate(learning_rate)
    momentum_of = optax.trace(decay=momentum, nesterov=nesterov)
    return keep_dtypes(
        optax.chain(*adapted, *((rate, momentum_of) if lr_in_momentum else (momentum_of, rate)))
    )


def lamb(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    max_grad_norm: float | None = None,
    weight_decay_mask: Mask = None,
    trust_ratio_mask: Mask = None,
    axis_name: AxisName = None,
    adam_w_mode: bool = True,
    grad_averaging: bool = True,
    adapt_without_decay: bool = True,
    freeze_step: int | None = None,
) -> optax.GradientTransformation:
    r"""LAMB: Adam with decoupled weight decay and a layer-wise trust ratio.

    Per leaf ``w`` with gradient ``g``, at step ``t`` = 1, 2, ...::

        g = g / max(1, ||all grads|| / max_grad_norm)        (only with max_grad_norm)
        m = b1 * m + (1 - b1) * g ;  v = b2 * v + (1 - b2) * g^2  (t > freeze_step: v kept)
        r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t')) + eps) (t' = min(t, freeze_step);
                                                  no 1 - b^t without bias_correction)
        u = r + wd * w
        ratio = ||w|| / ||u||                                (1 if ||w|| == 0 or ||u|| == 0)
        w = w - lr_t * ratio * u

    The variant: Algorithm 2 of the paper with phi = identity (no trust-ratio bounds),
    eps outside the square root, the weight decay added to the Adam direction *before*
    the trust ratio (``u = r + wd * w``, so it enters the ratio's denominator ``||u||``
    as well as the step), and the global gradient clipping of NVIDIA's LAMB when
    ``max_grad_norm`` is set. Leaves where ``trust_ratio_mask`` is False get ratio 1; their
    weight decay follows ``weight_decay_mask`` when it is given, and is off when it is
    not (plain Adam steps).

    The chain: [``divide_by_global_norm``] -> ``optax.scale_by_adam`` (or
    ``scale_by_uncorrected_adam``) -> ``optax.add_decayed_weights`` (masked) ->
    ``scale_by_lamb_trust_ratio`` (masked) -> ``optax.scale_by_learning_rate``. At its
    defaults this is ``optax.lamb``; the differences: ``optax.lamb`` has ``eps_root``
    and a single ``mask`` for weight decay only (its trust ratio covers every leaf), and
    neither ``bias_correction=False`` nor gradient clipping. ``optax.lamb(lr,
    weight_decay=wd, mask=m)`` equals ``lamb(lr, weight_decay=wd, weight_decay_mask=m)``.

    Args:
      learning_rate: ``lr_t``: a float >= 0 or a schedule of the step count.
      b1: the first moment's decay rate, in [0, 1).
      b2: the second moment's decay rate, in [0, 1).
      eps: At least 0; added to ``sqrt(v_hat)``.
      weight_decay: ``wd`` >= 0, decoupled from the moments: ``u = r + wd * w``, the
        direction whose norm ``||u||`` is the trust-ratio denominator.
      bias_correction: divide the moments by ``1 - b^t``.
      max_grad_norm: > 0 or None; clip the gradients by their global norm first.
      weight_decay_mask: optax mask; False removes weight decay from a leaf.
      trust_ratio_mask: optax mask; False excludes a leaf (ratio 1; decayed only where
        ``weight_decay_mask`` is given and True).
      adam_w_mode: ``True``: ``u = r + wd * w``; ``False``: L2, ``g + wd * w`` enters the
        moments and ``u = r`` (apex ``FusedLAMB(adam_w_mode=False)``).
      grad_averaging: ``False``: ``m = b1 * m + g`` (apex ``FusedLAMB``, timm).
      adapt_without_decay: ``False``: the trust ratio only on decayed leaves, while
        ``weight_decay`` is nonzero (apex ``FusedLAMB``'s default, timm's).
      freeze_step: None, or a whole number >= 1: after step ``t = freeze_step`` the
        second moment ``v`` and its bias correction stay as they are, while ``m`` goes
        on (1-bit LAMB's and 1-bit Adam's frozen variance: for gradients that arrive
        sparse in time, as AdaComp's). The chain then takes
        ``scale_by_uncorrected_adam(..., freeze_step=...)`` for the moments.
      axis_name: None, or the ``jax.shard_map`` mesh axis (a name, or a tuple of names)
        over which the params are sharded; see "Sharded params" below.

    Returns:
      An ``optax.GradientTransformation``; ``update`` needs ``params``.

    Every numeric argument may be a JAX array, traced included (``optax.inject_hyperparams``).

    Sharded params. Under ``jax.jit`` params sharded with ``jax.sharding`` need nothing:
    the norms are norms of whole arrays. Inside ``jax.shard_map`` each device sees only
    its block of a leaf: there pass ``axis_name``, the mesh axes over which the params
    are sharded, and ``||w||``, ``||u||`` and the global gradient norm of
    ``max_grad_norm`` are formed from the local sums of squares ``psum``-ed over them
    (their overflow-safe pass too), the same on every device. Every leaf that takes the
    trust ratio, and with ``max_grad_norm`` every leaf, must then be sharded over all of
    those axes: a leaf replicated over one of them would be counted once per device,
    its norm ``sqrt(n)`` times too large. Leave ``axis_name`` None for replicated,
    data-parallel params.

    Raises:
      ValueError: naming the value, for a negative rate, eps or weight decay, betas
        outside [0, 1), ``max_grad_norm <= 0`` or a non-finite number; for an empty
        ``axis_name`` or one with an empty or repeated name.
      TypeError: naming the value, for a non-number (a bool, a string) where a number
        belongs, anything but ``True``/``False`` for ``bias_correction``, or an
        ``axis_name`` that is not None, a str or a tuple of strs.

    Example::

        >>> import jax, jax.numpy as jnp, optax
        >>> from largebatch.jax import lamb, exclusion_mask, make_schedule
        >>> sched = make_schedule("poly", peak_lr=0.01, total_steps=100, warmup_steps=10)
        >>> opt = lamb(sched, weight_decay=0.01, trust_ratio_mask=exclusion_mask)
        >>> params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
        >>> state = opt.init(params)
        >>> loss = lambda p: jnp.sum((p["w"].sum(0) + p["b"] - 1.0) ** 2)
        >>> for _ in range(3):
        ...     updates, state = opt.update(jax.grad(loss)(params), state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> bool(loss(params) < 36.0)
        True

    References:
      You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in
      76 minutes", https://arxiv.org/abs/1904.00962.
      NVIDIA apex ``FusedLAMB`` (global gradient clipping).
      Li et al. 2021, "1-bit LAMB", https://arxiv.org/abs/2104.06069 (frozen variance).
    """
    check_masks(weight_decay_mask=weight_decay_mask, trust_ratio_mask=trust_ratio_mask)
    checked = LAMB_SPEC.check(
        {
            **_rate_to_check(learning_rate),
            "betas": (concrete_or_unknown(b1), concrete_or_unknown(b2)),
            "eps": concrete_or_unknown(eps),
            "weight_decay": concrete_or_unknown(weight_decay),
            "bias_correction": bias_correction,  # a flag: never traced
            "max_grad_norm": concrete_or_unknown(max_grad_norm),
            "adam_w_mode": adam_w_mode,
            "grad_averaging": grad_averaging,
            "adapt_without_decay": adapt_without_decay,
            "freeze_step": concrete_or_unknown(freeze_step),
        },
        names={"lr": "learning_rate", "betas": ("b1", "b2")},
    )
    bias_correction, adam_w_mode = checked["bias_correction"], checked["adam_w_mode"]
    grad_averaging, adapt_without_decay = checked["grad_averaging"], checked["adapt_without_decay"]
    axis_name = checks.axis_name("axis_name", axis_name)
    learning_rate = _as_optax_schedule(learning_rate)
    clip = [] if max_grad_norm is None else [divide_by_global_norm(max_grad_norm, axis_name)]
    if grad_averaging and bias_correction and freeze_step is None:
        moments = optax.scale_by_adam(b1, b2, eps)
    else:
        moments = scale_by_uncorrected_adam(b1, b2, eps, bias_correction, grad_averaging, freeze_step)
    # Decay and adaptation are independent where weight_decay_mask is given.
    decay_mask = trust_ratio_mask if weight_decay_mask is None else weight_decay_mask
    decay = optax.add_decayed_weights(weight_decay, decay_mask)
    if adapt_without_decay:
        adapt = masked(scale_by_lamb_trust_ratio(axis_name), trust_ratio_mask)
    else:  # only where the leaf's weight decay is nonzero
        adapt = masked(
            scale_by_lamb_trust_ratio(axis_name, weight_decay), mask_and(trust_ratio_mask, decay_mask)
        )
    steps = [decay, moments] if not adam_w_mode else [moments, decay]  # L2: decay first
    return keep_dtypes(optax.chain(*clip, *steps, adapt, optax.scale_by_learning_rate(learning_rate)))
