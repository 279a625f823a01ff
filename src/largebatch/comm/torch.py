"""AdaComp for PyTorch: a DDP communication hook, and the same exchange simulated in one process.

The compression is :mod:`largebatch.comm.reference`'s (Chen et al. 2018, arXiv 1712.02679,
Algorithm 1), on float32 (or float64) tensors::

    from largebatch.comm.torch import AdaCompState, adacomp_hook
    model = DistributedDataParallel(net)
    state = AdaCompState(model, warmup_steps=100)
    model.register_comm_hook(state, adacomp_hook)
    ...
    torch.save({"model": ..., "adacomp": state.state_dict()}, f"ckpt-rank{rank}.pt")

What the hook does with each gradient bucket DDP hands it (``bucket.parameters()`` gives
the layers; the tensor fusion is DDP's own buckets, ``bucket_cap_mb``):

- **Warm-up.** The first ``warmup_steps`` iterations are DDP's default all-reduce, and
  no residual is touched.
- **Which layers.** Weights of rank 3 or more (convolutions) are compressed with bins of
  ``conv_bin`` elements, rank 2 (fully connected) with ``fc_bin``; biases and normalization
  parameters (rank 0 or 1) are all-reduced uncompressed, as DDP's default hook does it
  (divided by the world size, then summed).
- **Residuals** are kept per parameter (by name), so DDP's rebuilding of its buckets after
  the first iteration moves nothing; :meth:`AdaCompState.state_dict` holds them for the
  checkpoint and :meth:`~AdaCompState.load_state_dict` refuses a different world size,
  rank, form or setting.
- **Exchange.** ``form="allgather"``: every rank all-gathers every rank's compressed
  message (indices with one sign bit, packed into as few bytes as the layer size needs,
  and one scale per layer), decodes them in rank order and divides by the world size;
  each rank receives ``world - 1`` messages, so it stops paying off at large worlds.
  ``form="two_phase"``: each layer is cut into one chunk of whole bins per rank; an
  all-to-all sends each rank its chunk of everyone's message, the owner averages it and
  compresses the average again with a residual of its own, and an all-gather of the
  re-compressed chunks finishes the exchange: each rank's traffic stays about twice its
  compressed message whatever the world size. ``form="auto"`` picks the cheaper of the
  two for the model's size and the world size, once, at construction.
- **Non-finite gradients** (an fp16 overflow that a ``GradScaler`` will skip): if any rank
  has one in the bucket, every rank all-reduces the bucket uncompressed so the scaler sees
  the inf, and no residual changes.
- **Bytes.** :attr:`AdaCompState.stats` counts, per kind of layer, the elements, the
  selected elements, and the bytes this rank put into the collectives, against the bytes
  of the uncompressed all-reduce's input.

The hook runs its collectives synchronously and returns a completed future: simple and
exact, at the cost of not overlapping the compressed buckets' exchange with the rest of
the backward pass.

:class:`SimulatedWorkers` runs the same exchange for ``n`` workers inside one process (one
residual per worker, the same encoding, the same rank-order sums): a two-process gloo run
with the hook and the simulation give the same parameters bit for bit (tested), which is
what lets the batch-size study measure AdaComp's accuracy on one machine.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from largebatch import checks
from largebatch.comm.reference import (
    CONV_BIN, FC_BIN, FORMS, bin_length, check_options, chunk_bounds, fit_bin,
)
from largebatch.comm.scaling import DEFAULT_LINK, choose_form

__all__ = ["FORMS", "AdaCompState", "Compressed", "SimulatedWorkers", "adacomp_hook", "compress",
           "simulate_step"]

KINDS = ("conv", "fc", "dense")
# 2: residuals in logical order; version 1 kept a channels_last weight's in memory order.
_STATE_VERSION = 2
if sys.byteorder != "little":  # the byte packing of the indices below assumes it
    raise ImportError("largebatch.comm.torch needs a little-endian machine")


@dataclasses.dataclass(frozen=True)
class Compressed:
    """One layer's compression on one worker (flat tensors): the decoded ``sent`` vector,
    the new ``residual``, the selection ``mask`` and the ternary ``scale`` (a 0-d tensor)."""

    sent: torch.Tensor
    residual: torch.Tensor
    mask: torch.Tensor
    scale: torch.Tensor


def compress(residual: torch.Tensor, grad: torch.Tensor, bin_len: int, *,
             select: str = "adacomp", values: str = "ternary") -> Compressed:
    """:func:`largebatch.comm.reference.compress` on flat tensors of one floating dtype."""
    big_g = residual + grad
    if select == "all":
        mask = big_g != 0
    else:
        h = big_g + grad
        bin_len = fit_bin(bin_len, big_g.numel())
        nbins = -(-big_g.numel() // bin_len)
        padded = big_g.new_zeros(nbins * bin_len)
        padded[: big_g.numel()] = big_g.abs()
        gmax = padded.view(nbins, bin_len).amax(dim=1).repeat_interleave(bin_len)[: big_g.numel()]
        mask = (h.abs() >= gmax) & (big_g != 0)
    if values == "exact":
        scale = big_g.new_zeros(())
        sent = torch.where(mask, big_g, torch.zeros_like(big_g))
    else:
        count = mask.sum()
        total = torch.where(mask, big_g.abs(), torch.zeros_like(big_g)).sum(dtype=torch.float64)
        scale = (total / count.clamp(min=1)).to(big_g.dtype)
        sent = torch.where(mask, big_g.sign() * scale, torch.zeros_like(big_g))
    return Compressed(sent=sent, residual=big_g - sent, mask=mask, scale=scale)


# ----------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True)
class _Layer:
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
        """``bin_len`` of a compressed layer (one of :attr:`_Layout.compressed`)."""
        assert self.bin_len is not None
        return self.bin_len


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The layers of a bucket, in its flat buffer's order, and the message format."""

    layers: tuple[_Layer, ...]
    numel: int
    dtype: torch.dtype  # the compute dtype (float32, or float64)

    @property
    def compressed(self) -> tuple[_Layer, ...]:
        return tuple(layer for layer in self.layers if layer.bin_len is not None)

    @property
    def dense(self) -> tuple[_Layer, ...]:
        return tuple(layer for layer in self.layers if layer.bin_len is None)

    @property
    def width(self) -> int:
        """Bytes per index: enough for twice the largest compressed layer (a sign bit)."""
        largest = max((layer.numel for layer in self.compressed), default=1)
        return max(1, math.ceil((2 * largest).bit_length() / 8))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _layout(names: Sequence[str], shapes: Sequence[torch.Size], dtype: torch.dtype,
            conv_bin: int, fc_bin: int,
            strides: Sequence[tuple[int, ...] | None] | None = None) -> _Layout:
    layers, offset = [], 0
    for i, (name, shape) in enumerate(zip(names, shapes)):
        numel = math.prod(shape)
        bin_len = bin_length(tuple(shape), conv_bin, fc_bin)
        stride = None if strides is None else strides[i]
        layers.append(_Layer(name, offset, numel, bin_len, fc=len(shape) == 2,
                             strided=None if stride is None else (torch.Size(shape), stride)))
        offset += numel
    return _Layout(tuple(layers), offset, _compute_dtype(dtype))


