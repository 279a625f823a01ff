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

On a terminal, rank 0 shows a progress bar on stderr over the steps of the run: the
epoch's mean training loss so far, images/s, and the time left for the run (to
``--stop-after``), evaluations included. Off a terminal there is no bar.

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
:mod:`largebatch.recipes.plots`, reading and writing the checkpoint from
:mod:`largebatch.recipes.checkpoint`; this module adds the processes, the checkpoints'
contents, the per-epoch metrics and the trust-ratio telemetry. ``_fit`` runs a run as steps:
build its objects (``largebatch.recipes.train_run``: ``Run``), restore the checkpoint, wrap
the model in DDP, print the header,
then per epoch train, evaluate, record and checkpoint, and last the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from largebatch.recipes.build import build_model, build_optimizer
from largebatch.recipes.checkpoint import (
    gather_residuals, gather_rng, read_checkpoint, write_checkpoint,
)
from largebatch.recipes.distributed import (
    buffers_sha256, check_device, full_optimizer_state, full_state, params_sha256,
    sync_buffers,
)
from largebatch.recipes.loop import evaluate, train_epoch
from largebatch.recipes.outputs import (
    atomic_write, lock_folder, remove_stale_temporaries, require,
)
from largebatch.recipes.registry import (
    DEFAULT_RECIPE, PRECISIONS, RECIPES, Recipe, get_recipe,
)
from largebatch.recipes.study.plan import COMPRESSIONS
from largebatch.recipes.train_data import batches, epoch_sampler, eval_chunks
from largebatch.recipes.train_run import Run, build_run, distribute, fail, restore
from largebatch.torch import trust_ratios

__all__ = ["build_model", "build_optimizer", "trust_ratios", "train", "add_arguments", "main"]


# --------------------------------------------------------------------------- telemetry


def _run_bar(run: Run, start_epoch: int) -> Any:
    """The run's progress bar (tqdm on stderr; rank 0, on a terminal only) over the steps
    of the epochs this invocation trains. Its rate is the average since the start,
    evaluations and checkpoints included, so its estimate of the time left is the run's."""
    from tqdm import tqdm

    return tqdm(total=run.ends[run.stop] - run.ends[start_epoch], unit="step", leave=False,
                desc=f"epoch {start_epoch + 1}/{run.epochs}", disable=run.rank != 0 or None,
                smoothing=0, dynamic_ncols=True)


class _EpochTelemetry:
    """The training loop's callbacks for one epoch: the run's progress bar (its steps, and
    about once a second the epoch's mean training loss so far and its images/s), and the
    trust ratios at the epoch's last step, read before the optimizer applies the step."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: Any, steps: int, batch: int,
                 bar: Any, desc: str) -> None:
        self.optimizer, self.scaler, self.last, self.batch = optimizer, scaler, steps - 1, batch
        self.ratios: list[float] = []
        self.seen = 0
        self.bar = bar
        bar.set_description(desc, refresh=False)
        self.loss_sum: torch.Tensor | None = None  # summed on the device: no sync per step
        self.losses = 0
        self.t0 = self.shown = time.perf_counter()

    def watch(self, loss_fn: Any) -> Any:
        """``loss_fn``, each loss it returns also summed for the bar (when the bar shows)."""
        if self.bar.disable:
            return loss_fn

        def watched(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(logits, target)
            self.loss_sum = loss.detach() if self.loss_sum is None else self.loss_sum + loss.detach()
            self.losses += 1
            return loss

        return watched

    def before_step(self, step: int) -> None:
        if step == self.last:
            self.ratios = trust_ratios(self.optimizer,
                                       self.scaler.get_scale() if self.scaler else 1.0)

    def after_step(self, step: int) -> None:
        self.seen += self.batch
        self.bar.update()
        now = time.perf_counter()
        if not self.bar.disable and (now - self.shown >= 1.0 or step == self.last):
            self.shown = now
            loss = float(self.loss_sum) / self.losses if self.loss_sum is not None else math.nan
            self.bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{self.seen / (now - self.t0):,.0f}",
                                 refresh=False)

    def close(self) -> float:
        """The epoch's seconds."""
        return time.perf_counter() - self.t0

    def row(self) -> dict[str, float | None]:
        ratios = self.ratios
        return {"trust_ratio_min": min(ratios) if ratios else None,
                "trust_ratio_median": statistics.median(ratios) if ratios else None,
                "trust_ratio_max": max(ratios) if ratios else None}


# --------------------------------------------------------------------------- training


