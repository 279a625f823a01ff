"""The DDP communication hook: :class:`AdaCompState` (settings, residuals, byte counts, its
checkpoint) and :func:`adacomp_hook`, which runs the exchange over a process group."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from largebatch.comm.costs import DEFAULT_LINK, choose_form
from largebatch.comm.reference import (
    CONV_BIN,
    FC_BIN,
    FORMS,
    bin_length,
    check_options,
    chunk_bounds,
)
from largebatch.comm.torch._codec import (
    KINDS,
    Exchange,
    Layout,
    Worker,
    bucket_strides,
    copy_stats,
    make_layout,
    new_stats,
    to_logical,
    to_memory,
)
from largebatch.comm.torch._fused import FusedExchange, applies, check_fused, resolve_fused

# 2: residuals in logical order; version 1 kept a channels_last weight's in memory order.
_STATE_VERSION = 2


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
        fused: the exchange on Triton kernels that take a whole bucket in a few launches
            and one host read (docs/communication.md): ``None`` (default) on CUDA
            gradients, and on the CPU under ``TRITON_INTERPRET=1``; ``True`` there (a
            RuntimeError elsewhere); ``False`` the torch operations per layer. Both select
            the same elements and send messages of one format; the scale's fp64 sum is
            added in another order, so that the two may differ in its last bit.
            ``fused`` holds the setting (not a saved one: a run may resume on the other
            path), ``stats["fused_buckets"]`` counts the buckets the kernels took.

    The residuals of an iteration are committed after its last bucket, and only if every
    bucket was finite on every rank, before and after the exchange (an fp16 average can
    overflow): a step a GradScaler skips leaves them untouched.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        warmup_steps: int = 0,
        conv_bin: int = CONV_BIN,
        fc_bin: int = FC_BIN,
        form: str = "auto",
        select: str = "adacomp",
        values: str = "ternary",
        network: Any = None,
        compression: float = 40.0,
        scaler: torch.amp.GradScaler | None = None,
        fused: bool | None = None,
    ) -> None:
        fused = check_fused(fused)
        options = check_options(
            warmup_steps=warmup_steps,
            conv_bin=conv_bin,
            fc_bin=fc_bin,
            form=form,
            select=select,
            values=values,
            forms=(*FORMS, "auto"),
        )
        warmup_steps, conv_bin, fc_bin = (options[k] for k in ("warmup_steps", "conv_bin", "fc_bin"))
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "AdaCompState needs an initialized process group (torch.distributed.init_process_group)"
            )
        module = getattr(model, "module", model)
        self.process_group = process_group
        self._world = dist.get_world_size(process_group)
        self._rank = dist.get_rank(process_group)
        self._names = {p: name for name, p in module.named_parameters()}
        if form == "auto":
            form = choose_model_form(self._world, module, compression, network)
        self.config = {
            "world": self._world,
            "rank": self._rank,
            "warmup_steps": warmup_steps,
            "conv_bin": conv_bin,
            "fc_bin": fc_bin,
            "form": form,
            "select": select,
            "values": values,
        }
        self.form, self.select, self.values = form, select, values
        self.warmup_steps, self.conv_bin, self.fc_bin = warmup_steps, conv_bin, fc_bin
        self.step = 0
        self._worker = Worker()
        self.stats = new_stats()
        self.stats["fused_buckets"] = 0
        self.scaler = scaler
        self.fused = fused
        self._fused: dict[Layout, FusedExchange] = {}
        self._pending: list[Callable[[Worker], None]] = []  # the iteration's residual commits
        self._skip = False  # a bucket of this iteration was not finite
        self._overflow: torch.Tensor | None = None  # the same, for the fused buckets, on the device
        self._scale: float | None = None  # the GradScaler's scale for this iteration

    def _loss_scale(self) -> float:
        if self._scale is None:
            self._scale = 1.0 if self.scaler is None else float(self.scaler.get_scale())
        return self._scale

    def _end_iteration(self) -> None:
        """Commit the iteration's residuals, unless one of its buckets was not finite."""
        if self._overflow is not None:
            self._skip |= bool(self._overflow)  # the fused buckets' one read an iteration
        if not self._skip:
            for commit in self._pending:
                commit(self._worker)
        self._pending, self._skip, self._scale, self._overflow = [], False, None, None
        self.step += 1
        self.stats["steps"] += 1

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: settings, iteration count, residuals (copies). Every rank has
        its own residuals: save one per rank (or gather them)."""
        return {
            "version": _STATE_VERSION,
            "config": dict(self.config),
            "step": self.step,
            "residuals": {k: v.clone() for k, v in self._worker.residuals.items()},
            "chunk_residuals": {k: v.clone() for k, v in self._worker.chunk_residuals.items()},
            "stats": copy_stats(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; a different world size, rank or setting is
        refused before anything changes."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(
                f"AdaComp state version {state.get('version')!r} is not "
                f"{_STATE_VERSION} (version 2 keeps residuals in logical order): "
                "start the compression afresh"
            )
        saved = state["config"]
        diff = {k: (saved.get(k), v) for k, v in self.config.items() if saved.get(k) != v}
        if diff:
            raise ValueError(
                "AdaComp state was saved with different settings "
                + ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            )
        self._check_residuals(state)
        self.step = int(state["step"])
        self._worker = Worker(
            {k: v.clone() for k, v in state["residuals"].items()},
            {k: v.clone() for k, v in state["chunk_residuals"].items()},
        )
        self.stats = copy_stats(state["stats"])
        self.stats.setdefault("fused_buckets", 0)

    def _fused_exchange(self, layout: Layout) -> FusedExchange:
        ex = self._fused.get(layout)
        if ex is None:
            ex = self._fused[layout] = FusedExchange(layout, self._world, self.select, self.values)
        return ex

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
                    raise ValueError(f"AdaComp state has {which} for {name!r}, which is sent uncompressed")
                if which == "residuals":
                    length = p.numel()
                else:
                    lo, hi = chunk_bounds(p.numel(), bin_len, self._world)[self._rank]
                    length = hi - lo
                ok = isinstance(r, torch.Tensor) and r.is_floating_point() and r.shape == (length,)
                if not ok:
                    got = (
                        f"{r.dtype} of shape {tuple(r.shape)}"
                        if isinstance(r, torch.Tensor)
                        else type(r).__name__
                    )
                    raise ValueError(
                        f"AdaComp state {which}[{name!r}]: expected a flat floating "
                        f"tensor of {length} elements (param of shape "
                        f"{tuple(p.shape)}), got {got}"
                    )

    def compression_rates(self) -> dict[str, float]:
        """Per kind of layer, over the compressed steps so far: elements / selected."""
        return {kind: self.stats[kind]["elements"] / max(self.stats[kind]["selected"], 1) for kind in KINDS}


DEFAULT_NETWORK = tuple(DEFAULT_LINK)  # latency (s) and bandwidth (bytes/s) "auto" plans for


def choose_model_form(world: int, module: torch.nn.Module, compression: float, network: Any) -> str:
    """:func:`largebatch.comm.scaling.choose_form` for this model's fp32 gradient bytes on one
    link ``network`` (``(latency, bandwidth)``; default :data:`DEFAULT_NETWORK`)."""
    latency, bandwidth = DEFAULT_NETWORK if network is None else network
    size = sum(p.numel() * 4 for p in module.parameters())
    return choose_form(world, size, compression, latency, bandwidth)


def _bucket_layout(state: AdaCompState, bucket: dist.GradBucket) -> Layout:
    params = bucket.parameters()
    names = []
    for p in params:
        if p not in state._names:
            raise ValueError(
                "a bucket holds a parameter the AdaCompState's model does not have: "
                "build the state with the DDP model the hook is registered on"
            )
        names.append(state._names[p])
    return make_layout(
        names,
        [p.shape for p in params],
        bucket.buffer().dtype,
        state.conv_bin,
        state.fc_bin,
        [bucket_strides(p) for p in params],
    )


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
adacomp_hook.__annotations__.update(
    state=AdaCompState, bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


def _dense(state: AdaCompState, buf: torch.Tensor, skip: bool = False) -> None:
    """DDP's default: divide by the world size, then sum. ``skip``: the bucket is not
    finite on some rank, and the iteration's residuals are not committed."""
    state._skip |= skip
    buf.div_(state._world)
    dist.all_reduce(buf, group=state.process_group)
    state.stats["dense_bytes"] += buf.numel() * buf.element_size()
    state.stats["sent_bytes"] += buf.numel() * buf.element_size()


