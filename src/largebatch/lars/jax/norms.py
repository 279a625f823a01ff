"""The L2 norms of LARS and LAMB for JAX: one pass in the common case, exact where the
plain sum of squares overflows or underflows; real for complex leaves; with an
``axis_name``, the norms of whole arrays whose blocks the devices of a ``shard_map`` hold."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from largebatch.checks import AxisName


def compute_dtype(x: jax.Array) -> jnp.dtype:
    """float32, or the dtype of ``x`` where that is wider (float64)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def abs_sq(x: jax.Array) -> jax.Array:
    """``|x|^2``, real: ``re^2 + im^2`` for complex ``x``."""
    if jnp.iscomplexobj(x):
        return jnp.square(x.real) + jnp.square(x.imag)
    return jnp.square(x)


def _powers_of_two(magnitude: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(2**-k, 2**k)`` with ``2**k <= magnitude < 2**(k + 1)`` for a normal ``magnitude``.

    Read from the exponent bits, so both are exact; ``k`` is clipped so that both are
    normal numbers (zero and subnormal magnitudes give the smallest ``k``, inf and NaN
    the largest).
    """
    info = jnp.finfo(magnitude.dtype)
    bias = 2 ** (info.nexp - 1) - 1
    uint = {32: jnp.uint32, 64: jnp.uint64}[info.bits]
    biased = (jax.lax.bitcast_convert_type(magnitude, uint) >> info.nmant) & (2 * bias + 1)
    biased = jnp.clip(biased, 1, 2 * bias - 1)
    down = jax.lax.bitcast_convert_type((2 * bias - biased) << info.nmant, magnitude.dtype)
    up = jax.lax.bitcast_convert_type(biased << info.nmant, magnitude.dtype)
    return down, up


def _psum(x: Any, axis_name: AxisName) -> Any:
    return x if axis_name is None else jax.lax.psum(x, axis_name)


def _exact_norm(x: jax.Array, axis_name: AxisName = None) -> jax.Array:
    """The norm of ``x`` (real, at least float32) after an exact power-of-two scaling:
    ``x`` is multiplied by ``2**-k``, with ``2**k`` the power of two at or below
    ``max |x|`` (``max(|re|, |im|)`` for complex ``x``), before squaring, so the scaled
    squares are below 8 and their sum cannot overflow. Two passes over ``x``.

    With ``axis_name``, ``x`` is this device's block of an array sharded over those
    axes: the largest magnitude is the ``pmax`` over the blocks, so every block is
    scaled by the same power of two, and the scaled squares are ``psum``-ed."""
    x = x.astype(compute_dtype(x))
    if jnp.iscomplexobj(x):
        magnitude = jnp.maximum(jnp.abs(x.real), jnp.abs(x.imag))
    else:
        magnitude = jnp.abs(x)
    largest = jnp.max(magnitude, initial=0.0)
    if axis_name is not None:
        largest = jax.lax.pmax(largest, axis_name)
    down, up = _powers_of_two(largest)
    return jnp.sqrt(_psum(jnp.sum(abs_sq(x * down)), axis_name)) * up


def _from_squares(squares: jax.Array, x: jax.Array, axis_name: AxisName) -> jax.Array:
    """The norm of ``x`` from its sum of squares ``squares`` (over all blocks with
    ``axis_name``), or from :func:`_exact_norm` where that sum may be wrong."""
    # One pass in the common case. The scaled pass runs only where the plain sum of
    # squares may be wrong: past the float range (||x|| > ~1.8e19 in float32), or so
    # small that squares of its elements may have rounded to zero (zero tensors too).
    # With axis_name, ``squares`` is a psum, the same on every device, so every device
    # takes the same branch (and the branch's collectives).
    fast = jnp.isfinite(squares) & (squares >= jnp.finfo(squares.dtype).tiny * 2.0**30)
    return jax.lax.cond(fast, lambda: jnp.sqrt(squares), lambda: _exact_norm(x, axis_name))


def _norm_of(x: jax.Array) -> jax.Array:
    x = x.astype(compute_dtype(x))
    return _from_squares(jnp.sum(abs_sq(x)), x, None)


_norm_of_jit = jax.jit(_norm_of)


def _norm(x: jax.Array) -> jax.Array:
    """The L2 norm of ``x`` (real, at least float32), safe from overflow and underflow.

    The sum of squares is formed in one pass; where it overflows (``||x|| > ~1.8e19`` in
    float32) or is tiny (below ~1e-29: elements' squares may have rounded to zero), the
    norm is taken again from ``x`` scaled by a power of two (:func:`_exact_norm`), inside
    a ``lax.cond``, so the common case pays nothing more. Non-finite elements give a
    non-finite norm.
    """
    x = jnp.asarray(x)
    # Outside jit one compiled call per norm instead of an op-by-op dispatch; inside
    # jit the operations are traced in place.
    return _norm_of(x) if isinstance(x, jax.core.Tracer) else _norm_of_jit(x)


def leaf_norms(leaves: Sequence[jax.Array], axis_name: AxisName = None) -> list[jax.Array]:
    """The norm of each of ``leaves``, as :func:`_norm` takes it.

    With ``axis_name`` each leaf is this device's block of an array sharded over those
    mesh axes (inside ``shard_map``), and its norm is that of the whole array: the local
    sums of squares of all leaves are ``psum``-ed together (one collective), and a leaf
    whose global sum overflows or is tiny is measured again by the scaled pass, with a
    common power of two for all its blocks. The result is the same on every device.
    """
    if axis_name is None:
        return [_norm(x) for x in leaves]
    leaves = [jnp.asarray(x) for x in leaves]
    leaves = [x.astype(compute_dtype(x)) for x in leaves]
    squares = jax.lax.psum([jnp.sum(abs_sq(x)) for x in leaves], axis_name)
    return [_from_squares(s, x, axis_name) for s, x in zip(squares, leaves)]


def global_norm(leaves: list[jax.Array], axis_name: AxisName = None) -> jax.Array:
    """The L2 norm of all ``leaves`` together: the norm of their norms, each overflow-safe
    (with ``axis_name``: the norms of the whole arrays, see :func:`leaf_norms`)."""
    norms = leaf_norms(leaves, axis_name)
    dtype = jnp.result_type(*norms)
    return _norm(jnp.stack([n.astype(dtype) for n in norms]))


def safe_ratio(
    numerator: jax.Array, denominator: jax.Array, w_norm: jax.Array, other_norm: jax.Array
) -> jax.Array:
    """``numerator / denominator``, or 1 where ``w_norm`` or ``other_norm`` is zero."""
    zero = jnp.logical_or(w_norm == 0.0, other_norm == 0.0)
    return jnp.where(zero, jnp.ones_like(numerator), numerator / jnp.where(zero, 1.0, denominator))
