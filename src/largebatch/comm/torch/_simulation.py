"""The torch exchange for ``n`` workers in one process (:class:`SimulatedWorkers`) and one
data-parallel step that uses it (:func:`simulate_step`): what the batch-size study runs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch

from largebatch import checks
from largebatch.comm.reference import CONV_BIN, FC_BIN, check_options
from largebatch.comm.torch._codec import KINDS, Exchange, Worker, copy_stats, make_layout, new_stats
from largebatch.comm.torch._fused import FusedExchange, applies, check_fused, resolve_fused


class SimulatedWorkers:
    """The hook's exchange for ``n`` workers in one process: one residual per worker, the
    same messages, the same rank-order sums and the same dense average. ``exchange`` takes
    each worker's gradients (a list per worker, in ``names``' order) and returns the
    averaged gradients: what every rank of a real run would hold after the hook.
    ``fused``: the hook's Triton kernels (None: on CUDA tensors; True: on the CPU too,
    under ``TRITON_INTERPRET=1``), bit for bit the hook's exchange with the same setting."""

    def __init__(
        self,
        names: Sequence[str],
        shapes: Sequence[torch.Size],
        n: int,
        *,
        warmup_steps: int = 0,
        conv_bin: int = CONV_BIN,
        fc_bin: int = FC_BIN,
        form: str = "allgather",
        select: str = "adacomp",
        values: str = "ternary",
        dtype: torch.dtype = torch.float32,
        fused: bool | None = None,
    ) -> None:
        n = checks.integer("workers", n, 1)
        self.fused = check_fused(fused)
        options = check_options(
            warmup_steps=warmup_steps,
            conv_bin=conv_bin,
            fc_bin=fc_bin,
            form=form,
            select=select,
            values=values,
        )
        warmup_steps, conv_bin, fc_bin = (options[k] for k in ("warmup_steps", "conv_bin", "fc_bin"))
        self.n, self.form, self.warmup_steps = n, form, warmup_steps
        self.layout = make_layout(list(names), list(shapes), dtype, conv_bin, fc_bin)
        self.ex = Exchange(self.layout, n, select, values)
        self.fused_ex = FusedExchange(self.layout, n, select, values)
        self.workers = [Worker() for _ in range(n)]
        self.step = 0
        self.stats = new_stats()

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
            out.append(result[pos : pos + layer.numel].view_as(g))
            pos += layer.numel
        return out

    def _compressed(self, flats: list[torch.Tensor]) -> torch.Tensor:
        device = flats[0].device
        if resolve_fused(self.fused, device) and applies(self.layout, self.fused):
            result = self._fused(flats)
        else:
            result = self._unfused(flats)
        dense = self.layout.dense
        if dense:
            dense_sum = _ordered_sum(
                [torch.cat([f[d.offset : d.offset + d.numel] for d in dense]) / self.n for f in flats]
            )
            pos = 0
            for d in dense:
                result[d.offset : d.offset + d.numel] = dense_sum[pos : pos + d.numel]
                pos += d.numel
        self.stats["compressed_steps"] += 1
        return result

    def _fused(self, flats: list[torch.Tensor]) -> torch.Tensor:
        ex, device = self.fused_ex, flats[0].device
        parts = [ex.compress(w, f) for w, f in zip(self.workers, flats)]
        if self.form == "allgather":
            sent = [ex.messages(p, 1) for p in parts]
            result = ex.decode_all([m[0] for m, _ in sent], [s[0] for _, s in sent], device)
        else:
            sent = [ex.messages(p, self.n) for p in parts]
            owned = [
                ex.owner_compress(
                    self.workers[j], j, [m[j] for m, _ in sent], [s[j] for _, s in sent], device
                )
                for j in range(self.n)
            ]
            back = [ex.messages(o, 1) for o in owned]
            result = ex.decode_chunks([m[0] for m, _ in back], [s[0] for _, s in back], device)
            for j, (w, o) in enumerate(zip(self.workers, owned)):
                ex.commit_owned(w, j, o)
        for w, p in zip(self.workers, parts):
            ex.commit(w, p)
            ex.count(self.stats, p.counts.tolist())
        return result

    def _unfused(self, flats: list[torch.Tensor]) -> torch.Tensor:
        ex, device = self.ex, flats[0].device
        parts = [ex.compress(w, f) for w, f in zip(self.workers, flats)]
        if self.form == "allgather":
            result = ex.decode_all([ex.message(p) for p in parts], device)
        else:
            owned = [
                ex.owner_compress(self.workers[j], j, [ex.message(p, j) for p in parts], device)
                for j in range(self.n)
            ]
            result = ex.decode_chunks([ex.owner_message(o) for o in owned], device)
            for w, o in zip(self.workers, owned):
                for name, c in o.items():
                    w.chunk_residuals[name] = c.residual
        for w, p in zip(self.workers, parts):
            ex.commit(w, p)
        for p in parts:
            ex.count(self.stats, p)
        return result

    def compression_rates(self) -> dict[str, float]:
        """Per kind of layer: elements / selected over all workers and compressed steps."""
        return {kind: self.stats[kind]["elements"] / max(self.stats[kind]["selected"], 1) for kind in KINDS}

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "stats": copy_stats(self.stats),
            "workers": [
                {
                    "residuals": {k: v.clone() for k, v in w.residuals.items()},
                    "chunk_residuals": {k: v.clone() for k, v in w.chunk_residuals.items()},
                }
                for w in self.workers
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["workers"]) != self.n:
            raise ValueError(f"state has {len(state['workers'])} workers, this has {self.n}")
        self.step = int(state["step"])
        self.stats = copy_stats(state["stats"])
        self.workers = [
            Worker(
                {k: v.clone() for k, v in w["residuals"].items()},
                {k: v.clone() for k, v in w["chunk_residuals"].items()},
            )
            for w in state["workers"]
        ]


def _ordered_sum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    it = iter(tensors)
    total = next(it).clone()
    for t in it:
        total = total + t
    return total


def simulate_step(
    model: torch.nn.Module,
    sim: SimulatedWorkers,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Any,
) -> list[float]:
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
