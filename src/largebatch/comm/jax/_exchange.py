"""AdaComp's exchanges of one leaf for JAX, inside ``jax.shard_map``: the all-gather form
(:func:`allgather_mean`) and the two-phase form (:func:`two_phase_mean`), with the packing
of their messages and their sums in device order."""

from __future__ import annotations

import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from largebatch import checks
from largebatch.checks import AxisName
from largebatch.comm.jax._compress import (
    AdaCompMessage,
    CompressedRows,
    chunk_length,
    compress,
    compress_rows,
    divide,
    flat_pair,
    message_capacity,
)
from largebatch.comm.reference import check_compression

_MAX_SPAN = 2**30 - 1  # index * 2 + sign bit must fit an int32 (with the fill value)
_GATHER_TO = "to" in inspect.signature(lax.all_gather).parameters


def check_span(span: int, values: str) -> None:
    if values == "ternary" and span > _MAX_SPAN:
        raise ValueError(
            f"a compressed leaf (or chunk) of {span} elements is too long for "
            f"the int32 message codes (at most {_MAX_SPAN})"
        )


def pack_codes(indices: jax.Array, signs: jax.Array) -> jax.Array:
    """One int32 per entry: ``index * 2 + (sign < 0)`` (``signs``: anything of the sent
    values' signs, the values themselves included)."""
    return indices * 2 + (signs < 0).astype(jnp.int32)