def _bucket_strides(p: torch.Tensor) -> tuple[int, ...] | None:
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


def _to_logical(flat: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """The bucket ``flat`` with every strided layer in logical (row-major) order."""
    strided = [(layer, layer.strided) for layer in layout.layers if layer.strided is not None]
    if not strided:
        return flat
    out = flat.clone()
    for layer, (shape, stride) in strided:
        seg = flat.narrow(0, layer.offset, layer.numel)
        out.narrow(0, layer.offset, layer.numel).copy_(seg.as_strided(shape, stride).reshape(-1))
    return out


def _to_memory(flat: torch.Tensor, layout: _Layout) -> torch.Tensor:
    """The inverse of :func:`_to_logical`: each strided layer back in DDP's memory order."""
    strided = [(layer, layer.strided) for layer in layout.layers if layer.strided is not None]
    if not strided:
        return flat
    out = flat.clone()
    for layer, (shape, stride) in strided:
        out.narrow(0, layer.offset, layer.numel).as_strided(shape, stride).copy_(
            flat.narrow(0, layer.offset, layer.numel).view(shape))
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


def _encode(parts: Sequence[tuple[Compressed, int, int]], width: int, values: str) -> torch.Tensor:
    """One message: for each (compressed layer, lo, hi) its count (int64), its scale, then
    every layer's packed codes (index relative to ``lo`` times 2, plus 1 for a negative
    sign), then, for ``values="exact"``, the values."""
    counts, scales, codes, vals = [], [], [], []
    for c, lo, hi in parts:
        mask = c.mask[lo:hi]
        idx = mask.nonzero().view(-1)
        counts.append(idx.numel())
        scales.append(c.scale.view(1))
        picked = c.sent[lo:hi][idx]
        if values == "exact":
            codes.append(idx)
            vals.append(picked)
        else:
            codes.append(idx * 2 + (picked < 0).to(torch.int64))
    device = parts[0][0].sent.device if parts else torch.device("cpu")
    pieces = [_as_bytes(torch.tensor(counts, dtype=torch.int64, device=device))]
    if parts:
        pieces.append(_as_bytes(torch.cat(scales)))
        pieces.append(_pack(torch.cat(codes), width))
        if values == "exact":
            pieces.append(_as_bytes(torch.cat(vals)))
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=device)


