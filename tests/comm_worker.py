"""The AdaComp DDP hook on N gloo processes (run by ``test_comm.py`` under
``torch.distributed.run``). Rank 0 writes one JSON line per case as it finishes.

``python -m torch.distributed.run --nproc_per_node=N comm_worker.py OUT.jsonl [full]
[fused]``: every world size runs the hook-contract cases (everything selected, the
reference, the simulation); ``full`` adds real training against the
one-process simulation, non-finite gradients and resume. The hook and the simulation run
on torch operations, or with ``fused`` on the Triton kernels (``TRITON_INTERPRET=1`` on
the CPU).
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import sys

import numpy as np
import torch
import torch.distributed as dist
import triton_interpreter
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from largebatch.comm import reference as ref
from largebatch.comm.torch import (
    AdaCompState,
    LocalClipState,
    SimulatedWorkers,
    adacomp_hook,
    local_clip_hook,
    simulate_step,
)
from largebatch.training.distributed import exit_process

FUSED = {"fused": False}  # the path of every AdaCompState and SimulatedWorkers here (main sets it)

SHAPES = {
    "conv": (6, 3, 3, 3),
    "conv_bias": (6,),
    "fc": (10, 131),
    "fc_bias": (10,),
    "norm": (7,),
    "zero": (4, 2, 3, 3),
    "small": (3, 17),
}


class Linear(nn.Module):
    """``forward`` returns sum(p * coef): each param's gradient is exactly ``coef``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        for name, shape in SHAPES.items():
            setattr(self, name, nn.Parameter(torch.zeros(shape, dtype=dtype)))

    def forward(self, coefs: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum((getattr(self, k) * c).sum() for k, c in coefs.items())


def coefs_for(rank: int, step: int, dtype: torch.dtype, dyadic: bool) -> dict[str, torch.Tensor]:
    """The gradients of ``rank`` at ``step``: random, with a few elements much larger than
    the rest; dense (rank <= 1) params and, with ``dyadic``, every param get multiples of
    2**-10 below 8, whose sums are exact in any order."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    out = {}
    for k, shape in SHAPES.items():
        if k == "zero":
            out[k] = torch.zeros(shape, dtype=dtype)
            continue
        x = torch.randn(shape, generator=g, dtype=torch.float64)
        x = x * torch.where(torch.rand(shape, generator=g) < 0.05, 10.0, 1.0)
        if dyadic or len(shape) <= 1:
            x = torch.round(x.clamp(-7, 7) * 1024) / 1024
        out[k] = x.to(dtype)
    return out


def names_shapes() -> tuple[list[str], list[tuple[int, ...]]]:
    return list(SHAPES), list(SHAPES.values())


def run_linear(
    steps: int, dtype: torch.dtype, dyadic: bool, hook: bool, **state_kwargs
) -> tuple[list[dict[str, np.ndarray]], AdaCompState | None]:
    """The gradients every step's exchange leaves on this rank (DDP with the hook, or DDP's
    default all-reduce), and the hook's state."""
    model = DDP(Linear(dtype), bucket_cap_mb=0.001)  # several buckets
    state = None
    if hook:
        state = AdaCompState(model, **state_kwargs, **FUSED)
        model.register_comm_hook(state, adacomp_hook)
    rank = dist.get_rank()
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        model(coefs_for(rank, step, dtype, dyadic)).backward()
        out.append({k: p.grad.detach().double().numpy().copy() for k, p in model.module.named_parameters()})
    return out, state


def everything_equals_allreduce(form: str) -> dict:
    plain, _ = run_linear(3, torch.float32, True, hook=False)
    hooked, state = run_linear(3, torch.float32, True, hook=True, form=form, select="all", values="exact")
    same = all(np.array_equal(a[k], b[k]) for a, b in zip(plain, hooked) for k in SHAPES)
    return {
        "same": same,
        "compressed_steps": state.stats["compressed_steps"],
        "fused_buckets": state.stats["fused_buckets"],
        "shapes_kept": all(b[k].shape == SHAPES[k] for b in hooked for k in SHAPES),
    }