_OUTPUTS = ("checkpoint.pt", "metrics.jsonl", "summary.json", "plot.png")


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
        raise fail(str(err)) from None
    if recipe.data == "imagenet" or recipe.model in ("resnet50", "alexnet_bn"):
        require("train", ("torchvision",))
    batch = args.batch_size or recipe.batch_size
    epochs = args.epochs or recipe.epochs
    precision = args.precision or recipe.precision
    lr = args.lr if args.lr is not None else recipe.lr_for(batch)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if batch % world:
        raise fail(f"batch size {batch} is not divisible by the world size {world}")
    local_batch = batch // world
    micro = args.micro_batch or local_batch
    if micro > local_batch or local_batch % micro:
        raise fail(f"micro-batch {micro} must divide the per-process batch {local_batch} "
                    f"(batch {batch} / world size {world})")
    if args.fsdp and world < 2:
        raise fail("--fsdp shards the model over processes: run it under torchrun with 2 or "
                    "more (torchrun --nproc_per_node=2 -m largebatch train --fsdp ...)")
    if args.fsdp and precision == "fp16":
        raise fail("--fsdp runs fp32 or bf16 (FSDP2's mixed-precision policy); fp16 needs a "
                    "loss scaler over sharded grads: use --precision bf16")
    compression = args.compression
    if compression != "none" and (world < 2 or args.fsdp):
        raise fail(f"--compression {compression} compresses DDP's all-reduce: run it under "
                    "torchrun with 2 or more processes, without --fsdp")
    if recipe.clip_per_process is not None and world > 1 and (args.fsdp or compression != "none"):
        raise fail(f"recipe {recipe.name!r} has each process clip its gradients before DDP's "
                    "all-reduce (a communication hook of its own): run it without --fsdp and "
                    "--compression")
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
        state = read_checkpoint(out / "checkpoint.pt", settings, world) if args.resume else None
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
    """Trains from the checkpoint ``state`` (None: from the start) up to ``--stop-after``,
    checkpointing every epoch, then summarizes the run."""
    run = build_run(args, recipe, settings, out, state, device_name, micro)
    start_epoch, history = restore(run, state) if state is not None else (0, [])
    distribute(run, state)
    _print_header(run, start_epoch)
    bar = _run_bar(run, start_epoch)
    try:
        for epoch in range(start_epoch, run.stop):
            loss_sum, telemetry, seconds = _train(run, epoch, bar)
            accuracy = _evaluate(run)
            history.append(_record(run, epoch, loss_sum, accuracy, telemetry, seconds))
            _checkpoint(run, epoch, history)
    finally:
        bar.close()
    return _summarize(run, history)


def _print_header(run: Run, start_epoch: int) -> None:
    """Rank 0 prints what the run is and which epochs this invocation runs."""
    if run.rank != 0:
        return
    recipe, shape, epochs, batch = run.recipe, run.shape, run.epochs, run.batch
    scaled = (f" (the recipe's {recipe.schedule_text} over {recipe.epochs} epochs, "
              f"scaled to {epochs})" if shape.schedule_text != recipe.schedule_text else "")
    span = (f"epochs {start_epoch + 1}-{run.stop} of {epochs}" if start_epoch < run.stop else
            f"{start_epoch} of {epochs} epochs done, writing the summary")
    print(f"{recipe.name}: {recipe.model} on {recipe.data} ({run.data.n_train:,} images), batch "
          f"{batch:,} (ImageNet-equivalent {run.nominal:,}) "
          f"= {run.world} x {run.local_batch // run.micro} x {run.micro}, {recipe.optimizer} "
          f"peak lr {run.settings['lr']:g}, {run.settings['precision']}, {span}, "
          f"{_steps_text(recipe, run.ends)}; schedule {shape.schedule_text}{scaled}", flush=True)


def _train(run: Run, epoch: int, bar: Any) -> tuple[torch.Tensor, _EpochTelemetry, float]:
    """Trains epoch ``epoch`` (from 0), advancing the run's ``bar``: its loss summed over
    its steps (averaged over the processes), its telemetry and its seconds."""
    steps = run.ends[epoch + 1] - run.ends[epoch]
    sampler = epoch_sampler(run.recipe, run.data.n_train, run.batch, run.rank, run.world,
                            run.args.seed, epoch)
    telemetry = _EpochTelemetry(run.optimizer, run.scaler, steps, run.batch, bar,
                                f"epoch {epoch + 1}/{run.epochs}")
    loss_sum = train_epoch(
        run.ddp, batches(run.data.train, sampler, run.local_batch, run.args.workers, run.device, run.dtype),
        run.optimizer, run.scheduler, telemetry.watch(run.loss_fn), micro_batch=run.micro,
        scaler=run.scaler,
        no_sync=run.ddp.no_sync if isinstance(run.ddp, nn.parallel.DistributedDataParallel) else None,
        before_step=telemetry.before_step, after_step=telemetry.after_step)
    seconds = telemetry.close()
    if run.world > 1:
        dist.all_reduce(loss_sum)
        loss_sum /= run.world
    return loss_sum, telemetry, seconds