def _decode_into(out: Sequence[torch.Tensor], message: torch.Tensor, width: int, values: str,
                 dtype: torch.dtype) -> None:
    """Add a message's decoded layers to ``out`` (one flat tensor per layer of the message)."""
    k = len(out)
    if k == 0:
        return
    item = torch.empty((), dtype=dtype).element_size()
    counts = message[: 8 * k].clone().view(torch.int64).tolist()  # clone: aligned
    pos = 8 * k
    scales = message[pos: pos + item * k].clone().view(dtype)
    pos += item * k
    total = sum(counts)
    codes = _unpack(message[pos: pos + width * total], width)
    pos += width * total
    vals = message[pos: pos + item * total].clone().view(dtype) if values == "exact" else None
    start = 0
    for j, (dst, count) in enumerate(zip(out, counts)):
        if count:
            code = codes[start: start + count]
            if vals is not None:  # values == "exact"
                dst.index_add_(0, code, vals[start: start + count])
            else:
                sign = 1 - 2 * (code & 1).to(dtype)
                dst.index_add_(0, code >> 1, sign * scales[j])
        start += count


# ----------------------------------------------------------------------------- the exchange


@dataclasses.dataclass
class _Worker:
    """One worker's residuals: per layer (by name), and per layer for its owned chunk."""

    residuals: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    chunk_residuals: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