def against_reference(form: str, steps: int = 5) -> dict:
    """float64: the hook against the NumPy reference, residuals carried over the steps."""
    world = dist.get_world_size()
    hooked, state = run_linear(steps, torch.float64, False, hook=True, form=form, warmup_steps=1)
    residuals = {k: [np.zeros(int(np.prod(s))) for _ in range(world)] for k, s in SHAPES.items()}
    server = {
        k: [np.zeros(hi - lo) for lo, hi in ref.chunk_bounds(int(np.prod(s)), ref.bin_length(s) or 1, world)]
        for k, s in SHAPES.items()
    }
    worst, masks_equal = 0.0, True
    for step in range(steps):
        for k, shape in SHAPES.items():
            grads = [coefs_for(r, step, torch.float64, False)[k].numpy().ravel() for r in range(world)]
            bin_len = ref.bin_length(shape)
            if step == 0 or bin_len is None:
                want = np.sum([g / world for g in grads], axis=0)
            elif form == "allgather":
                want, residuals[k] = ref.allgather_exchange(residuals[k], grads, bin_len)
            else:
                want, residuals[k], server[k] = ref.two_phase_exchange(
                    residuals[k], server[k], grads, bin_len
                )
            got = hooked[step][k].ravel()
            masks_equal &= bool(np.array_equal(got != 0, want != 0))
            scale = max(np.abs(want).max(), 1e-300)
            worst = max(worst, float(np.abs(got - want).max() / scale))
    rank = dist.get_rank()
    mine = {k: v.numpy() for k, v in state.state_dict()["residuals"].items()}
    res_err = max(float(np.abs(mine[k] - residuals[k][rank]).max()) for k in mine)
    return {
        "worst": worst,
        "masks_equal": masks_equal,
        "residual_err": res_err,
        "compressed_steps": state.stats["compressed_steps"],
        "fused_buckets": state.stats["fused_buckets"],
    }


def against_simulation(form: str, steps: int = 4) -> dict:
    """float32: the hook equals :class:`SimulatedWorkers` bit for bit (dense layers get
    dyadic gradients, so that the backend's summation order cannot matter; no warm-up, whose
    all-reduce sums in the backend's order)."""
    world = dist.get_world_size()
    hooked, state = run_linear(steps, torch.float32, False, hook=True, form=form)
    names, shapes = names_shapes()
    sim = SimulatedWorkers(names, shapes, world, form=form, **FUSED)
    same = True
    for step in range(steps):
        grads = [[coefs_for(r, step, torch.float32, False)[k] for k in names] for r in range(world)]
        want = sim.exchange(grads)
        same &= all(np.array_equal(hooked[step][k], w.double().numpy()) for k, w in zip(names, want))
    sent = state.stats["sent_bytes"]
    return {
        "same": same,
        "sent_bytes": sent,
        "dense_bytes": state.stats["dense_bytes"],
        "rates": state.compression_rates(),
        "fused_buckets": state.stats["fused_buckets"],
    }


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.fc = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x)))
        x = torch.relu(self.conv2(nn.functional.max_pool2d(x, 2)))
        return self.fc(nn.functional.max_pool2d(x, 2).flatten(1))


def batches(step: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(world * 16, 1, 16, 16, generator=g)
    y = torch.randint(0, 10, (world * 16,), generator=g)
    return [(x[16 * r : 16 * (r + 1)], y[16 * r : 16 * (r + 1)]) for r in range(world)]


def training_equals_simulation(form: str, steps: int = 6) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    sim_net = copy.deepcopy(net)
    model = DDP(net)
    state = AdaCompState(model, form=form, warmup_steps=2, **FUSED)
    model.register_comm_hook(state, adacomp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        x, y = batches(step, world)[rank]
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    names = [n for n, _ in sim_net.named_parameters()]
    sim = SimulatedWorkers(
        names, [p.shape for p in sim_net.parameters()], world, form=form, warmup_steps=2, **FUSED
    )
    sim_opt = torch.optim.SGD(sim_net.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        sim_opt.zero_grad(set_to_none=True)
        simulate_step(sim_net, sim, batches(step, world), loss_fn)
        sim_opt.step()
    same = all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), sim_net.state_dict().values()))
    moved = any(not torch.equal(a, b) for a, b in zip(net.parameters(), Net().parameters()))
    residuals = state.state_dict()["residuals"]
    res_same = all(torch.equal(residuals[k], sim.workers[rank].residuals[k]) for k in residuals)
    return {
        "same": same,
        "moved": moved,
        "residuals_same": res_same,
        "rates": state.compression_rates(),
        "fused_buckets": state.stats["fused_buckets"],
    }


