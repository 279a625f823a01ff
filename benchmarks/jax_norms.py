"""An experiment for the JAX step on a GPU: the norms in one pass and without a branch.

``largebatch.jax``'s norms take the plain sum of squares and, under a ``lax.cond`` per
leaf, a scaled pass where that sum overflowed or underflowed. On the CPU the conditional
costs nothing. On a GPU, XLA turns each such small conditional into a select, so both
branches run for every leaf on every step: ``benchmarks/xla_profile.py`` counted 1,147
kernels a ResNet-50 LARS step against 576 with plain norms, and the plain norms made the
step faster than optax's (docs/benchmarks.md, 2026-11-27). This module is one candidate
for the GPU: Blue's three sums (small, medium and big elements, each scaled so that its
squares stay in range; the classes of Anderson (2017), Algorithm 978, section 3) in one
variadic reduction, then brought to one scale under one square root. ``xla_profile.py``
times it as ``ours lars (one pass)``; ``tests/test_benchmarks.py`` holds it to float64
on every mix of magnitudes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from largebatch.checks import AxisName
from largebatch.lars.jax.norms import compute_dtype


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
    """The norm from :func:`_partial_sums` (over all blocks): the sums brought to one
    scale, the largest class's, and one square root. Where there are big elements the
    small ones cannot matter (Anderson 2017, Algorithm 978, section 3); where the medium
    sum is at least 2**-40 the small ones are added at its scale (what underflows there
    is below 2**-86 of it); else the medium ones at the small ones' scale. One chain of
    scalar operations, which XLA fuses into one kernel. A NaN element gives NaN, else an
    inf element inf."""
    big, medium, small = sums[0], sums[1], sums[2]
    _, _, ssml, sbig = _constants(sums.dtype)
    ssml, sbig = _opaque(ssml, sbig, sums.dtype)
    at_medium = medium >= 2.0**-40
    total = jnp.where(
        big > 0,
        big + (medium * sbig) * sbig,
        jnp.where(at_medium, medium + (small / ssml) / ssml, small + (medium * ssml) * ssml),
    )
    scale = jnp.where(big > 0, 1 / sbig, jnp.where(at_medium, 1.0, 1 / ssml))
    return jnp.sqrt(total) * scale


def one_pass_norms(leaves: Sequence[jax.Array], axis_name: AxisName = None) -> list[jax.Array]:
    """The norm of each leaf (of the whole array, with ``axis_name`` inside
    ``shard_map``: one ``psum`` of every leaf's three sums) from Blue's three sums."""
    sums = [_partial_sums(jnp.asarray(x).astype(compute_dtype(jnp.asarray(x)))) for x in leaves]
    if axis_name is not None:
        sums = jax.lax.psum(sums, axis_name)
    return [_norm_from_sums(s) for s in sums]
