"""LARS for JAX: ``lars()`` (its checks and its ``optax.chain``) and the transformation
that carries its rule, ``scale_by_lars_trust_ratio``. Defaults, valid values and error
messages come from :mod:`largebatch.lars.spec`; the names follow optax (``learning_rate``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from largebatch import checks
from largebatch.checks import AxisName
from largebatch.lars.jax import telemetry
from largebatch.lars.jax.common import (
    NO_PARAMS,
    ScalarOrSchedule,
    as_optax_rate,
    check_fused,
    computed_leaves,
    concrete_or_unknown,
    keep_dtypes,
    rate_at,
    rate_to_check,
)
from largebatch.lars.jax.fused import fused_lars
from largebatch.lars.jax.masks import Mask, check_masks, mask_and, masked
from largebatch.lars.jax.norms import leaf_norms, safe_ratio
from largebatch.lars.spec import LARS_SPEC


def _is_zero(value: Any) -> bool:
    """True for a Python number equal to 0 (a static zero: the term can be left out)."""
    return isinstance(value, (int, float)) and value == 0


class LarsTrustRatioState(NamedTuple):
    """State of :func:`scale_by_lars_trust_ratio`: the step count (for a clip schedule)."""

    count: jax.Array  # type: ignore[assignment]  # int32 scalar; shadows tuple.count


def scale_by_lars_trust_ratio(
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    clip_learning_rate: ScalarOrSchedule | None = None,
    axis_name: AxisName = None,
    zero_norm_skip: bool = False,
    decayed_norm: bool = False,
) -> optax.GradientTransformation:
    """Scale each leaf by the LARS trust ratio, with weight decay folded in.

    Per leaf with gradient ``g`` and parameter ``w``::

        ratio = tc * ||w|| / (||g|| + wd * ||w|| + eps)   (1 if ||w|| == 0 or ||g|| == 0)
        ratio = min(ratio / lr_t, 1)                      (only with clip_learning_rate)
        update = ratio * (g + wd * w)
        update = g                     (zero_norm_skip, where ||w|| == 0 or ||g|| == 0: LARC)

    ``decayed_norm=True`` takes optax's denominator (optax/_src/alias.py ``lars``, whose
    ``scale_by_trust_ratio`` sees the already decayed update): ``ratio = tc * ||w|| /
    (||g + wd * w|| + eps)``, 1 where ``||w||`` or ``||g + wd * w||`` is 0; it does not
    combine with ``zero_norm_skip``.

    The denominator holds ``||g||`` and ``wd * ||w||`` apart (MLPerf's LARS), so weight
    decay is part of this transformation rather than an ``add_decayed_weights`` before
    it. ``clip_learning_rate`` (a float or a schedule of the step count) turns on LARC's
    clipping: the local rate ``lr_t * ratio`` never exceeds ``lr_t``. Norms and the
    ratio are real and computed in float32 (float64 for float64 leaves), safe from
    overflow; the update keeps the leaf's dtype. The hyperparameters may be traced;
    concrete ones are checked as ``lars()`` checks them (``largebatch.lars.spec``).

    ``axis_name`` (a mesh axis name or a tuple of them) is for use inside
    ``jax.shard_map`` where each device holds a block of every leaf, sharded over those
    axes: ``||w||`` and ``||g||`` are then the norms of the whole leaf, from the local
    sums of squares ``psum``-ed over ``axis_name`` (the exactly scaled pass, where it
    runs, takes its power of two from the ``pmax`` of the blocks), the same on every
    device. Every leaf must be sharded over all of those axes: a replicated one would be
    counted once per device. Leave it None under plain ``jax.jit`` (sharded arrays
    already give global norms) and for replicated, data-parallel params.
    """
    for name, value in [
        ("weight_decay", weight_decay),
        ("trust_coefficient", trust_coefficient),
        ("eps", eps),
    ]:
        LARS_SPEC.hyper(name).check(concrete_or_unknown(value), name)
    axis_name = checks.axis_name("axis_name", axis_name)
    flags = LARS_SPEC.check({"zero_norm_skip": zero_norm_skip, "decayed_norm": decayed_norm})
    zero_norm_skip, decayed_norm = flags["zero_norm_skip"], flags["decayed_norm"]
    wd, tc = weight_decay, trust_coefficient

    def init_fn(params: optax.Params) -> LarsTrustRatioState:
        del params
        return LarsTrustRatioState(count=jnp.zeros([], jnp.int32))

    def update_fn(
        updates: optax.Updates,
        state: LarsTrustRatioState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, LarsTrustRatioState]:
        if params is None:
            raise ValueError(NO_PARAMS)
        lr = None if clip_learning_rate is None else rate_at(clip_learning_rate, state.count)
        gs, ws, treedef = computed_leaves(updates, params)
        ds = [g32 if _is_zero(wd) else g32 + wd * w32 for g32, w32 in zip(gs, ws)]
        norms = leaf_norms(ws + (ds if decayed_norm else gs), axis_name)

        def leaf(
            g: jax.Array, g32: jax.Array, d: jax.Array, w_norm: jax.Array, g_norm: jax.Array
        ) -> tuple[jax.Array, jax.Array]:
            """The leaf's update and the ratio it takes."""
            if decayed_norm:  # g_norm is ||g + wd * w|| (optax)
                ratio = safe_ratio(tc * w_norm, g_norm + eps, w_norm, g_norm)
            else:
                ratio = safe_ratio(tc * w_norm, g_norm + wd * w_norm + eps, w_norm, g_norm)
            if lr is not None:
                ratio = jnp.minimum(ratio / jnp.asarray(lr, ratio.dtype), 1.0)
            if zero_norm_skip:
                skip = jnp.logical_or(w_norm == 0.0, g_norm == 0.0)
                return jnp.where(skip, g32, ratio * d).astype(g.dtype), jnp.where(skip, 1.0, ratio)
            return (ratio * d).astype(g.dtype), ratio

        n = len(gs)
        new = list(map(leaf, treedef.flatten_up_to(updates), gs, ds, norms[:n], norms[n:]))
        telemetry.record(treedef, [ratio for _, ratio in new])
        updates = jax.tree.unflatten(treedef, [update for update, _ in new])
        return updates, LarsTrustRatioState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


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
    fused: bool | None = None,
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
    SGD, as MLPerf's reference); see "Masks" in docs/jax.md for how the two masks combine.

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
      fused: ``True``: the fused path, Pallas kernels over a packed state (compiled on a
        GPU, interpreted on the CPU; "The fused path" in docs/jax.md): the same numbers,
        another state (:class:`~largebatch.lars.jax.fused.FusedLarsState`), real
        floating-point leaves only. ``False``: the ``optax.chain`` below. ``None`` (the
        default): ``True`` where ``jax.default_backend()`` is ``"gpu"`` when ``lars`` is
        called, ``False`` elsewhere.

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
        repeated name; ``fused=True`` on a platform other than a GPU or the CPU (at
        the first step).
      TypeError: naming the value, for a non-number (a bool, a string, None) where a
        number belongs, anything but ``True``/``False`` for a flag (``None`` too for
        ``fused``), or an ``axis_name`` that is not None, a str or a tuple of strs;
        with ``fused=True``, for a leaf that is not real floating point.

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
            **rate_to_check(learning_rate),
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
    learning_rate = as_optax_rate(learning_rate)
    if check_fused(fused):
        return fused_lars(
            learning_rate, momentum, weight_decay, trust_coefficient, eps, nesterov, trust_clip,
            weight_decay_mask, trust_ratio_mask, axis_name, lr_in_momentum, zero_norm_skip,
            decayed_norm,
        )  # fmt: skip
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
