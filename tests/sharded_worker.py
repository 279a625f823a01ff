"""Run under ``torch.distributed.run`` (gloo, CPU) by ``test_torch_sharded.py``: LARS and
LAMB on params sharded by FSDP2 and on ZeroRedundancyOptimizer, against the same optimizer
on one process with the same gradients. Rank 0 writes one JSON line per case to argv[1].

Each case trains a few real steps (forward, backward, FSDP2's reduce-scatter or DDP's
all-reduce), then gives a plain copy of the model the gathered full gradients and steps
the reference optimizer on it. ``err`` is the largest ``|a - b| / (atol + rtol * |b|)``
over every element of every param (and master) at torch's float32 tolerances (bfloat16's
for bfloat16 params): 1 or less is "equal to float32 tolerance".
"""

from __future__ import annotations

import copy
import datetime
import io
import json
import os
import sys
from contextlib import contextmanager

import torch
import torch.distributed as dist
import triton_interpreter
from cases import torch_paths
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

from largebatch.lars.torch import _sharded
from largebatch.torch import LAMB, LARS, param_groups
from largebatch.training.distributed import exit_process

STEPS = 4
TOL = {torch.float32: (1.3e-6, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}  # torch's (rtol, atol)
PATHS = torch_paths("single_tensor", "foreach", "fused")  # DTensor params refuse compiled


class Net(nn.Module):
    """Rows that split unevenly over 2 ranks (7 -> 4 + 3, 3 -> 2 + 1, 1 -> 1 + 0: an empty
    shard), a LayerNorm (excluded group) and a zero-initialised head (ratio-1 rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 7)
        self.norm = nn.LayerNorm(7)
        self.fc2 = nn.Linear(7, 3)
        self.head = nn.Linear(3, 1)
        nn.init.zeros_(self.head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.norm(self.fc1(x))))))


CLASSES = {"lars": LARS, "lamb": LAMB}


def make_kwargs(name: str, path: str) -> dict:
    """Settings where a trust ratio formed from part of a param, or LAMB's clipping from
    part of the grads, moves the params well past float32 tolerance."""
    if name == "lars":
        return dict(lr=2.0, trust_coefficient=0.02, momentum=0.9, **PATHS[path])
    return dict(lr=0.05, max_grad_norm=0.05, **PATHS[path])


def make_optimizer(name: str, groups: list, path: str, **extra):
    return CLASSES[name](groups, **make_kwargs(name, path), **extra)


def batches(rank: int, world: int):
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 1, generator=gen)
        yield x.chunk(world)[rank], y.chunk(world)[rank]


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    rtol, atol = TOL[b.dtype]
    a, b = a.detach().double(), b.detach().double()
    return float(((a - b).abs() / (atol + rtol * b.abs())).max()) if b.numel() else 0.0


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if _sharded.is_sharded(t) else t


def compare(model: nn.Module, ref: nn.Module, opt, ref_opt) -> float:
    worst = 0.0
    for p, r in zip(model.parameters(), ref.parameters()):
        worst = max(worst, err(full(p), r))
        master = opt.state[p].get("master_param")
        if master is not None:
            worst = max(worst, err(full(master), ref_opt.state[r]["master_param"]))
    return worst


def train_fsdp2(
    name: str,
    path: str,
    *,
    dtype=torch.float32,
    mp_policy=None,
    master=False,
    layers: tuple[str, ...] = ("fc1", "fc2", "head"),
    root: bool = True,
    keep_grads: bool = False,
    reused: list | None = None,
    **options,
):
    """``keep_grads``: the grads are zeroed in place (``zero_grad(set_to_none=False)``);
    ``reused`` receives what each fused step reused of the last (``_fused.Replay.check``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net().to(dtype)
    ref = copy.deepcopy(model)
    extra = {"master_weights": True, **options} if master else dict(options)
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in layers:
        fully_shard(getattr(model, layer), **policy)
    if root:
        fully_shard(model, **policy)
    opt = make_optimizer(name, param_groups(model, 1e-2), path, **extra)
    ref_opt = make_optimizer(name, param_groups(ref, 1e-2), "foreach", **extra)
    if reused is not None:
        check = opt._replay.check
        opt._replay.check = lambda *args: reused.append(check(*args)) or reused[-1]
    for x, y in batches(rank, world):
        nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        for p in model.parameters():  # params left plain are replicated: average their grads
            if not _sharded.is_sharded(p):
                dist.all_reduce(p.grad)
                p.grad /= world
        for p, r in zip(model.parameters(), ref.parameters()):
            r.grad = full(p.grad).to(r.dtype)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=not keep_grads)
        ref_opt.zero_grad()
    assert all(_sharded.is_sharded(p) for p in model.parameters()) == root
    return compare(model, ref, opt, ref_opt)


def train_zero(name: str, path: str, partitioned: bool = True, **zero_kwargs):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    model = nn.parallel.DistributedDataParallel(net)
    extra = {"partitioned": partitioned} if name == "lamb" else {}
    opt = ZeroRedundancyOptimizer(
        param_groups(net, 1e-2),
        optimizer_class=CLASSES[name],
        **make_kwargs(name, path),
        **extra,
        **zero_kwargs,
    )
    ref_opt = make_optimizer(name, param_groups(ref, 1e-2), "foreach")
    whole = check_whole_params(opt, net)
    for x, y in batches(rank, world):
        nn.functional.mse_loss(model(x), y).backward()
        for p, r in zip(net.parameters(), ref.parameters()):
            r.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return max(err(p, r) for p, r in zip(net.parameters(), ref.parameters())), whole


def check_whole_params(opt: ZeroRedundancyOptimizer, net: nn.Module) -> bool:
    """Each rank's local optimizer holds whole params of the model, and every param is held
    by exactly one rank."""
    mine = [p for g in opt.optim.param_groups for p in g["params"]]
    index = {id(p): i for i, p in enumerate(net.parameters())}
    params = list(net.parameters())
    local_ok = all(id(p) in index and p.shape == params[index[id(p)]].shape for p in mine)
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, [index.get(id(p), -1) for p in mine])
    every = sorted(i for ids in held for i in ids)
    return bool(local_ok and every == list(range(len(index))))