def nonfinite_leaves_residuals(form: str) -> dict:
    """An inf on one rank: every rank all-reduces that step uncompressed (the inf reaches
    everyone, as a GradScaler needs) and no residual changes."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = DDP(Linear(torch.float32), bucket_cap_mb=0.001)
    state = AdaCompState(model, form=form, **FUSED)
    model.register_comm_hook(state, adacomp_hook)
    model(coefs_for(rank, 0, torch.float32, False)).backward()
    before = copy.deepcopy(state.state_dict())
    model.zero_grad(set_to_none=True)
    coefs = coefs_for(rank, 1, torch.float32, False)
    if rank == world - 1:
        coefs["fc"][3, 5] = float("inf")
    model(coefs).backward()
    after = state.state_dict()
    kept = all(torch.equal(before["residuals"][k], after["residuals"][k]) for k in before["residuals"])
    grad = model.module.fc.grad
    return {
        "kept": kept,
        "inf_seen": bool(torch.isinf(grad[3, 5])),
        "others_finite": int(torch.isfinite(grad).sum()) == grad.numel() - 1,
    }


def overflow_keeps_residuals(form: str) -> dict:
    """fp16 gradients, all finite, whose compressed average overflows 65504 (residuals of
    300,000 sent at once): the bucket holds the inf, so a GradScaler skips the step, and
    the residuals stay as they were."""
    rank = dist.get_rank()
    model = DDP(Linear(torch.float16), bucket_cap_mb=0.001)
    state = AdaCompState(model, form=form, **FUSED)
    model.register_comm_hook(state, adacomp_hook)
    model(coefs_for(rank, 0, torch.float16, False)).backward()
    saved = state.state_dict()
    saved["residuals"]["fc"] = torch.full_like(saved["residuals"]["fc"], 3e5)
    state.load_state_dict(saved)
    before = copy.deepcopy(state.state_dict())
    model.zero_grad(set_to_none=True)
    model(coefs_for(rank, 1, torch.float16, False)).backward()
    after = state.state_dict()
    kept = all(
        torch.equal(before[part][k], after[part][k])
        for part in ("residuals", "chunk_residuals")
        for k in before[part]
    )
    return {
        "kept": kept,
        "inf_seen": bool(torch.isinf(model.module.fc.grad).any()),
        "dtype": str(model.module.fc.grad.dtype),
        "finite_in": all(
            bool(torch.isfinite(c).all()) for c in coefs_for(rank, 1, torch.float16, False).values()
        ),
    }


def channels_last_is_logical(form: str, steps: int = 3) -> dict:
    """The same gradients through a model whose conv weights are channels_last and one
    whose are contiguous: the same averages and the same residuals, element for element
    (the hook bins in logical order), and a state saved from one loads into the other."""
    rank = dist.get_rank()
    runs = []
    for channels_last in (False, True):
        model = Linear(torch.float32)
        if channels_last:
            for p in (model.conv, model.zero):
                p.data = p.data.contiguous(memory_format=torch.channels_last)
        ddp = DDP(model, bucket_cap_mb=0.001)
        state = AdaCompState(ddp, form=form, **FUSED)
        ddp.register_comm_hook(state, adacomp_hook)
        grads = []
        for step in range(steps):
            ddp.zero_grad(set_to_none=True)
            ddp(coefs_for(rank, step, torch.float32, False)).backward()
            grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        runs.append((model, state, grads))
    (_, plain, plain_grads), (model, strided, strided_grads) = runs
    saved, mine = plain.state_dict(), strided.state_dict()
    return {
        "strided": not model.conv.is_contiguous(),
        "grads": all(torch.equal(a[k], b[k]) for a, b in zip(plain_grads, strided_grads) for k in a),
        "residuals": all(
            torch.equal(saved[part][k], mine[part][k])
            for part in ("residuals", "chunk_residuals")
            for k in saved[part]
        ),
        "loads": refusal(strided, saved) == "",
    }


def local_clip_sums_clipped_gradients(steps: int = 2) -> dict:
    """The local-clip hook over several buckets: each rank's gradients clipped to a global
    norm that binds on some ranks and not on others, then summed; against the same in
    float64 from every rank's known gradients."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = DDP(Linear(torch.float32), bucket_cap_mb=0.001)  # several buckets
    state = LocalClipState(1.0)
    model.register_comm_hook(state, local_clip_hook)
    worst, bound = 0.0, True
    for step in range(steps):
        every = [coefs_for(r, step, torch.float64, False) for r in range(world)]
        norms = [math.sqrt(sum(float(c.pow(2).sum()) for c in g.values())) for g in every]
        low, high = sorted(norms)[world // 2 - 1 : world // 2 + 1]
        state.max_norm = (low + high) / 2  # binds on the upper half of the ranks only
        bound &= any(n > state.max_norm for n in norms) and any(n <= state.max_norm for n in norms)
        model.zero_grad(set_to_none=True)
        model(coefs_for(rank, step, torch.float32, False)).backward()
        for k, p in model.module.named_parameters():
            want = sum(g[k] * (state.max_norm / max(n, state.max_norm)) for g, n in zip(every, norms))
            scale = float(want.abs().max()) or 1.0
            worst = max(worst, float((p.grad.double() - want).abs().max()) / scale)
    return {"worst": worst, "bound": bound}


def resume_is_exact(form: str, first: int = 3, then: int = 3) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()

    def build():
        torch.manual_seed(0)
        model = DDP(Net())
        state = AdaCompState(model, form=form, warmup_steps=1, **FUSED)
        model.register_comm_hook(state, adacomp_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, state, opt

    def train(model, opt, steps):
        for step in steps:
            x, y = batches(step, world)[rank]
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

    model, state, opt = build()
    train(model, opt, range(first))
    ckpt = copy.deepcopy(
        {"model": model.module.state_dict(), "opt": opt.state_dict(), "adacomp": state.state_dict()}
    )
    train(model, opt, range(first, first + then))
    model2, state2, opt2 = build()
    model2.module.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["opt"])
    state2.load_state_dict(ckpt["adacomp"])
    train(model2, opt2, range(first, first + then))
    same = all(
        torch.equal(a, b)
        for a, b in zip(model.module.state_dict().values(), model2.module.state_dict().values())
    )
    other = AdaCompState(model2, form="two_phase" if form == "allgather" else "allgather", **FUSED)
    return {
        "same": same,
        "refused": refusal(other, ckpt["adacomp"]),
        **bad_residuals_are_refused(state2, ckpt["adacomp"]),
    }


def refusal(state: AdaCompState, saved: dict) -> str:
    """The ValueError's message of ``state.load_state_dict(saved)`` ("" if it loads)."""
    try:
        state.load_state_dict(saved)
    except ValueError as err:
        return str(err)
    return ""


def bad_residuals_are_refused(state: AdaCompState, saved: dict) -> dict:
    """Residuals of the wrong size, or of the right size in the wrong shape, are refused
    before anything changes."""
    name, residual = next(iter(saved["residuals"].items()))
    before = copy.deepcopy(state.state_dict())
    short = {**saved, "residuals": {**saved["residuals"], name: residual[:-1]}}
    folded = {**saved, "residuals": {**saved["residuals"], name: residual.view(1, -1)}}
    out = {"short": refusal(state, short), "folded": refusal(state, folded)}
    after = state.state_dict()
    out["untouched"] = after["step"] == before["step"] and all(
        torch.equal(after["residuals"][k], v) for k, v in before["residuals"].items()
    )
    return out


def main() -> None:
    out = sys.argv[1]
    full = "full" in sys.argv[2:]
    FUSED["fused"] = "fused" in sys.argv[2:]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    triton_interpreter.install()  # the interpreter as under pytest (tests/triton_interpreter.py)
    rank, world = dist.get_rank(), dist.get_world_size()

    def record(case: str, **values) -> None:
        if rank == 0:
            with open(out, "a") as f:
                f.write(json.dumps({"case": f"{case}/{world}", **values}) + "\n")

    for form in ("allgather", "two_phase"):
        record(f"everything/{form}", **everything_equals_allreduce(form))
        record(f"reference/{form}", **against_reference(form))
        record(f"simulation/{form}", **against_simulation(form))
        if full:
            record(f"training/{form}", **training_equals_simulation(form))
            record(f"nonfinite/{form}", **nonfinite_leaves_residuals(form))
            record(f"overflow/{form}", **overflow_keeps_residuals(form))
            record(f"channels_last/{form}", **channels_last_is_logical(form))
            record(f"resume/{form}", **resume_is_exact(form))
    if full:
        record("local_clip", **local_clip_sums_clipped_gradients())


if __name__ == "__main__":
    main()
    exit_process(0)  # not a plain return: its docstring says why
