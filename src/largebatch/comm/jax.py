"""AdaComp for JAX: the compressor with static shapes, its exchanges inside ``jax.shard_map``,
and an optax transformation to chain before the optimizer.

The compression is :mod:`largebatch.comm.reference`'s (Chen et al. 2018, arXiv 1712.02679,
Algorithm 1): per leaf, ``G = r + g``, ``H = G + g``, bins of ``L_T`` elements, an element
selected where ``|H| >= max |G|`` of its bin (and ``G != 0``), sent as ``sign(G) * scale``
with ``scale`` the mean ``|G|`` of the leaf's sent elements, and ``r_new = G - sent``.
Weights of rank 3 or more take ``conv_bin`` (50), rank 2 ``fc_bin`` (500); rank 0 and 1
leaves (biases, normalization) are averaged uncompressed with ``lax.pmean``.

Example (data parallelism over the mesh axis ``"data"``; params replicated, each device
differentiates its shard of the batch)::

    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from largebatch.jax import adacomp, adacomp_init_state, lars

    mesh = Mesh(np.array(jax.devices()), ("data",))
    opt = optax.chain(adacomp("data", warmup_steps=2), lars(0.1, weight_decay=1e-4))

    def loss_fn(params, x, y):
        h = jnp.tanh(x @ params["w1"] + params["b1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    keys = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(keys[0], (16, 64)) / 4, "b1": jnp.zeros(64),
              "w2": jax.random.normal(keys[1], (64, 4)) / 8}
    params = jax.device_put(params, NamedSharding(mesh, P()))  # replicated
    state, state_specs = adacomp_init_state(opt, params, mesh, "data")

    def train_step(params, state, x, y):  # runs on every device, on its shard of x, y
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)  # the AdaComp exchange
        return optax.apply_updates(params, updates), state

    train_step = jax.jit(jax.shard_map(
        train_step, mesh=mesh, in_specs=(P(), state_specs, P("data"), P("data")),
        out_specs=(P(), state_specs)))
    batch = jax.device_put(jax.random.normal(keys[2], (8 * len(jax.devices()), 16)),
                           NamedSharding(mesh, P("data")))
    target = jax.device_put(jax.random.normal(keys[3], (8 * len(jax.devices()), 4)),
                            NamedSharding(mesh, P("data")))
    for _ in range(5):  # compiled once
        params, state = train_step(params, state, batch, target)
    checkpoint = jax.device_get(state)  # numpy; every device's residuals
    state = jax.device_put(checkpoint, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                    state_specs))

**Static shapes.** Under ``jit`` the message must have a fixed size, so the compressor
(:func:`compress`) returns the indices of the *first* ``capacity`` selected elements in
index order (int32, padded with a fill value out of range), one sign each (int8; or the
exact values for ``values="exact"``), the scale and the counts. An element selected
beyond the capacity is not sent and not dropped: it stays in the residual, so
``sent + r_new = r + g`` holds whatever the capacity, and it is sent at a later step. The
scale is the mean over the elements actually sent. When the capacity is not exceeded,
every output is the reference's. The capacity is the traffic: each device sends
``capacity`` 4-byte entries per leaf (index and sign packed into one int32) however few
are selected. :data:`DEFAULT_BIN_CAPACITY` (8) entries per bin are 16% of a
convolution's elements (a 6x smaller message than the dense leaf) and 1.6% of a fully
connected one's (62x); AdaComp selects about 2 to 5 elements per bin once the residuals
have built up (the paper; this package's study: about 4.5 per bin of 50 on
convolutions), more in the first steps after the warm-up. A smaller capacity sends less
but defers more; a leaf whose selections exceed its capacity step after step would
never send its last elements (they are last in index order), so watch
``AdaCompState.selected`` against the capacity (:func:`default_capacity`) and raise
``bin_capacity`` if it stays above. ``bin_capacity=None`` makes the message as long as
the leaf: never exceeded, no saving.

**Exchanges** (inside ``jax.shard_map`` over ``axis_name``):

- :func:`allgather_mean`: every device ``lax.all_gather``\\ s every device's message,
  decodes and sums them in device order (``lax.fori_loop``, one scatter-add per device,
  so every device adds the same numbers in the same order) and divides by the axis size.
  Each device receives ``n`` messages: it pays off against a dense all-reduce (about
  ``2 * size`` per device) while ``n * capacity < 2 * size``.
- :func:`two_phase_mean`: the leaf is cut into one chunk of whole bins per device
  (:func:`chunk_length`); each device's message is built per chunk (the first
  ``capacity`` selected of *each* chunk) and ``lax.all_to_all`` brings device ``j``
  everyone's chunk ``j``; the owner averages it in device order, compresses the average
  again with its own chunk residual (state), and an all-gather of the re-compressed
  chunks finishes. Each device sends and receives about ``2 * capacity`` entries per
  chunk whatever ``n``. ``lax.all_to_all`` works on the host (CPU) platform too, so it
  is used rather than an all-gather-and-slice, which would cost the all-gather's traffic.

Both collectives that produce the result gather with ``to="invarying"``, so under
``shard_map``'s ``check_vma`` the averaged gradient is typed as the same on every device
(as ``lax.pmean``'s is) and replicated params can be returned with ``P()``.

**The optax transformation** :func:`adacomp` keeps per leaf a residual (and for
``form="two_phase"`` a chunk residual), both per device, and a step count. Its state
lives inside ``shard_map``: ``init`` runs there (:func:`adacomp_init_state` does it for a
whole optimizer) and every per-device leaf has a leading axis of length 1 there, of
length ``n`` outside (``P(axis_name)``): ``state.residuals[...][k]`` is device ``k``'s
residual. :func:`adacomp_state_specs` gives the specs of a state holding AdaComp states
(in a chain, ``optax.MultiSteps``, ``optax.inject_hyperparams``). Scalars (the count)
are replicated (``P()``).

Arithmetic. Compression runs in float32 (float64 for float64 leaves); bf16 and fp16
gradients are compressed in float32 and the averaged result has the gradient's dtype.
The scale's sum of ``|G|`` is accumulated in double-word arithmetic (a pair of floats,
error-free additions) so it is the exactly rounded sum; the float32 scale is then the
exactly rounded mean (as the reference's float64 scale rounded to float32, and as the
torch compressor's float64 accumulation gives), the float64 scale the exactly rounded sum
divided by the count (the reference's own arithmetic). Counts above ``2**24`` in float32
round.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from largebatch import checks
from largebatch.comm.reference import (
    CONV_BIN, FC_BIN, FORMS, _check_modes, bin_length, check_options, fit_bin,
)
from largebatch.lars.jax.norms import AxisName, _check_axis_name

__all__ = [
    "DEFAULT_BIN_CAPACITY",
    "FORMS",
    "AdaCompMessage",
    "AdaCompState",
    "adacomp",
    "adacomp_init_state",
    "adacomp_state_specs",
    "allgather_mean",
    "chunk_length",
    "compress",
    "decode",
    "default_capacity",
    "two_phase_mean",
]

DEFAULT_BIN_CAPACITY = 8  # message entries per bin of L_T elements
_MAX_SPAN = 2**30 - 1  # index * 2 + sign bit must fit an int32 (with the fill value)
_GATHER_TO = "to" in inspect.signature(lax.all_gather).parameters


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


class AdaCompState(NamedTuple):
    """State of :func:`adacomp`, held inside ``shard_map``.

    ``count``: int32 scalar, the updates so far (warm-up included), replicated.
    ``residuals``: per leaf, this device's residual, shape ``(1, *leaf.shape)`` inside
    ``shard_map`` (``(n, *leaf.shape)`` outside, ``P(axis_name)``), float32 (float64 for
    float64 leaves); None for leaves sent uncompressed. ``chunk_residuals``: for
    ``form="two_phase"``, per leaf, the residual of the chunk this device owns, shape
    ``(1, chunk_length)`` (:func:`chunk_length`; the tail beyond the leaf stays 0);
    None otherwise. ``selected``: per leaf, int32 ``(1,)``, the elements this device
    selected at the last compressed update (0 until then; phase 1 for two-phase):
    ``leaf.size / selected`` is the compression rate, and ``selected`` above the
    leaf's capacity means elements were deferred.
    """

    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count
    residuals: Any
    chunk_residuals: Any
    selected: Any


# ----------------------------------------------------------------------------- checks


def _check_bin(bin_len: Any) -> int:
    return checks.integer("bin length L_T", bin_len, 1)


def _compute_dtype(x: Any) -> jnp.dtype:
    """float32, or float64 for float64 leaves; a TypeError for anything not real floating."""
    dtype = jnp.result_type(x)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"AdaComp compresses real floating arrays, got dtype {dtype}")
    return jnp.promote_types(dtype, jnp.float32)


def _compressible(leaf: Any, conv_bin: int, fc_bin: int) -> int | None:
    """``L_T`` for a leaf to compress; None for one sent uncompressed: rank 0 or 1, empty,
    or not real floating (integer or complex gradients are averaged as they are)."""
    shape = jnp.shape(leaf)
    if math.prod(shape) == 0 or not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
        return None
    return bin_length(shape, conv_bin, fc_bin)


def default_capacity(numel: int, bin_len: int,
                     bin_capacity: int | None = DEFAULT_BIN_CAPACITY) -> int:
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


def _capacity(capacity: Any, span: int, bin_len: int) -> int:
    """A message length: ``capacity`` (int >= 1) or the default, at most ``span``."""
    if capacity is None:
        return default_capacity(span, bin_len)
    return min(checks.integer("capacity", capacity, 1), span)


def _check_span(span: int, values: str) -> None:
    if values == "ternary" and span > _MAX_SPAN:
        raise ValueError(f"a compressed leaf (or chunk) of {span} elements is too long for "
                         f"the int32 message codes (at most {_MAX_SPAN})")


# ------------------------------------------------------------------------- arithmetic


def _two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a + b = s + e`` exactly (Knuth's TwoSum: no condition on the magnitudes)."""
    s = a + b
    bv = s - a
    return s, (a - (s - bv)) + (b - bv)


