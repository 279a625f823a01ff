"""The Pallas kernels of the fused JAX path: one program a row of the packed buffers
(``packed.py``), compiled on a GPU and interpreted on the CPU. :func:`row_call` runs a
body over the rows; the bodies are the passes of LARS and LAMB (docs/jax.md, "The fused
path"); :func:`piece_stats` is the overflow-safe statistics each norm is formed from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from largebatch.lars.jax.packed import PIECE, SUB

PLATFORMS = ("cpu", "gpu", "cuda", "rocm")


def interpret(what: str = "fused=True") -> bool:
    """Whether the kernels run interpreted (the CPU) or compiled (a GPU); a ValueError
    naming ``what`` on any other platform."""
    backend = jax.default_backend()
    if backend not in PLATFORMS:
        raise ValueError(
            f"Invalid {what} on {backend}: the fused path's Pallas kernels run compiled on a "
            "GPU and interpreted on the CPU; use fused=False here"
        )
    return backend == "cpu"


def piece_stats(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Of each piece (a row of ``x``, a ``(SUB, PIECE)`` block): its largest magnitude
    ``m`` (kept within the normal range) and ``s``, the sum of squares of the piece
    divided by ``m``, below ``PIECE``: ``||piece|| = sqrt(s) * m`` without overflow or
    underflow. A non-finite element gives a non-finite ``s`` (NaN where one is NaN)."""
    info = jnp.finfo(dtype)
    x = x.astype(dtype)
    peak = jnp.minimum(jnp.maximum(jnp.max(jnp.abs(x), axis=1), info.tiny), 2.0 ** (info.maxexp - 2))
    y = x * (1.0 / peak)[:, None]
    return peak, jnp.sum(y * y, axis=1)


def row_call(
    body: Callable[..., Sequence[jax.Array]],
    packed: Sequence[jax.Array],
    per_piece: Sequence[jax.Array],
    out_packed: Sequence[Any],
    out_pieces: int,
    stats_dtype: Any,
    aliases: dict[int, int] | None = None,
) -> list[jax.Array]:
    """``body`` over every row of the ``(rows, ROW)`` buffers ``packed``, with
    ``per_piece`` vectors (one value a piece: ``(rows * SUB,)``).

    ``body(*blocks, *piece_values)`` gets each buffer's row as a ``(SUB, PIECE)`` block
    and each vector's ``(SUB,)`` values, and returns the new rows of ``out_packed``
    (buffers of the dtypes given) followed by ``out_pieces`` vectors of ``stats_dtype``.
    ``aliases`` maps an index of ``packed`` to one of ``out_packed`` that overwrites it.
    One program a row: a grid of ``rows``."""
    rows = packed[0].shape[0]
    shape = (rows * SUB, PIECE)
    if rows == 0:
        return [jnp.zeros((0, packed[0].shape[1]), d) for d in out_packed] + [
            jnp.zeros((0,), stats_dtype) for _ in range(out_pieces)
        ]
    block = pl.BlockSpec((SUB, PIECE), lambda i: (i, 0))
    piece = pl.BlockSpec((SUB,), lambda i: (i,))
    n_in, n_out = len(packed) + len(per_piece), len(out_packed) + out_pieces

    def kernel(*refs: Any) -> None:
        values = [r[...] for r in refs[:n_in]]
        outs = body(*values)
        for ref, value in zip(refs[n_in:], outs):
            ref[...] = value.astype(ref.dtype)

    out_shape = [jax.ShapeDtypeStruct(shape, d) for d in out_packed]
    out_shape += [jax.ShapeDtypeStruct((rows * SUB,), stats_dtype)] * out_pieces
    results = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(rows,),
        in_specs=[block] * len(packed) + [piece] * len(per_piece),
        out_specs=tuple([block] * len(out_packed) + [piece] * out_pieces),
        input_output_aliases=dict(aliases or {}),
        interpret=interpret(),
    )(*[b.reshape(shape) for b in packed], *per_piece)
    assert len(results) == n_out
    return [r.reshape(rows, -1) for r in results[: len(out_packed)]] + list(results[len(out_packed) :])
