"""AdaComp's exchange of all compressed leaves at once for JAX (``adacomp(..., fused=True)``):
the leaves as rows of one bin each, compressed by three passes over every row (Pallas
kernels on a GPU), one message buffer exchanged by one collective, and decoded by one
scatter a device: a fixed number of operations, whatever the number of leaves. The numbers
are the per-leaf path's (docs/design.md, "AdaComp's kernels")."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from largebatch.checks import AxisName
from largebatch.comm.jax._compress import add_pair, pair_mean
from largebatch.comm.jax._exchange import ordered_mean, pack_codes, unpack_codes
from largebatch.lars.jax.rows import block_call

BLOCK = 4096  # elements a kernel program takes: rows of one bin, ``BLOCK // width`` of them
MAX_BIN = 2048  # a longer bin is compressed leaf by leaf
RUN = 64  # message entries summed together in the first level of a scale's sum
FILL = np.iinfo(np.int32).max  # an empty message entry: its index (FILL >> 1) is past any span


def fusable(bin_len: int) -> bool:
    """Whether a leaf with bins of ``bin_len`` takes the packed exchange."""
    return bin_len <= MAX_BIN


@dataclass(frozen=True)
class Leaf:
    """One compressed leaf: ``parts`` chunks of ``span`` elements (whole bins of
    ``bin_len``; one chunk but for the two-phase exchange's first phase), each with a
    message of ``capacity`` entries."""

    numel: int
    bin_len: int
    parts: int
    span: int
    capacity: int

    @property
    def rows(self) -> int:
        return self.parts * self.span // self.bin_len


def _width(bin_len: int) -> int:
    return 1 << max(0, bin_len - 1).bit_length()


@dataclass(frozen=True)
class Group:
    """The leaves whose bins fit rows of one ``width`` (a power of two), and one int per
    row: its segment's first row, message capacity and first slot, its bin length, its
    place in the segment and its leaf (rows past the leaves: capacity 0)."""

    width: int
    leaves: tuple[int, ...]
    table: np.ndarray  # (6, rows) int32: first, capacity, base, bin_len, row_in_part, leaf

    @property
    def rows(self) -> int:
        return int(self.table.shape[1])

    @property
    def block_rows(self) -> int:
        return max(1, BLOCK // self.width)


@dataclass(frozen=True)
class Layout:
    """Where each leaf's rows and message entries lie. ``owner_major``: the messages of
    chunk ``j`` of every leaf come together (the two-phase exchange sends them to device
    ``j``); otherwise each leaf's messages are contiguous."""

    leaves: tuple[Leaf, ...]
    owner_major: bool = False

    @functools.cached_property
    def bases(self) -> list[list[int]]:
        """Each leaf's first message slot of each part."""
        caps = [leaf.capacity for leaf in self.leaves]
        if self.owner_major:
            per_owner, offsets = sum(caps), np.cumsum([0, *caps])
            return [
                [j * per_owner + int(offsets[k]) for j in range(leaf.parts)]
                for k, leaf in enumerate(self.leaves)
            ]
        start, out = 0, []
        for leaf in self.leaves:
            out.append([start + j * leaf.capacity for j in range(leaf.parts)])
            start += leaf.parts * leaf.capacity
        return out

    @property
    def slots(self) -> int:
        return sum(leaf.parts * leaf.capacity for leaf in self.leaves)

    @functools.cached_property
    def groups(self) -> tuple[Group, ...]:
        widths = sorted({_width(leaf.bin_len) for leaf in self.leaves})
        out = []
        for width in widths:
            members = tuple(k for k, leaf in enumerate(self.leaves) if _width(leaf.bin_len) == width)
            columns: list[np.ndarray] = []
            row = 0
            for k in members:
                leaf = self.leaves[k]
                per_part = leaf.span // leaf.bin_len
                for j in range(leaf.parts):
                    columns.append(
                        np.stack(
                            [
                                np.full(per_part, row),
                                np.full(per_part, leaf.capacity),
                                np.full(per_part, self.bases[k][j]),
                                np.full(per_part, leaf.bin_len),
                                np.arange(per_part),
                                np.full(per_part, k),
                            ]
                        )
                    )
                    row += per_part
            block_rows = max(1, BLOCK // width)
            pad = -row % block_rows
            columns.append(np.stack([np.arange(row, row + pad), *np.zeros((4, pad), int), np.full(pad, -1)]))
            out.append(Group(width, members, np.concatenate(columns, axis=1).astype(np.int32)))
        return tuple(out)

    def pack(self, group: Group, flats: Sequence[jax.Array]) -> jax.Array:
        """The group's leaves (flat, ``numel`` each) as rows of one bin, zero-padded."""
        parts = []
        for k in group.leaves:
            leaf = self.leaves[k]
            x = jnp.pad(flats[k], (0, leaf.rows * leaf.bin_len - leaf.numel)).reshape(leaf.rows, leaf.bin_len)
            parts.append(jnp.pad(x, ((0, 0), (0, group.width - leaf.bin_len))))
        parts.append(jnp.zeros((group.rows - sum(p.shape[0] for p in parts), group.width), flats[0].dtype))
        return jnp.concatenate(parts)

    def unpack(self, group: Group, rows: jax.Array) -> list[jax.Array]:
        """The group's leaves (flat, ``numel`` each) back from :meth:`pack`'s rows."""
        out, start = [], 0
        for k in group.leaves:
            leaf = self.leaves[k]
            x = rows[start : start + leaf.rows, : leaf.bin_len]
            out.append(x.reshape(-1)[: leaf.numel])
            start += leaf.rows
        return out

    @functools.cached_property
    def slot_table(self) -> np.ndarray:
        """Per message slot: its leaf, part, and the span its indices are relative to."""
        table = np.zeros((3, self.slots), np.int64)
        for k, leaf in enumerate(self.leaves):
            for j, base in enumerate(self.bases[k]):
                table[:, base : base + leaf.capacity] = np.array([[k], [j], [leaf.span]])
        return table

    @functools.cached_property
    def scale_runs(self) -> tuple[np.ndarray, np.ndarray]:
        """The slots of each leaf's messages in two levels: runs of at most :data:`RUN`
        contiguous slots (``(runs, RUN)``, -1 past a run's end), then each leaf's runs
        (``(leaves, most runs)``, -1 past its last)."""
        runs: list[list[int]] = []
        per_leaf: list[list[int]] = []
        for k, leaf in enumerate(self.leaves):
            mine = []
            for base in self.bases[k]:
                for start in range(0, leaf.capacity, RUN):
                    mine.append(len(runs))
                    runs.append(list(range(base + start, base + min(leaf.capacity, start + RUN))))
            per_leaf.append(mine)
        first = np.full((max(1, len(runs)), RUN), -1, np.int32)
        for i, run in enumerate(runs):
            first[i, : len(run)] = run
        second = np.full((len(self.leaves), max(1, max(map(len, per_leaf), default=1))), -1, np.int32)
        for k, mine in enumerate(per_leaf):
            second[k, : len(mine)] = mine
        return first, second


# ------------------------------------------------------------------------ the kernels


def _selected(r: jax.Array, g: jax.Array, select: str) -> tuple[jax.Array, jax.Array]:
    """``G = r + g`` and AdaComp's selection in each row (one bin): ``|G + g| >= max |G|``
    and ``G != 0`` (the padding is never selected)."""
    big = r + g
    nonzero = big != 0
    if select == "all":
        return big, nonzero
    peak = jnp.max(jnp.abs(big), axis=1, keepdims=True)
    return big, (jnp.abs(big + g) >= peak) & nonzero


def _kept(mask: jax.Array, allow: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each selected element's rank in its row, and whether it is among the row's first
    ``allow``."""
    rank = jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1
    return rank, mask & (rank < allow[:, None])


def _count_body(select: str) -> Callable[..., list[jax.Array]]:
    def body(r: jax.Array, g: jax.Array) -> list[jax.Array]:
        _, mask = _selected(r, g, select)
        return [jnp.sum(mask.astype(jnp.int32), axis=1)]

    return body


def _slot_body(select: str, empty: int) -> Callable[..., list[jax.Array]]:
    def body(r: jax.Array, g: jax.Array, first: jax.Array, allow: jax.Array) -> list[jax.Array]:
        _, mask = _selected(r, g, select)
        rank, keep = _kept(mask, allow)
        return [jnp.where(keep, first[:, None] + rank, empty)]

    return body


def _residual_body(select: str, values: str) -> Callable[..., list[jax.Array]]:
    def body(r: jax.Array, g: jax.Array, allow: jax.Array, scale: jax.Array) -> list[jax.Array]:
        big, mask = _selected(r, g, select)
        _, keep = _kept(mask, allow)
        if values == "exact":
            sent = jnp.where(keep, big, jnp.zeros((), big.dtype))
        else:
            s = scale[:, None]
            sent = jnp.where(keep, jnp.where(big < 0, -s, s), jnp.zeros((), big.dtype))
        return [big - sent]

    return body


# ------------------------------------------------------------------------- compressing


class Packed(NamedTuple):
    """The compression of a layout's leaves: each leaf's new residual (flat), the message
    buffer (``indices`` as ternary codes ``index * 2 + (sign < 0)``, or indices with
    ``values`` for exact values), each leaf's scale, and its sent and selected counts."""

    residuals: list[jax.Array]
    indices: jax.Array
    values: jax.Array | None
    scales: jax.Array
    counts: jax.Array
    selected: jax.Array


def _pair_sums(x: jax.Array, layout: Layout) -> tuple[jax.Array, jax.Array]:
    """Each leaf's sum of its message entries ``x`` as a double-word pair, in two levels
    of static gathers (the per-leaf path's ``_sum_pair``: both exactly rounded)."""
    first, second = layout.scale_runs
    zero = jnp.zeros((), x.dtype)

    def gather(v: jax.Array, index: np.ndarray) -> jax.Array:
        return jnp.where(jnp.asarray(index) >= 0, v[jnp.asarray(np.maximum(index, 0))], zero)

    hi, lo = lax.reduce((gather(x, first), jnp.zeros(first.shape, x.dtype)), (zero, zero), add_pair, (1,))
    return lax.reduce((gather(hi, second), gather(lo, second)), (zero, zero), add_pair, (1,))


def compress(
    layout: Layout, residuals: Sequence[jax.Array], grads: Sequence[jax.Array], select: str, values: str
) -> Packed:
    """AdaComp (Algorithm 1) on every leaf of ``layout`` (flat ``residuals`` and ``grads``
    of the compute dtype), each part sending the first ``capacity`` selected elements in
    index order: what ``compress_rows`` gives leaf by leaf."""
    dtype = grads[0].dtype
    slots = layout.slots
    elements = sum(leaf.rows * _width(leaf.bin_len) for leaf in layout.leaves) + BLOCK * len(layout.leaves)
    if max(slots, elements) >= FILL:
        raise ValueError(
            f"a packed AdaComp exchange of {elements} elements and {slots} message entries is "
            f"too large for int32 places (at most {FILL - 1}): use fused=False"
        )
    codes = jnp.full((slots,), FILL, jnp.int32)
    exact = jnp.zeros((slots,), dtype)
    count_parts, selected_parts, leaf_of_part = [], [], []
    passes = []
    for group in layout.groups:
        r, g = layout.pack(group, residuals), layout.pack(group, grads)
        first, capacity, base, bin_len, row_in_part, leaf = (jnp.asarray(t) for t in group.table)
        [counts] = block_call(_count_body(select), [r, g], [], [], [jnp.int32], group.block_rows)
        ends = jnp.cumsum(counts)  # int32: the differences below are exact modulo 2**32
        before = ends - counts
        rank0 = before - before[first]  # selected in the part before this row
        allow = jnp.clip(capacity - rank0, 0, counts)
        [slot] = block_call(
            _slot_body(select, slots), [r, g], [base + rank0, allow], [jnp.int32], [], group.block_rows
        )
        big = r + g
        index = row_in_part[:, None] * bin_len[:, None] + jnp.arange(group.width, dtype=jnp.int32)
        where = slot.reshape(-1)
        if values == "exact":
            codes = codes.at[where].set(index.reshape(-1), mode="drop")
        else:
            codes = codes.at[where].set(pack_codes(index, big).reshape(-1), mode="drop")
        exact = exact.at[where].set(big.reshape(-1), mode="drop")
        # Per part: its selected elements, and the leaf it counts for.
        starts = np.flatnonzero(np.diff(group.table[0], prepend=-1))
        lasts = np.append(starts[1:], group.rows) - 1
        real = group.table[5][starts] >= 0
        part_selected = ends[lasts[real]] - before[starts[real]]
        selected_parts.append(part_selected)
        count_parts.append(jnp.minimum(part_selected, capacity[starts[real]]))
        leaf_of_part.append(group.table[5][starts[real]])
        passes.append((group, r, g, allow, leaf))
    segments = np.concatenate(leaf_of_part)
    k = len(layout.leaves)
    counts = jax.ops.segment_sum(jnp.concatenate(count_parts), segments, k)
    selected = jax.ops.segment_sum(jnp.concatenate(selected_parts), segments, k)
    if values == "exact":
        scales = jnp.zeros((k,), dtype)
    else:
        scales = pair_mean(*_pair_sums(jnp.abs(exact), layout), counts)
    residuals_out: list[Any] = [None] * k
    for group, r, g, allow, leaf in passes:
        scale = jnp.where(leaf >= 0, scales[jnp.maximum(leaf, 0)], jnp.zeros((), dtype))
        [new] = block_call(
            _residual_body(select, values), [r, g], [allow, scale], [dtype], [], group.block_rows
        )
        for i, x in zip(group.leaves, layout.unpack(group, new)):
            residuals_out[i] = x
    return Packed(residuals_out, codes, exact if values == "exact" else None, scales, counts, selected)


# ------------------------------------------------------------------------- exchanging


def _decoded(
    layout: Layout, packed: Packed, route: Callable[[jax.Array], jax.Array], route_scales: Callable[..., Any]
) -> tuple[jax.Array, jax.Array]:
    """Every device's message buffer (``route`` moves it: ``[n, ...]``) as indices
    relative to each part and decoded values."""
    if packed.values is not None:
        return route(packed.indices), route(packed.values)
    codes = route(packed.indices)
    scales = route_scales(packed.scales)  # [n, leaves]
    return unpack_codes(codes, scales[:, jnp.asarray(layout.slot_table[0][: codes.shape[1]])])


def _places(index: jax.Array, offsets: np.ndarray, spans: np.ndarray, length: int) -> jax.Array:
    """Where each entry lands in a dense buffer of ``length``: its offset plus its index,
    or ``length`` (dropped) for an empty entry."""
    return jnp.where(index < jnp.asarray(spans), jnp.asarray(offsets) + index, length)


def allgather_mean(
    layout: Layout,
    residuals: Sequence[jax.Array],
    grads: Sequence[jax.Array],
    gather: Callable[[jax.Array], jax.Array],
    select: str,
    values: str,
) -> tuple[list[jax.Array], list[jax.Array], jax.Array]:
    """The all-gather exchange of every leaf of ``layout`` (flat, compute dtype): each
    leaf's mean and new residual (flat), and each leaf's selected count."""
    packed = compress(layout, residuals, grads, select, values)
    index, vals = _decoded(layout, packed, gather, gather)
    leaf, _, span = layout.slot_table
    offsets = np.cumsum([0] + [x.numel for x in layout.leaves])
    total = int(offsets[-1])
    mean = ordered_mean(_places(index, offsets[leaf], span, total), vals, total)
    means = [mean[offsets[k] : offsets[k + 1]] for k in range(len(layout.leaves))]
    return means, packed.residuals, packed.selected


def two_phase_mean(
    first: Layout,
    second: Layout,
    residuals: Sequence[jax.Array],
    chunk_residuals: Sequence[jax.Array],
    grads: Sequence[jax.Array],
    axis_name: AxisName,
    gather: Callable[[jax.Array], jax.Array],
    select: str,
    values: str,
) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array], jax.Array]:
    """The two-phase exchange of every leaf: ``first`` holds the leaves in ``n`` chunks
    (messages by owner), ``second`` each owner's chunks. Each leaf's mean and new residual
    (flat), its new chunk residual, and its selected count (phase 1)."""
    n = first.leaves[0].parts
    packed = compress(first, residuals, grads, select, values)

    def to_owner(x: jax.Array) -> jax.Array:
        return lax.all_to_all(x.reshape(n, -1), axis_name, 0, 0, tiled=True)

    index, vals = _decoded(first, packed, to_owner, lambda s: lax.all_gather(s, axis_name))
    per_owner = first.slots // n
    leaf, _, span = (t[:per_owner] for t in first.slot_table)
    spans = np.array([x.span for x in first.leaves])
    chunk_offsets = np.cumsum([0, *spans])
    length = int(chunk_offsets[-1])
    chunk_mean = ordered_mean(_places(index, chunk_offsets[leaf], span, length), vals, length)
    chunks = [chunk_mean[chunk_offsets[k] : chunk_offsets[k + 1]] for k in range(len(spans))]
    again = compress(second, chunk_residuals, chunks, select, values)
    index, vals = _decoded(second, again, gather, gather)
    leaf, _, span = second.slot_table
    owner = jnp.arange(n, dtype=jnp.int32)[:, None]
    full_offsets = np.cumsum([0, *(n * spans)])
    full = int(full_offsets[-1])
    where = jnp.where(
        index < jnp.asarray(span), jnp.asarray(full_offsets[leaf]) + owner * jnp.asarray(span) + index, full
    )
    out = jnp.zeros(full, vals.dtype).at[where.reshape(-1)].set(vals.reshape(-1), mode="drop")
    numels = [x.numel for x in first.leaves]
    means = [out[full_offsets[k] : full_offsets[k] + numels[k]] for k in range(len(numels))]
    return means, packed.residuals, again.residuals, packed.selected
