"""Trust ratios under ``jit``: :func:`trust_ratios` runs an optimizer's update while the
trust-ratio transformations hand it the ratio of each leaf they scale (:func:`record`);
the update itself is discarded (``jit`` removes what the ratios do not need)."""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from largebatch.lars.jax.norms import compute_dtype
from largebatch.lars.jax.packed import Group, PackedParams

# The ratio trees handed over during trust_ratios(); None outside it (nothing is kept).
_RECORDED: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("trust_ratios", default=None)


def record(treedef: Any, ratios: Sequence[jax.Array]) -> None:
    """A trust-ratio transformation's ratio of each leaf it scales (``treedef``: that of
    the updates it was given, ``optax.MaskedNode`` where a mask left a leaf out), kept
    while :func:`trust_ratios` runs."""
    recorded = _RECORDED.get()
    if recorded is not None:
        recorded.append(jax.tree.unflatten(treedef, list(ratios)))


def record_groups(updates: Any, groups: Sequence[Group], ratios: Sequence[jax.Array]) -> None:
    """The fused path's ratios, one vector a group of its layout, as :func:`record` takes them."""
    if _RECORDED.get() is None:
        return
    treedef = updates.treedef if isinstance(updates, PackedParams) else jax.tree.structure(updates)
    leaves: list[Any] = [None] * sum(len(g.leaves) for g in groups)
    for group, ratio in zip(groups, ratios):
        for j, i in enumerate(group.leaves):
            leaves[i] = ratio[j]
    record(treedef, leaves)


def trust_ratios(
    optimizer: optax.GradientTransformation, updates: optax.Updates, state: optax.OptState, params: Any
) -> Any:
    """The trust ratio each leaf of ``params`` takes at the update ``optimizer.update(updates,
    state, params)`` would make, as a pytree of scalars shaped as ``params`` (their
    structure, for :class:`PackedParams`); 1 where no trust ratio applies (a masked-out
    leaf, or LAMB's ``adapt_without_decay=False`` at zero weight decay).

    The same code as the step computes the ratios: ``optimizer`` (``lars()``, ``lamb()``,
    fused or not, or any chain that holds their trust-ratio transformations) runs its
    update while they hand over their ratios; nothing of its state changes. Under
    ``jax.jit`` it compiles once, like the step, and only what the ratios need runs.
    Call it on the update itself, not inside a transformation that runs the update under
    ``jax.lax.cond`` (``optax.MultiSteps``), whose branches keep their values.

    Raises:
      ValueError: ``optimizer`` holds no trust-ratio transformation of largebatch.
    """
    recorded: list[Any] = []
    token = _RECORDED.set(recorded)
    try:
        optimizer.update(updates, state, params)
    finally:
        _RECORDED.reset(token)
    if not recorded:
        raise ValueError(
            "trust_ratios: the optimizer's update ran no trust-ratio transformation of largebatch "
            "(lars(), lamb(), scale_by_lars_trust_ratio, scale_by_lamb_trust_ratio)"
        )
    reference = params.structure() if isinstance(params, PackedParams) else params
    leaves, treedef = jax.tree.flatten(reference)
    out = [jnp.ones((), jnp.finfo(compute_dtype(jnp.asarray(leaf))).dtype) for leaf in leaves]
    for tree in recorded:
        flat = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
        if len(flat) != len(out):
            raise ValueError(
                f"trust_ratios: a trust-ratio transformation saw {len(flat)} leaves, params have {len(out)}"
            )
        for i, ratio in enumerate(flat):
            if not isinstance(ratio, optax.MaskedNode):
                out[i] = ratio
    return jax.tree.unflatten(treedef, out)