@contextmanager
def per_shard_norms():
    """The failure mode: norms of each rank's own block, as an optimizer unaware of the
    sharding would form them."""
    saved = _sharded.shard_key
    _sharded.shard_key = lambda param: ()
    try:
        yield
    finally:
        _sharded.shard_key = saved


def skip_when_one_rank_found_inf(name: str, path: str) -> bool:
    """GradScaler's flag set on rank 1 only: every rank must skip (and none may hang)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    fully_shard(model)
    opt = make_optimizer(name, param_groups(model, 1e-2), path)
    x, y = next(batches(rank, world))
    nn.functional.mse_loss(model(x), y).backward()
    before = [p.to_local().clone() for p in model.parameters()]
    opt.grad_scale, opt.found_inf = None, torch.tensor(float(rank == 1))
    opt.step()
    del opt.grad_scale, opt.found_inf
    same = all(torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters()))
    return same and opt.num_steps == 0


def with_grad_scaler(name: str, path: str) -> dict:
    """torch.amp.GradScaler on FSDP2: the optimizer unscales; on step 1 rank 1 alone finds
    an inf in its shard. Every rank skips that step and halves its scale; the other steps
    equal the one-process run given the unscaled full grads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    fully_shard(model)
    opt = make_optimizer(name, param_groups(model, 1e-2), path)
    ref_opt = make_optimizer(name, param_groups(ref, 1e-2), "foreach")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scales = []
    for i, (x, y) in enumerate(batches(rank, world)):
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if i == 1 and rank == 1:
            next(iter(model.parameters())).grad.to_local()[0, 0] = float("inf")
        scale = scaler.get_scale()
        for p, r in zip(model.parameters(), ref.parameters()):
            r.grad = full(p.grad) / scale
        scaler.step(opt)
        scaler.update()
        if i != 1:
            ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        scales.append(scaler.get_scale())
    every = [None] * world
    dist.all_gather_object(every, scales)
    return {"err": compare(model, ref, opt, ref_opt), "scales": every, "steps": opt.num_steps}


def partitioned_with_no_grads_on_one_rank(path: str) -> float:
    """LAMB(partitioned=True) where rank 1 holds a param without a grad: rank 1 still adds
    its (empty) share to the global norm, so neither rank waits forever, and rank 0's step
    equals one process's on the grads there are."""
    gen = torch.Generator().manual_seed(2)
    w, g = torch.randn(7, 6, generator=gen), torch.randn(7, 6, generator=gen)
    param, ref = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    if dist.get_rank() == 0:
        param.grad, ref.grad = g.clone(), g.clone()
    opt = CLASSES["lamb"]([param], **make_kwargs("lamb", path), partitioned=True)
    make_optimizer("lamb", [ref], "foreach").step()
    opt.step()
    return err(param, ref)


