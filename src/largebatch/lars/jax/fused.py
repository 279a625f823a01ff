"""The fused JAX path of ``lars(..., fused=True)`` and ``lamb(..., fused=True)``: the state
kept packed (``packed.py``), the grads and params packed once a step, the passes as
Pallas kernels over rows (``rows.py``), the updates unpacked once. The math is the
unfused chains' (``_lars.py``, ``_lamb.py``), computed in float32 (float64 for float64
leaves) with one rounding to the leaf's dtype; docs/jax.md, "The fused path"."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from largebatch.checks import AxisName
from largebatch.lars.jax import telemetry
from largebatch.lars.jax.common import NO_PARAMS, ScalarOrSchedule, rate_at
from largebatch.lars.jax.masks import Mask, full_mask
from largebatch.lars.jax.norms import safe_ratio
from largebatch.lars.jax.packed import (
    SUB,
    Group,
    Layout,
    PackedParams,
    global_norm,
    layout_of,
    leaf_stats,
    norms_from_stats,
)
from largebatch.lars.jax.rows import piece_stats, row_call


class FusedLarsState(NamedTuple):
    """State of ``lars(..., fused=True)``: the step count and the momentum buffers, one
    buffer a dtype of the leaves, ``(rows * 8, 512)`` (docs/jax.md, "The fused path")."""

    count: jax.Array  # type: ignore[assignment]  # int32 scalar; shadows tuple.count
    momentum: tuple[jax.Array, ...]


class FusedLambState(NamedTuple):
    """State of ``lamb(..., fused=True)``: the step count and Adam's two moments, packed
    as :class:`FusedLarsState`'s momentum."""

    count: jax.Array  # type: ignore[assignment]  # int32 scalar; shadows tuple.count
    mu: tuple[jax.Array, ...]
    nu: tuple[jax.Array, ...]


def _flags(mask: Mask, updates: Any, treedef: Any) -> np.ndarray:
    """``mask`` (as ``optax.masked`` reads it, of the updates) as one bool a leaf."""
    return np.asarray([bool(x) for x in treedef.flatten_up_to(full_mask(mask, updates))], bool)


class _Inputs(NamedTuple):
    """A step's grads and params as packed buffers, one pair a dtype of the layout."""

    layout: Layout
    weights: list[jax.Array]
    grads: list[jax.Array]
    adapt_decay: tuple[np.ndarray, np.ndarray]  # per leaf: the masks' flags
    finish: Any  # the update buffers -> the updates, in the form the grads came in


def _inputs(updates: Any, params: Any, trust_ratio_mask: Mask, weight_decay_mask: Mask) -> _Inputs:
    """The grads and params packed (params in the grads' dtypes; :class:`PackedParams`
    as they are), the masks' flags per leaf (of the grads, as ``optax.masked`` reads
    them; ``weight_decay_mask`` None: decayed where adapted), and how to give back the
    updates."""
    if params is None:
        raise ValueError(NO_PARAMS)
    if isinstance(updates, PackedParams):
        if not isinstance(params, PackedParams) or params.layout != updates.layout:
            raise ValueError("the grads are PackedParams: the params must be PackedParams of the same layout")
        tree, treedef, layout = updates.structure(), updates.treedef, updates.layout
        gbufs = list(updates.buffers)
        wbufs = [w.astype(g.dtype) for w, g in zip(params.buffers, gbufs)]
        finish: Any = updates.like
    else:
        gs, treedef = jax.tree.flatten(updates)
        gs = [jnp.asarray(g) for g in gs]
        param_leaves = treedef.flatten_up_to(params)  # type: ignore[attr-defined]  # PyTreeDef: no stubs
        ws = [jnp.asarray(w).astype(g.dtype) for w, g in zip(param_leaves, gs)]
        tree, layout = updates, layout_of(gs)
        gbufs, wbufs = list(layout.pack(gs)), list(layout.pack(ws))

        def finish(buffers: list[jax.Array]) -> Any:
            return jax.tree.unflatten(treedef, layout.unpack(buffers))

    adapt = _flags(trust_ratio_mask, tree, treedef)
    decay = adapt if weight_decay_mask is None else _flags(weight_decay_mask, tree, treedef)
    return _Inputs(layout, wbufs, gbufs, (adapt, decay), finish)