def _evaluate(run: Run) -> float:
    """The test accuracy of the one model: the processes first average its batch-norm statistics;
    under FSDP it is gathered whole (every rank) and evaluated in fp32 without collectives."""
    sync_buffers(run.model, run.world)  # one model: evaluated, checkpointed and summarized
    if run.whole is not None:
        run.whole.load_state_dict(full_state(run.model))
    return evaluate(run.evaluated, eval_chunks(run.data.test, run.rank, run.world, run.args.workers),
                    device=run.device, dtype=torch.float32 if run.fsdp else run.dtype,
                    world=run.world).accuracy


def _record(run: Run, epoch: int, loss_sum: torch.Tensor, accuracy: float,
            telemetry: _EpochTelemetry, seconds: float) -> dict[str, Any]:
    """Epoch ``epoch``'s (from 0) line of ``metrics.jsonl``."""
    row = {
        "epoch": epoch + 1, "train_loss": float(loss_sum) / (run.ends[epoch + 1] - run.ends[epoch]),
        "test_accuracy": accuracy, "lr": run.optimizer.param_groups[0]["lr"],
        "images_per_second": telemetry.seen / seconds, "seconds": seconds, **telemetry.row(),
    }
    if run.comm is not None:  # elements per selected element so far, rank 0's
        row["compression_rates"] = run.comm.compression_rates()
    return row


def _checkpoint(run: Run, epoch: int, history: list[dict[str, Any]]) -> None:
    """Gathers the run's state (collectives, every rank); rank 0 then prints epoch ``epoch``'s
    (from 0) line and rewrites the checkpoint, the metrics and, before the last epoch, the plot."""
    rng = gather_rng(run.device, run.world)
    residuals = gather_residuals(run.comm, run.world)  # every rank's own residuals
    # A checkpoint holds the whole model and state, sharded or not (collectives).
    saved_model = run.evaluated.state_dict()
    saved_optimizer = full_optimizer_state(run.optimizer) if run.fsdp else run.optimizer.state_dict()
    if run.rank != 0:
        return
    from tqdm import tqdm

    row = history[-1]
    with tqdm.external_write_mode():  # above the run's bar
        print(f"epoch {epoch + 1:>3}/{run.epochs}  train loss {row['train_loss']:.4f}  "
              f"test acc {row['test_accuracy']:.2%}  lr {row['lr']:.4g}  "
              f"{row['images_per_second']:,.0f} img/s", flush=True)
    write_checkpoint(run.out / "checkpoint.pt", {
        "model": saved_model, "optimizer": saved_optimizer, "scheduler": run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler else None, "epoch": epoch + 1, "rng": rng,
        "history": history, "adacomp": residuals, "recipe": run.recipe.name,
        "settings": run.settings})
    atomic_write(run.out / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
    if epoch + 1 < run.stop:  # the last plot comes after the summary
        run.plot(history)


def _summarize(run: Run, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's summary: every rank prints its model's hashes; rank 0 writes it and the plot."""
    summary = {
        "recipe": run.recipe.name,
        "test_accuracy": history[-1]["test_accuracy"] if history else float("nan"),
        "epochs": len(history), "batch_size": run.batch, "imagenet_equivalent_batch": run.nominal,
        "world_size": run.world, "precision": run.settings["precision"],
        "peak_lr": run.settings["lr"], "schedule": run.shape.schedule_text,
        "published_top1": run.recipe.published_top1,
        "params_sha256": params_sha256(run.evaluated),
        "buffers_sha256": buffers_sha256(run.evaluated),
        "images_per_second": statistics.mean(h["images_per_second"] for h in history)
        if history else None,
    }
    print(f"rank {run.rank}/{run.world}: params sha256 {summary['params_sha256']}", flush=True)
    print(f"rank {run.rank}/{run.world}: buffers sha256 {summary['buffers_sha256']}", flush=True)
    if run.rank == 0:
        atomic_write(run.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        run.plot(history)
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
    add("--subset", type=int, default=None, metavar="N", help="first N train (and test) images "
        "(the ImageNet-equivalent batch stays that of the full training set)")
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
            raise fail(f"invalid --{flag.replace('_', '-')} {value} (must be >= 1)")
    if args.workers < 0:
        raise fail(f"invalid --workers {args.workers} (must be >= 0)")
    if args.compression_warmup < 0:
        raise fail(f"invalid --compression-warmup {args.compression_warmup} (must be >= 0)")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise fail(f"invalid --lr {args.lr} (must be a finite number > 0)")
    require("train", ("tqdm", "matplotlib"))
    try:
        train(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
