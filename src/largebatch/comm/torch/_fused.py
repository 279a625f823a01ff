"""The fused AdaComp exchange: a bucket's compressed layers compressed, encoded and decoded
by the Triton kernels of ``_kernels.py`` in a few launches, with the tables built once per
layout (:class:`FusedExchange`, the counterpart of ``_codec.Exchange``); and the choice of
path (:func:`resolve_fused`). Design: docs/design.md, "AdaComp's kernels"."""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from largebatch.comm.reference import chunk_bounds, fit_bin
from largebatch.comm.torch._codec import Layout, Worker

MAX_BIN = 2048  # the longest bin the kernels take (one bin is one row of a program's tile)
TILE = 1024  # elements a program of the selection and encoding passes holds (at least one bin)
_FINISH_BLOCK = 1024  # bins a step of the per-segment pass
DECODE_TILE = 8192  # a decoder program compares each of its codes with every segment's end
_MAX_PLANS = 64


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def check_fused(fused: Any) -> bool | None:
    """``fused`` is None, True or False; else a TypeError (as for every flag)."""
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"Invalid fused: {fused!r} (must be True, False or None)")
    return fused


def resolve_fused(fused: bool | None, device: torch.device) -> bool:
    """Whether a bucket on ``device`` takes the kernels: ``None`` on CUDA where triton
    imports (never the interpreter: on the CPU the torch operations are faster);
    ``True`` where they run (CUDA, or the CPU under ``TRITON_INTERPRET=1``, as the tests
    run them), else a RuntimeError saying why; ``False`` never."""
    if fused is None:
        return device.type == "cuda" and triton_available()
    if fused:
        if not triton_available():
            raise RuntimeError("AdaComp's fused=True needs triton: pip install triton")
        interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if device.type != "cuda" and not interpreted:
            raise RuntimeError(
                f"AdaComp's fused=True needs CUDA gradients (these are on {device}); on the CPU "
                "the Triton kernels run only under TRITON_INTERPRET=1 (set before import)"
            )
    return bool(fused)


def applies(layout: Layout, fused: bool | None) -> bool:
    """Whether the kernels take this layout: every bin at most :data:`MAX_BIN` long; a
    ValueError where ``fused=True`` asked for them and a bin is longer."""
    longest = max((layer.bins for layer in layout.compressed), default=0)
    if longest <= MAX_BIN:
        return True
    if fused:
        raise ValueError(
            f"AdaComp's fused=True takes bins of up to {MAX_BIN} elements; this bucket has one "
            f"of {longest} (conv_bin / fc_bin): use fused=None or False"
        )
    return False


# ----------------------------------------------------------------------------- plans


@dataclasses.dataclass
class _Class:
    """The programs of one tile shape: bins of up to COLS elements, ROWS bins a program."""

    progs: torch.Tensor  # int32 [n, 2]: (segment, first bin)
    rows: int
    cols: int


@dataclasses.dataclass
class Plan:
    """The device tables of a set of segments (each an element range of the gradients
    and the residuals, with its bin length), built once and cached."""

    segs: torch.Tensor  # int64 [k, SEG_COLS]
    classes: list[_Class]
    k: int
    kp: int  # k rounded up to a power of two
    n_bins: int
    numel: int  # residual elements (the segments' total)
    numels: tuple[int, ...]
    segments: tuple[tuple[int, int, int, int], ...]  # the host's description
    sources: list[torch.Tensor]  # the host tables copied from, kept while the plan lives


_PLANS: OrderedDict[tuple, Plan] = OrderedDict()


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _upload(
    rows: list[list[int]], dtype: torch.dtype, device: torch.device, keep: list[torch.Tensor]
) -> torch.Tensor:
    host = torch.tensor(rows, dtype=dtype).reshape(len(rows), -1)
    if device.type == "cuda":
        host = host.pin_memory()
    keep.append(host)
    return host.to(device, non_blocking=True)


