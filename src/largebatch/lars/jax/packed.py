"""The packed layout of the fused JAX path (docs/jax.md, "The fused path"): the leaves of
one dtype as one buffer of fixed-width rows, each leaf padded to whole rows (held as
``(rows * SUB, PIECE)``, the kernels' pieces); packing and
unpacking; and the per-leaf norms formed from the kernels' per-piece statistics by sums
over each leaf's contiguous pieces (static gathers, no scatter), with one ``psum`` of all
leaves' sums under ``shard_map``."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from largebatch.checks import AxisName

ROW = 4096  # elements a row: each leaf starts on a row and owns its rows
SUB = 8  # the kernels see a row as SUB pieces of ROW // SUB elements
PIECE = ROW // SUB
CHUNK = 64  # pieces summed together in the first level of a leaf's sums

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class Segments:
    """Contiguous runs of a vector (the pieces of each leaf), reduced run by run in two
    levels of static gathers: runs of at most :data:`CHUNK` elements, then each leaf's
    chunks. The order of each sum is fixed, so the result is the same at every step."""

    counts: tuple[int, ...]

    @functools.cached_property
    def _levels(self) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        starts = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        c_starts, c_counts, per_leaf = [], [], []
        for start, count in zip(starts, self.counts):
            offsets = list(range(0, count, CHUNK))
            per_leaf.append(len(offsets))
            c_starts += [start + o for o in offsets]
            c_counts += [min(CHUNK, count - o) for o in offsets]
        l_starts = np.concatenate([[0], np.cumsum(per_leaf)[:-1]]) if per_leaf else np.zeros(0)
        first = (np.asarray(c_starts, np.int32), np.asarray(c_counts, np.int32))
        second = (np.asarray(l_starts, np.int32), np.asarray(per_leaf, np.int32))
        return first, second

    def reduce(self, x: jax.Array, op: str) -> jax.Array:
        """``op`` ("sum" or "max") of each run of ``x``; an empty run gives 0."""
        first, second = self._levels
        return _runs(_runs(x, *first, op), *second, op)


def _runs(x: jax.Array, starts: np.ndarray, counts: np.ndarray, op: str) -> jax.Array:
    """``op`` over ``x[starts[i] : starts[i] + counts[i]]`` for each ``i`` (0 where empty)."""
    if len(starts) == 0 or x.shape[0] == 0:
        return jnp.zeros(len(starts), x.dtype)
    width = int(counts.max(initial=1)) or 1
    offsets = jnp.arange(width, dtype=jnp.int32)[None, :]
    valid = offsets < jnp.asarray(counts)[:, None]
    index = jnp.minimum(jnp.asarray(starts)[:, None] + offsets, x.shape[0] - 1)
    values = jnp.where(valid, x[index], jnp.zeros((), x.dtype))
    return jnp.max(values, axis=1) if op == "max" else jnp.sum(values, axis=1)


@dataclass(frozen=True)
class Group:
    """The leaves of one dtype: their places among all leaves, shapes, and rows."""

    dtype: str
    leaves: tuple[int, ...]  # indices into the flattened leaves
    shapes: tuple[tuple[int, ...], ...]

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(s, dtype=np.int64)) for s in self.shapes]

    @property
    def rows(self) -> list[int]:
        """Each leaf's rows: its size rounded up to whole rows."""
        return [-(-n // ROW) for n in self.sizes]

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @functools.cached_property
    def segments(self) -> Segments:
        """Each leaf's run of pieces."""
        return Segments(tuple(r * SUB for r in self.rows))

    @functools.cached_property
    def row_leaf(self) -> np.ndarray:
        """Each row's leaf (an index into this group's leaves): one int a row."""
        return np.repeat(np.arange(len(self.leaves)), self.rows).astype(np.int32)

    @property
    def compute_dtype(self) -> Any:
        """float32, or float64 for float64 leaves."""
        return jnp.promote_types(jnp.dtype(self.dtype), jnp.float32)

    def pack(self, leaves: Sequence[jax.Array]) -> jax.Array:
        """This group's leaves (of all ``leaves``) as one buffer of ``total_rows`` rows,
        shaped ``(total_rows * SUB, PIECE)``: the pieces the kernels read, so that no
        reshape stands between the buffer and them (on the CPU, XLA's reductions over a
        reshaped buffer index it element by element, ten times slower)."""
        parts = [
            jnp.pad(jnp.ravel(leaves[i]), (0, r * ROW - n))
            for i, r, n in zip(self.leaves, self.rows, self.sizes)
        ]
        if not parts:
            return jnp.zeros((0, PIECE), self.dtype)
        return jnp.concatenate(parts).reshape(self.total_rows * SUB, PIECE)

    def unpack(self, buffer: jax.Array) -> list[jax.Array]:
        """The leaves back from a buffer of :meth:`pack`'s shape: static slices."""
        flat = buffer.reshape(-1)
        starts = np.concatenate([[0], np.cumsum(self.rows)[:-1]]) * ROW
        return [flat[s : s + n].reshape(shape) for s, n, shape in zip(starts, self.sizes, self.shapes)]

    def per_piece(self, values: jax.Array) -> jax.Array:
        """A value per leaf (``(len(leaves),)``) as a value per piece."""
        return jnp.repeat(values[jnp.asarray(self.row_leaf)], SUB)

    def piece_sizes(self) -> jax.Array:
        """How many of each piece's elements belong to its leaf (the rest is padding)."""
        row_leaf = jnp.asarray(self.row_leaf)
        starts = jnp.asarray(np.concatenate([[0], np.cumsum(self.rows)[:-1]]), jnp.int32)
        sizes = jnp.asarray(self.sizes, jnp.int32)
        row = jnp.arange(self.total_rows, dtype=jnp.int32)
        in_row = sizes[row_leaf] - (row - starts[row_leaf]) * ROW
        in_piece = in_row[:, None] - jnp.arange(SUB, dtype=jnp.int32)[None, :] * PIECE
        return jnp.clip(in_piece, 0, PIECE).reshape(-1)


@dataclass(frozen=True)
class Layout:
    """Where every leaf of a pytree's flattened leaves lives in the packed buffers: one
    :class:`Group` per dtype, in the order the dtypes first appear."""

    groups: tuple[Group, ...]
    count: int  # how many leaves

    def pack(self, leaves: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        return tuple(g.pack(leaves) for g in self.groups)

    def unpack(self, buffers: Sequence[jax.Array]) -> list[jax.Array]:
        out: list[Any] = [None] * self.count
        for g, buffer in zip(self.groups, buffers):
            for i, leaf in zip(g.leaves, g.unpack(buffer)):
                out[i] = leaf
        return out

    def zeros(self) -> tuple[jax.Array, ...]:
        """Zero buffers of this layout (a state's moments)."""
        return tuple(jnp.zeros((g.total_rows * SUB, PIECE), g.dtype) for g in self.groups)


@jax.tree_util.register_pytree_node_class
class PackedParams:
    """Params (or grads, updates) kept packed: one buffer a dtype (``Group.pack``), and
    the layout and structure of the pytree they hold, so that ``lars``/``lamb(...,
    fused=True)`` step them with no packing and no slicing (docs/jax.md, "Params kept
    packed"). A pytree whose leaves are the buffers: ``jax.grad`` of a loss of
    :meth:`unpack` gives the grads as ``PackedParams`` (zero in the padding), and
    ``optax.apply_updates`` adds the updates buffer to buffer.

    >>> import jax.numpy as jnp
    >>> packed = PackedParams.pack({"w": jnp.ones((3, 2)), "b": jnp.zeros(2)})
    >>> [b.shape for b in packed.buffers], packed.unpack()["w"].shape
    ([(16, 512)], (3, 2))
    """

    def __init__(self, buffers: Sequence[jax.Array], layout: Layout, treedef: Any) -> None:
        self.buffers = tuple(buffers)
        self.layout = layout
        self.treedef = treedef

    @classmethod
    def pack(cls, tree: Any) -> PackedParams:
        """``tree``'s leaves packed (each padded with zeros to whole rows)."""
        leaves, treedef = jax.tree.flatten(tree)
        layout = layout_of(leaves)
        return cls(layout.pack(leaves), layout, treedef)

    def unpack(self) -> Any:
        """The pytree back: each leaf a static slice of its buffer (free inside ``jit``)."""
        return jax.tree.unflatten(self.treedef, self.layout.unpack(self.buffers))

    def like(self, buffers: Sequence[jax.Array]) -> PackedParams:
        """Other buffers of the same layout (the updates of these params)."""
        return PackedParams(buffers, self.layout, self.treedef)

    def structure(self) -> Any:
        """The pytree of ``jax.ShapeDtypeStruct`` it holds: what a mask is given."""
        structs: list[Any] = [None] * self.layout.count
        for g in self.layout.groups:
            for i, shape in zip(g.leaves, g.shapes):
                structs[i] = jax.ShapeDtypeStruct(shape, jnp.dtype(g.dtype))
        return jax.tree.unflatten(self.treedef, structs)

    def tree_flatten(self) -> tuple[tuple[jax.Array, ...], tuple[Layout, Any]]:
        return self.buffers, (self.layout, self.treedef)

    @classmethod
    def tree_unflatten(cls, aux: tuple[Layout, Any], buffers: Sequence[jax.Array]) -> PackedParams:
        return cls(buffers, *aux)


def layout_of(leaves: Sequence[Any], what: str = "fused=True") -> Layout:
    """The layout of ``leaves`` (arrays or shape-dtype structs); a TypeError for a leaf
    that is not float16, bfloat16, float32 or float64."""
    return _layout(tuple((tuple(jnp.shape(x)), str(jnp.result_type(x))) for x in leaves), what)


@functools.lru_cache(maxsize=64)
def _layout(signature: tuple[tuple[tuple[int, ...], str], ...], what: str) -> Layout:
    order: dict[str, list[int]] = {}
    for i, (shape, dtype) in enumerate(signature):
        if dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"Invalid {what} for a leaf of dtype {dtype} (shape {shape}): the fused path "
                f"takes real floating-point leaves ({', '.join(FLOAT_DTYPES)}); use fused=False"
            )
        order.setdefault(dtype, []).append(i)
    groups = tuple(
        Group(dtype, tuple(idx), tuple(signature[i][0] for i in idx)) for dtype, idx in order.items()
    )
    return Layout(groups, len(signature))


# ------------------------------------------------------------------------------ norms


def leaf_stats(group: Group, peak: jax.Array, scaled: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each leaf's ``(M, S)`` from its pieces' ``(m, s)`` (:func:`piece_stats`): ``M``
    the largest ``m``, ``S`` the sum of ``s * (m / M)**2``, so ``||x|| = sqrt(S) * M``
    and ``S`` stays below the leaf's element count (no overflow, no underflow)."""
    largest = group.segments.reduce(peak, "max")
    largest = jnp.maximum(largest, jnp.finfo(peak.dtype).tiny)  # empty leaves: 0 / tiny
    ratio = peak / group.per_piece(largest)
    return largest, group.segments.reduce(scaled * ratio * ratio, "sum")


def norms_from_stats(
    stats: Sequence[tuple[jax.Array, jax.Array]], axis_name: AxisName = None
) -> list[jax.Array]:
    """The norms of leaves from their ``(M, S)`` (each a vector over some leaves).

    With ``axis_name`` each ``(M, S)`` is this device's block of every leaf: the blocks'
    squares ``S * M**2`` of all vectors are ``psum``-ed at once (one collective), and
    where one of them overflowed or may have underflowed, all are formed again with a
    common scale, the ``pmax`` of the blocks' ``M`` (two more collectives, in a
    ``lax.cond`` that only such steps take).
    """
    if axis_name is None:
        return [jnp.sqrt(s) * m for m, s in stats]
    sizes = [m.shape[0] for m, _ in stats]
    peak = jnp.concatenate([m for m, _ in stats])
    scaled = jnp.concatenate([s for _, s in stats])
    nonzero = (scaled > 0).astype(scaled.dtype)
    squares, blocks = jax.lax.psum(jnp.stack([scaled * peak * peak, nonzero]), axis_name)
    tiny = jnp.finfo(squares.dtype).tiny
    fast = jnp.all((jnp.isfinite(squares) & (squares >= tiny * 2.0**30)) | (blocks == 0))

    def rescued() -> jax.Array:
        common = jax.lax.pmax(jnp.where(scaled > 0, peak, tiny), axis_name)
        ratio = peak / common
        return jnp.sqrt(jax.lax.psum(scaled * ratio * ratio, axis_name)) * common

    norms = jax.lax.cond(fast, lambda: jnp.sqrt(squares), rescued)
    return list(jnp.split(norms, np.cumsum(sizes)[:-1])) if len(sizes) > 1 else [norms]


def global_norm(norms: Sequence[jax.Array]) -> jax.Array:
    """The norm of all ``norms`` (vectors of leaf norms) together, safe from overflow."""
    if not norms:
        return jnp.zeros(())
    dtype = jnp.result_type(*norms)
    values = jnp.concatenate([n.astype(dtype) for n in norms])
    if values.shape[0] == 0:
        return jnp.zeros((), dtype)
    largest = jnp.maximum(jnp.max(values), jnp.finfo(dtype).tiny)
    largest = jnp.where(jnp.isfinite(largest), largest, 1.0)
    return jnp.sqrt(jnp.sum(jnp.square(values / largest))) * largest
