"""The torch exchange's layout of a gradient bucket and its message codec, and the parts
of the exchange (:class:`Exchange`) that the DDP hook and the simulation share."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from typing import Any

import torch

from largebatch.comm.reference import bin_length, chunk_bounds
from largebatch.comm.torch._compress import Compressed, compress

KINDS = ("conv", "fc", "dense")
if sys.byteorder != "little":  # the byte packing of the indices below assumes it
    raise ImportError("largebatch.comm.torch needs a little-endian machine")


# ----------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class Layer:
    name: str
    offset: int  # into the flat buffer
    numel: int
    bin_len: int | None  # None: uncompressed
    fc: bool = False  # a rank-2 weight
    # The param's shape and strides where DDP's bucket holds it in memory order other
    # than the logical one (channels_last): the hook bins in logical order, as
    # SimulatedWorkers and JAX do, and keeps its residuals in it.
    strided: tuple[torch.Size, tuple[int, ...]] | None = None

    @property
    def kind(self) -> str:
        return "dense" if self.bin_len is None else "fc" if self.fc else "conv"

    @property
    def bins(self) -> int:
        """``bin_len`` of a compressed layer (one of :attr:`Layout.compressed`)."""
        assert self.bin_len is not None
        return self.bin_len


@dataclasses.dataclass(frozen=True)
class Layout:
    """The layers of a bucket, in its flat buffer's order, and the message format."""

    layers: tuple[Layer, ...]
    numel: int
    dtype: torch.dtype  # the compute dtype (float32, or float64)

    @property
    def compressed(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.bin_len is not None)

    @property
    def dense(self) -> tuple[Layer, ...]:
        return tuple(layer for layer in self.layers if layer.bin_len is None)

    @property
    def strided(self) -> tuple[tuple[Layer, torch.Size, tuple[int, ...]], ...]:
        """The layers DDP holds in a memory order other than the logical one, each with
        its shape and strides."""
        return tuple((layer, *layer.strided) for layer in self.layers if layer.strided is not None)

    @property
    def width(self) -> int:
        """Bytes per index: enough for twice the largest compressed layer (a sign bit)."""
        largest = max((layer.numel for layer in self.compressed), default=1)
        return max(1, math.ceil((2 * largest).bit_length() / 8))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def make_layout(
    names: Sequence[str],
    shapes: Sequence[torch.Size],
    dtype: torch.dtype,
    conv_bin: int,
    fc_bin: int,
    strides: Sequence[tuple[int, ...] | None] | None = None,
) -> Layout:
    layers, offset = [], 0
    for i, (name, shape) in enumerate(zip(names, shapes)):
        numel = math.prod(shape)
        bin_len = bin_length(tuple(shape), conv_bin, fc_bin)
        stride = None if strides is None else strides[i]
        layers.append(
            Layer(
                name,
                offset,
                numel,
                bin_len,
                fc=len(shape) == 2,
                strided=None if stride is None else (torch.Size(shape), stride),
            )
        )
        offset += numel
    return Layout(tuple(layers), offset, _compute_dtype(dtype))


def bucket_strides(p: torch.Tensor) -> tuple[int, ...] | None:
    """``p``'s strides if DDP's bucket holds it in a memory order other than the logical
    one: DDP lays a dense, non-overlapping param out as the param is (channels_last
    included), anything else contiguously."""
    if p.is_contiguous():
        return None
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(p.stride(), p.shape) if n != 1):
        if stride != expected:
            return None  # overlapping or with gaps: DDP copies it in logical order
        expected *= size
    return tuple(p.stride())


