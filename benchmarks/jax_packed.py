"""An experiment for the JAX step on a GPU: LARS on one packed buffer instead of per leaf.

Under ``jax.jit`` on an H100, optax's ``lars`` and ours reach 5-7% of the two-pass memory
bound on ResNet-50's 161 tensors (docs/benchmarks.md): XLA runs each leaf's norms and
update as fusions of their own. Before a fused JAX path is built (Pallas kernels over a
packed layout), this measures what packing alone gives: every step concatenates the
params and grads into one buffer of 4,096-element rows (each leaf padded to whole rows,
as the fused Triton path chunks its tensors), takes each row's sums of squares and adds
them per tensor, updates the momentum kept packed in the state, and slices the update
back into the leaves. It computes ``largebatch.jax.lars`` with its defaults (every leaf
adapted and decayed) but with plain sums of squares, without the rescaled pass for tiny
or huge norms, so it is the cheaper of the two. ``optimizer_step.py`` times it as
``lars packed (jax, jit)``; ``tests/test_benchmarks.py`` holds it to
``largebatch.jax.lars``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

CHUNK = 4096  # elements per row of the packed buffer, as the fused Triton path's chunks


class PackedState(NamedTuple):
    momentum: jax.Array  # every leaf's buffer in the packed layout: (rows, CHUNK)


def _rows(sizes: list[int]) -> list[int]:
    return [-(-n // CHUNK) for n in sizes]


def _pack(leaves: list[jax.Array], rows: list[int]) -> jax.Array:
    """The leaves, each raveled and zero-padded to whole rows, as one (rows, CHUNK) array."""
    return jnp.concatenate(
        [jnp.pad(leaf.ravel(), (0, r * CHUNK - leaf.size)) for leaf, r in zip(leaves, rows)]
    ).reshape(-1, CHUNK)


def packed_lars(
    learning_rate: float, momentum: float = 0.9, weight_decay: float = 0.0, trust_coefficient: float = 0.001
) -> optax.GradientTransformation:
    """``largebatch.jax.lars(learning_rate, momentum, weight_decay, trust_coefficient)`` on
    one packed buffer (a constant rate; plain sums of squares)."""

    def init(params: Any) -> PackedState:
        leaves = jax.tree.leaves(params)
        rows = sum(_rows([leaf.size for leaf in leaves]))
        return PackedState(jnp.zeros((rows, CHUNK), leaves[0].dtype))

    def update(grads: Any, state: PackedState, params: Any = None) -> tuple[Any, PackedState]:
        leaves, treedef = jax.tree.flatten(params)
        sizes = [leaf.size for leaf in leaves]
        rows = _rows(sizes)
        w, g = _pack(leaves, rows), _pack(jax.tree.leaves(grads), rows)
        # Each row's tensor: one small constant (a row per 4,096 elements), no per-element ids.
        owner = jnp.asarray(np.repeat(np.arange(len(sizes)), rows), dtype=jnp.int32)

        def norms(x: jax.Array) -> jax.Array:
            return jnp.sqrt(
                jax.ops.segment_sum(jnp.sum(x * x, axis=1), owner, len(sizes), indices_are_sorted=True)
            )

        w_norm, g_norm = norms(w), norms(g)
        ratio = jnp.where(
            (w_norm > 0) & (g_norm > 0), trust_coefficient * w_norm / (g_norm + weight_decay * w_norm), 1.0
        )
        v = momentum * state.momentum + learning_rate * ratio[owner][:, None] * (g + weight_decay * w)
        flat = -v.reshape(-1)
        starts = np.cumsum([0, *rows[:-1]]) * CHUNK
        updates = [flat[s : s + leaf.size].reshape(leaf.shape) for s, leaf in zip(starts, leaves)]
        return jax.tree.unflatten(treedef, updates), PackedState(v)

    return optax.GradientTransformation(init, update)