def resumes_exactly(name: str, zero: bool) -> bool:
    """2 steps, a checkpoint of model and optimizer, 2 more steps: a copy restored from
    the checkpoint ends with bitwise the params of the run that went on. FSDP2 through
    torch.distributed.checkpoint (sharded state), ZeRO through its consolidated state dict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = list(batches(rank, world))

    def make():
        torch.manual_seed(0)
        net = Net()
        if zero:
            extra = {"partitioned": True} if name == "lamb" else {}
            opt = ZeroRedundancyOptimizer(
                param_groups(net, 1e-2),
                optimizer_class=CLASSES[name],
                **make_kwargs(name, "foreach"),
                **extra,
            )
            return net, nn.parallel.DistributedDataParallel(net), opt
        fully_shard(net)
        return net, net, make_optimizer(name, param_groups(net, 1e-2), "foreach")

    def train(model, opt, chunk) -> None:
        for x, y in chunk:
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    net, model, opt = make()
    train(model, opt, steps[:2])
    net_b, model_b, opt_b = make()
    if zero:
        opt.consolidate_state_dict(to=0)
        saved = [None]
        if rank == 0:  # written out as a checkpoint is: the live state is not shared
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            saved = [buffer.getvalue()]
        dist.broadcast_object_list(saved, src=0)
        net_b.load_state_dict(net.state_dict())
        opt_b.load_state_dict(torch.load(io.BytesIO(saved[0]), weights_only=False))
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        folder = [os.environ.get("SHARDED_WORKER_TMP", "/tmp") + f"/dcp-{name}"]
        dist.broadcast_object_list(folder, src=0)
        model_sd, optim_sd = get_state_dict(net, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder[0])
        model_sd, optim_sd = get_state_dict(net_b, opt_b)
        loaded = {"model": model_sd, "optim": optim_sd}
        dcp.load(loaded, checkpoint_id=folder[0])
        set_state_dict(net_b, opt_b, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    train(model, opt, steps[2:])
    train(model_b, opt_b, steps[2:])
    local = (lambda t: t.to_local()) if not zero else (lambda t: t)
    same = all(torch.equal(local(a), local(b)) for a, b in zip(net.parameters(), net_b.parameters()))
    if zero:  # ZeRO sets the state of its local optimizer itself: only the state is kept
        return same
    return same and opt.num_steps == opt_b.num_steps == STEPS


def refusal(make) -> str:
    """The message of the ValueError ``make()`` raises ("" if none)."""
    try:
        make()
    except ValueError as e:
        return str(e)
    return ""


def sharded_net() -> nn.Module:
    model = Net()
    fully_shard(model)
    return model


def fused_step_on_mixed_layouts() -> None:
    """fc1 sharded, the rest plain: the fused kernels reduce whole tables, so they refuse."""
    model = Net()
    fully_shard(model.fc1)
    opt = LARS(model.parameters(), lr=1.0, fused=True)
    x, y = next(batches(dist.get_rank(), dist.get_world_size()))
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    triton_interpreter.install()  # the interpreter as under pytest (tests/triton_interpreter.py)
    cases = []

    def record(case: str, **values) -> None:
        cases.append({"case": case, **values})
        if rank == 0:
            with open(out, "a") as f:
                f.write(json.dumps(cases[-1]) + "\n")

    for name in ("lars", "lamb"):
        for path in PATHS:
            record(f"fsdp2/{name}/{path}", err=train_fsdp2(name, path))
            if path == "fused":  # grads zeroed in place: the steps after the first replay it
                reused: list = []
                e = train_fsdp2(name, path, keep_grads=True, reused=reused)
                record(f"fsdp2-grads-kept/{name}/fused", err=e, reused=reused)
            if name == "lars":  # optax's denominator: the norm of g + wd * w, over the shards
                record(f"fsdp2-decayed-norm/lars/{path}", err=train_fsdp2(name, path, decayed_norm=True))
        with per_shard_norms():
            record(f"fsdp2-per-shard-norms/{name}/foreach", err=train_fsdp2(name, "foreach"))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        record(f"fsdp2-mp-policy/{name}/foreach", err=train_fsdp2(name, "foreach", mp_policy=policy))
        for path in ("foreach", "fused"):
            record(
                f"fsdp2-bf16-masters/{name}/{path}",
                err=train_fsdp2(name, path, dtype=torch.bfloat16, master=True),
            )
        for path in ("foreach", "fused"):
            e, whole = train_zero(name, path)
            record(f"zero/{name}/{path}", err=e, whole=whole)
        e, whole = train_zero(name, "foreach", parameters_as_bucket_view=True)
        record(f"zero-bucket-view/{name}/foreach", err=e, whole=whole)
        if name == "lamb":  # the failure mode: clipping from this rank's grads alone
            e, whole = train_zero(name, "foreach", partitioned=False)
            record(f"zero-not-partitioned/{name}/foreach", err=e, whole=whole)
        for path in ("single_tensor", "fused"):
            record(f"skip/{name}/{path}", ok=skip_when_one_rank_found_inf(name, path))
        for path in ("foreach", "fused"):
            record(f"grad-scaler/{name}/{path}", **with_grad_scaler(name, path))
    for path in ("foreach", "fused"):
        record(f"zero-rank-without-grads/lamb/{path}", err=partitioned_with_no_grads_on_one_rank(path))
    for name in ("lars", "lamb"):
        record(f"resume-dcp/{name}", ok=resumes_exactly(name, zero=False))
        record(f"resume-zero/{name}", ok=resumes_exactly(name, zero=True))
        for path in ("single_tensor", "foreach"):  # fc1 sharded, the rest plain tensors
            record(
                f"fsdp2-some-layers/{name}/{path}", err=train_fsdp2(name, path, layers=("fc1",), root=False)
            )
    record("refused/compiled", message=refusal(lambda: LARS(sharded_net().parameters(), compiled=True)))
    record("refused/fused-mixed-layouts", message=refusal(fused_step_on_mixed_layouts))


if __name__ == "__main__":
    main()
    exit_process(0)  # not a plain return: its docstring says why
