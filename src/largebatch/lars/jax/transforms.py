"""The gradient transformations ``lars()`` and ``lamb()`` chain where optax has none with
their rule, each an ``(init, update)`` pair with NamedTuple state, and the wrapper that
keeps the chains' dtypes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from largebatch import checks
from largebatch.checks import AxisName
from largebatch.lars import spec
from largebatch.lars.jax.norms import (
    abs_sq,
    compute_dtype,
    global_norm,
    leaf_norms,
    safe_ratio,
)
from largebatch.lars.spec import LAMB_SPEC, LARS_SPEC

_NO_PARAMS = "this transformation needs the params: call update(updates, state, params)"
ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]

# divide_by_global_norm's threshold: LAMB's max_grad_norm, but a number (None is lamb's
# "no clipping", which leaves this transformation out).
_MAX_NORM = dataclasses.replace(LAMB_SPEC.hyper("max_grad_norm"), optional=False)


def concrete_or_unknown(value: Any) -> Any:
    """``value``, or :data:`spec.UNKNOWN` where it is traced (its value cannot be read
    and is not checked)."""
    return spec.UNKNOWN if isinstance(value, jax.core.Tracer) else value


def _rate(learning_rate: ScalarOrSchedule, count: jax.Array) -> Any:
    return learning_rate(count) if callable(learning_rate) else learning_rate


def _is_zero(value: Any) -> bool:
    """True for a Python number equal to 0 (a static zero: the term can be left out)."""
    return isinstance(value, (int, float)) and value == 0


def _computed_leaves(updates: Any, params: Any) -> tuple[list, list, Any]:
    """The leaves of ``updates`` and of ``params`` (its structure), both in the dtype
    norms and ratios are computed in (that of the update leaf), and the treedef."""
    leaves, treedef = jax.tree.flatten(updates)
    dtypes = [compute_dtype(u) for u in leaves]
    us = [u.astype(d) for u, d in zip(leaves, dtypes)]
    param_leaves = treedef.flatten_up_to(params)  # type: ignore[attr-defined]  # PyTreeDef: no stubs
    ws = [w.astype(d) for w, d in zip(param_leaves, dtypes)]
    return us, ws, treedef


def keep_dtypes(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` with its updates in the incoming updates' dtypes and its state in the
    dtypes ``init`` gave it, so that float32 hyperparameters (injected, or passed as
    arrays) never promote bf16 updates or state, and ``jit`` sees the same state types
    at every step."""

    inner = optax.with_extra_args_support(inner)

    def update_fn(
        updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, optax.OptState]:  # as optax's aliases
        new_updates, new_state = inner.update(updates, state, params, **extra_args)
        new_updates = jax.tree.map(lambda u, g: u.astype(jnp.result_type(g)), new_updates, updates)
        new_state = jax.tree.map(lambda n, o: n.astype(jnp.result_type(o)), new_state, state)
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)


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
            raise ValueError(_NO_PARAMS)
        lr = None if clip_learning_rate is None else _rate(clip_learning_rate, state.count)
        gs, ws, treedef = _computed_leaves(updates, params)
        ds = [g32 if _is_zero(wd) else g32 + wd * w32 for g32, w32 in zip(gs, ws)]
        norms = leaf_norms(ws + (ds if decayed_norm else gs), axis_name)

        def leaf(
            g: jax.Array, g32: jax.Array, d: jax.Array, w_norm: jax.Array, g_norm: jax.Array
        ) -> jax.Array:
            if decayed_norm:  # g_norm is ||g + wd * w|| (optax)
                ratio = safe_ratio(tc * w_norm, g_norm + eps, w_norm, g_norm)
            else:
                ratio = safe_ratio(tc * w_norm, g_norm + wd * w_norm + eps, w_norm, g_norm)
            if lr is not None:
                ratio = jnp.minimum(ratio / jnp.asarray(lr, ratio.dtype), 1.0)
            if zero_norm_skip:
                skip = jnp.logical_or(w_norm == 0.0, g_norm == 0.0)
                return jnp.where(skip, g32, ratio * d).astype(g.dtype)
            return (ratio * d).astype(g.dtype)

        n = len(gs)
        new = map(leaf, treedef.flatten_up_to(updates), gs, ds, norms[:n], norms[n:])
        updates = jax.tree.unflatten(treedef, list(new))
        return updates, LarsTrustRatioState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


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
            raise ValueError(_NO_PARAMS)
        us, ws, treedef = _computed_leaves(updates, params)
        norms = leaf_norms(ws + us, axis_name)

        def leaf(u: jax.Array, u32: jax.Array, w_norm: jax.Array, u_norm: jax.Array) -> jax.Array:
            ratio = safe_ratio(w_norm, u_norm, w_norm, u_norm)
            if weight_decay is not None:
                ratio = jnp.where(jnp.asarray(weight_decay) != 0, ratio, jnp.ones_like(ratio))
            return (ratio * u32).astype(u.dtype)

        n = len(us)
        new = map(leaf, treedef.flatten_up_to(updates), us, norms[:n], norms[n:])
        return jax.tree.unflatten(treedef, list(new)), state

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