def _set(which: str, name: str, residual: torch.Tensor) -> Callable[[Worker], None]:
    def commit(worker: Worker) -> None:
        getattr(worker, which)[name] = residual

    return commit


def _compressed(state: AdaCompState, bucket: dist.GradBucket, buf: torch.Tensor) -> None:
    layout = _bucket_layout(state, bucket)
    if resolve_fused(state.fused, buf.device) and applies(layout, state.fused):
        return _compressed_fused(state, bucket, buf, layout)
    ex = Exchange(layout, state._world, state.select, state.values)
    flat = to_logical(buf.to(layout.dtype), layout)
    finite = bool(torch.isfinite(flat).all())
    scale = state._loss_scale()
    parts = ex.compress(state._worker, flat, scale) if finite else {}
    group, world, rank = state.process_group, state._world, state._rank
    device = buf.device
    if state.form == "allgather":
        mine = ex.message(parts) if finite else torch.zeros(0, dtype=torch.uint8, device=device)
        sizes = _all_gather_sizes(torch.tensor([mine.numel() if finite else -1], device=device), world, group)
        if (sizes < 0).any():
            return _dense(state, buf, skip=True)
        messages = _all_gather_padded(mine, sizes, group)
        result = ex.decode_all(messages, device)
        sent = int(sizes.max()) * (world - 1)
    else:
        outgoing = (
            [ex.message(parts, j) for j in range(world)]
            if finite
            else [torch.zeros(0, dtype=torch.uint8, device=device)] * world
        )
        split = torch.tensor([m.numel() if finite else -1 for m in outgoing], device=device)
        incoming_sizes = torch.empty_like(split)
        dist.all_to_all_single(incoming_sizes, split, group=group)
        # a non-finite rank flags every destination; the flag must reach every rank
        flag = torch.tensor([int((incoming_sizes < 0).any())], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag):
            return _dense(state, buf, skip=True)
        received = torch.empty(int(incoming_sizes.sum()), dtype=torch.uint8, device=device)
        dist.all_to_all_single(
            received, torch.cat(outgoing), incoming_sizes.tolist(), split.tolist(), group=group
        )
        chunks = list(received.split(incoming_sizes.tolist()))
        owned = ex.owner_compress(state._worker, rank, chunks, device, scale)
        mine = ex.owner_message(owned)
        sizes = _all_gather_sizes(torch.tensor([mine.numel()], device=device), world, group)
        messages = _all_gather_padded(mine, sizes, group)
        result = ex.decode_chunks(messages, device)
        state._pending += [_set("chunk_residuals", name, c.residual.div(scale)) for name, c in owned.items()]
        sent = int(split.sum() - split[rank]) + int(sizes.max()) * (world - 1)
    dense = layout.dense
    if dense:
        packed = torch.cat([buf[d.offset : d.offset + d.numel] for d in dense]).div_(world)
        dist.all_reduce(packed, group=group)
        result_dense = packed.to(layout.dtype)
        pos = 0
        for d in dense:
            result[d.offset : d.offset + d.numel] = result_dense[pos : pos + d.numel]
            pos += d.numel
        sent += packed.numel() * packed.element_size()
    state._pending += [_set("residuals", name, c.residual.div(scale)) for name, c in parts.items()]
    buf.copy_(to_memory(result, layout))
    # Every input was finite, but the average overflows the bucket's dtype (fp16): the
    # GradScaler will skip the step, so the iteration's residuals are not committed
    # (delayed, never dropped). The average is the same on every rank, so is this choice.
    state._skip |= not bool(torch.isfinite(buf).all())
    stats = state.stats
    stats["compressed_steps"] += int(bucket.is_last())
    stats["dense_bytes"] += buf.numel() * buf.element_size()
    stats["sent_bytes"] += sent
    ex.count(stats, parts)