def _layout(params: Any) -> Layout:
    return params.layout if isinstance(params, PackedParams) else layout_of(jax.tree.leaves(params))


def _of(group: Group, flags: np.ndarray) -> np.ndarray:
    """The group's leaves' entries of a per-leaf array."""
    return flags[np.asarray(group.leaves, np.int64)] if group.leaves else flags[:0]


def _pieces(group: Group, value: Any) -> jax.Array:
    """A scalar or a per-leaf vector of ``group`` as one value a piece."""
    value = jnp.asarray(value, group.compute_dtype)
    if value.ndim == 0:
        return jnp.full((group.total_rows * SUB,), value)
    return group.per_piece(value)


def fused_lars(
    learning_rate: ScalarOrSchedule,
    momentum: Any,
    weight_decay: Any,
    trust_coefficient: Any,
    eps: Any,
    nesterov: bool,
    trust_clip: bool,
    weight_decay_mask: Mask,
    trust_ratio_mask: Mask,
    axis_name: AxisName,
    lr_in_momentum: bool,
    zero_norm_skip: bool,
    decayed_norm: bool,
) -> optax.GradientTransformationExtraArgs:
    """``lars()``'s step on the packed layout, with arguments ``lars()`` has checked.

    Two kernels a dtype: the statistics of ``w``, ``g`` (and ``g + wd * w`` with
    ``decayed_norm``), then the momentum and the update; between them, per leaf, the
    trust ratio from the norms (one ``psum`` of all of them with ``axis_name``)."""

    def init_fn(params: optax.Params) -> FusedLarsState:
        return FusedLarsState(jnp.zeros([], jnp.int32), _layout(params).zeros())

    def update_fn(
        updates: optax.Updates, state: FusedLarsState, params: optax.Params | None = None, **extra: Any
    ) -> tuple[optax.Updates, FusedLarsState]:
        del extra
        inputs = _inputs(updates, params, trust_ratio_mask, weight_decay_mask)
        layout, (adapt, decay) = inputs.layout, inputs.adapt_decay
        lr = rate_at(learning_rate, state.count)
        packed, stats = [], []
        for group, w, g in zip(layout.groups, inputs.weights, inputs.grads):
            ct = group.compute_dtype
            wd = jnp.where(jnp.asarray(_of(group, decay)), jnp.asarray(weight_decay, ct), 0.0)
            pieces = [_pieces(group, wd)] if decayed_norm else []

            def body(w: jax.Array, g: jax.Array, *wd: jax.Array, ct: Any = ct) -> list[jax.Array]:
                w32, g32 = w.astype(ct), g.astype(ct)
                out = [*piece_stats(w32, ct), *piece_stats(g32, ct)]
                if decayed_norm:
                    out += piece_stats(g32 + wd[0][:, None] * w32, ct)
                return out

            raw = row_call(body, [w, g], pieces, [], 6 if decayed_norm else 4, ct)
            stats += [leaf_stats(group, raw[i], raw[i + 1]) for i in range(0, len(raw), 2)]
            packed.append((w, g, wd))
        norms = norms_from_stats(stats, axis_name)
        per = 3 if decayed_norm else 2
        new_momentum: list[jax.Array] = []
        new_updates: list[jax.Array] = []
        ratios: list[jax.Array] = []
        for k, (group, (w, g, wd), v) in enumerate(zip(layout.groups, packed, state.momentum)):
            ct = group.compute_dtype
            w_norm, g_norm = norms[per * k], norms[per * k + 1]
            tc, e = jnp.asarray(trust_coefficient, ct), jnp.asarray(eps, ct)
            if decayed_norm:
                d_norm = norms[per * k + 2]
                ratio = safe_ratio(tc * w_norm, d_norm + e, w_norm, d_norm)
            else:
                ratio = safe_ratio(tc * w_norm, g_norm + wd * w_norm + e, w_norm, g_norm)
            rate = jnp.asarray(lr, ct)
            if trust_clip:
                ratio = jnp.minimum(ratio / rate, 1.0)
            adapted = jnp.asarray(_of(group, adapt))
            if zero_norm_skip:
                skip = adapted & ((w_norm == 0.0) | (g_norm == 0.0))
                ratio, wd = jnp.where(skip, 1.0, ratio), jnp.where(skip, 0.0, wd)
            ratio = jnp.where(adapted, ratio, 1.0)
            ratios.append(ratio)
            inner, outer = (rate * ratio, -1.0) if lr_in_momentum else (ratio, -rate)
            mom = jnp.asarray(momentum, ct)

            def apply(
                w: jax.Array, g: jax.Array, v: jax.Array, a: jax.Array, wd: jax.Array,
                m: jax.Array, out: jax.Array, ct: Any = ct,
            ) -> list[jax.Array]:  # fmt: skip
                a, wd, m, out = (x[:, None] for x in (a, wd, m, out))
                d = g.astype(ct) + wd * w.astype(ct)
                v = m * v.astype(ct) + a * d
                step = m * v + a * d if nesterov else v
                return [v, out * step]

            pieces = [_pieces(group, x) for x in (inner, wd, mom, outer)]
            v_new, update = row_call(apply, [w, g, v], pieces, [v.dtype, g.dtype], 0, ct, {2: 0})
            new_momentum.append(v_new)
            new_updates.append(update)
        count = optax.safe_increment(state.count)
        telemetry.record_groups(updates, layout.groups, ratios)
        return inputs.finish(new_updates), FusedLarsState(count, tuple(new_momentum))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def fused_lamb(
    learning_rate: ScalarOrSchedule,
    b1: Any,
    b2: Any,
    eps: Any,
    weight_decay: Any,
    bias_correction: bool,
    max_grad_norm: Any,
    weight_decay_mask: Mask,
    trust_ratio_mask: Mask,
    axis_name: AxisName,
    adam_w_mode: bool,
    grad_averaging: bool,
    adapt_without_decay: bool,
    freeze_step: Any,
) -> optax.GradientTransformationExtraArgs:
    """``lamb()``'s step on the packed layout, with arguments ``lamb()`` has checked.

    Per dtype: with ``max_grad_norm``, a kernel for the grads' norms (the global norm's
    divisor); a kernel for the moments, which also gives the statistics of ``w`` and of
    the direction ``u``; a kernel for the update ``-lr * ratio * u``, ``u`` formed again
    from the new moments (a pass over them instead of a buffer of ``u``)."""

    def init_fn(params: optax.Params) -> FusedLambState:
        layout = _layout(params)
        return FusedLambState(jnp.zeros([], jnp.int32), layout.zeros(), layout.zeros())

    def update_fn(
        updates: optax.Updates, state: FusedLambState, params: optax.Params | None = None, **extra: Any
    ) -> tuple[optax.Updates, FusedLambState]:
        del extra
        inputs = _inputs(updates, params, trust_ratio_mask, weight_decay_mask)
        layout, (trust, decay) = inputs.layout, inputs.adapt_decay
        adapt = trust if adapt_without_decay else trust & decay
        count = optax.safe_increment(state.count)
        lr = rate_at(learning_rate, state.count)
        packed = list(zip(inputs.weights, inputs.grads))
        divisor: Any = 1.0
        if max_grad_norm is not None:
            stats = []
            for group, (_, g) in zip(layout.groups, packed):

                def grad_stats(g: jax.Array, ct: Any = group.compute_dtype) -> list[jax.Array]:
                    return list(piece_stats(g, ct))

                raw = row_call(grad_stats, [g], [], [], 2, group.compute_dtype)
                stats.append(leaf_stats(group, *raw))
            divisor = jnp.maximum(1.0, global_norm(norms_from_stats(stats, axis_name)) / max_grad_norm)
        b3 = (1 - b1) if grad_averaging else 1.0
        if freeze_step is None:
            keep_v, count_v = False, count
        else:
            keep_v, count_v = count > freeze_step, jnp.minimum(count, freeze_step)
        bc1 = 1 - b1**count if bias_correction else 1.0
        bc2 = 1 - b2**count_v if bias_correction else 1.0
        b2v, gv = jnp.where(keep_v, 1.0, b2), jnp.where(keep_v, 0.0, 1 - b2)
        moments, stats, wds = [], [], []
        for group, (w, g), m, v in zip(layout.groups, packed, state.mu, state.nu):
            ct = group.compute_dtype
            wd = jnp.where(jnp.asarray(_of(group, decay)), jnp.asarray(weight_decay, ct), 0.0)
            wds.append(wd)

            def moment(
                g: jax.Array, w: jax.Array, m: jax.Array, v: jax.Array, size: jax.Array,
                wd: jax.Array, div: jax.Array, b1: jax.Array, b3: jax.Array, b2v: jax.Array,
                gv: jax.Array, bc1: jax.Array, bc2: jax.Array, e: jax.Array, ct: Any = ct,
                dtype: Any = m.dtype,
            ) -> list[jax.Array]:  # fmt: skip
                wd, div, b1, b3, b2v, gv, bc1, bc2, e = (
                    x[:, None] for x in (wd, div, b1, b3, b2v, gv, bc1, bc2, e)
                )
                w32 = w.astype(ct)
                g32 = g.astype(ct) / div
                if not adam_w_mode:  # L2: the decay enters the moments
                    g32 = g32 + wd * w32
                m_new = (b1 * m.astype(ct) + b3 * g32).astype(dtype)
                v_new = (b2v * v.astype(ct) + gv * (g32 * g32)).astype(dtype)
                u = (m_new.astype(ct) / bc1) / (jnp.sqrt(v_new.astype(ct) / bc2) + e)
                if adam_w_mode:
                    u = u + wd * w32
                # The padding's u is 0 / 0 at eps = 0: left out of the norm.
                u = jnp.where(jax.lax.broadcasted_iota(jnp.int32, u.shape, 1) < size[:, None], u, 0.0)
                return [m_new, v_new, *piece_stats(w32, ct), *piece_stats(u, ct)]

            scalars = (divisor, b1, b3, b2v, gv, bc1, bc2, eps)
            pieces = [group.piece_sizes(), _pieces(group, wd)] + [_pieces(group, x) for x in scalars]
            m_new, v_new, *raw = row_call(
                moment, [g, w, m, v], pieces, [m.dtype, v.dtype], 4, ct, {2: 0, 3: 1}
            )
            moments.append((m_new, v_new))
            stats += [leaf_stats(group, raw[0], raw[1]), leaf_stats(group, raw[2], raw[3])]
        norms = norms_from_stats(stats, axis_name)
        new_updates: list[jax.Array] = []
        ratios: list[jax.Array] = []
        for k, (group, (w, _), (m, v), wd) in enumerate(zip(layout.groups, packed, moments, wds)):
            ct = group.compute_dtype
            w_norm, u_norm = norms[2 * k], norms[2 * k + 1]
            ratio = safe_ratio(w_norm, u_norm, w_norm, u_norm)
            if not adapt_without_decay:
                ratio = jnp.where(jnp.asarray(weight_decay) != 0, ratio, 1.0)
            ratio = jnp.where(jnp.asarray(_of(group, adapt)), ratio, 1.0)
            ratios.append(ratio)
            coef = -jnp.asarray(lr, ct) * ratio

            def apply(
                w: jax.Array, m: jax.Array, v: jax.Array, size: jax.Array, wd: jax.Array,
                coef: jax.Array, bc1: jax.Array, bc2: jax.Array, e: jax.Array, ct: Any = ct,
            ) -> list[jax.Array]:  # fmt: skip
                wd, coef, bc1, bc2, e = (x[:, None] for x in (wd, coef, bc1, bc2, e))
                u = (m.astype(ct) / bc1) / (jnp.sqrt(v.astype(ct) / bc2) + e)
                if adam_w_mode:
                    u = u + wd * w.astype(ct)
                # Zero in the padding (0 / 0 at eps = 0), which params kept packed keep.
                return [
                    jnp.where(jax.lax.broadcasted_iota(jnp.int32, u.shape, 1) < size[:, None], coef * u, 0.0)
                ]

            pieces = [group.piece_sizes()] + [_pieces(group, x) for x in (wd, coef, bc1, bc2, eps)]
            (update,) = row_call(apply, [w, m, v], pieces, [w.dtype], 0, ct)
            new_updates.append(update)
        new_state = FusedLambState(count, tuple(m for m, _ in moments), tuple(v for _, v in moments))
        telemetry.record_groups(updates, layout.groups, ratios)
        return inputs.finish(new_updates), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
