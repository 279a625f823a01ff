"""A ``largebatch train`` run's objects: built from a recipe and the command's settings
(:func:`build_run`), restored from a checkpoint (:func:`restore`) and wrapped for several
processes (:func:`distribute`). ``largebatch.training.train`` runs the epochs on them.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from largebatch import plots
from largebatch.outputs import CommandError
from largebatch.recipes.build import (
    DTYPES,
    build_loss,
    build_model,
    build_optimizer,
    build_schedule,
    setup_options,
)
from largebatch.recipes.registry import TRAIN_IMAGES, Recipe, imagenet_equivalent
from largebatch.torch import ScheduleLR, to_half
from largebatch.training.checkpoint import to_device
from largebatch.training.data import TrainData, load_data
from largebatch.training.distributed import join, shard_model

__all__ = ["Run", "build_run", "restore", "distribute", "fail"]


def fail(message: str) -> CommandError:
    """A user error of ``largebatch train``: one line, exit status 2."""
    return CommandError("train", message)


@dataclasses.dataclass
class Run:
    """One run's objects, built by :func:`build_run` and read by every step of
    ``largebatch.training.train``."""

    args: argparse.Namespace
    recipe: Recipe
    settings: dict[str, Any]
    out: Path
    rank: int
    world: int
    device: torch.device
    batch: int
    local_batch: int
    micro: int
    epochs: int
    stop: int  # the epoch this invocation stops after (--stop-after)
    fsdp: bool
    dtype: torch.dtype
    data: TrainData
    ends: list[int]  # the step count at the end of each epoch, by the recipe's source's arithmetic
    model: nn.Module  # sharded under FSDP
    whole: nn.Module | None  # under FSDP, the whole model, gathered from the shards
    optimizer: torch.optim.Optimizer
    scheduler: ScheduleLR
    scaler: torch.amp.GradScaler | None
    loss_fn: nn.Module
    shape: Recipe  # the recipe's schedule, its warmup and milestones scaled to --epochs
    nominal: int  # the ImageNet-equivalent batch
    plot: plots.Plotter
    ddp: nn.Module = dataclasses.field(init=False)  # what trains: DDP's wrapper, or the model
    comm: Any = None  # the AdaComp hook's state

    @property
    def evaluated(self) -> nn.Module:
        """The one whole model: evaluated, checkpointed and summarized."""
        return self.model if self.whole is None else self.whole


def build_run(
    args: argparse.Namespace,
    recipe: Recipe,
    settings: dict[str, Any],
    out: Path,
    state: dict[str, Any] | None,
    device_name: str,
    micro: int,
) -> Run:
    """Joins the processes; the run's data, model, optimizer, schedule, scaler, loss and plot."""
    batch, epochs, lr = settings["batch_size"], settings["epochs"], settings["lr"]
    precision, fsdp = settings["precision"], settings["fsdp"]
    rank, world, device = join(device_name)
    data = load_data(recipe, args.data, args.subset)
    if data.n_train < batch:
        raise fail(f"{data.n_train} training images hold no full batch of {batch}")
    ends = [recipe.epoch_end(e, data.n_train, batch) for e in range(epochs + 1)]
    torch.manual_seed(args.seed)
    dtype = DTYPES[precision]
    model, whole = _build_model(
        recipe, data.num_classes, device, precision, fsdp, state, settings["ghost_batch"]
    )
    try:
        optimizer = build_optimizer(recipe, model, lr, precision, world)
    except ValueError as err:
        raise fail(str(err)) from None
    shape = recipe.with_epochs(epochs)
    schedule = build_schedule(recipe, peak_lr=lr, epochs=epochs, n_train=data.n_train, batch=batch)
    scheduler = ScheduleLR(optimizer, schedule, follow_optimizer=hasattr(optimizer, "num_steps"))
    title = f"{recipe.name} (batch {batch:,})"
    return Run(
        args=args,
        recipe=recipe,
        settings=settings,
        out=out,
        rank=rank,
        world=world,
        device=device,
        batch=batch,
        local_batch=batch // world,
        micro=micro,
        epochs=epochs,
        stop=min(epochs, args.stop_after or epochs),
        fsdp=fsdp,
        dtype=dtype,
        data=data,
        ends=ends,
        model=model,
        whole=whole,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=torch.amp.GradScaler(device.type) if precision == "fp16" else None,
        loss_fn=build_loss(recipe),
        shape=shape,
        nominal=imagenet_equivalent(batch, TRAIN_IMAGES[recipe.data]),
        plot=plots.Plotter(
            "train",
            out / "plot.png",
            lambda h, path: plots.plot_history(h, path, title),
            "; the metrics, checkpoint and summary are unaffected",
        ),
    )