def plan_for(segments: tuple[tuple[int, int, int, int], ...], device: torch.device) -> Plan:
    """The plan of ``segments`` ((offset, residual offset, numel, bin length) each)."""
    key = (segments, device)
    plan = _PLANS.get(key)
    if plan is not None:
        _PLANS.move_to_end(key)
        return plan
    rows: list[list[int]] = []
    by_cols: dict[int, list[list[int]]] = {}
    n_bins = 0
    for t, (off, roff, numel, blen) in enumerate(segments):
        blen = fit_bin(blen, numel)
        nbins = -(-numel // blen)
        rows.append([off, roff, numel, blen, nbins, n_bins])
        if nbins:
            cols = _pow2(blen)
            per = max(1, TILE // cols)
            by_cols.setdefault(cols, []).extend([t, b] for b in range(0, nbins, per))
        n_bins += nbins
    keep: list[torch.Tensor] = []
    classes = [
        _Class(_upload(progs, torch.int32, device, keep), max(1, TILE // cols), cols)
        for cols, progs in sorted(by_cols.items())
    ]
    plan = Plan(
        segs=_upload(rows or [[0] * 6], torch.int64, device, keep),
        classes=classes,
        k=len(segments),
        kp=_pow2(max(len(segments), 2)),
        n_bins=n_bins,
        numel=sum(s[2] for s in segments),
        numels=tuple(s[2] for s in segments),
        segments=segments,
        sources=keep,
    )
    _PLANS[key] = plan
    while len(_PLANS) > _MAX_PLANS:
        _PLANS.popitem(last=False)
    return plan


# ----------------------------------------------------------------------------- one compression


@dataclasses.dataclass
class Batch:
    """One worker's compression of a plan's segments: the per-bin and per-segment results
    of the first two passes; the new residuals once :func:`encode` ran."""

    plan: Plan
    g: torch.Tensor
    r: torch.Tensor
    rscale: torch.Tensor | None
    bin_prefix: torch.Tensor
    counts: torch.Tensor  # int64 [k]: selected elements of each segment
    scales: torch.Tensor  # [k]: each segment's scale
    residual: torch.Tensor  # new residuals, written by encode
    select: str
    values: str
    table: torch.Tensor | None = None
    bases: torch.Tensor | None = None
    dests: int = 1


def _grid(n: int) -> tuple[int]:
    return (n,)


def compress(plan: Plan, g: torch.Tensor, r: torch.Tensor, scale: float, select: str, values: str) -> Batch:
    """Passes 1 and 2 over every segment: per-bin counts and sums, per-segment counts,
    scales and bin prefixes (``scale``: the loss scale the residuals are multiplied by)."""
    K = _kernels()
    device, dtype = g.device, g.dtype
    rscale = torch.full((1,), scale, dtype=dtype, device=device) if scale != 1.0 else None
    bin_count = torch.empty(plan.n_bins, dtype=torch.int32, device=device)
    bin_sum = torch.empty(plan.n_bins, dtype=torch.float64, device=device)
    batch = Batch(
        plan=plan,
        g=g,
        r=r,
        rscale=rscale,
        bin_prefix=torch.empty(plan.n_bins, dtype=torch.int64, device=device),
        counts=torch.empty(plan.k, dtype=torch.int64, device=device),
        scales=torch.empty(plan.k, dtype=dtype, device=device),
        residual=torch.empty(plan.numel, dtype=dtype, device=device),
        select=select,
        values=values,
    )
    if plan.k == 0:
        return batch
    for c in plan.classes:
        K.select_kernel[_grid(c.progs.shape[0])](
            c.progs,
            plan.segs,
            g,
            r,
            g if rscale is None else rscale,
            bin_count,
            bin_sum,
            HAS_SCALE=rscale is not None,
            ALL=select == "all",
            ROWS=c.rows,
            COLS=c.cols,
        )
    K.finish_kernel[_grid(plan.k)](
        plan.segs,
        bin_count,
        bin_sum,
        batch.bin_prefix,
        batch.counts,
        batch.scales,
        EXACT=values == "exact",
        BLOCK=_FINISH_BLOCK,
    )
    return batch


def scan(batch: Batch, dests: int, width: int, finite: torch.Tensor) -> torch.Tensor:
    """The byte sizes of the batch's ``dests`` messages (int64 on the device; -1 each
    where ``finite`` is false), and the tables :func:`encode` writes by."""
    plan, device = batch.plan, batch.g.device
    batch.dests = dests
    batch.table = torch.empty(max(dests * plan.k * 3, 1), dtype=torch.int64, device=device)
    batch.bases = torch.empty(dests, dtype=torch.int64, device=device)
    sizes = torch.empty(dests, dtype=torch.int64, device=device)
    item = batch.g.element_size()
    if plan.k == 0:
        return torch.where(finite, torch.zeros_like(sizes), -1)
    _kernels().scan_kernel[_grid(1)](
        plan.segs,
        batch.bin_prefix,
        batch.counts,
        finite,
        batch.table,
        sizes,
        batch.bases,
        plan.k,
        DESTS=dests,
        WIDTH=width,
        ITEM=item,
        EXACT=batch.values == "exact",
        KP=plan.kp,
    )
    return sizes


def encode(batch: Batch, width: int, out: torch.Tensor) -> None:
    """Pass 3: the messages into ``out`` (the send buffer, one after the other as
    :func:`scan` sized them), and the new residuals."""
    plan = batch.plan
    if plan.k == 0:
        return
    K = _kernels()
    item = batch.g.element_size()
    K.header_kernel[_grid(batch.dests)](
        out, batch.table, batch.bases, batch.scales, plan.k, ITEM=item, KP=plan.kp
    )
    for c in plan.classes:
        K.encode_kernel[_grid(c.progs.shape[0])](
            c.progs,
            plan.segs,
            batch.g,
            batch.r,
            batch.g if batch.rscale is None else batch.rscale,
            batch.bin_prefix,
            batch.scales,
            batch.table,
            out,
            batch.residual,
            plan.k,
            DESTS=batch.dests,
            WIDTH=width,
            ITEM=item,
            HAS_SCALE=batch.rscale is not None,
            ALL=batch.select == "all",
            EXACT=batch.values == "exact",
            ROWS=c.rows,
            COLS=c.cols,
        )


def decode(
    message: torch.Tensor,
    size: int,
    targets: torch.Tensor,
    dst: torch.Tensor,
    k: int,
    width: int,
    values: str,
) -> None:
    """Add a message of ``size`` bytes to ``dst`` (segment ``t``'s element 0 at ``targets[t]``)."""
    item = dst.element_size()
    codes = (size - k * (8 + item)) // (width + (item if values == "exact" else 0))
    if k == 0 or codes == 0:
        return
    kp = _pow2(max(k, 2))
    block = max(16, DECODE_TILE // kp)
    _kernels().decode_kernel[_grid(-(-codes // block))](
        message,
        targets,
        dst,
        k,
        codes,
        WIDTH=width,
        ITEM=item,
        EXACT=values == "exact",
        KP=kp,
        BLOCK=block,
    )


KERNELS = ("select_kernel", "finish_kernel", "scan_kernel", "header_kernel", "encode_kernel", "decode_kernel")


def _kernels() -> Any:
    """The kernels' module, imported (its ``@triton.jit`` functions defined, and
    ``TRITON_INTERPRET`` read) on first use."""
    from largebatch.comm.torch import _kernels as kernels

    return kernels


# ----------------------------------------------------------------------------- the exchange


class FusedExchange:
    """The exchange of ``_codec.Exchange`` on the kernels: the same messages, sums and
    residuals. A compression is a :class:`Batch` (every compressed layer of the bucket,
    or every layer's chunk of one owner); residuals live in one flat buffer a worker
    keeps per layout, each layer's entry of ``Worker.residuals`` a view of it."""

    def __init__(self, layout: Layout, world: int, select: str, values: str) -> None:
        self.layout, self.world, self.select, self.values = layout, world, select, values
        compressed = layout.compressed
        self.names = tuple(layer.name for layer in compressed)
        self.numels = tuple(layer.numel for layer in compressed)
        self.k = len(compressed)
        segments, roff = [], 0
        for layer in compressed:
            segments.append((layer.offset, roff, layer.numel, layer.bins))
            roff += layer.numel
        self.segments = tuple(segments)
        # each owner's chunks: (element 0 of its chunk in the bucket, chunk length) per layer
        self.chunks = [
            [
                (layer.offset + lo, hi - lo)
                for layer in compressed
                for lo, hi in [chunk_bounds(layer.numel, layer.bins, world)[j]]
            ]
            for j in range(world)
        ]
        self._device: dict[tuple, Any] = {}  # device tables, by (what, device)
        self._sources: list[torch.Tensor] = []  # the host tables they were copied from

    # -- tables

    def _cached(self, what: tuple, device: torch.device, build: Any) -> Any:
        key = (*what, device)
        if key not in self._device:
            self._device[key] = build()
        return self._device[key]

    def _index(self, values: list[int], device: torch.device) -> torch.Tensor:
        return _upload([values], torch.int64, device, self._sources).view(-1)

    def _chunk_segments(self, j: int) -> tuple[tuple[int, int, int, int], ...]:
        segments, pos = [], 0
        for (_, n), layer in zip(self.chunks[j], self.layout.compressed):
            segments.append((pos, pos, n, layer.bins))
            pos += n
        return tuple(segments)

    def _chunk_plan(self, j: int, device: torch.device) -> Plan:
        return plan_for(self._chunk_segments(j), device)

    def _targets(self, what: str, j: int, device: torch.device) -> torch.Tensor:
        """Each segment's element 0 where a message is decoded to: the bucket's layers
        ("layers"), owner ``j``'s chunks in the bucket ("chunks"), or in its own chunk
        buffer ("owned")."""

        def build() -> torch.Tensor:
            if what == "layers":
                values = [s[0] for s in self.segments]
            elif what == "chunks":
                values = [at for at, _ in self.chunks[j]]
            else:
                values = [s[0] for s in self._chunk_segments(j)]
            return self._index(values, device)

        return self._cached(("targets", what, j), device, build)

    def dense_index(self, device: torch.device) -> torch.Tensor:
        """The elements of the dense (uncompressed) layers in the bucket."""

        def build() -> torch.Tensor:
            values = [
                i for layer in self.layout.dense for i in range(layer.offset, layer.offset + layer.numel)
            ]
            return self._index(values, device)

        return self._cached(("dense",), device, build)

    def _strided(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each strided layer's elements are in logical order, and in memory order."""

        def build() -> tuple[torch.Tensor, torch.Tensor]:
            logical: list[int] = []
            memory: list[int] = []
            for layer, shape, stride in self.layout.strided:
                logical += range(layer.offset, layer.offset + layer.numel)
                at = torch.arange(layer.numel).as_strided(shape, stride).reshape(-1) + layer.offset
                memory += at.tolist()
            return self._index(logical, device), self._index(memory, device)

        return self._cached(("strided",), device, build)

    def to_logical(self, flat: torch.Tensor) -> torch.Tensor:
        """``_codec.to_logical`` in one gather, whatever the number of strided layers."""
        if not self.layout.strided:
            return flat
        logical, memory = self._strided(flat.device)
        return flat.index_put((logical,), flat[memory])

    def to_memory(self, flat: torch.Tensor) -> torch.Tensor:
        if not self.layout.strided:
            return flat
        logical, memory = self._strided(flat.device)
        return flat.index_put((memory,), flat[logical])

    # -- residuals

    def _residuals(
        self,
        worker: Worker,
        which: str,
        key: tuple,
        names: tuple[str, ...],
        numels: tuple[int, ...],
        like: torch.Tensor,
    ) -> torch.Tensor:
        held = getattr(worker, which)
        cached = worker.flat.get(key)
        if cached is not None and all(held.get(n) is v for n, v in zip(names, cached[1])):
            return cached[0]
        found = [held.get(n) for n in names]
        total = sum(numels)
        if all(r is None for r in found):
            return like.new_zeros(total)
        return torch.cat(
            [like.new_zeros(n) if r is None else r.reshape(-1).to(like) for r, n in zip(found, numels)]
        )

    @staticmethod
    def _commit(
        worker: Worker,
        which: str,
        key: tuple,
        names: tuple[str, ...],
        numels: tuple[int, ...],
        flat: torch.Tensor,
    ) -> None:
        views = tuple(flat.split(numels)) if names else ()
        getattr(worker, which).update(zip(names, views))
        worker.flat[key] = (flat, views)

    def commit(self, worker: Worker, batch: Batch) -> None:
        """The layers' new residuals (after :meth:`encode`) become the worker's."""
        self._commit(worker, "residuals", ("residuals", self.names), self.names, self.numels, batch.residual)

    def commit_owned(self, worker: Worker, j: int, batch: Batch) -> None:
        """Owner ``j``'s new chunk residuals become the worker's."""
        numels = tuple(n for _, n in self.chunks[j])
        self._commit(
            worker, "chunk_residuals", ("chunk_residuals", self.names, j), self.names, numels, batch.residual
        )

    # -- the passes

    def compress(self, worker: Worker, flat: torch.Tensor, scale: float = 1.0) -> Batch:
        """Every compressed layer of ``flat`` (the bucket in logical order, compute dtype)
        with the worker's residuals times ``scale``; nothing is committed here."""
        r = self._residuals(worker, "residuals", ("residuals", self.names), self.names, self.numels, flat)
        return compress(plan_for(self.segments, flat.device), flat, r, scale, self.select, self.values)

    def sizes(self, batch: Batch, dests: int, finite: torch.Tensor) -> torch.Tensor:
        """The byte sizes of the batch's messages to ``dests`` owners (1: one message of
        every bin), on the device; -1 each where ``finite`` (bool [1]) is false."""
        return scan(batch, dests, self.layout.width, finite)

    def encode(self, batch: Batch, out: torch.Tensor) -> None:
        """The batch's messages into ``out`` (uint8, at least the sizes' sum), and its new
        residuals."""
        encode(batch, self.layout.width, out)

    def messages(self, batch: Batch, dests: int) -> tuple[list[torch.Tensor], list[int]]:
        """The batch's messages and their sizes (a host read): for the simulation."""
        finite = torch.ones(1, dtype=torch.bool, device=batch.g.device)
        sizes = self.sizes(batch, dests, finite).tolist()
        out = torch.empty(sum(sizes), dtype=torch.uint8, device=batch.g.device)
        self.encode(batch, out)
        return list(out.split(sizes)), sizes

    def _decode(self, message: torch.Tensor, size: int, targets: torch.Tensor, dst: torch.Tensor) -> None:
        decode(message, size, targets, dst, self.k, self.layout.width, self.values)

    def decode_all(
        self, messages: Sequence[torch.Tensor], sizes: Sequence[int], device: torch.device
    ) -> torch.Tensor:
        """The all-gather form's result (the compressed layers; the dense ones 0)."""
        out = torch.zeros(self.layout.numel, dtype=self.layout.dtype, device=device)
        targets = self._targets("layers", 0, device)
        for message, size in zip(messages, sizes):
            self._decode(message, size, targets, out)
        return out.div_(self.world)

    def owner_compress(
        self,
        worker: Worker,
        j: int,
        messages: Sequence[torch.Tensor],
        sizes: Sequence[int],
        device: torch.device,
        scale: float = 1.0,
    ) -> Batch:
        """Phase 1's receiving side: the mean of everyone's chunk ``j``, compressed again
        with the owner's chunk residuals (not committed here)."""
        plan = self._chunk_plan(j, device)
        total = torch.zeros(plan.numel, dtype=self.layout.dtype, device=device)
        targets = self._targets("owned", j, device)
        for message, size in zip(messages, sizes):
            self._decode(message, size, targets, total)
        mean = total.div_(self.world)
        numels = tuple(n for _, n in self.chunks[j])
        r = self._residuals(
            worker, "chunk_residuals", ("chunk_residuals", self.names, j), self.names, numels, mean
        )
        return compress(plan, mean, r, scale, self.select, self.values)

    def decode_chunks(
        self, messages: Sequence[torch.Tensor], sizes: Sequence[int], device: torch.device
    ) -> torch.Tensor:
        """Phase 2's result: owner ``j``'s message fills chunk ``j`` of every layer."""
        out = torch.zeros(self.layout.numel, dtype=self.layout.dtype, device=device)
        for j, (message, size) in enumerate(zip(messages, sizes)):
            self._decode(message, size, self._targets("chunks", j, device), out)
        return out

    def count(self, stats: dict[str, Any], counts: Sequence[int]) -> None:
        """``_codec.Exchange.count`` from the layers' selected counts (read with the sizes)."""
        selected = dict(zip(self.names, counts))
        for layer in self.layout.layers:
            row = stats[layer.kind]
            row["elements"] += layer.numel
            row["selected"] += selected.get(layer.name, layer.numel)
