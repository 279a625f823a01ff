"""The Pallas kernels of the fused JAX path: one program a row of the packed buffers
(``packed.py``), compiled on a GPU and interpreted on the CPU. :func:`row_call` runs a
body over the rows (:func:`block_call` over any row-wise blocks: AdaComp's bins too); the
bodies are the passes of LARS and LAMB (docs/jax.md, "The fused path"); :func:`piece_stats`
is the overflow-safe statistics each norm is formed from."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from largebatch.lars.jax.packed import SUB

PLATFORMS = ("cpu", "gpu", "cuda", "rocm")
# How the CPU runs the kernels' bodies: "xla", as one XLA computation over all rows (the
# bodies are row-wise: the same numbers), or "interpret", in Pallas's interpreter, whose
# time grows with the square of the rows (minutes for a ResNet-50 step); the tests take
# the interpreter, to run the kernels as a GPU compiles them.
CPU_KERNELS = "xla"


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


def _varying_as(x: jax.Array) -> dict[str, Any]:
    """The ``ShapeDtypeStruct`` keyword that types an output as varying over the
    ``shard_map`` axes as ``x`` does (``check_vma``): ``manual_axis_type`` in newer jax,
    ``vma`` in older; none outside ``shard_map``."""
    aval = jax.typeof(x)
    parameters = inspect.signature(jax.ShapeDtypeStruct).parameters
    for attribute, keyword in (("mat", "manual_axis_type"), ("vma", "vma")):
        value = getattr(aval, attribute, None)
        if value is not None and keyword in parameters:
            return {keyword: value}
    return {}


def _triton() -> Any:
    """The compiler parameters that take Pallas's Triton backend on a GPU (newer jax
    takes Mosaic GPU by default, whose copies are at most 256 elements a dimension)."""
    from jax.experimental.pallas import triton as pltriton

    # CompilerParams in current jax, TritonCompilerParams in older releases.
    params = (
        pltriton.CompilerParams
        if hasattr(pltriton, "CompilerParams")
        else vars(pltriton)["TritonCompilerParams"]
    )
    return params(num_warps=4)


def _varies(x: jax.Array) -> bool:
    """Whether ``x`` varies over ``shard_map`` axes under ``check_vma``."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)
    return bool(getattr(mat, "varying", None) or getattr(aval, "vma", None))


def row_call(
    body: Callable[..., Sequence[jax.Array]],
    packed: Sequence[jax.Array],
    per_piece: Sequence[jax.Array],
    out_packed: Sequence[Any],
    out_pieces: int,
    stats_dtype: Any,
    aliases: dict[int, int] | None = None,
) -> list[jax.Array]:
    """``body`` over every row of the ``(rows * SUB, PIECE)`` buffers ``packed``, with
    ``per_piece`` vectors (one value a piece: ``(rows * SUB,)``).

    ``body(*blocks, *piece_values)`` gets each buffer's row as a ``(SUB, PIECE)`` block
    and each vector's ``(SUB,)`` values, and returns the new rows of ``out_packed``
    (buffers of the dtypes given) followed by ``out_pieces`` vectors of ``stats_dtype``.
    ``aliases`` maps an index of ``packed`` to one of ``out_packed`` that overwrites it.
    One program a row: a grid of ``rows``."""
    return block_call(body, packed, per_piece, out_packed, [stats_dtype] * out_pieces, SUB, aliases)


def block_call(
    body: Callable[..., Sequence[jax.Array]],
    blocks: Sequence[jax.Array],
    vectors: Sequence[jax.Array],
    out_blocks: Sequence[Any],
    out_vectors: Sequence[Any],
    block_rows: int,
    aliases: dict[int, int] | None = None,
) -> list[jax.Array]:
    """``body`` over the 2-D arrays ``blocks`` (all ``(rows, width)``, ``rows`` a multiple
    of ``block_rows``), ``block_rows`` rows a program, with ``vectors`` of one value a row.

    ``body(*block_values, *vector_values)`` returns the blocks of ``out_blocks`` (arrays of
    the dtypes given, in ``blocks``' shape) followed by the values of ``out_vectors`` (a
    value a row, of the dtypes given). ``aliases`` maps an index of ``blocks`` to one of
    ``out_blocks`` that overwrites it. The body must be row-wise: on the CPU it runs on
    all rows at once (:data:`CPU_KERNELS`)."""
    rows, width = blocks[0].shape
    if rows == 0:
        return [jnp.zeros((0, width), d) for d in out_blocks] + [jnp.zeros((0,), d) for d in out_vectors]
    run_interpreted = interpret()
    if run_interpreted and (CPU_KERNELS == "xla" or _varies(blocks[0])):
        # The body is row-wise: on all rows at once it computes what the grid computes.
        # (Pallas's interpreter cannot type its loop for shard_map's check_vma either.)
        results = list(body(*blocks, *vectors))
        return [r.astype(d) for r, d in zip(results, [*out_blocks, *out_vectors])]
    block = pl.BlockSpec((block_rows, width), lambda i: (i, 0))
    per_row = pl.BlockSpec((block_rows,), lambda i: (i,))
    n_in = len(blocks) + len(vectors)

    def kernel(*refs: Any) -> None:
        values = [r[...] for r in refs[:n_in]]
        outs = body(*values)
        for ref, value in zip(refs[n_in:], outs):
            ref[...] = value.astype(ref.dtype)

    like = _varying_as(blocks[0])
    out_shape = [jax.ShapeDtypeStruct((rows, width), d, **like) for d in out_blocks]
    out_shape += [jax.ShapeDtypeStruct((rows,), d, **like) for d in out_vectors]
    results = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(rows // block_rows,),
        in_specs=[block] * len(blocks) + [per_row] * len(vectors),
        out_specs=tuple([block] * len(out_blocks) + [per_row] * len(out_vectors)),
        input_output_aliases=dict(aliases or {}),
        interpret=run_interpreted,
        **({} if run_interpreted else {"compiler_params": _triton()}),
    )(*blocks, *vectors)
    assert len(results) == len(out_shape)
    return list(results)