def _add_pair(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
              ) -> tuple[jax.Array, jax.Array]:
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
    return lax.reduce((x, jnp.zeros_like(x)), (zero, zero), _add_pair, (0,))


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


def _divide(hi: jax.Array, lo: jax.Array, c: jax.Array) -> jax.Array:
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


def _mean(hi: jax.Array, lo: jax.Array, count: jax.Array) -> jax.Array:
    """``(hi + lo) / count`` (0 for ``count == 0``): in float32 the exactly rounded
    quotient (:func:`_divide`); in float64 ``hi / count``, the reference's ``fsum /
    count`` (a scalar division: not rewritten)."""
    c = jnp.maximum(count, 1).astype(hi.dtype)
    q = _divide(hi, lo, c) if hi.dtype == jnp.float32 else hi / c
    return jnp.where(count > 0, q, jnp.zeros_like(q))


# --------------------------------------------------------------------------- compressor


class _Parts(NamedTuple):
    residual: jax.Array  # flat, numel
    indices: jax.Array  # [rows, capacity] int32, relative to the row; fill row_len
    values: jax.Array  # [rows, capacity] int8 signs or exact values
    scale: jax.Array
    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count
    selected: jax.Array


def _compress_rows(r: jax.Array, g: jax.Array, bin_len: int, rows: int, row_len: int,
                   capacity: int, select: str, values: str) -> _Parts:
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
    picked = jnp.take_along_axis(gp.reshape(rows, row_len), indices, axis=1, mode="fill",
                                 fill_value=0)
    keep = keep.reshape(-1)
    count = jnp.sum(keep, dtype=jnp.int32)
    selected = jnp.sum(mask, dtype=jnp.int32)
    if values == "exact":
        scale = jnp.zeros((), gp.dtype)
        vals = picked
        sent = jnp.where(keep, gp, 0)
    else:
        scale = _mean(*_sum_pair(jnp.abs(picked).reshape(-1)), count)
        vals = jnp.sign(picked).astype(jnp.int8)
        sent = jnp.where(keep, jnp.sign(gp) * scale, 0)
    return _Parts((gp - sent)[:numel], indices, vals, scale, count, selected)


