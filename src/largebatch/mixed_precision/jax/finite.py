"""Finiteness checks and step skipping: whether a step's gradients are all finite, and an
optax wrapper that turns a step with an inf or a NaN into a no-op."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


def is_float(x: Any) -> bool:
    """True for an array (anything with a dtype) of a floating dtype."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def all_finite(tree: Any) -> jax.Array:
    """True (a scalar ``bool`` array) when no floating leaf of ``tree`` holds inf or NaN.

    Non-floating leaves are ignored; an empty tree is finite. Works under ``jit``:
    the answer stays on the device.
    """
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if is_float(x)]
    if not leaves:
        return jnp.array(True)
    return jnp.all(jnp.stack(leaves))


def select_tree(pred: Any, on_true: Any, on_false: Any) -> Any:
    """``on_true`` where the scalar ``pred`` holds, else ``on_false``, leaf by leaf.

    For state outside the optimizer (batch-norm statistics, an EMA of the weights) that
    must also stay put on a skipped step. Both trees need the same structure and dtypes.
    """
    pred = jnp.asarray(pred)
    if pred.shape != ():
        raise ValueError(f"pred must be a scalar, got shape {pred.shape}")
    return jax.tree.map(lambda a, b: jax.lax.select(pred, a, b), on_true, on_false)


class SkipIfNonfiniteState(NamedTuple):
    """State of :func:`skip_if_nonfinite`.

    Attributes:
      inner_state: the wrapped transformation's state, as of the last finite step.
      skipped: how many steps were skipped since ``init`` (int32).
      last_finite: whether the last step's gradients were all finite.
    """

    inner_state: Any
    skipped: jax.Array
    last_finite: jax.Array


def skip_if_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    r"""Wrap ``inner`` so that a step whose gradients hold an inf or a NaN does nothing.

    .. math::

        (u, s') = \begin{cases} \text{inner.update}(g, s, w) & \text{all of } g \text{ finite} \\
                                (-0, s) & \text{otherwise} \end{cases}

    On a skipped step the updates are negative zeros (``w + (-0) == w`` bitwise for
    every ``w``, ``-0.0`` included, which ``+0`` would flip) and the inner state is
    returned as it was: momentum, moments and step counts (LAMB's bias correction
    included) do not move, so ``optax.apply_updates`` leaves the parameters
    bit-for-bit unchanged. The choice is made with ``jax.lax.cond`` on the device,
    with no host synchronisation; the inner update is not computed on a skipped step.

    Unlike ``optax.apply_if_finite`` it never gives up and applies a non-finite
    update: with :class:`DynamicLossScale` an overflow is resolved by lowering the
    scale, so every bad step is skipped.

    Args:
      inner: the transformation to protect, e.g. ``largebatch.jax.lamb(...)``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`SkipIfNonfiniteState`.
    """
    inner = optax.with_extra_args_support(inner)

    def init_fn(params: optax.Params) -> SkipIfNonfiniteState:
        return SkipIfNonfiniteState(
            inner_state=inner.init(params),
            skipped=jnp.zeros((), jnp.int32),
            last_finite=jnp.array(True),
        )

    def update_fn(
        updates: optax.Updates,
        state: SkipIfNonfiniteState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, SkipIfNonfiniteState]:
        finite = all_finite(updates)

        def apply(_: None) -> tuple[optax.Updates, optax.OptState]:
            return inner.update(updates, state.inner_state, params, **extra_args)

        new_updates_shape, _ = jax.eval_shape(apply, None)

        def skip(_: None) -> tuple[optax.Updates, optax.OptState]:
            zeros = jax.tree.map(lambda s: jnp.full(s.shape, -0.0, s.dtype), new_updates_shape)
            return zeros, state.inner_state

        new_updates, inner_state = jax.lax.cond(finite, apply, skip, None)
        skipped = state.skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
        return new_updates, SkipIfNonfiniteState(inner_state, skipped, finite)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
