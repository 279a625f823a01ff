"""AdaComp's compressor for JAX: one leaf into a message of fixed size (:func:`compress`)
and back (:func:`decode`), the message's capacity, and the arithmetic of the scale (an
exactly rounded sum and mean)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from largebatch import checks
from largebatch.comm.reference import bin_length, check_compression, fit_bin

DEFAULT_BIN_CAPACITY = 8  # message entries per bin of L_T elements


class AdaCompMessage(NamedTuple):
    """One leaf's compressed message on one device, of fixed size.

    ``indices``: int32 ``[capacity]``, the flat indices of the sent elements in
    increasing order, then the fill value ``numel`` (one past the end). ``values``:
    int8 signs (``+1``/``-1``, 0 in the padding) for ``values="ternary"``, or the
    exact values ``G`` (0 in the padding) for ``values="exact"``. ``scale``: the ternary
    scale (0 when nothing is sent, and for ``values="exact"``). ``count``: int32, the
    elements sent (at most ``capacity``). ``selected``: int32, the elements AdaComp
    selected (``count`` plus those deferred by the capacity).
    """

    indices: jax.Array
    values: jax.Array
    scale: jax.Array
    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count
    selected: jax.Array


# ----------------------------------------------------------------------------- checks


def compute_dtype(x: Any) -> jnp.dtype:
    """float32, or float64 for float64 leaves; a TypeError for anything not real floating."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"AdaComp compresses real floating arrays, got dtype {dtype}")
    return jnp.promote_types(dtype, jnp.float32)


def compressible(leaf: Any, conv_bin: int, fc_bin: int) -> int | None:
    """``L_T`` for a leaf to compress; None for one sent uncompressed: rank 0 or 1, empty,
    or not real floating (integer or complex gradients are averaged as they are)."""
    shape = jnp.shape(leaf)
    if math.prod(shape) == 0 or not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
        return None
    return bin_length(shape, conv_bin, fc_bin)


