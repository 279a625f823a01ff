"""``largebatch train``: run a named recipe (``largebatch.recipes.registry``) end to end.

One process, or many under ``torchrun`` (``RANK``/``WORLD_SIZE`` set): gloo on CPU,
NCCL on CUDA, ``DistributedDataParallel``, the recipe's global batch split evenly across
processes, gradient accumulation when ``--micro-batch`` is smaller than a process's share.
Before every evaluation the processes average their batch-norm running statistics, so
the test accuracy and the checkpoint are those of one model.

Every epoch appends a line to ``OUT/metrics.jsonl`` (train loss, test accuracy, lr,
images/s, min/median/max trust ratio over the adapted layers) and rewrites
``OUT/checkpoint.pt`` (model, optimizer, scheduler, GradScaler, epoch, RNG, the run's
settings) and ``OUT/plot.png``; the run ends with ``OUT/summary.json``. Every file is
replaced atomically (``largebatch.recipes.outputs.atomic_write``), and a lock on ``OUT``
keeps a second run out of it. ``--resume`` continues from the checkpoint, refuses
settings other than the run's own, and gives the same parameters as an uninterrupted run.

``--epochs`` other than the recipe's scales the recipe's warmup and milestones with it
(``Recipe.with_epochs``).

``--compression adacomp`` (under ``torchrun``, DDP) registers the AdaComp communication hook
(:mod:`largebatch.comm.torch`) after ``--compression-warmup`` epochs of plain all-reduce:
every rank's residuals go into the checkpoint, and each metrics line records the
compression rates so far.

The trust ratio is recomputed here from params and gradients with the optimizer's own
formula (docs/design.md §2) at the last step of each epoch; for SGD it is the ratio LARS would
apply, a diagnostic only.

The model, optimizer, schedule and loss come from :mod:`largebatch.recipes.build`, the
epoch and the evaluation from :mod:`largebatch.recipes.loop` (both shared with ``largebatch
study``), the data from :mod:`largebatch.recipes.train_data`, the plot from
:mod:`largebatch.recipes.plots`; this module adds the processes, the checkpoints, the
per-epoch metrics and the trust-ratio telemetry.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from largebatch.recipes import plots
from largebatch.recipes.build import (
    DTYPES, build_loss, build_model, build_optimizer, build_schedule,
)
from largebatch.recipes.distributed import (
    buffers_sha256, check_device, full_optimizer_state, full_state, join, params_sha256,
    shard_model, sync_buffers,
)
from largebatch.recipes.loop import evaluate, train_epoch
from largebatch.recipes.outputs import (
    CommandError, atomic_write, lock_folder, remove_stale_temporaries, require,
)
from largebatch.recipes.registry import (
    DEFAULT_RECIPE, PRECISIONS, RECIPES, TRAIN_IMAGES, Recipe, get_recipe, imagenet_equivalent,
)
from largebatch.recipes.study.plan import COMPRESSIONS
from largebatch.recipes.train_data import batches, epoch_sampler, eval_chunks, load_data
from largebatch.torch import ScheduleLR, to_half, trust_ratios

__all__ = ["build_model", "build_optimizer", "trust_ratios", "train", "add_arguments", "main"]



def _fail(message: str) -> CommandError:
    return CommandError("train", message)


# --------------------------------------------------------------------------- telemetry


class _EpochTelemetry:
    """The training loop's callbacks for one epoch: the progress bar (rank 0), and the
    trust ratios at the epoch's last step, read before the optimizer applies the step."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any, steps: int, batch: int,
                 desc: str, show: bool) -> None:
        from tqdm import tqdm

        self.optimizer, self.scaler, self.last, self.batch = optimizer, scaler, steps - 1, batch
        self.ratios: list[float] = []
        self.seen = 0
        self.bar = tqdm(total=steps, desc=desc, unit="step", disable=not show or None,
                        leave=False)
        self.t0 = time.perf_counter()

    def before_step(self, step: int) -> None:
        if step == self.last:
            self.ratios = trust_ratios(self.optimizer,
                                       self.scaler.get_scale() if self.scaler else 1.0)

    def after_step(self, step: int) -> None:
        self.seen += self.batch
        self.bar.update()
        self.bar.set_postfix(img_s=f"{self.seen / (time.perf_counter() - self.t0):,.0f}")

    def close(self) -> float:
        """Closes the bar; the epoch's seconds."""
        self.bar.close()
        return time.perf_counter() - self.t0

    def row(self) -> dict[str, float | None]:
        ratios = self.ratios
        return {"trust_ratio_min": min(ratios) if ratios else None,
                "trust_ratio_median": statistics.median(ratios) if ratios else None,
                "trust_ratio_max": max(ratios) if ratios else None}


