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
``largebatch.jax.lars``. With ``pallas=True`` the two passes over the packed rows (the
sums of squares, the update) are Pallas kernels (compiled on a GPU, interpreted on the
CPU) instead of XLA's fusions: ``lars packed (jax, pallas)``. ``packed_rows_step`` is the
same step on params and grads the caller already keeps packed (no packing, no slicing):
``lars on packed rows (jax, pallas)``, the floor a fused JAX path can reach. The product's
fused path, ``lars(..., fused=True)`` (``largebatch.lars.jax.fused``, docs/jax.md), took
this layout (its rows are :data:`largebatch.lars.jax.packed.ROW` wide, as here) with
kernels of its own: overflow-safe norms, every option, and no scatter.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import pallas as pl

from largebatch.lars.jax.packed import ROW

CHUNK = ROW  # elements per row of the packed buffer, as the fused Triton path's chunks
# The kernels see each row as SUB pieces of CHUNK // SUB elements, BLOCK pieces a program.
SUB, BLOCK = 8, 8


class PackedState(NamedTuple):
    momentum: jax.Array  # every leaf's buffer in the packed layout: (rows, CHUNK)


def _rows(sizes: list[int]) -> list[int]:
    return [-(-n // CHUNK) for n in sizes]


def pack(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The leaves packed as (rows, CHUNK), each padded to whole rows, and each row's leaf
    (the ``owner`` of :func:`packed_rows_step`)."""
    rows = _rows([leaf.size for leaf in leaves])
    owner = jnp.asarray(np.repeat(np.arange(len(leaves)), rows), dtype=jnp.int32)
    return _pack(leaves, rows), owner


def _pack(leaves: list[jax.Array], rows: list[int]) -> jax.Array:
    """The leaves, each raveled and zero-padded to whole rows, as one (rows, CHUNK) array."""
    return jnp.concatenate(
        [jnp.pad(leaf.ravel(), (0, r * CHUNK - leaf.size)) for leaf, r in zip(leaves, rows)]
    ).reshape(-1, CHUNK)


def _interpret() -> bool:
    return jax.default_backend() == "cpu"


def _pieces(x: jax.Array) -> jax.Array:
    return x.reshape(-1, CHUNK // SUB)


def _sums_kernel(w_ref: Any, g_ref: Any, ws_ref: Any, gs_ref: Any) -> None:
    w = w_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    ws_ref[...] = jnp.sum(w * w, axis=1)
    gs_ref[...] = jnp.sum(g * g, axis=1)


def row_sums(w: jax.Array, g: jax.Array, pallas: bool) -> tuple[jax.Array, jax.Array]:
    """Each row's sums of squares of ``w`` and ``g`` ((rows, CHUNK) each): two (rows,) arrays."""
    if not pallas:
        return jnp.sum(w * w, axis=1), jnp.sum(g * g, axis=1)
    wp, gp = _pieces(w), _pieces(g)
    piece = pl.BlockSpec((BLOCK, CHUNK // SUB), lambda i: (i, 0))
    out = pl.BlockSpec((BLOCK,), lambda i: (i,))
    ws, gs = pl.pallas_call(
        _sums_kernel,
        out_shape=(jax.ShapeDtypeStruct((wp.shape[0],), jnp.float32),) * 2,
        grid=(wp.shape[0] // BLOCK,),
        in_specs=[piece, piece],
        out_specs=(out, out),
        interpret=_interpret(),
    )(wp, gp)
    return ws.reshape(-1, SUB).sum(axis=1), gs.reshape(-1, SUB).sum(axis=1)


def apply_rows(
    w: jax.Array,
    g: jax.Array,
    v: jax.Array,
    scale: jax.Array,
    momentum: float,
    weight_decay: float,
    pallas: bool,
) -> jax.Array:
    """The new momentum ``momentum * v + scale * (g + weight_decay * w)``, ``scale`` one
    value a row ((rows,)); the update is its negative."""
    if not pallas:
        return momentum * v + scale[:, None] * (g + weight_decay * w)

    def kernel(w_ref: Any, g_ref: Any, v_ref: Any, s_ref: Any, out_ref: Any) -> None:
        s = s_ref[...]
        out_ref[...] = momentum * v_ref[...] + s[:, None] * (g_ref[...] + weight_decay * w_ref[...])

    wp = _pieces(w)
    piece = pl.BlockSpec((BLOCK, CHUNK // SUB), lambda i: (i, 0))
    new_v = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(wp.shape, v.dtype),
        grid=(wp.shape[0] // BLOCK,),
        in_specs=[piece, piece, piece, pl.BlockSpec((BLOCK,), lambda i: (i,))],
        out_specs=piece,
        input_output_aliases={2: 0},
        interpret=_interpret(),
    )(wp, _pieces(g), _pieces(v), jnp.repeat(scale, SUB))
    return new_v.reshape(v.shape)


def packed_rows_step(
    w: jax.Array,
    g: jax.Array,
    v: jax.Array,
    owner: jax.Array,
    tensors: int,
    learning_rate: float,
    momentum: float,
    weight_decay: float,
    trust_coefficient: float,
    pallas: bool,
) -> jax.Array:
    """One LARS step on packed rows: the new momentum (the update is its negative).
    ``owner`` names each row's tensor (sorted), ``tensors`` how many there are."""
    ws, gs = row_sums(w, g, pallas)

    def norms(rows: jax.Array) -> jax.Array:
        return jnp.sqrt(jax.ops.segment_sum(rows, owner, tensors, indices_are_sorted=True))

    w_norm, g_norm = norms(ws), norms(gs)
    ratio = jnp.where(
        (w_norm > 0) & (g_norm > 0), trust_coefficient * w_norm / (g_norm + weight_decay * w_norm), 1.0
    )
    return apply_rows(w, g, v, learning_rate * ratio[owner], momentum, weight_decay, pallas)


def packed_lars(
    learning_rate: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    pallas: bool = False,
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
        v = packed_rows_step(
            w,
            g,
            state.momentum,
            owner,
            len(sizes),
            learning_rate,
            momentum,
            weight_decay,
            trust_coefficient,
            pallas,
        )
        flat = -v.reshape(-1)
        starts = np.cumsum([0, *rows[:-1]]) * CHUNK
        updates = [flat[s : s + leaf.size].reshape(leaf.shape) for s, leaf in zip(starts, leaves)]
        return jax.tree.unflatten(treedef, updates), PackedState(v)

    return optax.GradientTransformation(init, update)