def unpack_codes(codes: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Indices and values of packed ternary messages ``[n, capacity]``, each entry's
    scale given by ``scale`` (broadcast against ``codes``)."""
    negative = (codes & 1) == 1
    return codes >> 1, jnp.where(negative, -scale, scale)


def all_gather(x: Any, axis_name: AxisName) -> Any:
    """``lax.all_gather`` typed as the same on every device (``check_vma``), where jax
    has the option."""
    if _GATHER_TO:
        return lax.all_gather(x, axis_name, to="invarying")
    return lax.all_gather(x, axis_name)  # pragma: no cover (older jax)


def axis_size(axis_name: AxisName) -> int:
    if hasattr(lax, "axis_size"):
        return lax.axis_size(axis_name)
    return lax.psum(1, axis_name)  # pragma: no cover (older jax: a static int)


def ordered_mean(indices: jax.Array, vals: jax.Array, length: int) -> jax.Array:
    """The messages ``[n, capacity]`` (indices, decoded values) summed in device order into
    a dense vector of ``length`` and divided by ``n`` (correctly rounded, as torch divides):
    device 0's decoded vector, then one scatter-add per device (its indices are distinct),
    as ``reference``'s ordered sum. An index of ``length`` or more is dropped."""
    n = indices.shape[0]
    total = jnp.zeros(length, vals.dtype).at[indices[0]].set(vals[0], mode="drop")

    def add(k: jax.Array, acc: jax.Array) -> jax.Array:
        return acc.at[indices[k]].add(vals[k], mode="drop")

    total = lax.fori_loop(1, n, add, total)
    return divide(total, jnp.zeros_like(total), jnp.asarray(n, total.dtype))


def _exchanged(parts: CompressedRows, values: str, route: Any) -> tuple[jax.Array, jax.Array]:
    """Every device's message rows (``route`` moves them: all-gather or all-to-all) as
    indices and decoded values ``[n, capacity]``, in device order."""
    if values == "exact":
        return route(parts.indices), route(parts.values)
    codes = pack_codes(parts.indices, parts.values)
    return unpack_codes(route(codes), route(parts.scale)[:, None])


def allgather_mean(
    residual: Any,
    grad: Any,
    bin_len: int | None,
    axis_name: AxisName,
    *,
    capacity: int | None = None,
    select: str = "adacomp",
    values: str = "ternary",
) -> tuple[jax.Array, Any, AdaCompMessage | None]:
    """The all-gather exchange of one leaf, inside ``jax.shard_map`` over ``axis_name``.

    Each device compresses its ``grad`` (:func:`compress`), the messages are all-gathered
    (ternary entries packed into one int32 each), decoded and summed in device order and
    divided by the axis size: ``reference.allgather_exchange`` when no device exceeds
    ``capacity``. The result is the same on every device.

    Args:
      residual: this device's residual for the leaf (``grad.size`` elements).
      grad: this device's gradient.
      bin_len: ``L_T``; None sends the leaf uncompressed (``lax.pmean``, the residual
        returned as it came).
      axis_name: the data-parallel mesh axis (a name, or a tuple of names).
      capacity: the message length (see :func:`compress`).
      select: as in :func:`compress`.
      values: as in :func:`compress`.

    Returns:
      ``(mean, new_residual, message)``: the average in ``grad``'s shape and dtype, the
      new residual (``grad``'s shape, compute dtype), and this device's message (None
      for ``bin_len=None``).
    """
    axis_name = checks.axis_name("axis_name", axis_name)
    if bin_len is None:
        return lax.pmean(grad, axis_name), residual, None
    new_residual, message = compress(residual, grad, bin_len, capacity=capacity, select=select, values=values)
    shape, numel = jnp.shape(grad), math.prod(jnp.shape(grad))
    if numel == 0:
        return lax.pmean(grad, axis_name), new_residual, message
    check_span(numel, values)
    parts = CompressedRows(
        new_residual, message.indices, message.values, message.scale, message.count, message.selected
    )
    indices, vals = _exchanged(parts, values, lambda x: all_gather(x, axis_name))
    mean = ordered_mean(indices, vals, numel)
    return mean.reshape(shape).astype(jnp.result_type(grad)), new_residual, message


def two_phase_mean(
    residual: Any,
    chunk_residual: Any,
    grad: Any,
    bin_len: int,
    axis_name: AxisName,
    *,
    capacity: int | None = None,
    select: str = "adacomp",
    values: str = "ternary",
) -> tuple[jax.Array, jax.Array, jax.Array, AdaCompMessage]:
    """The two-phase exchange of one leaf, inside ``jax.shard_map`` over ``axis_name``.

    The leaf is cut into ``n`` chunks of :func:`chunk_length` (whole bins); device ``j``
    owns chunk ``j``. Phase 1: each device compresses its ``grad`` with the first
    ``capacity`` selected elements of *each chunk* in its message, and ``lax.all_to_all``
    gives device ``j`` everyone's chunk ``j``, which it sums in device order and divides
    by ``n``. Phase 2: device ``j`` compresses that average with its ``chunk_residual``
    (capacity ``capacity``) and the re-compressed chunks are all-gathered by everyone:
    ``reference.two_phase_exchange`` when no chunk's message is exceeded.

    Args:
      residual: this device's residual for the leaf (``grad.size`` elements).
      chunk_residual: this device's residual for the chunk it owns, ``chunk_length``
        elements (zeros to start; the tail past the leaf stays 0).
      grad: this device's gradient.
      bin_len: ``L_T``, an int >= 1.
      axis_name: the data-parallel mesh axis (a name, or a tuple of names).
      capacity: the length of each chunk's message, in both phases; None:
        :func:`default_capacity` of the chunk (:data:`DEFAULT_BIN_CAPACITY` per bin).
      select: as in :func:`compress`.
      values: as in :func:`compress`.

    Returns:
      ``(mean, new_residual, new_chunk_residual, message)``: the result in ``grad``'s
      shape and dtype (the same on every device), the new residuals (compute dtype; the
      first in ``grad``'s shape, the second flat), and this device's phase-1 message
      (indices relative to each chunk, ``[n, capacity]``; ``count`` and ``selected`` for
      the whole leaf).
    """
    axis_name = checks.axis_name("axis_name", axis_name)
    check_compression(bin_len, select, values)
    r, g, dtype = flat_pair(residual, grad)
    shape, numel = jnp.shape(grad), g.shape[0]
    n = axis_size(axis_name)
    span = chunk_length(numel, bin_len, n)
    cr = jnp.asarray(chunk_residual).reshape(-1).astype(dtype)
    if cr.shape != (span,):
        raise ValueError(
            f"chunk residual has {cr.size} elements, the chunk {span} "
            f"({numel} elements in bins of {bin_len} over {n} devices)"
        )
    if numel == 0:
        zero = jnp.zeros((), jnp.int32)
        message = AdaCompMessage(
            jnp.zeros((n, 0), jnp.int32), jnp.zeros((n, 0), dtype), jnp.zeros((), dtype), zero, zero
        )
        return lax.pmean(grad, axis_name), r.reshape(shape), cr, message
    check_span(span, values)
    cap = message_capacity(capacity, span, bin_len)
    parts = compress_rows(r, g, bin_len, n, span, cap, select, values)

    def to_owner(x: jax.Array) -> jax.Array:
        if x.ndim == 0:  # the scale: every owner needs every device's
            return lax.all_gather(x, axis_name)
        return lax.all_to_all(x, axis_name, 0, 0, tiled=True)

    indices, vals = _exchanged(parts, values, to_owner)
    chunk_mean = ordered_mean(indices, vals, span)
    again = compress_rows(cr, chunk_mean, bin_len, 1, span, cap, select, values)
    again = again._replace(indices=again.indices[0], values=again.values[0])
    indices, vals = _exchanged(again, values, lambda x: all_gather(x, axis_name))
    offsets = jnp.arange(n, dtype=jnp.int32)[:, None] * span
    where = jnp.where(indices < span, indices + offsets, n * span)  # fill: dropped
    out = jnp.zeros(n * span, dtype).at[where.reshape(-1)].set(vals.reshape(-1), mode="drop")
    message = AdaCompMessage(parts.indices, parts.values, parts.scale, parts.count, parts.selected)
    mean = out[:numel].reshape(shape).astype(jnp.result_type(grad))
    return mean, parts.residual.reshape(shape), again.residual, message