def to_logical(flat: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The bucket ``flat`` with every strided layer in logical (row-major) order."""
    strided = layout.strided
    if not strided:
        return flat
    out = flat.clone()
    for layer, shape, stride in strided:
        seg = flat.narrow(0, layer.offset, layer.numel)
        out.narrow(0, layer.offset, layer.numel).copy_(seg.as_strided(shape, stride).reshape(-1))
    return out


def to_memory(flat: torch.Tensor, layout: Layout) -> torch.Tensor:
    """The inverse of :func:`to_logical`: each strided layer back in DDP's memory order."""
    strided = layout.strided
    if not strided:
        return flat
    out = flat.clone()
    for layer, shape, stride in strided:
        out.narrow(0, layer.offset, layer.numel).as_strided(shape, stride).copy_(
            flat.narrow(0, layer.offset, layer.numel).view(shape)
        )
    return out


# ----------------------------------------------------------------------------- messages


def _pack(codes: torch.Tensor, width: int) -> torch.Tensor:
    return codes.to(torch.int64).view(torch.uint8).view(-1, 8)[:, :width].reshape(-1)


def _unpack(data: torch.Tensor, width: int) -> torch.Tensor:
    full = data.new_zeros(data.numel() // width, 8)
    full[:, :width] = data.view(-1, width)
    return full.view(torch.int64).view(-1)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


# CUDA has ``nonzero_static`` since torch 2.6.
_STATIC_NONZERO_ON_GPU = torch.torch_version.TorchVersion(torch.__version__) >= "2.6"


def host_waits(device: torch.device) -> bool:
    """Whether reading a value of ``device`` on the host waits for the device, and torch
    has ``nonzero_static`` there."""
    return device.type != "cpu" and _STATIC_NONZERO_ON_GPU


def _selected(
    masks: Sequence[torch.Tensor],
    device: torch.device,
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each mask's selected indices, and their counts (int64 on ``device``). On a GPU a
    ``nonzero`` makes the host wait for the device, once per mask; reading every count at
    once and then ``nonzero_static`` waits once in all. The CPU has nothing to wait for,
    and its ``nonzero`` is the cheaper."""
    if not host_waits(device) or not masks:
        indices = [m.nonzero().view(-1) for m in masks]
        return indices, torch.tensor([i.numel() for i in indices], dtype=torch.int64, device=device)
    counts = torch.stack([m.sum() for m in masks])
    sizes = counts.tolist()  # the one host sync
    # An empty mask's indices are known (CUDA's nonzero_static failed on one before 2.9).
    return [
        torch.nonzero_static(m, size=n).view(-1)
        if m.numel()
        else torch.zeros(0, dtype=torch.int64, device=device)
        for m, n in zip(masks, sizes)
    ], counts


def _encode(parts: Sequence[tuple[Compressed, int, int]], width: int, values: str) -> torch.Tensor:
    """One message: for each (compressed layer, lo, hi) its count (int64), its scale, then
    every layer's packed codes (index relative to ``lo`` times 2, plus 1 for a negative
    sign), then, for ``values="exact"``, the values."""
    device = parts[0][0].sent.device if parts else torch.device("cpu")
    indices, counts = _selected([c.mask[lo:hi] for c, lo, hi in parts], device)
    scales, codes, vals = [], [], []
    for (c, lo, hi), idx in zip(parts, indices):
        scales.append(c.scale.view(1))
        picked = c.sent[lo:hi][idx]
        if values == "exact":
            codes.append(idx)
            vals.append(picked)
        else:
            codes.append(idx * 2 + (picked < 0).to(torch.int64))
    pieces = [_as_bytes(counts)]
    if parts:
        pieces.append(_as_bytes(torch.cat(scales)))
        pieces.append(_pack(torch.cat(codes), width))
        if values == "exact":
            pieces.append(_as_bytes(torch.cat(vals)))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=device)


def _decode_into(
    out: Sequence[torch.Tensor], message: torch.Tensor, width: int, values: str, dtype: torch.dtype
) -> None:
    """Add a message's decoded layers to ``out`` (one flat tensor per layer of the message)."""
    k = len(out)
    if k == 0:
        return
    item = torch.empty((), dtype=dtype).element_size()
    counts = message[: 8 * k].clone().view(torch.int64).tolist()  # clone: aligned
    pos = 8 * k
    scales = message[pos : pos + item * k].clone().view(dtype)
    pos += item * k
    total = sum(counts)
    codes = _unpack(message[pos : pos + width * total], width)
    pos += width * total
    vals = message[pos : pos + item * total].clone().view(dtype) if values == "exact" else None
    start = 0
    for j, (dst, count) in enumerate(zip(out, counts)):
        if count:
            code = codes[start : start + count]
            if vals is not None:  # values == "exact"
                dst.index_add_(0, code, vals[start : start + count])
            else:
                sign = 1 - 2 * (code & 1).to(dtype)
                dst.index_add_(0, code >> 1, sign * scales[j])
        start += count


# ----------------------------------------------------------------------------- the exchange


@dataclasses.dataclass
class Worker:
    """One worker's residuals: per layer (by name), and per layer for its owned chunk.
    ``flat``: the fused exchange's residual buffers, each with the views of it that the
    two dicts held when it was committed (a dict entry that is no longer its view sends
    the next step back to the dicts)."""

    residuals: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    chunk_residuals: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    flat: dict[tuple, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = dataclasses.field(default_factory=dict)


class Exchange:
    """The parts of an exchange every worker runs, shared by the hook and the simulation."""

    def __init__(self, layout: Layout, world: int, select: str, values: str) -> None:
        self.layout, self.world, self.select, self.values = layout, world, select, values

    def compress(
        self,
        worker: Worker,
        flat: torch.Tensor,
        scale: float = 1.0,
    ) -> dict[str, Compressed]:
        """Each compressed layer of ``flat`` (the bucket, compute dtype) with the worker's
        residual times ``scale`` (a GradScaler's loss scale: residuals are kept unscaled);
        the residuals are not updated here."""
        out = {}
        for layer in self.layout.compressed:
            g = flat[layer.offset : layer.offset + layer.numel]
            r = worker.residuals.get(layer.name)
            r = torch.zeros_like(g) if r is None else r * scale if scale != 1.0 else r
            out[layer.name] = compress(r, g, layer.bins, select=self.select, values=self.values)
        return out

    @staticmethod
    def commit(worker: Worker, parts: dict[str, Compressed]) -> None:
        for name, c in parts.items():
            worker.residuals[name] = c.residual

    def message(self, parts: dict[str, Compressed], dest: int | None = None) -> torch.Tensor:
        """The all-gather form's message (``dest=None``), or the part for chunk ``dest``."""
        items = []
        for layer in self.layout.compressed:
            lo, hi = (0, layer.numel) if dest is None else self.chunk(layer, dest)
            items.append((parts[layer.name], lo, hi))
        return _encode(items, self.layout.width, self.values)

    def chunk(self, layer: Layer, j: int) -> tuple[int, int]:
        return chunk_bounds(layer.numel, layer.bins, self.world)[j]

    def decode_all(self, messages: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The all-gather form's result for the compressed layers: messages decoded and
        summed in rank order, divided by the world size (a flat tensor of the bucket)."""
        out = torch.zeros(self.layout.numel, dtype=self.layout.dtype, device=device)
        views = [out[layer.offset : layer.offset + layer.numel] for layer in self.layout.compressed]
        for message in messages:
            _decode_into(views, message, self.layout.width, self.values, self.layout.dtype)
        return out.div_(self.world)

    def owner_compress(
        self,
        worker: Worker,
        j: int,
        messages: Sequence[torch.Tensor],
        device: torch.device,
        scale: float = 1.0,
    ) -> dict[str, Compressed]:
        """Phase 1's receiving side: the mean of everyone's chunk ``j`` (rank order), then
        compressed again with the owner's chunk residuals (not committed here)."""
        chunks = []
        for layer in self.layout.compressed:
            lo, hi = self.chunk(layer, j)
            chunks.append(torch.zeros(hi - lo, dtype=self.layout.dtype, device=device))
        for message in messages:
            _decode_into(chunks, message, self.layout.width, self.values, self.layout.dtype)
        parts = {}
        for layer, total in zip(self.layout.compressed, chunks):
            mean = total.div_(self.world)
            r = worker.chunk_residuals.get(layer.name)
            r = torch.zeros_like(mean) if r is None else r * scale if scale != 1.0 else r
            parts[layer.name] = compress(r, mean, layer.bins, select=self.select, values=self.values)
        return parts

    def owner_message(self, parts: dict[str, Compressed]) -> torch.Tensor:
        items = [(parts[layer.name], 0, parts[layer.name].sent.numel()) for layer in self.layout.compressed]
        return _encode(items, self.layout.width, self.values)

    def decode_chunks(self, messages: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Phase 2's result: owner ``j``'s message fills chunk ``j`` of every layer."""
        out = torch.zeros(self.layout.numel, dtype=self.layout.dtype, device=device)
        for j, message in enumerate(messages):
            views = []
            for layer in self.layout.compressed:
                lo, hi = self.chunk(layer, j)
                views.append(out[layer.offset + lo : layer.offset + hi])
            _decode_into(views, message, self.layout.width, self.values, self.layout.dtype)
        return out

    def count(self, stats: dict[str, dict[str, int]], parts: dict[str, Compressed]) -> None:
        layers = self.layout.compressed
        sums = [parts[layer.name].mask.sum() for layer in layers]
        selected = dict(
            zip((layer.name for layer in layers), torch.stack(sums).tolist() if sums else [])
        )  # one host sync
        for layer in self.layout.layers:
            row = stats[layer.kind]
            row["elements"] += layer.numel
            row["selected"] += selected.get(layer.name, layer.numel)


def new_stats() -> dict[str, Any]:
    return {
        "steps": 0,
        "compressed_steps": 0,
        "dense_bytes": 0,
        "sent_bytes": 0,
        **{kind: {"elements": 0, "selected": 0} for kind in KINDS},
    }


def copy_stats(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: dict(v) if isinstance(v, dict) else v for k, v in stats.items()}