def _build_model(
    recipe: Recipe,
    num_classes: int,
    device: torch.device,
    precision: str,
    fsdp: bool,
    state: dict[str, Any] | None,
    ghost_batch: int | None = None,
) -> tuple[nn.Module, nn.Module | None]:
    """The recipe's model on ``device`` (its batch norms ghost batch norms of ``ghost_batch``
    when given), and under FSDP its whole copy (None otherwise)."""
    model = build_model(recipe.model, num_classes, ghost_batch=ghost_batch)
    # FSDP2 shards contiguous params only: channels-last weights are not.
    model = (
        model.to(device)
        if fsdp
        else model.to(  # type: ignore[call-overload]  # torch's stubs
            device, memory_format=torch.channels_last
        )
    )
    dtype = DTYPES[precision]
    whole = None
    if fsdp:  # sharded: fp32 params, FSDP2's policy computes in dtype; evaluated whole
        if state is not None:  # restored before sharding
            model.load_state_dict(state["model"])
        whole = copy.deepcopy(model)
        shard_model(model, dtype)
    elif precision != "fp32":
        to_half(model, dtype)
    return model, whole


def restore(run: Run, state: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """Loads the checkpoint ``state`` into the run (under FSDP the model is already loaded) and
    this process's RNG states; the epochs done and their metrics. The optimizer's options
    that the set-up decides (:func:`~largebatch.recipes.build.setup_options`: the clip of a
    ``clip_per_process`` recipe, by the number of processes) stay as built for this run."""
    if not run.fsdp:
        run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    for name, value in setup_options(run.recipe, run.world).items():
        setattr(run.optimizer, name, value)
    run.scheduler.load_state_dict(state["scheduler"])
    if run.scaler is not None:
        run.scaler.load_state_dict(state["scaler"])
    cpu_rng, cuda_rng = state["rng"][run.rank if len(state["rng"]) > run.rank else 0]
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None and run.device.type == "cuda":
        torch.cuda.set_rng_state(cuda_rng, run.device)
    return state["epoch"], state["history"]


def distribute(run: Run, state: dict[str, Any] | None) -> None:
    """Wraps the model in DDP (several processes, no FSDP) and registers its hook: the
    recipe's per-process clip (``clip_per_process``), or AdaComp (``--compression
    adacomp``), its residuals restored from the checkpoint ``state``."""
    run.ddp = nn.parallel.DistributedDataParallel(run.model) if run.world > 1 and not run.fsdp else run.model
    if run.recipe.clip_per_process is not None and run.world > 1:
        from largebatch.comm.torch import LocalClipState, local_clip_hook

        clip = LocalClipState(run.recipe.clip_per_process, scaler=run.scaler)
        cast(nn.parallel.DistributedDataParallel, run.ddp).register_comm_hook(clip, local_clip_hook)
    if run.settings["compression"] != "adacomp":
        return
    from largebatch.torch import AdaCompState, adacomp_hook

    warmup = run.ends[min(run.settings["compression_warmup"], run.epochs)]
    run.comm = AdaCompState(run.ddp, warmup_steps=warmup, scaler=run.scaler)
    if state is not None:
        try:
            run.comm.load_state_dict(to_device(state["adacomp"][run.rank], run.device))
        except ValueError as err:  # another version or setting: every rank alike
            raise fail(f"--resume: {run.out / 'checkpoint.pt'}: {err}") from None
    # compression runs under DDP only (checked with the settings)
    cast(nn.parallel.DistributedDataParallel, run.ddp).register_comm_hook(run.comm, adacomp_hook)
