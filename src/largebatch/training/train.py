"""``largebatch train``'s run of a recipe: the epochs, their records, checkpoints and summary.

:func:`train` checks the settings against the recipe and the processes, holds ``OUT``, and
runs the epochs on a :class:`~largebatch.training.run.Run`: train (sampling the trust
ratios every ``--trust-ratio-every`` steps), evaluate, record, checkpoint, and last the
summary (docs/design.md §6 says what each file holds).
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

from largebatch.outputs import atomic_write, lock_folder, remove_stale_temporaries, require, rounded
from largebatch.recipes.registry import Recipe, get_recipe
from largebatch.torch import named_trust_ratios
from largebatch.training.checkpoint import gather_residuals, gather_rng, read_checkpoint, write_checkpoint
from largebatch.training.data import augment_generator, batches, epoch_sampler, eval_chunks
from largebatch.training.distributed import (
    buffers_sha256,
    check_device,
    full_optimizer_state,
    full_state,
    params_sha256,
    sync_buffers,
)
from largebatch.training.logs import MetricsLog, ratio_stats
from largebatch.training.loop import evaluate, train_epoch
from largebatch.training.run import Run, build_run, distribute, fail, restore

__all__ = ["train"]


# --------------------------------------------------------------------------- telemetry


def _run_bar(run: Run, start_epoch: int) -> Any:
    """The run's progress bar (tqdm on stderr; rank 0, on a terminal only) over the steps
    of the epochs this invocation trains. Its rate is the average since the start,
    evaluations and checkpoints included, so its estimate of the time left is the run's."""
    from tqdm import tqdm

    return tqdm(
        total=run.ends[run.stop] - run.ends[start_epoch],
        unit="step",
        leave=False,
        desc=f"epoch {start_epoch + 1}/{run.epochs}",
        disable=run.rank != 0 or None,
        smoothing=0,
        dynamic_ncols=True,
    )


class _EpochTelemetry:
    """The training loop's callbacks for one epoch: the run's progress bar (its steps, and
    about once a second the epoch's mean training loss so far and its images/s), and the
    trust ratios by parameter name every ``every`` steps of the run and at the epoch's
    last step, read before the optimizer applies the step (every rank: under FSDP the
    norms are collectives), logged to ``log`` as they are taken."""

    def __init__(self, run: Run, epoch: int, bar: Any, log: MetricsLog) -> None:
        self.optimizer, self.scaler, self.model, self.log = run.optimizer, run.scaler, run.model, log
        self.epoch, self.first = epoch, run.ends[epoch]  # the steps done before this epoch
        steps = run.ends[epoch + 1] - run.ends[epoch]
        self.steps, self.last, self.batch = steps, steps - 1, run.batch
        self.every = getattr(run.args, "trust_ratio_every", None) or _TRUST_RATIO_EVERY
        self.samples: list[dict[str, Any]] = []
        self.seen = 0
        self.bar = bar
        bar.set_description(f"epoch {epoch + 1}/{run.epochs}", refresh=False)
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
        number = self.first + step + 1  # the run's step about to be applied, from 1
        if number % self.every and step != self.last:
            return
        scale = self.scaler.get_scale() if self.scaler else 1.0
        ratios = named_trust_ratios(self.optimizer, self.model, scale)
        self.samples.append({"step": number, "epoch": self.epoch + (step + 1) / self.steps, "ratios": ratios})
        stats = {k.replace("trust_ratio_", "trust_ratio/"): v for k, v in ratio_stats(ratios).items()}
        self.log.scalars({**stats, **{f"trust_ratio_by_param/{k}": v for k, v in ratios.items()}}, number)

    def after_step(self, step: int) -> None:
        self.seen += self.batch
        self.bar.update()
        now = time.perf_counter()
        if not self.bar.disable and (now - self.shown >= 1.0 or step == self.last):
            self.shown = now
            loss = float(self.loss_sum) / self.losses if self.loss_sum is not None else math.nan
            self.bar.set_postfix(
                loss=f"{loss:.4f}", img_s=f"{self.seen / (now - self.t0):,.0f}", refresh=False
            )

    def close(self) -> float:
        """The epoch's seconds."""
        return time.perf_counter() - self.t0

    def row(self) -> dict[str, Any]:
        """The epoch's trust ratios: the min, median and max at its last step, and every
        sample by name (``trust_ratios.jsonl``; the plot's points)."""
        last = self.samples[-1]["ratios"] if self.samples else {}
        return {**ratio_stats(last), _SAMPLES: self.samples}


# --------------------------------------------------------------------------- training