class _Exchange:
    """The parts of an exchange every worker runs, shared by the hook and the simulation."""

    def __init__(self, layout: _Layout, world: int, select: str, values: str) -> None:
        self.layout, self.world, self.select, self.values = layout, world, select, values

    def compress(self, worker: _Worker, flat: torch.Tensor, scale: float = 1.0,
                 ) -> dict[str, Compressed]:
        """Each compressed layer of ``flat`` (the bucket, compute dtype) with the worker's
        residual times ``scale`` (a GradScaler's loss scale: residuals are kept unscaled);
        the residuals are not updated here."""
        out = {}
        for layer in self.layout.compressed:
            g = flat[layer.offset: layer.offset + layer.numel]
            r = worker.residuals.get(layer.name)
            r = torch.zeros_like(g) if r is None else r * scale if scale != 1.0 else r
            out[layer.name] = compress(r, g, layer.bins, select=self.select, values=self.values)
        return out

    @staticmethod
    def commit(worker: _Worker, parts: dict[str, Compressed]) -> None:
        for name, c in parts.items():
            worker.residuals[name] = c.residual

    def message(self, parts: dict[str, Compressed], dest: int | None = None) -> torch.Tensor:
        """The all-gather form's message (``dest=None``), or the part for chunk ``dest``."""
        items = []
        for layer in self.layout.compressed:
            lo, hi = (0, layer.numel) if dest is None else self.chunk(layer, dest)
            items.append((parts[layer.name], lo, hi))
        return _encode(items, self.layout.width, self.values)

    def chunk(self, layer: _Layer, j: int) -> tuple[int, int]:
        return chunk_bounds(layer.numel, layer.bins, self.world)[j]

    def decode_all(self, messages: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """The all-gather form's result for the compressed layers: messages decoded and
        summed in rank order, divided by the world size (a flat tensor of the bucket)."""
        out = torch.zeros(self.layout.numel, dtype=self.layout.dtype, device=device)
        views = [out[layer.offset: layer.offset + layer.numel] for layer in self.layout.compressed]
        for message in messages:
            _decode_into(views, message, self.layout.width, self.values, self.layout.dtype)
        return out.div_(self.world)

    def owner_compress(self, worker: _Worker, j: int, messages: Sequence[torch.Tensor],
                       device: torch.device, scale: float = 1.0) -> dict[str, Compressed]:
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
            parts[layer.name] = compress(r, mean, layer.bins, select=self.select,
                                         values=self.values)
        return parts

    def owner_message(self, parts: dict[str, Compressed]) -> torch.Tensor:
        items = [(parts[layer.name], 0, parts[layer.name].sent.numel())
                 for layer in self.layout.compressed]
        return _encode(items, self.layout.width, self.values)

    def decode_chunks(self, messages: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
        """Phase 2's result: owner ``j``'s message fills chunk ``j`` of every layer."""
        out = torch.zeros(self.layout.numel, dtype=self.layout.dtype, device=device)
        for j, message in enumerate(messages):
            views = []
            for layer in self.layout.compressed:
                lo, hi = self.chunk(layer, j)
                views.append(out[layer.offset + lo: layer.offset + hi])
            _decode_into(views, message, self.layout.width, self.values, self.layout.dtype)
        return out

    def count(self, stats: dict[str, dict[str, int]], parts: dict[str, Compressed]) -> None:
        for layer in self.layout.layers:
            row = stats[layer.kind]
            row["elements"] += layer.numel
            row["selected"] += (int(parts[layer.name].mask.sum()) if layer.bin_len is not None
                                else layer.numel)


def _new_stats() -> dict[str, Any]:
    return {"steps": 0, "compressed_steps": 0, "dense_bytes": 0, "sent_bytes": 0,
            **{kind: {"elements": 0, "selected": 0} for kind in KINDS}}


# ----------------------------------------------------------------------------- the hook state


class AdaCompState:
    """The hook's state: settings, every parameter's residual, and the byte counts.

    Args:
        model: the ``DistributedDataParallel`` model (or the module it wraps): its
            parameter names key the residuals in :meth:`state_dict`.
        process_group: the group to exchange over (default: the default group).
        warmup_steps: iterations sent uncompressed before compression starts.
        conv_bin: ``L_T`` for convolution weights (rank 3 or more; 50).
        fc_bin: ``L_T`` for fully connected weights (rank 2; 500).
        form: ``"allgather"``, ``"two_phase"`` or ``"auto"`` (the scaling model's choice
            for this world size and model, made once here).
        select: ``"adacomp"``, or ``"all"``: every element with ``G != 0`` (no selection).
        values: ``"ternary"``, or ``"exact"``: no quantization. With ``"all"`` and
            ``"exact"`` the hook equals the plain average.
        network: for ``form="auto"``, ``(latency in s, bandwidth in bytes/s)`` of the
            links (default :data:`DEFAULT_NETWORK`, 5 us and 10 GB/s).
        compression: for ``form="auto"``, the compression rate to plan for (default 40,
            the paper's rate on convolutional layers).
        scaler: the ``torch.amp.GradScaler`` of the run, if any: DDP hands the hook scaled
            gradients, so residuals are kept unscaled (divided by the scale, a power of
            two: exact) and rescaled each iteration; a change of scale moves nothing.

    The residuals of an iteration are committed after its last bucket, and only if every
    bucket was finite on every rank, before and after the exchange (an fp16 average can
    overflow): a step a GradScaler skips leaves them untouched.
    """

    def __init__(self, model: torch.nn.Module, process_group: dist.ProcessGroup | None = None, *,
                 warmup_steps: int = 0, conv_bin: int = CONV_BIN, fc_bin: int = FC_BIN,
                 form: str = "auto", select: str = "adacomp", values: str = "ternary",
                 network: Any = None, compression: float = 40.0,
                 scaler: torch.amp.GradScaler | None = None) -> None:
        options = check_options(warmup_steps=warmup_steps, conv_bin=conv_bin, fc_bin=fc_bin,
                                form=form, select=select, values=values, forms=(*FORMS, "auto"))
        warmup_steps, conv_bin, fc_bin = (options[k] for k in ("warmup_steps", "conv_bin", "fc_bin"))
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("AdaCompState needs an initialized process group "
                             "(torch.distributed.init_process_group)")
        module = getattr(model, "module", model)
        self.process_group = process_group
        self._world = dist.get_world_size(process_group)
        self._rank = dist.get_rank(process_group)
        self._names = {p: name for name, p in module.named_parameters()}
        if form == "auto":
            form = _choose_form(self._world, module, compression, network)
        self.config = {"world": self._world, "rank": self._rank, "warmup_steps": warmup_steps,
                       "conv_bin": conv_bin, "fc_bin": fc_bin, "form": form, "select": select,
                       "values": values}
        self.form, self.select, self.values = form, select, values
        self.warmup_steps, self.conv_bin, self.fc_bin = warmup_steps, conv_bin, fc_bin
        self.step = 0
        self._worker = _Worker()
        self.stats = _new_stats()
        self.scaler = scaler
        self._pending: list[tuple[str, str, torch.Tensor]] = []  # (which, name, residual)
        self._skip = False  # a bucket of this iteration was not finite
        self._scale: float | None = None  # the GradScaler's scale for this iteration

    def _loss_scale(self) -> float:
        if self._scale is None:
            self._scale = 1.0 if self.scaler is None else float(self.scaler.get_scale())
        return self._scale

    def _end_iteration(self) -> None:
        """Commit the iteration's residuals, unless one of its buckets was not finite."""
        if not self._skip:
            for which, name, residual in self._pending:
                getattr(self._worker, which)[name] = residual
        self._pending, self._skip, self._scale = [], False, None
        self.step += 1
        self.stats["steps"] += 1

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: settings, iteration count, residuals (copies). Every rank has
        its own residuals: save one per rank (or gather them)."""
        return {"version": _STATE_VERSION, "config": dict(self.config), "step": self.step,
                "residuals": {k: v.clone() for k, v in self._worker.residuals.items()},
                "chunk_residuals": {k: v.clone() for k, v in self._worker.chunk_residuals.items()},
                "stats": _copy_stats(self.stats)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a different world size, rank or setting is
        refused before anything changes."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"AdaComp state version {state.get('version')!r} is not "
                             f"{_STATE_VERSION} (version 2 keeps residuals in logical order): "
                             "start the compression afresh")
        saved = state["config"]
        diff = {k: (saved.get(k), v) for k, v in self.config.items() if saved.get(k) != v}
        if diff:
            raise ValueError("AdaComp state was saved with different settings "
                             + ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items()))
        self._check_residuals(state)
        self.step = int(state["step"])
        self._worker = _Worker({k: v.clone() for k, v in state["residuals"].items()},
                              {k: v.clone() for k, v in state["chunk_residuals"].items()})
        self.stats = _copy_stats(state["stats"])

    def _check_residuals(self, state: dict[str, Any]) -> None:
        """Every saved residual names a compressed param of this model and is a flat
        floating tensor of its length (this rank's chunk for the two-phase exchange's
        chunk residuals); else a ValueError naming it."""
        params = {name: p for p, name in self._names.items()}
        for which in ("residuals", "chunk_residuals"):
            unknown = sorted(set(state[which]) - set(params))
            if unknown:
                raise ValueError(f"AdaComp state has {which} for unknown parameters {unknown}")
            for name, r in state[which].items():
                p = params[name]
                bin_len = bin_length(tuple(p.shape), self.conv_bin, self.fc_bin)
                if bin_len is None:
                    raise ValueError(f"AdaComp state has {which} for {name!r}, which is sent "
                                     "uncompressed")
                if which == "residuals":
                    length = p.numel()
                else:
                    lo, hi = chunk_bounds(p.numel(), bin_len, self._world)[self._rank]
                    length = hi - lo
                ok = isinstance(r, torch.Tensor) and r.is_floating_point() and r.shape == (length,)
                if not ok:
                    got = (f"{r.dtype} of shape {tuple(r.shape)}" if isinstance(r, torch.Tensor)
                           else type(r).__name__)
                    raise ValueError(f"AdaComp state {which}[{name!r}]: expected a flat floating "
                                     f"tensor of {length} elements (param of shape "
                                     f"{tuple(p.shape)}), got {got}")

    def compression_rates(self) -> dict[str, float]:
        """Per kind of layer, over the compressed steps so far: elements / selected."""
        return {kind: self.stats[kind]["elements"] / max(self.stats[kind]["selected"], 1)
                for kind in KINDS}


def _copy_stats(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: dict(v) if isinstance(v, dict) else v for k, v in stats.items()}


DEFAULT_NETWORK = tuple(DEFAULT_LINK)  # latency (s) and bandwidth (bytes/s) "auto" plans for


def _choose_form(world: int, module: torch.nn.Module, compression: float, network: Any) -> str:
    """:func:`largebatch.comm.scaling.choose_form` for this model's fp32 gradient bytes on one
    link ``network`` (``(latency, bandwidth)``; default :data:`DEFAULT_NETWORK`)."""
    latency, bandwidth = DEFAULT_NETWORK if network is None else network
    size = sum(p.numel() * 4 for p in module.parameters())
    return choose_form(world, size, compression, latency, bandwidth)


def _bucket_layout(state: AdaCompState, bucket: dist.GradBucket) -> _Layout:
    params = bucket.parameters()
    names = []
    for p in params:
        if p not in state._names:
            raise ValueError("a bucket holds a parameter the AdaCompState's model does not have: "
                             "build the state with the DDP model the hook is registered on")
        names.append(state._names[p])
    return _layout(names, [p.shape for p in params], bucket.buffer().dtype, state.conv_bin,
                   state.fc_bin, [_bucket_strides(p) for p in params])


def adacomp_hook(state: AdaCompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``model.register_comm_hook(state, adacomp_hook)``."""
    buf = bucket.buffer()
    last = bucket.is_last()
    try:
        if state.step < state.warmup_steps:
            _dense(state, buf)
        else:
            _compressed(state, bucket, buf)
    finally:
        if last:
            state._end_iteration()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


# DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
adacomp_hook.__annotations__.update(state=AdaCompState, bucket=dist.GradBucket,
                                    **{"return": torch.futures.Future[torch.Tensor]})


def _dense(state: AdaCompState, buf: torch.Tensor, skip: bool = False) -> None:
    """DDP's default: divide by the world size, then sum. ``skip``: the bucket is not
    finite on some rank, and the iteration's residuals are not committed."""
    state._skip |= skip
    buf.div_(state._world)
    dist.all_reduce(buf, group=state.process_group)
    state.stats["dense_bytes"] += buf.numel() * buf.element_size()
    state.stats["sent_bytes"] += buf.numel() * buf.element_size()


def _compressed(state: AdaCompState, bucket: dist.GradBucket, buf: torch.Tensor) -> None:
    layout = _bucket_layout(state, bucket)
    ex = _Exchange(layout, state._world, state.select, state.values)
    flat = _to_logical(buf.to(layout.dtype), layout)
    finite = bool(torch.isfinite(flat).all())
    scale = state._loss_scale()
    parts = ex.compress(state._worker, flat, scale) if finite else {}
    group, world, rank = state.process_group, state._world, state._rank
    device = buf.device
    if state.form == "allgather":
        mine = ex.message(parts) if finite else torch.zeros(0, dtype=torch.uint8, device=device)
        sizes = _all_gather_sizes(torch.tensor([mine.numel() if finite else -1], device=device),
                                  world, group)
        if (sizes < 0).any():
            return _dense(state, buf, skip=True)
        messages = _all_gather_padded(mine, sizes, group)
        result = ex.decode_all(messages, device)
        sent = int(sizes.max()) * (world - 1)
    else:
        outgoing = ([ex.message(parts, j) for j in range(world)] if finite
                    else [torch.zeros(0, dtype=torch.uint8, device=device)] * world)
        split = torch.tensor([m.numel() if finite else -1 for m in outgoing], device=device)
        incoming_sizes = torch.empty_like(split)
        dist.all_to_all_single(incoming_sizes, split, group=group)
        # a non-finite rank flags every destination; the flag must reach every rank
        flag = torch.tensor([int((incoming_sizes < 0).any())], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag):
            return _dense(state, buf, skip=True)
        received = torch.empty(int(incoming_sizes.sum()), dtype=torch.uint8, device=device)
        dist.all_to_all_single(received, torch.cat(outgoing), incoming_sizes.tolist(),
                               split.tolist(), group=group)
        chunks = list(received.split(incoming_sizes.tolist()))
        owned = ex.owner_compress(state._worker, rank, chunks, device, scale)
        mine = ex.owner_message(owned)
        sizes = _all_gather_sizes(torch.tensor([mine.numel()], device=device), world, group)
        messages = _all_gather_padded(mine, sizes, group)
        result = ex.decode_chunks(messages, device)
        state._pending += [("chunk_residuals", name, c.residual.div(scale))
                           for name, c in owned.items()]
        sent = int(split.sum() - split[rank]) + int(sizes.max()) * (world - 1)
    dense = layout.dense
    if dense:
        packed = torch.cat([buf[d.offset: d.offset + d.numel] for d in dense]).div_(world)
        dist.all_reduce(packed, group=group)
        result_dense = packed.to(layout.dtype)
        pos = 0
        for d in dense:
            result[d.offset: d.offset + d.numel] = result_dense[pos: pos + d.numel]
            pos += d.numel
        sent += packed.numel() * packed.element_size()
    state._pending += [("residuals", name, c.residual.div(scale)) for name, c in parts.items()]
    buf.copy_(_to_memory(result, layout))
    # Every input was finite, but the average overflows the bucket's dtype (fp16): the
    # GradScaler will skip the step, so the iteration's residuals are not committed
    # (delayed, never dropped). The average is the same on every rank, so is this choice.
    state._skip |= not bool(torch.isfinite(buf).all())
    stats = state.stats
    stats["compressed_steps"] += int(bucket.is_last())
    stats["dense_bytes"] += buf.numel() * buf.element_size()
    stats["sent_bytes"] += sent
    ex.count(stats, parts)


def _all_gather_sizes(size: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    out = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(out, size, group=group)
    return torch.cat(out)


def _all_gather_padded(mine: torch.Tensor, sizes: torch.Tensor, group: Any) -> list[torch.Tensor]:
    top = int(sizes.max())
    padded = mine.new_zeros(top)
    padded[: mine.numel()] = mine
    out = [torch.empty_like(padded) for _ in range(sizes.numel())]
    dist.all_gather(out, padded, group=group)
    return [m[: int(n)] for m, n in zip(out, sizes)]


# ----------------------------------------------------------------------------- simulation


class SimulatedWorkers:
    """The hook's exchange for ``n`` workers in one process: one residual per worker, the
    same messages, the same rank-order sums and the same dense average. ``exchange`` takes
    each worker's gradients (a list per worker, in ``names``' order) and returns the
    averaged gradients: what every rank of a real run would hold after the hook."""

    def __init__(self, names: Sequence[str], shapes: Sequence[torch.Size], n: int, *,
                 warmup_steps: int = 0, conv_bin: int = CONV_BIN, fc_bin: int = FC_BIN,
                 form: str = "allgather", select: str = "adacomp", values: str = "ternary",
                 dtype: torch.dtype = torch.float32) -> None:
        n = checks.integer("workers", n, 1)
        options = check_options(warmup_steps=warmup_steps, conv_bin=conv_bin, fc_bin=fc_bin,
                                form=form, select=select, values=values)
        warmup_steps, conv_bin, fc_bin = (options[k] for k in ("warmup_steps", "conv_bin", "fc_bin"))
        self.n, self.form, self.warmup_steps = n, form, warmup_steps
        self.layout = _layout(list(names), list(shapes), dtype, conv_bin, fc_bin)
        self.ex = _Exchange(self.layout, n, select, values)
        self.workers = [_Worker() for _ in range(n)]
        self.step = 0
        self.stats = _new_stats()

    def exchange(self, grads: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
        if len(grads) != self.n:
            raise ValueError(f"need gradients from {self.n} workers, got {len(grads)}")
        flats = [torch.cat([g.reshape(-1) for g in gs]) for gs in grads]
        dtype = flats[0].dtype
        if self.step < self.warmup_steps or not all(bool(torch.isfinite(f).all()) for f in flats):
            result = _ordered_sum([f / self.n for f in flats])
        else:
            result = self._compressed([f.to(self.layout.dtype) for f in flats]).to(dtype)
        self.step += 1
        self.stats["steps"] += 1
        out, pos = [], 0
        for layer, g in zip(self.layout.layers, grads[0]):
            out.append(result[pos: pos + layer.numel].view_as(g))
            pos += layer.numel
        return out

    def _compressed(self, flats: list[torch.Tensor]) -> torch.Tensor:
        ex, device = self.ex, flats[0].device
        parts = [ex.compress(w, f) for w, f in zip(self.workers, flats)]
        if self.form == "allgather":
            result = ex.decode_all([ex.message(p) for p in parts], device)
        else:
            owned = [ex.owner_compress(self.workers[j], j, [ex.message(p, j) for p in parts],
                                       device) for j in range(self.n)]
            result = ex.decode_chunks([ex.owner_message(o) for o in owned], device)
            for w, o in zip(self.workers, owned):
                for name, c in o.items():
                    w.chunk_residuals[name] = c.residual
        for w, p in zip(self.workers, parts):
            ex.commit(w, p)
        dense = self.layout.dense
        if dense:
            dense_sum = _ordered_sum([torch.cat([f[d.offset: d.offset + d.numel] for d in dense])
                                      / self.n for f in flats])
            pos = 0
            for d in dense:
                result[d.offset: d.offset + d.numel] = dense_sum[pos: pos + d.numel]
                pos += d.numel
        self.stats["compressed_steps"] += 1
        for p in parts:
            ex.count(self.stats, p)
        return result

    def compression_rates(self) -> dict[str, float]:
        """Per kind of layer: elements / selected over all workers and compressed steps."""
        return {kind: self.stats[kind]["elements"] / max(self.stats[kind]["selected"], 1)
                for kind in KINDS}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "stats": _copy_stats(self.stats),
                "workers": [{"residuals": {k: v.clone() for k, v in w.residuals.items()},
                             "chunk_residuals": {k: v.clone() for k, v in w.chunk_residuals.items()}}
                            for w in self.workers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["workers"]) != self.n:
            raise ValueError(f"state has {len(state['workers'])} workers, this has {self.n}")
        self.step = int(state["step"])
        self.stats = _copy_stats(state["stats"])
        self.workers = [_Worker({k: v.clone() for k, v in w["residuals"].items()},
                                {k: v.clone() for k, v in w["chunk_residuals"].items()})
                        for w in state["workers"]]


def _ordered_sum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    it = iter(tensors)
    total = next(it).clone()
    for t in it:
        total = total + t
    return total


def simulate_step(model: torch.nn.Module, sim: SimulatedWorkers,
                  batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                  loss_fn: Any) -> list[float]:
    """One data-parallel step of ``len(batches)`` simulated workers, as DDP runs it: each
    worker's forward and backward on its own batch (normalization statistics from that
    batch), the exchange, and the averaged gradients in ``param.grad``. Buffers (running
    statistics) end as worker 0's, as DDP's ``broadcast_buffers`` makes them. Returns each
    worker's loss. Parameters without a gradient are not supported (every parameter of the
    model must take part, as in :class:`SimulatedWorkers`' names)."""
    params = [p for p in model.parameters() if p.requires_grad]
    start = [b.clone() for b in model.buffers()]
    after_first: list[torch.Tensor] = []
    grads, losses = [], []
    for w, (x, y) in enumerate(batches):
        for b, s in zip(model.buffers(), start):
            b.copy_(s)
        for p in params:
            p.grad = None
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append([cast(torch.Tensor, p.grad) for p in params])  # every param takes part
        if w == 0:
            after_first = [b.clone() for b in model.buffers()]
    for b, s in zip(model.buffers(), after_first):
        b.copy_(s)
    for p, g in zip(params, sim.exchange(grads)):
        p.grad = g.clone()
    return losses