def _flat_pair(residual: Any, grad: Any) -> tuple[jax.Array, jax.Array, jnp.dtype]:
    dtype = _compute_dtype(grad)
    r, g = jnp.asarray(residual).reshape(-1), jnp.asarray(grad).reshape(-1)
    if r.shape != g.shape:
        raise ValueError(f"residual has {r.size} elements, gradient {g.size}")
    return r.astype(dtype), g.astype(dtype), dtype


def compress(residual: Any, grad: Any, bin_len: int, *, capacity: int | None = None,
             select: str = "adacomp", values: str = "ternary",
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
    _check_bin(bin_len)
    _check_modes(select, values)
    r, g, dtype = _flat_pair(residual, grad)
    numel = g.shape[0]
    shape = jnp.shape(grad)
    if numel == 0:
        empty = jnp.zeros(0, jnp.int32)
        vals = jnp.zeros(0, jnp.int8 if values == "ternary" else dtype)
        zero = jnp.zeros((), jnp.int32)
        return r.reshape(shape), AdaCompMessage(empty, vals, jnp.zeros((), dtype), zero, zero)
    bin_len = fit_bin(bin_len, numel)
    cap = _capacity(capacity, numel, bin_len)
    nbins = -(-numel // bin_len)
    parts = _compress_rows(r, g, bin_len, 1, nbins * bin_len, cap, select, values)
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


# ---------------------------------------------------------------------------- exchanges


def _pack(indices: jax.Array, signs: jax.Array) -> jax.Array:
    """One int32 per entry: ``index * 2 + (sign < 0)``."""
    return indices * 2 + (signs < 0).astype(jnp.int32)


def _unpack(codes: jax.Array, scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Indices and values of packed ternary messages ``[n, capacity]`` with their scales
    ``[n]``."""
    negative = (codes & 1) == 1
    scale = scales[:, None]
    return codes >> 1, jnp.where(negative, -scale, scale)


def _gather(x: Any, axis_name: AxisName) -> Any:
    """``lax.all_gather`` typed as the same on every device (``check_vma``), where jax
    has the option."""
    if _GATHER_TO:
        return lax.all_gather(x, axis_name, to="invarying")
    return lax.all_gather(x, axis_name)  # pragma: no cover (older jax)


def _axis_size(axis_name: AxisName) -> int:
    if hasattr(lax, "axis_size"):
        return lax.axis_size(axis_name)
    return lax.psum(1, axis_name)  # pragma: no cover (older jax: a static int)


def _ordered_mean(indices: jax.Array, vals: jax.Array, length: int) -> jax.Array:
    """The messages ``[n, capacity]`` (indices, decoded values) summed in device order into
    a dense vector of ``length`` and divided by ``n`` (correctly rounded, as torch divides):
    device 0's decoded vector, then one scatter-add per device (its indices are distinct),
    as ``reference``'s ordered sum."""
    n = indices.shape[0]
    total = jnp.zeros(length, vals.dtype).at[indices[0]].set(vals[0], mode="drop")

    def add(k, acc):
        return acc.at[indices[k]].add(vals[k], mode="drop")

    total = lax.fori_loop(1, n, add, total)
    return _divide(total, jnp.zeros_like(total), jnp.asarray(n, total.dtype))


def _exchanged(parts: _Parts, values: str, route: Any) -> tuple[jax.Array, jax.Array]:
    """Every device's message rows (``route`` moves them: all-gather or all-to-all) as
    indices and decoded values ``[n, capacity]``, in device order."""
    if values == "exact":
        return route(parts.indices), route(parts.values)
    codes = _pack(parts.indices, parts.values)
    return _unpack(route(codes), route(parts.scale))


def allgather_mean(residual: Any, grad: Any, bin_len: int | None, axis_name: AxisName, *,
                   capacity: int | None = None, select: str = "adacomp",
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
    axis_name = _check_axis_name(axis_name)
    if bin_len is None:
        return lax.pmean(grad, axis_name), residual, None
    new_residual, message = compress(residual, grad, bin_len, capacity=capacity,
                                     select=select, values=values)
    shape, numel = jnp.shape(grad), math.prod(jnp.shape(grad))
    if numel == 0:
        return lax.pmean(grad, axis_name), new_residual, message
    _check_span(numel, values)
    parts = _Parts(new_residual, message.indices, message.values, message.scale,
                   message.count, message.selected)
    indices, vals = _exchanged(parts, values, lambda x: _gather(x, axis_name))
    mean = _ordered_mean(indices, vals, numel)
    return mean.reshape(shape).astype(jnp.result_type(grad)), new_residual, message


def two_phase_mean(residual: Any, chunk_residual: Any, grad: Any, bin_len: int,
                   axis_name: AxisName, *, capacity: int | None = None,
                   select: str = "adacomp", values: str = "ternary",
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
    axis_name = _check_axis_name(axis_name)
    _check_bin(bin_len)
    _check_modes(select, values)
    r, g, dtype = _flat_pair(residual, grad)
    shape, numel = jnp.shape(grad), g.shape[0]
    n = _axis_size(axis_name)
    span = chunk_length(numel, bin_len, n)
    cr = jnp.asarray(chunk_residual).reshape(-1).astype(dtype)
    if cr.shape != (span,):
        raise ValueError(f"chunk residual has {cr.size} elements, the chunk {span} "
                         f"({numel} elements in bins of {bin_len} over {n} devices)")
    if numel == 0:
        zero = jnp.zeros((), jnp.int32)
        message = AdaCompMessage(jnp.zeros((n, 0), jnp.int32), jnp.zeros((n, 0), dtype),
                                 jnp.zeros((), dtype), zero, zero)
        return lax.pmean(grad, axis_name), r.reshape(shape), cr, message
    _check_span(span, values)
    cap = _capacity(capacity, span, bin_len)
    parts = _compress_rows(r, g, bin_len, n, span, cap, select, values)

    def to_owner(x):
        if x.ndim == 0:  # the scale: every owner needs every device's
            return lax.all_gather(x, axis_name)
        return lax.all_to_all(x, axis_name, 0, 0, tiled=True)

    indices, vals = _exchanged(parts, values, to_owner)
    chunk_mean = _ordered_mean(indices, vals, span)
    again = _compress_rows(cr, chunk_mean, bin_len, 1, span, cap, select, values)
    again = again._replace(indices=again.indices[0], values=again.values[0])
    indices, vals = _exchanged(again, values, lambda x: _gather(x, axis_name))
    offsets = jnp.arange(n, dtype=jnp.int32)[:, None] * span
    where = jnp.where(indices < span, indices + offsets, n * span)  # fill: dropped
    out = jnp.zeros(n * span, dtype).at[where.reshape(-1)].set(vals.reshape(-1), mode="drop")
    message = AdaCompMessage(parts.indices, parts.values, parts.scale, parts.count,
                             parts.selected)
    mean = out[:numel].reshape(shape).astype(jnp.result_type(grad))
    return mean, parts.residual.reshape(shape), again.residual, message


# ------------------------------------------------------------------------------- optax


def _all_finite(leaves: Sequence[Any]) -> jax.Array:
    """Whether every element of every leaf is finite (True for no leaves)."""
    flags = [jnp.isfinite(x).all() for x in leaves
             if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.stack(flags).all() if flags else jnp.asarray(True)


def adacomp(axis_name: AxisName, *, warmup_steps: int = 0, conv_bin: int = CONV_BIN,
            fc_bin: int = FC_BIN, bin_capacity: int | None = DEFAULT_BIN_CAPACITY,
            form: str = "allgather", select: str = "adacomp", values: str = "ternary",
            ) -> optax.GradientTransformationExtraArgs:
    """AdaComp's compressed average of the gradients over ``axis_name``, as an optax
    transformation for use inside ``jax.shard_map``.

    Chain it first, before the optimizer: ``optax.chain(adacomp("data"), lars(...))``.
    ``update`` takes this device's gradients and returns their average over the
    devices of ``axis_name``, the same on every device: weights of rank 3 or more
    compressed with bins of ``conv_bin``, rank 2 with ``fc_bin``, everything else
    (biases, normalization parameters, empty or non-real-floating leaves) averaged
    with ``lax.pmean``. During the first ``warmup_steps`` updates every leaf is
    ``pmean``-ed and the residuals stay zero (a ``lax.cond`` on the step count: one
    compiled step for both). A step where any device's gradients hold an inf or NaN is
    such a plain step too, on every device, and leaves every residual as it was (the
    inf reaches the result, so ``skip_if_nonfinite`` around the optimizer after it skips
    the step on every device); so does a step whose compressed average overflows the leaves' dtype (fp16):
    gradient is delayed, never dropped. The state (:class:`AdaCompState`) holds
    per-device residuals: create it inside ``shard_map`` (:func:`adacomp_init_state`) and pass it
    in and out with :func:`adacomp_state_specs`. See the module docstring for an
    example.

    ``optax.MultiSteps`` around a chain holding it works (its accumulated gradients are
    per device too; :func:`adacomp_state_specs` gives them ``P(axis_name)``), but
    ``MultiSteps`` runs the inner update at every mini-step and keeps it at the last
    one only, so the exchange runs, and costs, every mini-step. Its arguments are all
    static (shapes and branches depend on them): there is nothing to inject with
    ``optax.inject_hyperparams``; inject the optimizer after it instead.

    Args:
      axis_name: the data-parallel mesh axis (a name, or a tuple of names).
      warmup_steps: updates sent uncompressed first, an int >= 0.
      conv_bin: ``L_T`` for weights of rank 3 or more, an int >= 1.
      fc_bin: ``L_T`` for weights of rank 2, an int >= 1.
      bin_capacity: message entries per bin (an int >= 1; the message of a leaf of
        ``nbins`` bins has ``bin_capacity * nbins`` entries, at most its size; per chunk
        for two-phase); None: as many as elements (never exceeded, nothing saved). See
        "Static shapes" in the module docstring.
      form: ``"allgather"`` (:func:`allgather_mean`) or ``"two_phase"``
        (:func:`two_phase_mean`; the state holds a chunk residual per leaf).
      select: ``"adacomp"``, or ``"all"``: every element with ``G != 0``.
      values: ``"ternary"``, or ``"exact"``: the values as they are. With
        ``select="all"``, ``values="exact"`` and ``bin_capacity=None`` the result is the
        plain average.

    Returns:
      An ``optax.GradientTransformation`` (``update`` ignores ``params``).

    Raises:
      ValueError: naming the value, for ``warmup_steps < 0``, a bin length or
        ``bin_capacity`` below 1 (or not an int), an unknown ``form``, ``select`` or
        ``values``, or a bad ``axis_name``; at construction.
      TypeError: for an ``axis_name`` that is not a str or a tuple of strs.
    """
    if axis_name is None:
        raise ValueError("axis_name must name the data-parallel mesh axis, got None")
    axis_name = _check_axis_name(axis_name)
    options = check_options(warmup_steps=warmup_steps, conv_bin=conv_bin, fc_bin=fc_bin,
                            form=form, select=select, values=values)
    warmup_steps, conv_bin, fc_bin = (options[k] for k in ("warmup_steps", "conv_bin", "fc_bin"))
    if bin_capacity is not None:
        bin_capacity = checks.integer("bin_capacity", bin_capacity, 1)
    two_phase = form == "two_phase"

    def bins_of(leaves):
        return [_compressible(x, conv_bin, fc_bin) for x in leaves]

    def capacity(numel, bin_len):
        return default_capacity(numel, bin_len, bin_capacity)

    def init_fn(params):
        leaves, treedef = jax.tree.flatten(params)
        bins = bins_of(leaves)
        res = [None if b is None else jnp.zeros((1, *jnp.shape(p)), _compute_dtype(p))
               for p, b in zip(leaves, bins)]
        selected = [None if b is None else jnp.zeros((1,), jnp.int32) for b in bins]
        chunks = None
        if two_phase:
            try:
                n = _axis_size(axis_name)
            except NameError as e:
                raise ValueError(
                    f"adacomp(form='two_phase').init must run inside shard_map over "
                    f"{axis_name!r} (the chunk length depends on the axis size): {e}") from None
            chunks = treedef.unflatten([
                None if b is None else
                jnp.zeros((1, chunk_length(math.prod(jnp.shape(p)), b, n)), _compute_dtype(p))
                for p, b in zip(leaves, bins)])
        return AdaCompState(count=jnp.zeros([], jnp.int32), residuals=treedef.unflatten(res),
                            chunk_residuals=chunks, selected=treedef.unflatten(selected))

    def exchange(grads, bins, residuals, chunks):
        means, new_res, new_chunks, selected = [], [], [], []
        for g, b, r, c in zip(grads, bins, residuals, chunks):
            numel = math.prod(jnp.shape(g))
            if two_phase:
                n = _axis_size(axis_name)
                cap = capacity(chunk_length(numel, b, n), b)
                mean, r, c, message = two_phase_mean(r[0], c[0], g, b, axis_name, capacity=cap,
                                                     select=select, values=values)
                c = c[None]
            else:
                mean, r, message = allgather_mean(r[0], g, b, axis_name,
                                                  capacity=capacity(numel, b),
                                                  select=select, values=values)
            means.append(mean)
            new_res.append(r[None])
            new_chunks.append(c)
            selected.append(message.selected[None])
        return means, new_res, new_chunks, selected

    def update_fn(updates, state, params=None, **extra_args):  # as optax's aliases: ignored
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        bins = bins_of(leaves)
        out = list(leaves)
        dense = [i for i, b in enumerate(bins) if b is None]
        if dense:
            for i, mean in zip(dense, lax.pmean([leaves[i] for i in dense], axis_name)):
                out[i] = mean
        packed = [i for i, b in enumerate(bins) if b is not None]
        residuals = treedef.flatten_up_to(state.residuals)
        selected = treedef.flatten_up_to(state.selected)
        chunks = (treedef.flatten_up_to(state.chunk_residuals) if two_phase
                  else [None] * len(leaves))
        if packed:
            operands = tuple([x[i] for i in packed] for x in (leaves, residuals, chunks, selected))
            pick = [bins[i] for i in packed]

            def compressed(ops):
                grads, res, chk, _ = ops
                return exchange(grads, pick, res, chk)

            def warm(ops):
                grads, res, chk, sel = ops
                return lax.pmean(grads, axis_name), res, chk, sel

            # A non-finite gradient on any device: every leaf plain-averaged (the inf or
            # NaN reaches every device, for a loss scaler or apply_if_finite to see) and
            # no residual changes, on every device alike.
            plain = lax.pmin(_all_finite(leaves).astype(jnp.int32), axis_name) == 0
            if warmup_steps:
                plain = plain | (state.count < warmup_steps)
            result = lax.cond(plain, warm, compressed, operands)
            # A finite exchange whose average overflows the leaves' dtype (fp16) is a
            # skipped step too: its residuals are not committed, so nothing is lost. The
            # average is the same on every device, and so is this choice.
            keep = ~_all_finite(result[0])
            result = (result[0], *(
                [jax.tree.map(lambda old, new: jnp.where(keep, old, new), o, n)
                 for o, n in zip(before, after)]
                for before, after in zip(operands[1:], result[1:])))
            for k, i in enumerate(packed):
                out[i], residuals[i], chunks[i], selected[i] = (x[k] for x in result)
        new_state = AdaCompState(
            count=optax.safe_increment(state.count),
            residuals=treedef.unflatten(residuals),
            chunk_residuals=treedef.unflatten(chunks) if two_phase else None,
            selected=treedef.unflatten(selected),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adacomp_state_specs(state: Any, axis_name: AxisName) -> Any:
    """The ``shard_map`` specs of an optimizer state holding :class:`AdaCompState`\\ s.

    Per-device leaves get ``P(axis_name)``: every AdaComp residual, chunk residual and
    selection count (their leading axis is the device axis), and the accumulated
    gradients of an ``optax.MultiStepsState`` (each device accumulates its own; they
    are split along their first axis). Every other leaf (step counts, the optimizer's
    moments) gets ``P()``, replicated. ``state`` may be abstract (``jax.eval_shape``).

    Args:
      state: an optimizer state (any pytree), or its shapes.
      axis_name: the data-parallel mesh axis (a name, or a tuple of names).

    Returns:
      A pytree of ``PartitionSpec``\\ s with the structure of ``state``, for
      ``shard_map``'s ``in_specs``/``out_specs`` (and ``NamedSharding`` outside).

    Raises:
      ValueError: for a scalar among ``MultiSteps``' accumulated gradients (a per-device
        scalar has no axis to split).
    """
    axis_name = _check_axis_name(axis_name)
    device = P(axis_name)

    def per_device(tree):
        return jax.tree.map(lambda _: device, tree)

    def accumulated(leaf):
        if len(jnp.shape(leaf)) == 0:
            raise ValueError("optax.MultiSteps accumulates a scalar gradient per device; "
                             "adacomp_state_specs needs leaves of rank >= 1 to split")
        return device

    def node(x):
        if isinstance(x, AdaCompState):
            return AdaCompState(count=P(), residuals=per_device(x.residuals),
                                chunk_residuals=per_device(x.chunk_residuals),
                                selected=per_device(x.selected))
        if isinstance(x, optax.MultiStepsState):
            return x._replace(
                mini_step=P(), gradient_step=P(),
                inner_opt_state=adacomp_state_specs(x.inner_opt_state, axis_name),
                acc_grads=jax.tree.map(accumulated, x.acc_grads),
                skip_state=jax.tree.map(lambda _: P(), x.skip_state))
        return P()

    return jax.tree.map(node, state,
                        is_leaf=lambda x: isinstance(x, (AdaCompState, optax.MultiStepsState)))


def _shard_map(f, mesh, in_specs, out_specs, check):
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=check)
    from jax.experimental.shard_map import shard_map  # pragma: no cover (older jax)

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                     check_rep=check)  # pragma: no cover


def adacomp_init_state(optimizer: optax.GradientTransformation, params: Any,
                       mesh: jax.sharding.Mesh, axis_name: AxisName) -> tuple[Any, Any]:
    """``optimizer.init(params)`` run inside ``shard_map``, and the state's specs.

    For an optimizer holding :func:`adacomp` (chained, wrapped in ``optax.MultiSteps`` or
    ``optax.inject_hyperparams``), whose state has per-device leaves. ``params`` are the
    replicated params (``P()``).

    Args:
      optimizer: the ``optax.GradientTransformation``.
      params: the params, replicated over ``mesh``.
      mesh: the mesh of the ``shard_map``'d train step.
      axis_name: its data-parallel axis (a name, or a tuple of names).

    Returns:
      ``(state, specs)``: the state, placed as ``shard_map`` returns it (so a jitted
      step sees the same input shardings at every call), and
      :func:`adacomp_state_specs` of it.
    """
    axis_name = _check_axis_name(axis_name)
    shapes = jax.eval_shape(_shard_map(optimizer.init, mesh, (P(),), P(), False), params)
    specs = adacomp_state_specs(shapes, axis_name)
    state = jax.jit(_shard_map(optimizer.init, mesh, (P(),), specs, False))(params)
    return state, specs