_OUTPUTS = ("checkpoint.pt", "metrics.jsonl", "trust_ratios.jsonl", "summary.json", "plot.png")
_TRUST_RATIO_EVERY = 50  # --trust-ratio-every's default: steps between samples
_SAMPLES = "trust_ratios"  # an epoch's samples in the history (trust_ratios.jsonl, not metrics.jsonl)


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
        raise fail(
            f"micro-batch {micro} must divide the per-process batch {local_batch} "
            f"(batch {batch} / world size {world})"
        )
    ghost_batch = getattr(args, "ghost_batch", None)
    if ghost_batch is not None and micro % ghost_batch:
        raise fail(
            f"--ghost-batch {ghost_batch} must divide the per-process micro-batch {micro} "
            f"(batch {batch} / world size {world}, in micro-batches of {micro})"
        )
    augment = getattr(args, "augment", False)
    if augment and recipe.data != "fashion-mnist":
        raise fail(
            f"--augment crops and flips Fashion-MNIST batches; recipe {recipe.name!r} reads "
            "ImageFolder data, which has its own RandomResizedCrop and RandomHorizontalFlip"
        )
    if args.fsdp and world < 2:
        raise fail(
            "--fsdp shards the model over processes: run it under torchrun with 2 or "
            "more (torchrun --nproc_per_node=2 -m largebatch train --fsdp ...)"
        )
    if args.fsdp and precision == "fp16":
        raise fail(
            "--fsdp runs fp32 or bf16 (FSDP2's mixed-precision policy); fp16 needs a "
            "loss scaler over sharded grads: use --precision bf16"
        )
    compression = args.compression
    if compression != "none" and (world < 2 or args.fsdp):
        raise fail(
            f"--compression {compression} compresses DDP's all-reduce: run it under "
            "torchrun with 2 or more processes, without --fsdp"
        )
    if recipe.clip_per_process is not None and world > 1 and (args.fsdp or compression != "none"):
        raise fail(
            f"recipe {recipe.name!r} has each process clip its gradients before DDP's "
            "all-reduce (a communication hook of its own): run it without --fsdp and "
            "--compression"
        )
    device_name = check_device(args.device)
    out = Path(args.out or Path("runs") / recipe.name)
    settings = {
        "recipe": recipe.name,
        "batch_size": batch,
        "epochs": epochs,
        "lr": lr,
        "seed": args.seed,
        "subset": args.subset,
        "precision": precision,
        "fsdp": args.fsdp,
        "compression": compression,
        "compression_warmup": args.compression_warmup if compression != "none" else None,
        "ghost_batch": ghost_batch,
        "augment": augment,
    }
    with contextlib.ExitStack() as held:
        if rank == 0:  # only rank 0 writes: it holds the folder for the whole run
            held.enter_context(lock_folder(out, "train"))
            remove_stale_temporaries(out, _OUTPUTS)
        state = read_checkpoint(out / "checkpoint.pt", settings, world) if args.resume else None
        done, stop = (state["epoch"] if state else 0), min(epochs, args.stop_after or epochs)
        if done >= stop and (out / "summary.json").is_file():
            if rank == 0:
                print(
                    f"largebatch train: {out} "
                    + (
                        f"already finished: {done} of {epochs} epochs"
                        if done >= epochs
                        else f"is already at epoch {done} of {epochs} (--stop-after {stop})"
                    )
                    + "; nothing to do",
                    flush=True,
                )
            return _read_summary(out / "summary.json")
        return _fit(args, recipe, settings, out, state, device_name, micro)


def _fit(
    args: argparse.Namespace,
    recipe: Recipe,
    settings: dict[str, Any],
    out: Path,
    state: dict[str, Any] | None,
    device_name: str,
    micro: int,
) -> dict[str, Any]:
    """Trains from the checkpoint ``state`` (None: from the start) up to ``--stop-after``,
    checkpointing every epoch, then summarizes the run."""
    run = build_run(args, recipe, settings, out, state, device_name, micro)
    start_epoch, history = restore(run, state) if state is not None else (0, [])
    distribute(run, state)
    _print_header(run, start_epoch)
    log = MetricsLog(
        run.rank,
        out,
        settings,
        tensorboard=getattr(args, "tensorboard", None),
        wandb=getattr(args, "wandb", None),
        start_step=run.ends[start_epoch],
    )
    bar = _run_bar(run, start_epoch)
    try:
        for epoch in range(start_epoch, run.stop):
            loss_sum, telemetry, seconds = _train(run, epoch, bar, log)
            accuracy = _evaluate(run)
            history.append(_record(run, epoch, loss_sum, accuracy, telemetry, seconds))
            log.scalars({k: v for k, v in history[-1].items() if k in _LOGGED}, run.ends[epoch + 1])
            log.flush()
            _checkpoint(run, epoch, history)
    finally:
        bar.close()
        log.close()
    return _summarize(run, history)


# An epoch's metrics that the live logs take (the trust ratios are logged as sampled).
_LOGGED = ("train_loss", "test_accuracy", "lr", "images_per_second", "seconds")