def _compressed_fused(
    state: AdaCompState, bucket: dist.GradBucket, buf: torch.Tensor, layout: Layout
) -> None:
    """:func:`_compressed` on the kernels: a fixed number of launches and one host read a
    bucket (two for two-phase), whatever its number of layers; whether the results are
    finite is read once an iteration, in ``_end_iteration``."""
    ex = state._fused_exchange(layout)
    flat = ex.to_logical(buf.to(layout.dtype))
    finite = torch.isfinite(flat).all().view(1)
    scale = state._loss_scale()
    group, world, rank, device = state.process_group, state._world, state._rank, buf.device
    worker = state._worker
    batch = ex.compress(worker, flat, scale)
    if state.form == "allgather":
        gathered = _all_gather_sizes(ex.sizes(batch, 1, finite), world, group)
        head = torch.cat([gathered, batch.counts]).tolist()  # the host read before the exchange
        sizes, counts = head[:world], head[world:]
        if min(sizes) < 0:
            return _dense(state, buf, skip=True)
        mine = torch.empty(max(sizes), dtype=torch.uint8, device=device)
        ex.encode(batch, mine)
        received = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(received, mine, group=group)
        result = ex.decode_all(received, sizes, device)
        sent = max(sizes) * (world - 1)
    else:
        split = ex.sizes(batch, world, finite)
        incoming = torch.empty_like(split)
        dist.all_to_all_single(incoming, split, group=group)
        # a non-finite rank flags every destination; the flag must reach every rank
        flag = (incoming < 0).any().to(torch.int64).view(1)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        head = torch.cat([flag, split, incoming, batch.counts]).tolist()  # one host read
        if head[0]:
            return _dense(state, buf, skip=True)
        out_sizes, in_sizes, counts = (
            head[1 : 1 + world],
            head[1 + world : 1 + 2 * world],
            head[1 + 2 * world :],
        )
        outgoing = torch.empty(sum(out_sizes), dtype=torch.uint8, device=device)
        ex.encode(batch, outgoing)
        chunks = torch.empty(sum(in_sizes), dtype=torch.uint8, device=device)
        dist.all_to_all_single(chunks, outgoing, in_sizes, out_sizes, group=group)
        owned = ex.owner_compress(worker, rank, chunks.split(in_sizes), in_sizes, device, scale)
        ones = torch.ones(1, dtype=torch.bool, device=device)
        sizes = _all_gather_sizes(ex.sizes(owned, 1, ones), world, group).tolist()  # one host read
        mine = torch.empty(max(sizes), dtype=torch.uint8, device=device)
        ex.encode(owned, mine)
        received = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(received, mine, group=group)
        result = ex.decode_chunks(received, sizes, device)
        state._pending.append(lambda w: ex.commit_owned(w, rank, owned))
        sent = sum(out_sizes) - out_sizes[rank] + max(sizes) * (world - 1)
    if layout.dense:
        index = ex.dense_index(device)
        packed = buf.index_select(0, index).div_(world)
        dist.all_reduce(packed, group=group)
        result.index_copy_(0, index, packed.to(layout.dtype))
        sent += packed.numel() * packed.element_size()
    state._pending.append(lambda w: ex.commit(w, batch))
    buf.copy_(ex.to_memory(result))
    # as in _compressed: an average that overflows the bucket's dtype commits nothing
    over = ~torch.isfinite(buf).all()
    state._overflow = over if state._overflow is None else state._overflow | over
    stats = state.stats
    stats["compressed_steps"] += int(bucket.is_last())
    stats["fused_buckets"] += 1
    stats["dense_bytes"] += buf.numel() * buf.element_size()
    stats["sent_bytes"] += sent
    ex.count(stats, counts)


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