# --------------------------------------------------------------------------- training


_OUTPUTS = ("checkpoint.pt", "metrics.jsonl", "summary.json", "plot.png")
# The settings a checkpoint records and ``--resume`` must match, with their flags.
_SETTINGS = {"recipe": "--recipe", "batch_size": "--batch-size", "epochs": "--epochs",
             "lr": "--lr", "seed": "--seed", "subset": "--subset", "precision": "--precision",
             "fsdp": "--fsdp", "compression": "--compression",
             "compression_warmup": "--compression-warmup"}
# What a checkpoint made before a setting existed ran with.
_SETTINGS_BEFORE = {"compression": "none", "compression_warmup": None}


def _to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` (dicts of tensors and plain values) with every tensor on ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _to_device(v, device) for k, v in tree.items()}
    return tree


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def _read_checkpoint(path: Path, settings: dict[str, Any], world: int) -> dict[str, Any]:
    """The checkpoint to resume from, after checking that it was made with ``settings``
    (and, for AdaComp, on ``world`` processes: each kept its own residuals)."""
    if not path.is_file():
        raise _fail(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 -- any unreadable checkpoint is a user error
        raise _fail(f"--resume: cannot read {path} ({type(err).__name__}: {err})") from None
    saved = ({**_SETTINGS_BEFORE, **state["settings"]} if state.get("settings")
             else {"recipe": state.get("recipe")})
    for key, flag in _SETTINGS.items():
        if key in saved and saved[key] != settings[key]:
            raise _fail(f"--resume: {path} is a run with {flag} {_show(saved[key])}, not "
                        f"{_show(settings[key])}; resume it with its own settings, or start "
                        "a new run in another --out")
    saved_world = len(state.get("adacomp") or ())
    if settings["compression"] == "adacomp" and saved_world and saved_world != world:
        raise _fail(f"--resume: {path} holds the AdaComp residuals of {saved_world} processes, "
                    f"not {world}: resume it on {saved_world} (each process keeps its own "
                    "residuals), or start a new run in another --out")
    return state


def _steps_text(recipe: Recipe, ends: list[int]) -> str:
    """How many steps the run takes, in the recipe's step arithmetic (``epoch_steps``)."""
    if recipe.epoch_steps == "exact":
        return f"{ends[-1]:,} steps in all (epoch e ends at step round(e N / B))"
    rule = "N // B" if recipe.epoch_steps == "floor" else "ceil(N / B)"
    return f"{ends[1]:,} step{'s' * (ends[1] != 1)} an epoch ({rule})"


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.recipe`` with the command-line overrides; returns the summary (all ranks)."""
    try:
        recipe = get_recipe(args.recipe)
    except ValueError as err:
        raise _fail(str(err)) from None
    if recipe.data == "imagenet" or recipe.model in ("resnet50", "alexnet_bn"):
        require("train", ("torchvision",))
    batch = args.batch_size or recipe.batch_size
    epochs = args.epochs or recipe.epochs
    precision = args.precision or recipe.precision
    lr = args.lr if args.lr is not None else recipe.lr_for(batch)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if batch % world:
        raise _fail(f"batch size {batch} is not divisible by the world size {world}")
    local_batch = batch // world
    micro = args.micro_batch or local_batch
    if micro > local_batch or local_batch % micro:
        raise _fail(f"micro-batch {micro} must divide the per-process batch {local_batch} "
                    f"(batch {batch} / world size {world})")
    if args.fsdp and world < 2:
        raise _fail("--fsdp shards the model over processes: run it under torchrun with 2 or "
                    "more (torchrun --nproc_per_node=2 -m largebatch train --fsdp ...)")
    if args.fsdp and precision == "fp16":
        raise _fail("--fsdp runs fp32 or bf16 (FSDP2's mixed-precision policy); fp16 needs a "
                    "loss scaler over sharded grads: use --precision bf16")
    compression = args.compression
    if compression != "none" and (world < 2 or args.fsdp):
        raise _fail(f"--compression {compression} compresses DDP's all-reduce: run it under "
                    "torchrun with 2 or more processes, without --fsdp")
    device_name = check_device(args.device)
    out = Path(args.out or Path("runs") / recipe.name)
    settings = {"recipe": recipe.name, "batch_size": batch, "epochs": epochs, "lr": lr,
                "seed": args.seed, "subset": args.subset, "precision": precision,
                "fsdp": args.fsdp, "compression": compression,
                "compression_warmup": args.compression_warmup if compression != "none" else None}
    with contextlib.ExitStack() as held:
        if rank == 0:  # only rank 0 writes: it holds the folder for the whole run
            held.enter_context(lock_folder(out, "train"))
            remove_stale_temporaries(out, _OUTPUTS)
        state = (_read_checkpoint(out / "checkpoint.pt", settings, world) if args.resume
                 else None)
        done, stop = (state["epoch"] if state else 0), min(epochs, args.stop_after or epochs)
        if done >= stop and (out / "summary.json").is_file():
            if rank == 0:
                print(f"largebatch train: {out} "
                      + (f"already finished: {done} of {epochs} epochs" if done >= epochs else
                         f"is already at epoch {done} of {epochs} (--stop-after {stop})")
                      + "; nothing to do", flush=True)
            return _read_summary(out / "summary.json")
        return _fit(args, recipe, settings, out, state, device_name, micro)


def _fit(args: argparse.Namespace, recipe: Recipe, settings: dict[str, Any], out: Path,
         state: dict[str, Any] | None, device_name: str, micro: int) -> dict[str, Any]:
    batch, epochs, lr = settings["batch_size"], settings["epochs"], settings["lr"]
    precision = settings["precision"]
    rank, world, device = join(device_name)
    local_batch = batch // world
    data = load_data(recipe, args.data, args.subset)
    if data.n_train < batch:
        raise _fail(f"{data.n_train} training images hold no full batch of {batch}")
    # The step count at the end of each epoch, by the recipe's source's arithmetic.
    ends = [recipe.epoch_end(e, data.n_train, batch) for e in range(epochs + 1)]

    torch.manual_seed(args.seed)
    model = build_model(recipe.model, data.num_classes)
    fsdp = settings["fsdp"]
    # FSDP2 shards contiguous params only: channels-last weights are not.
    model = model.to(device) if fsdp else model.to(  # type: ignore[call-overload]  # torch's stubs
        device, memory_format=torch.channels_last)
    dtype = DTYPES[precision]
    if fsdp:  # sharded: fp32 params, FSDP2's policy computes in dtype; evaluated whole
        if state is not None:
            model.load_state_dict(state["model"])
        whole = copy.deepcopy(model)
        shard_model(model, dtype)
    elif precision != "fp32":
        to_half(model, dtype)
    try:
        optimizer = build_optimizer(recipe, model, lr, precision)
    except ValueError as err:
        raise _fail(str(err)) from None
    # The recipe's schedule, its warmup and milestones scaled to --epochs.
    shape = recipe.with_epochs(epochs)
    schedule = build_schedule(recipe, peak_lr=lr, epochs=epochs, n_train=data.n_train,
                              batch=batch)
    scheduler = ScheduleLR(optimizer, schedule, follow_optimizer=hasattr(optimizer, "num_steps"))
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    loss_fn = build_loss(recipe)

    start_epoch, history = 0, []
    checkpoint = out / "checkpoint.pt"
    if state is not None:
        if not fsdp:
            model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
        cpu_rng, cuda_rng = state["rng"][rank if len(state["rng"]) > rank else 0]
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None and device.type == "cuda":
            torch.cuda.set_rng_state(cuda_rng, device)
        start_epoch, history = state["epoch"], state["history"]
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 and not fsdp else model
    comm = None
    if settings["compression"] == "adacomp":
        from largebatch.comm.torch import AdaCompState, adacomp_hook

        comm = AdaCompState(ddp, warmup_steps=ends[min(settings["compression_warmup"], epochs)],
                            scaler=scaler)
        if state is not None:
            try:
                comm.load_state_dict(_to_device(state["adacomp"][rank], device))
            except ValueError as err:  # another version or setting: every rank alike
                raise _fail(f"--resume: {out / 'checkpoint.pt'}: {err}") from None
        # compression runs under DDP only (checked with the settings)
        cast(nn.parallel.DistributedDataParallel, ddp).register_comm_hook(comm, adacomp_hook)
    nominal = imagenet_equivalent(batch, TRAIN_IMAGES[recipe.data])
    stop = min(epochs, args.stop_after or epochs)
    if rank == 0:
        scaled = (f" (the recipe's {recipe.schedule_text} over {recipe.epochs} epochs, "
                  f"scaled to {epochs})" if shape.schedule_text != recipe.schedule_text else "")
        span = (f"epochs {start_epoch + 1}-{stop} of {epochs}" if start_epoch < stop else
                f"{start_epoch} of {epochs} epochs done, writing the summary")
        print(f"{recipe.name}: {recipe.model} on {recipe.data} ({data.n_train:,} images), batch "
              f"{batch:,} (ImageNet-equivalent {nominal:,}) "
              f"= {world} x {local_batch // micro} x {micro}, {recipe.optimizer} peak lr {lr:g}, "
              f"{precision}, {span}, {_steps_text(recipe, ends)}; "
              f"schedule {shape.schedule_text}{scaled}", flush=True)

    title = f"{recipe.name} (batch {batch:,})"
    plot = plots.Plotter("train", out / "plot.png",
                         lambda h, path: plots.plot_history(h, path, title),
                         "; the metrics, checkpoint and summary are unaffected")
    acc = history[-1]["test_accuracy"] if history else float("nan")
    for epoch in range(start_epoch, stop):
        steps = ends[epoch + 1] - ends[epoch]
        sampler = epoch_sampler(recipe, data.n_train, batch, rank, world, args.seed, epoch)
        telemetry = _EpochTelemetry(optimizer, scaler, steps, batch,
                                    f"epoch {epoch + 1}/{epochs}", show=rank == 0)
        loss_sum = train_epoch(
            ddp, batches(data.train, sampler, local_batch, args.workers, device, dtype),
            optimizer, scheduler, loss_fn, micro_batch=micro, scaler=scaler,
            no_sync=ddp.no_sync if isinstance(ddp, nn.parallel.DistributedDataParallel) else None,
            before_step=telemetry.before_step, after_step=telemetry.after_step)
        seconds, seen = telemetry.close(), telemetry.seen
        if world > 1:
            dist.all_reduce(loss_sum)
            loss_sum /= world
        sync_buffers(model, world)  # one model: evaluated, checkpointed and summarized
        if fsdp:  # gathered whole (every rank), evaluated in fp32 without collectives
            whole.load_state_dict(full_state(model))
        acc = evaluate(whole if fsdp else model, eval_chunks(data.test, rank, world, args.workers),
                       device=device, dtype=torch.float32 if fsdp else dtype, world=world).accuracy
        row = {
            "epoch": epoch + 1, "train_loss": float(loss_sum) / steps,
            "test_accuracy": acc, "lr": optimizer.param_groups[0]["lr"],
            "images_per_second": seen / seconds, "seconds": seconds, **telemetry.row(),
        }
        if comm is not None:  # elements per selected element so far, rank 0's
            row["compression_rates"] = comm.compression_rates()
        history.append(row)
        rng: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [
            (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)]
        if world > 1:
            mine, rng = rng[0], [None] * world
            dist.all_gather_object(rng, mine)
        residuals = None
        if comm is not None:  # every rank's own residuals
            residuals = [None] * world
            dist.all_gather_object(residuals, _to_device(comm.state_dict(), torch.device("cpu")))
        # A checkpoint holds the whole model and state, sharded or not (collectives).
        saved_model = whole.state_dict() if fsdp else model.state_dict()
        saved_optimizer = full_optimizer_state(optimizer) if fsdp else optimizer.state_dict()
        if rank == 0:
            print(f"epoch {epoch + 1:>3}/{epochs}  train loss {row['train_loss']:.4f}  "
                  f"test acc {acc:.2%}  lr {row['lr']:.4g}  "
                  f"{row['images_per_second']:,.0f} img/s", flush=True)
            snapshot = {"model": saved_model, "optimizer": saved_optimizer,
                        "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict() if scaler else None,
                        "epoch": epoch + 1, "rng": rng, "history": history,
                        "adacomp": residuals,
                        "recipe": recipe.name, "settings": settings}
            atomic_write(checkpoint, functools.partial(torch.save, snapshot))
            atomic_write(out / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
            if epoch + 1 < stop:  # the last plot comes after the summary
                plot(history)

    summary = {
        "recipe": recipe.name, "test_accuracy": acc, "epochs": len(history),
        "batch_size": batch, "imagenet_equivalent_batch": nominal,
        "world_size": world, "precision": precision, "peak_lr": lr,
        "schedule": shape.schedule_text, "published_top1": recipe.published_top1,
        "params_sha256": params_sha256(whole if fsdp else model),
        "buffers_sha256": buffers_sha256(whole if fsdp else model),
        "images_per_second": statistics.mean(h["images_per_second"] for h in history)
        if history else None,
    }
    print(f"rank {rank}/{world}: params sha256 {summary['params_sha256']}", flush=True)
    print(f"rank {rank}/{world}: buffers sha256 {summary['buffers_sha256']}", flush=True)
    if rank == 0:
        atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")
        plot(history)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``largebatch train`` flags; every recipe value left unset keeps the recipe's."""
    add = parser.add_argument
    add("--recipe", default=DEFAULT_RECIPE, help=f"recipe name (default %(default)s; "
        f"'largebatch recipes' lists {len(RECIPES)})")
    add("--data", default=None, metavar="DIR", help="ImageFolder tree (DIR/train, DIR/val) for "
        "ImageNet recipes; Fashion-MNIST idx folder otherwise (default: the installed copy)")
    add("--batch-size", type=int, default=None, help="global batch (default: the recipe's)")
    add("--micro-batch", type=int, default=None,
        help="per-process micro-batch; smaller than the per-process batch: gradient accumulation")
    add("--epochs", type=int, default=None, help="epochs (default: the recipe's; another number "
        "scales the recipe's warmup and milestones with it)")
    add("--lr", type=float, default=None,
        help="peak lr (default: the recipe's, scaled to the batch)")
    add("--precision", choices=PRECISIONS, default=None, help="default: the recipe's")
    add("--out", default=None, metavar="DIR", help="output folder (default runs/RECIPE); "
        "one run at a time")
    add("--resume", action="store_true", help="continue from OUT/checkpoint.pt (same settings)")
    add("--stop-after", type=int, default=None, metavar="EPOCH",
        help="stop after this epoch (the schedule still spans --epochs); --resume continues")
    add("--seed", type=int, default=0)
    add("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    add("--subset", type=int, default=None, metavar="N", help="first N train (and test) images")
    add("--workers", type=int, default=4, help="data-loader workers for ImageFolder data")
    add("--fsdp", action="store_true", help="under torchrun: shard params, grads and optimizer "
        "state with FSDP2 (fully_shard) instead of replicating them with DDP; trust ratios "
        "use each whole param's norm")
    add("--compression", choices=COMPRESSIONS, default="none",
        help="under torchrun: compress DDP's gradient all-reduce with AdaComp (a communication "
             "hook; docs/communication.md) after --compression-warmup epochs uncompressed")
    add("--compression-warmup", type=int, default=1, metavar="EPOCHS",
        help="epochs of plain all-reduce before AdaComp starts (default %(default)s)")


def main(args: argparse.Namespace) -> int:
    for flag in ("batch_size", "micro_batch", "epochs", "subset", "stop_after"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise _fail(f"invalid --{flag.replace('_', '-')} {value} (must be >= 1)")
    if args.workers < 0:
        raise _fail(f"invalid --workers {args.workers} (must be >= 0)")
    if args.compression_warmup < 0:
        raise _fail(f"invalid --compression-warmup {args.compression_warmup} (must be >= 0)")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise _fail(f"invalid --lr {args.lr} (must be a finite number > 0)")
    require("train", ("tqdm", "matplotlib"))
    try:
        train(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
