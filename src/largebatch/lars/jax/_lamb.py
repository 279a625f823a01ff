"""LAMB for JAX: ``lamb()`` (its checks and its ``optax.chain``) and the transformations
it chains where optax has none with its rule: ``scale_by_lamb_trust_ratio``,
``scale_by_uncorrected_adam`` and ``divide_by_global_norm``. Defaults, valid values and
error messages come from :mod:`largebatch.lars.spec`; the names follow optax
(``learning_rate``, the betas as ``b1, b2``)."""

from __future__ import annotations

import dataclasses
from typing import Any

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
    rate_to_check,
)
from largebatch.lars.jax.fused import fused_lamb
from largebatch.lars.jax.masks import Mask, check_masks, mask_and, masked
from largebatch.lars.jax.norms import abs_sq, global_norm, leaf_norms, safe_ratio
from largebatch.lars.spec import LAMB_SPEC

# divide_by_global_norm's threshold: LAMB's max_grad_norm, but a number (None is lamb's
# "no clipping", which leaves this transformation out).
_MAX_NORM = dataclasses.replace(LAMB_SPEC.hyper("max_grad_norm"), optional=False)


def scale_by_lamb_trust_ratio(
    axis_name: AxisName = None, weight_decay: Any = None
) -> optax.GradientTransformation:
    """Scale each leaf ``u`` by the LAMB trust ratio ``||w|| / ||u||``.

    The ratio is 1 where ``||w|| == 0`` or ``||u|| == 0``; no bounds, no coefficient
    (``optax.scale_by_trust_ratio()`` at its defaults, with overflow-safe real norms in
    float32 or wider and the update in the leaf's dtype). In ``lamb()``, ``u`` is the
    Adam direction with the weight decay already added, ``u = r + wd * w``, so the
    decay enters the denominator ``||u||``.

    ``axis_name``: as in :func:`scale_by_lars_trust_ratio`, for ``||w||`` and ``||u||``
    (inside ``jax.shard_map``, over the axes that shard every leaf).

    ``weight_decay`` (a number, possibly traced): when given, the ratio applies only
    while it is nonzero (apex ``FusedLAMB``'s and timm's rule; ``lamb()``'s
    ``adapt_without_decay=False``).
    """
    axis_name = checks.axis_name("axis_name", axis_name)

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        if params is None:
            raise ValueError(NO_PARAMS)
        us, ws, treedef = computed_leaves(updates, params)
        norms = leaf_norms(ws + us, axis_name)

        def ratio_of(w_norm: jax.Array, u_norm: jax.Array) -> jax.Array:
            ratio = safe_ratio(w_norm, u_norm, w_norm, u_norm)
            if weight_decay is not None:
                ratio = jnp.where(jnp.asarray(weight_decay) != 0, ratio, jnp.ones_like(ratio))
            return ratio

        n = len(us)
        ratios = list(map(ratio_of, norms[:n], norms[n:]))
        telemetry.record(treedef, ratios)
        new = [(r * u32).astype(u.dtype) for u, u32, r in zip(treedef.flatten_up_to(updates), us, ratios)]
        return jax.tree.unflatten(treedef, new), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def divide_by_global_norm(max_norm: float, axis_name: AxisName = None) -> optax.GradientTransformation:
    """Divide all updates by ``max(1, ||all updates|| / max_norm)`` (NVIDIA's LAMB clip).

    The same rule as ``optax.clip_by_global_norm`` (which multiplies by
    ``max_norm / norm`` above the threshold), written as NVIDIA's LAMB and the torch
    optimizers write it; the global norm is the norm of the per-leaf norms, each
    computed in float32 or wider and safe from overflow. ``max_norm`` is a number > 0
    (LAMB's ``max_grad_norm``), or traced.

    ``axis_name`` (a mesh axis name or a tuple of them) is for use inside
    ``jax.shard_map`` where each device holds a block of every leaf, sharded over those
    axes: each leaf's norm is then that of the whole leaf, from the local sums of squares
    ``psum``-ed over ``axis_name`` (overflow-safe as without it), so the divisor is the
    same on every device. Every leaf must be sharded over all of those axes: a
    replicated one would be counted once per device. Leave it None under plain
    ``jax.jit`` and for replicated, data-parallel updates.
    """
    _MAX_NORM.check(concrete_or_unknown(max_norm), "max_norm")
    axis_name = checks.axis_name("axis_name", axis_name)

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        leaves = jax.tree.leaves(updates)
        if not leaves:
            return updates, state
        divisor = jnp.maximum(1.0, global_norm(leaves, axis_name) / max_norm)
        updates = jax.tree.map(lambda g: (g / divisor).astype(g.dtype), updates)
        return updates, state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def scale_by_uncorrected_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    bias_correction: bool = False,
    grad_averaging: bool = True,
    freeze_step: Any = None,
) -> optax.GradientTransformation:
    """Adam's scaling without bias correction: ``m / (sqrt(v) + eps)``.

    ``m = b1 * m + (1 - b1) * g`` and ``v = b2 * v + (1 - b2) * g^2``, as
    ``optax.scale_by_adam`` but without dividing by ``1 - b^t`` (``g^2`` is ``|g|^2``
    for complex ``g``); the state is an ``optax.ScaleByAdamState``, so a checkpoint
    fits either setting. ``grad_averaging=False`` takes ``m = b1 * m + g`` (apex
    ``FusedLAMB``, timm); ``bias_correction=True`` divides by ``1 - b^t`` after all
    (``optax.scale_by_adam``'s direction, for use with ``grad_averaging=False``).
    ``freeze_step`` (None, or a whole number >= 1, traced allowed): at a step t >
    ``freeze_step`` v is kept as it is, and its bias correction stays at ``1 -
    b2^freeze_step`` (the frozen variance of 1-bit LAMB and 1-bit Adam).
    """
    b3 = (1 - b1) if grad_averaging else 1.0

    def init_fn(params: optax.Params) -> optax.ScaleByAdamState:
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params),
            nu=optax.tree.zeros_like(params),
        )

    def update_fn(
        updates: optax.Updates,
        state: optax.ScaleByAdamState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, optax.ScaleByAdamState]:
        del params
        mu = jax.tree.map(lambda g, m: b3 * g + b1 * m, updates, state.mu)
        count = optax.safe_increment(state.count)
        if freeze_step is None:
            nu = jax.tree.map(lambda g, v: (1 - b2) * abs_sq(g) + b2 * v, updates, state.nu)
            count_v = count
        else:
            frozen = count > freeze_step
            nu = jax.tree.map(
                lambda g, v: jnp.where(frozen, v, (1 - b2) * abs_sq(g) + b2 * v), updates, state.nu
            )
            count_v = jnp.minimum(count, freeze_step)
        if bias_correction:
            bc1, bc2 = 1 - b1**count, 1 - b2**count_v
            updates = jax.tree.map(lambda m, v: (m / bc1) / (jnp.sqrt(v / bc2) + eps), mu, nu)
        else:
            updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


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
    fused: bool | None = None,
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
      fused: ``True``: the fused path, Pallas kernels over a packed state (compiled on a
        GPU, interpreted on the CPU; "The fused path" in docs/jax.md): the same numbers,
        another state (:class:`~largebatch.lars.jax.fused.FusedLambState`), real
        floating-point leaves only. ``False``: the ``optax.chain`` below. ``None`` (the
        default): ``True`` where ``jax.default_backend()`` is ``"gpu"`` when ``lamb`` is
        called, ``False`` elsewhere.

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
        ``axis_name`` or one with an empty or repeated name; ``fused=True`` on a
        platform other than a GPU or the CPU (at the first step).
      TypeError: naming the value, for a non-number (a bool, a string) where a number
        belongs, anything but ``True``/``False`` for ``bias_correction`` (``None`` too
        for ``fused``), or an ``axis_name`` that is not None, a str or a tuple of strs;
        with ``fused=True``, for a leaf that is not real floating point.

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
            **rate_to_check(learning_rate),
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
    learning_rate = as_optax_rate(learning_rate)
    if check_fused(fused):
        return fused_lamb(
            learning_rate, b1, b2, eps, weight_decay, bias_correction, max_grad_norm,
            weight_decay_mask, trust_ratio_mask, axis_name, adam_w_mode, grad_averaging,
            adapt_without_decay, freeze_step,
        )  # fmt: skip
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