def default_capacity(numel: int, bin_len: int, bin_capacity: int | None = DEFAULT_BIN_CAPACITY) -> int:
    """The message length for ``numel`` elements in bins of ``bin_len``:
    ``bin_capacity`` entries per bin (the last, short bin counts as one), at most
    ``numel``; ``bin_capacity=None``: ``numel`` (never exceeded)."""
    nbins = -(-numel // bin_len)
    return numel if bin_capacity is None else min(numel, bin_capacity * nbins)


def chunk_length(numel: int, bin_len: int, n: int) -> int:
    """The two-phase exchange's chunk length for ``n`` devices: whole bins, enough of
    them that ``n`` chunks cover ``numel`` elements (``reference.chunk_bounds``'s size;
    chunk ``j`` starts at ``j * chunk_length``; the last ones may reach past the leaf)."""
    bin_len = fit_bin(bin_len, numel)
    nbins = -(-numel // bin_len)
    return -(-nbins // n) * bin_len


def message_capacity(capacity: Any, span: int, bin_len: int) -> int:
    """A message length: ``capacity`` (int >= 1) or the default, at most ``span``."""
    if capacity is None:
        return default_capacity(span, bin_len)
    return min(checks.integer("capacity", capacity, 1), span)


# ------------------------------------------------------------------------- arithmetic


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a + b = s + e`` exactly (Knuth's TwoSum: no condition on the magnitudes)."""
    s = a + b
    bv = s - a
    return s, (a - (s - bv)) + (b - bv)


def add_pair(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Double-word addition of two normalized pairs of nonnegative numbers."""
    s, e = _two_sum(a[0], b[0])
    e = e + (a[1] + b[1])
    hi = s + e  # s >= |e|: Fast2Sum renormalizes
    return hi, e - (hi - s)


def _sum_pair(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The sum of ``x`` (1-D, nonnegative) as a normalized pair ``hi + lo``: one
    ``lax.reduce`` whose combiner is a double-word addition, so the pair is within about
    ``n * eps**2`` of the exact sum whatever order XLA reduces in, and ``hi`` is the
    exactly rounded sum (but for sums within that of a rounding tie)."""
    zero = jnp.zeros((), x.dtype)
    return lax.reduce((x, jnp.zeros_like(x)), (zero, zero), add_pair, (0,))


def _split(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x = hi + lo`` exactly, by masking off the low bits of the significand (no rounding,
    whatever the compiler contracts): float32 keeps 12 significant bits in ``hi`` (``lo``:
    at most 12), float64 26 (``lo``: at most 27)."""
    if x.dtype == jnp.float64:
        bits = lax.bitcast_convert_type(x, jnp.uint64) & jnp.uint64(0xFFFFFFFFF8000000)
        hi = lax.bitcast_convert_type(bits, jnp.float64)
    else:
        bits = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFF000)
        hi = lax.bitcast_convert_type(bits, jnp.float32)
    return hi, x - hi


def divide(hi: jax.Array, lo: jax.Array, c: jax.Array) -> jax.Array:
    """``(hi + lo) / c``, correctly rounded, for ``c`` a positive integer (below ``2**12``
    in float32 exactly, any count in practice). XLA rewrites a division by a scalar
    broadcast as a product with its reciprocal (off by an ulp about a third of the time
    for ``c = 3``); the quotient is corrected by the division's remainder, which
    Dekker's product gives exactly (``hi - p``: exact, Sterbenz)."""
    q = hi / c
    p = q * c
    qh, ql = _split(q)
    ch, cl = _split(c)
    err = ((qh * ch - p) + qh * cl + ql * ch) + ql * cl  # q * c = p + err exactly
    return q + (((hi - p) - err) + lo) / c


def pair_mean(hi: jax.Array, lo: jax.Array, count: jax.Array) -> jax.Array:
    """``(hi + lo) / count`` (0 for ``count == 0``): in float32 the exactly rounded
    quotient (:func:`divide`); in float64 ``hi / count``, the reference's ``fsum /
    count`` (a scalar division: not rewritten)."""
    c = jnp.maximum(count, 1).astype(hi.dtype)
    q = divide(hi, lo, c) if hi.dtype == jnp.float32 else hi / c
    return jnp.where(count > 0, q, jnp.zeros_like(q))


# --------------------------------------------------------------------------- compressor


class CompressedRows(NamedTuple):
    residual: jax.Array  # flat, numel
    indices: jax.Array  # [rows, capacity] int32, relative to the row; fill row_len
    values: jax.Array  # [rows, capacity] int8 signs or exact values
    scale: jax.Array
    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count
    selected: jax.Array


def compress_rows(
    r: jax.Array, g: jax.Array, bin_len: int, rows: int, row_len: int, capacity: int, select: str, values: str
) -> CompressedRows:
    """Algorithm 1 on the flat ``r``, ``g`` (compute dtype), zero-padded to ``rows`` rows of
    ``row_len`` elements (whole bins), sending at most ``capacity`` per row: the first
    selected of each row in index order."""
    numel, total = r.shape[0], rows * row_len
    big_g = r + g
    gp = jnp.pad(big_g, (0, total - numel))  # the padding is never selected: G = 0
    nonzero = gp != 0
    if select == "all":
        mask = nonzero
    else:
        h = jnp.abs(jnp.pad(big_g + g, (0, total - numel))).reshape(-1, bin_len)
        gmax = jnp.max(jnp.abs(gp).reshape(-1, bin_len), axis=1, keepdims=True)
        mask = (h >= gmax).reshape(-1) & nonzero
    m = mask.reshape(rows, row_len)
    pos = jnp.cumsum(m, axis=1, dtype=jnp.int32) - 1  # rank among the row's selected
    keep = m & (pos < capacity)
    slot = jnp.where(keep, pos, capacity)  # out of range: dropped
    col = jnp.broadcast_to(jnp.arange(row_len, dtype=jnp.int32), (rows, row_len))
    row = jnp.broadcast_to(jnp.arange(rows, dtype=jnp.int32)[:, None], (rows, row_len))
    indices = jnp.full((rows, capacity), row_len, jnp.int32).at[row, slot].set(col, mode="drop")
    picked = jnp.take_along_axis(gp.reshape(rows, row_len), indices, axis=1, mode="fill", fill_value=0)
    keep = keep.reshape(-1)
    count = jnp.sum(keep, dtype=jnp.int32)
    selected = jnp.sum(mask, dtype=jnp.int32)
    if values == "exact":
        scale = jnp.zeros((), gp.dtype)
        vals = picked
        sent = jnp.where(keep, gp, 0)
    else:
        scale = pair_mean(*_sum_pair(jnp.abs(picked).reshape(-1)), count)
        vals = jnp.sign(picked).astype(jnp.int8)
        sent = jnp.where(keep, jnp.sign(gp) * scale, 0)
    return CompressedRows((gp - sent)[:numel], indices, vals, scale, count, selected)


def flat_pair(residual: Any, grad: Any) -> tuple[jax.Array, jax.Array, jnp.dtype]:
    dtype = compute_dtype(grad)
    r, g = jnp.asarray(residual).reshape(-1), jnp.asarray(grad).reshape(-1)
    if r.shape != g.shape:
        raise ValueError(f"residual has {r.size} elements, gradient {g.size}")
    return r.astype(dtype), g.astype(dtype), dtype


def compress(
    residual: Any,
    grad: Any,
    bin_len: int,
    *,
    capacity: int | None = None,
    select: str = "adacomp",
    values: str = "ternary",
) -> tuple[jax.Array, AdaCompMessage]:
    """AdaComp on one leaf (Algorithm 1, as ``reference.compress``), with a fixed-size message.

    Selection, scale and residual are the reference's, restricted to the first
    ``capacity`` selected elements in index order: an element selected beyond them is
    not sent and stays in the residual (``r_new = G`` there), and the scale is the mean
    ``|G|`` of the elements sent. Jit-able; every shape depends on the arguments' shapes
    and on ``capacity`` only.

    Args:
      residual: the residual ``r``, any shape with ``grad.size`` elements.
      grad: the gradient ``g``, a real floating array (compressed in float32, or
        float64 for float64).
      bin_len: ``L_T``, an int >= 1.
      capacity: the message length, an int >= 1 (capped at ``grad.size``); None:
        :func:`default_capacity` (:data:`DEFAULT_BIN_CAPACITY` per bin).
      select: ``"adacomp"``, or ``"all"`` (every element with ``G != 0``).
      values: ``"ternary"`` (sign times scale), or ``"exact"`` (``G`` as it is).

    Returns:
      ``(new_residual, message)``: the residual ``G - sent`` in ``grad``'s shape and the
      compute dtype, and the :class:`AdaCompMessage`; :func:`decode` gives ``sent``.

    Raises:
      ValueError: naming the value, for a bad ``bin_len``, ``capacity``, ``select`` or
        ``values``, or a residual of another size.
      TypeError: for a gradient that is not real floating.
    """
    check_compression(bin_len, select, values)
    r, g, dtype = flat_pair(residual, grad)
    numel = g.shape[0]
    shape = jnp.shape(grad)
    if numel == 0:
        empty = jnp.zeros(0, jnp.int32)
        vals = jnp.zeros(0, jnp.int8 if values == "ternary" else dtype)
        zero = jnp.zeros((), jnp.int32)
        return r.reshape(shape), AdaCompMessage(empty, vals, jnp.zeros((), dtype), zero, zero)
    bin_len = fit_bin(bin_len, numel)
    cap = message_capacity(capacity, numel, bin_len)
    nbins = -(-numel // bin_len)
    parts = compress_rows(r, g, bin_len, 1, nbins * bin_len, cap, select, values)
    indices = jnp.minimum(parts.indices[0], numel)
    message = AdaCompMessage(indices, parts.values[0], parts.scale, parts.count, parts.selected)
    return parts.residual.reshape(shape), message


def decode(message: AdaCompMessage, shape: Sequence[int]) -> jax.Array:
    """The dense vector a message stands for (``sent``), in ``shape``, in the scale's dtype."""
    numel = math.prod(shape)
    dtype = message.scale.dtype
    vals = message.values.astype(dtype)
    if message.values.dtype == jnp.int8:  # ternary signs
        vals = vals * message.scale
    return jnp.zeros(numel, dtype).at[message.indices].set(vals, mode="drop").reshape(shape)