def _print_header(run: Run, start_epoch: int) -> None:
    """Rank 0 prints what the run is and which epochs this invocation runs."""
    if run.rank != 0:
        return
    recipe, shape, epochs, batch = run.recipe, run.shape, run.epochs, run.batch
    scaled = (
        f" (the recipe's {recipe.schedule_text} over {recipe.epochs} epochs, scaled to {epochs})"
        if shape.schedule_text != recipe.schedule_text
        else ""
    )
    span = (
        f"epochs {start_epoch + 1}-{run.stop} of {epochs}"
        if start_epoch < run.stop
        else f"{start_epoch} of {epochs} epochs done, writing the summary"
    )
    print(
        f"{recipe.name}: {recipe.model} on {recipe.data} ({run.data.n_train:,} images), batch "
        f"{batch:,} (ImageNet-equivalent {run.nominal:,}) "
        f"= {run.world} x {run.local_batch // run.micro} x {run.micro}, {recipe.optimizer} "
        f"peak lr {rounded(run.settings['lr'])}, {run.settings['precision']}, {span}, "
        f"{_steps_text(recipe, run.ends)}; schedule {shape.schedule_text}{scaled}",
        flush=True,
    )


def _train(run: Run, epoch: int, bar: Any, log: MetricsLog) -> tuple[torch.Tensor, _EpochTelemetry, float]:
    """Trains epoch ``epoch`` (from 0), advancing the run's ``bar``: its loss summed over
    its steps (averaged over the processes), its telemetry and its seconds."""
    sampler = epoch_sampler(
        run.recipe, run.data.n_train, run.batch, run.rank, run.world, run.args.seed, epoch
    )
    telemetry = _EpochTelemetry(run, epoch, bar, log)
    augment = (
        augment_generator(run.args.seed, epoch, run.rank, run.world) if run.settings["augment"] else None
    )
    loss_sum = train_epoch(
        run.ddp,
        batches(run.data.train, sampler, run.local_batch, run.args.workers, run.device, run.dtype, augment),
        run.optimizer,
        run.scheduler,
        telemetry.watch(run.loss_fn),
        micro_batch=run.micro,
        scaler=run.scaler,
        no_sync=run.ddp.no_sync if isinstance(run.ddp, nn.parallel.DistributedDataParallel) else None,
        before_step=telemetry.before_step,
        after_step=telemetry.after_step,
    )
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
    return evaluate(
        run.evaluated,
        eval_chunks(run.data.test, run.rank, run.world, run.args.workers),
        device=run.device,
        dtype=torch.float32 if run.fsdp else run.dtype,
        world=run.world,
    ).accuracy


def _record(
    run: Run, epoch: int, loss_sum: torch.Tensor, accuracy: float, telemetry: _EpochTelemetry, seconds: float
) -> dict[str, Any]:
    """Epoch ``epoch``'s (from 0) line of ``metrics.jsonl``."""
    row = {
        "epoch": epoch + 1,
        "train_loss": float(loss_sum) / (run.ends[epoch + 1] - run.ends[epoch]),
        "test_accuracy": accuracy,
        "lr": run.optimizer.param_groups[0]["lr"],
        "images_per_second": telemetry.seen / seconds,
        "seconds": seconds,
        **telemetry.row(),
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
        print(
            f"epoch {epoch + 1:>3}/{run.epochs}  train loss {row['train_loss']:.4f}  "
            f"test acc {row['test_accuracy']:.2%}  lr {row['lr']:.4g}  "
            f"{row['images_per_second']:,.0f} img/s",
            flush=True,
        )
    write_checkpoint(
        run.out / "checkpoint.pt",
        {
            "model": saved_model,
            "optimizer": saved_optimizer,
            "scheduler": run.scheduler.state_dict(),
            "scaler": run.scaler.state_dict() if run.scaler else None,
            "epoch": epoch + 1,
            "rng": rng,
            "history": history,
            "adacomp": residuals,
            "recipe": run.recipe.name,
            "settings": run.settings,
        },
    )
    atomic_write(
        run.out / "metrics.jsonl",
        "".join(json.dumps({k: v for k, v in h.items() if k != _SAMPLES}) + "\n" for h in history),
    )
    samples = (json.dumps(s) + "\n" for h in history for s in h.get(_SAMPLES, []))
    atomic_write(run.out / "trust_ratios.jsonl", "".join(samples))
    if epoch + 1 < run.stop:  # the last plot comes after the summary
        run.plot(history)


def _summarize(run: Run, history: list[dict[str, Any]]) -> dict[str, Any]:
    """The run's summary: every rank prints its model's hashes; rank 0 writes it and the plot."""
    summary = {
        "recipe": run.recipe.name,
        "test_accuracy": history[-1]["test_accuracy"] if history else float("nan"),
        "epochs": len(history),
        "batch_size": run.batch,
        "imagenet_equivalent_batch": run.nominal,
        "world_size": run.world,
        "precision": run.settings["precision"],
        "peak_lr": run.settings["lr"],
        "schedule": run.shape.schedule_text,
        "published_top1": run.recipe.published_top1,
        "params_sha256": params_sha256(run.evaluated),
        "buffers_sha256": buffers_sha256(run.evaluated),
        "images_per_second": statistics.mean(h["images_per_second"] for h in history) if history else None,
    }
    print(f"rank {run.rank}/{run.world}: params sha256 {summary['params_sha256']}", flush=True)
    print(f"rank {run.rank}/{run.world}: buffers sha256 {summary['buffers_sha256']}", flush=True)
    if run.rank == 0:
        atomic_write(run.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        run.plot(history)
    return summary
