"""Which leaves LARS and LAMB adapt and decay: optax masks, combined leaf by leaf.

A mask is ``None`` (every leaf), a pytree of bools with the structure of the params (or
a prefix of it), or a callable returning one, as in ``optax.masked``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

Mask = Any  # None, a pytree (or prefix) of bools, or a callable params -> such a pytree

_STATIC = (
    "under optax.inject_hyperparams, name the masks in static_args, e.g. "
    "inject_hyperparams(lars, static_args=('trust_ratio_mask', 'weight_decay_mask')), "
    "so that they are not taken for hyperparameters or schedules"
)


def check_masks(**masks: Mask) -> None:
    """Refuse a mask that is an array (a traced or concrete value): the masks decide the
    structure of the chain, so they must be known when it is built. That is what
    ``optax.inject_hyperparams`` passes for a mask it took for a hyperparameter."""
    for name, mask in masks.items():
        if isinstance(mask, (jax.Array, np.ndarray, np.generic)):
            raise TypeError(
                f"Invalid {name}: an array ({type(mask).__name__} of shape "
                f"{jnp.shape(mask)}); a mask is None, a pytree of bools or a callable on the "
                f"params, fixed when the optimizer is built: {_STATIC}"
            )


def exclusion_mask(params: Any) -> Any:
    """True for leaves that get the trust ratio and weight decay, False for ``ndim <= 1``.

    Pass it as ``trust_ratio_mask``: vectors (biases, normalization scales and shifts)
    and scalars are excluded, as MLPerf does. It decides by shape alone. The default
    rule of ``largebatch.torch.param_groups`` also excludes a param whose *name* ends
    in ``.bias``, whatever its shape; so the two splits differ only for a bias of
    ``ndim >= 2``, which this mask adapts and decays. To exclude such leaves too, pass
    a mask that also reads the path, e.g.::

        def mask(params):
            return jax.tree_util.tree_map_with_path(
                lambda path, p: jnp.ndim(p) > 1 and "bias" not in jax.tree_util.keystr(path),
                params,
            )
    """
    if (
        isinstance(params, (jax.Array, np.ndarray, np.generic))
        and jnp.ndim(params) == 0
        and jnp.issubdtype(jnp.result_type(params), jnp.integer)
    ):
        raise TypeError(f"exclusion_mask was called on a step count ({params!r}), not on params: {_STATIC}")
    return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


def full_mask(mask: Mask, tree: Any) -> Any:
    """``mask`` resolved against ``tree``: a pytree of bools with its full structure."""
    if mask is None:
        return jax.tree.map(lambda _: True, tree)
    if callable(mask):
        mask = mask(tree)
    return jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: flag, sub), mask, tree)


def mask_and(a: Mask, b: Mask, negate_b: bool = False) -> Mask:
    """The leaf-wise ``a and b`` (or ``a and not b``) of two optax masks, as a callable."""
    if b is None and not negate_b:
        return a

    def mask_fn(tree: Any) -> Any:
        return jax.tree.map(
            lambda x, y: bool(x) and (bool(y) != negate_b),
            full_mask(a, tree),
            full_mask(b, tree),
        )

    return mask_fn


def masked(inner: optax.GradientTransformation, mask: Mask) -> optax.GradientTransformation:
    """``inner`` on the leaves where ``mask`` holds (on every leaf for ``None``)."""
    return inner if mask is None else optax.masked(inner, mask)
