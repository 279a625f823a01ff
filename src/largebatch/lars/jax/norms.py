"""The L2 norms of LARS and LAMB for JAX: one pass in the common case, safe from overflow
and underflow, in a form for the platform (a rescue pass under a ``lax.cond`` on the CPU,
Blue's three sums without a branch elsewhere); real for complex leaves; with an
``axis_name``, the norms of whole arrays whose blocks the devices of a ``shard_map`` hold."""

from __future__ import annotations

import math
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


def _constants(dtype: jnp.dtype) -> tuple[float, float, float, float]:
    """Blue's thresholds and scales for ``dtype``: ``(tsml, tbig, ssml, sbig)``.

    Squares of elements between ``tsml`` and ``tbig`` neither overflow nor underflow
    when summed; elements below ``tsml`` are squared after a scaling up by ``ssml``,
    those above ``tbig`` after a scaling down by ``sbig`` (all powers of two). The
    exponents are those of Anderson (2017), Algorithm 978, section 3 (LAPACK's
    ``la_constants``), written with numpy's exponent range."""
    info = jnp.finfo(dtype)
    digits, minexp, maxexp = info.nmant + 1, int(info.minexp) + 1, int(info.maxexp)
    return (
        2.0 ** math.ceil((minexp - 1) / 2),
        2.0 ** math.floor((maxexp - digits + 1) / 2),
        2.0 ** -math.floor((minexp - digits) / 2),
        2.0 ** -math.ceil((maxexp + digits - 1) / 2),
    )


def _opaque(ssml: float, sbig: float, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """The two scales as values XLA cannot see into: it would fold ``square(a * sbig)``
    into ``(a * a) * (sbig * sbig)``, and ``sbig * sbig`` is zero in float32."""
    pair = jax.lax.optimization_barrier(jnp.asarray([ssml, sbig], dtype))
    return pair[0], pair[1]


def _partial_sums(x: jax.Array) -> jax.Array:
    """``[big, medium, small]``: the three sums of one pass over ``x`` (real, at least
    float32; complex: its real and imaginary parts as elements) after Blue (1978): the
    squares of the medium elements as they are, of the big ones scaled down, of the
    small ones scaled up. Each sum is additive over blocks of ``x``."""
    if jnp.iscomplexobj(x):
        return _partial_sums(x.real) + _partial_sums(x.imag)
    tsml, tbig, ssml, sbig = _constants(x.dtype)
    ssml, sbig = _opaque(ssml, sbig, x.dtype)
    a = jnp.abs(x)
    big, small = a > tbig, a < tsml
    zero = jnp.zeros((), a.dtype)
    squares = (
        jnp.where(big, jnp.square(a * sbig), zero),
        jnp.where(big | small, zero, jnp.square(a)),
        jnp.where(small, jnp.square(a * ssml), zero),
    )
    # One variadic reduction: one read of ``x`` for the three sums.
    sums = jax.lax.reduce(
        squares, (zero,) * 3, lambda s, t: (s[0] + t[0], s[1] + t[1], s[2] + t[2]), tuple(range(a.ndim))
    )
    return jnp.stack(sums)


def _norm_from_sums(sums: jax.Array) -> jax.Array:
    """The norm from :func:`_partial_sums` (over all blocks), combined as Anderson
    (2017), Algorithm 978, does: where there are big elements the small ones cannot
    matter; where there are small and medium ones, the two partial norms are added
    without forming a square that could underflow. A NaN element gives NaN, else an
    inf element inf."""
    big, medium, small = sums[0], sums[1], sums[2]
    _, _, ssml, sbig = _constants(sums.dtype)
    ssml, sbig = _opaque(ssml, sbig, sums.dtype)
    # hypot: the partial norms added without squaring them again.
    with_big = jnp.hypot(jnp.sqrt(big), jnp.sqrt(medium) * sbig) / sbig
    y_small, y_medium = jnp.sqrt(small) / ssml, jnp.sqrt(medium)
    norm = jnp.where(
        big > 0,
        with_big,
        jnp.where(small > 0, jnp.where(medium > 0, jnp.hypot(y_small, y_medium), y_small), y_medium),
    )
    return jnp.where(jnp.isnan(medium), medium, norm)  # a NaN element lands in ``medium``


# ---------------------------------------------------------------- the rescued form


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


def rescued_norms(leaves: Sequence[jax.Array], axis_name: AxisName = None) -> list[jax.Array]:
    """The norms from the plain sums of squares, one pass, with a ``lax.cond`` per leaf
    to :func:`_exact_norm` where that sum may be wrong. The form for the CPU, where a
    conditional costs nothing and three sums would cost a pass's time again."""
    squares = _psum([jnp.sum(abs_sq(x)) for x in leaves], axis_name)
    return [_from_squares(s, x, axis_name) for s, x in zip(squares, leaves)]


def one_pass_norms(leaves: Sequence[jax.Array], axis_name: AxisName = None) -> list[jax.Array]:
    """The norms from Blue's three sums (:func:`_partial_sums`), one pass and no branch.
    The form for GPUs: XLA there turns each ``lax.cond`` of :func:`rescued_norms` into a
    select, so the scaled pass would run for every leaf on every step."""
    sums = _psum([_partial_sums(x) for x in leaves], axis_name)
    return [_norm_from_sums(s) for s in sums]


def _norms(leaves: list[jax.Array], axis_name: AxisName) -> list[jax.Array]:
    leaves = [jnp.asarray(x) for x in leaves]
    leaves = [x.astype(compute_dtype(x)) for x in leaves]
    return jax.lax.platform_dependent(
        leaves,
        cpu=lambda ls: rescued_norms(ls, axis_name),
        default=lambda ls: one_pass_norms(ls, axis_name),
    )


_norm_jit = jax.jit(lambda x: _norms([x], None)[0])


def _norm(x: jax.Array) -> jax.Array:
    """The L2 norm of ``x`` (real, at least float32), safe from overflow and underflow.

    One pass over ``x`` in the common case (no element below ~1e-19 or above ~4.5e15 in
    float32): the square root of the plain sum of squares. The form is chosen when the
    program is compiled for its platform (``lax.platform_dependent``): on the CPU
    :func:`rescued_norms`, elsewhere :func:`one_pass_norms`. Both hold to float64.
    Non-finite elements give a non-finite norm.
    """
    x = jnp.asarray(x)
    # Outside jit one compiled call per norm instead of an op-by-op dispatch; inside
    # jit the operations are traced in place.
    return _norms([x], None)[0] if isinstance(x, jax.core.Tracer) else _norm_jit(x)


def leaf_norms(leaves: Sequence[jax.Array], axis_name: AxisName = None) -> list[jax.Array]:
    """The norm of each of ``leaves``, as :func:`_norm` takes it.

    With ``axis_name`` each leaf is this device's block of an array sharded over those
    mesh axes (inside ``shard_map``), and its norm is that of the whole array: the local
    sums of all leaves are ``psum``-ed together (one collective). In the rescued form a
    leaf whose global sum overflows or is tiny is measured again by the scaled pass,
    with one power of two for all its blocks. The result is the same on every device.
    """
    if axis_name is None:
        return [_norm(x) for x in leaves]
    return _norms(list(leaves), axis_name)


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
