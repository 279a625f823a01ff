"""One run of the steps-to-target study (:func:`run_trial`), in a worker process of the
study (``largebatch.study.steps.run``) or inline.

The model is the study's with ghost batch norm (:func:`largebatch.models.ghost_batch_norm`),
the batches are augmented (:func:`largebatch.training.data.random_crop_flip`), the
optimizer is built from the run's hyperparameters (:func:`trial_optimizer`), the schedule
is a linear warmup and a polynomial decay to zero over the run's steps, and the training
loop is ``largebatch train``'s (:func:`largebatch.training.loop.train_epoch`). Torch is
imported inside the functions, by the worker that trains.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from typing import Any

from largebatch.study.steps.plan import TrialSpec, steps_to

__all__ = ["StepStatistics", "micro_batch", "run_trial", "trial_optimizer"]

_EVAL_CHUNK = 2000


def micro_batch(spec: TrialSpec, device: str) -> int | None:
    """The micro-batch a run trains in (None: the whole batch at once). On the CPU a batch
    above the ghost batch is trained one ghost batch at a time, the gradients summed:
    each micro-batch's batch norm is then the plain one over its ghost batch, without the
    ghost path's copies, and the step is the same (:class:`StepStatistics` keeps the
    running statistics to one update a step), faster than in larger micro-batches
    (``benchmarks/study_cpu.py``). Runs recorded without a ``micro_batch`` took
    micro-batches of 1,024 above 1,024 images."""
    return spec.ghost_batch if device == "cpu" and spec.batch > spec.ghost_batch else None


class StepStatistics:
    """Batch norm's running statistics updated once a step however many micro-batches
    the step takes: each micro-batch's forward starts from the statistics the step began
    with, and ``step()`` (before the optimizer's) sets them to the mean of the
    micro-batches' updates and counts one batch. That is one update with the mean of the
    micro-batches' chunk statistics, as one forward over the whole batch gives with ghost
    batch norm, and as averaging the running statistics of data-parallel workers gives.
    Evaluation (``model.eval()``) is left alone."""

    def __init__(self, model: Any) -> None:
        from torch import nn

        norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.norms: list[Any] = [m for m in norms if m.track_running_stats]
        self.start: dict[int, tuple[Any, Any, Any]] = {}
        self.sums: dict[int, list[Any]] = {}
        for m in self.norms:
            m.register_forward_pre_hook(self._before)
            m.register_forward_hook(self._after)

    def _before(self, module: Any, _: Any) -> None:
        if not module.training:
            return
        key = id(module)
        if key not in self.start:
            self.start[key] = (
                module.running_mean.clone(),
                module.running_var.clone(),
                module.num_batches_tracked.clone(),
            )
        else:
            mean, var, count = self.start[key]
            module.running_mean.copy_(mean)
            module.running_var.copy_(var)
            module.num_batches_tracked.copy_(count)

    def _after(self, module: Any, _: Any, __: Any) -> None:
        if not module.training:
            return
        sums = self.sums.setdefault(id(module), [0.0, 0.0, 0])
        sums[0] = sums[0] + module.running_mean
        sums[1] = sums[1] + module.running_var
        sums[2] += 1

    def step(self, _: int = 0) -> None:
        """Set each norm's statistics to the mean of this step's updates."""
        for m in self.norms:
            key = id(m)
            if key in self.sums:
                mean, var, n = self.sums[key]
                m.running_mean.copy_(mean / n)
                m.running_var.copy_(var / n)
                m.num_batches_tracked.copy_(self.start[key][2] + 1)
        self.start.clear()
        self.sums.clear()


def trial_optimizer(spec: TrialSpec, model: Any) -> Any:
    """The run's optimizer over ``model``: weight decay (and LARS's and LAMB's trust ratio)
    on every param but the biases and normalization params (:func:`largebatch.torch.param_groups`,
    as every recipe). Nesterov is ``torch.optim.SGD(nesterov=True)``, AdamW ``torch.optim.AdamW``
    (its decay decoupled: ``w -= lr * wd * w``), LARS and LAMB this package's."""
    import torch

    from largebatch.torch import LAMB, LARS, param_groups

    groups = param_groups(model, spec.weight_decay)
    value = spec.value
    if spec.optimizer == "lars":
        return LARS(
            groups, lr=spec.lr, momentum=value("momentum"), trust_coefficient=value("trust_coefficient")
        )
    if spec.optimizer == "lamb":
        return LAMB(groups, lr=spec.lr, betas=(value("beta1"), value("beta2")))
    for group in groups:
        group.pop("trust_ratio", None)
    if spec.optimizer == "nesterov":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=value("momentum"), nesterov=True)
    if spec.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=spec.lr, betas=(value("beta1"), value("beta2")))
    raise ValueError(f"Unknown optimizer {spec.optimizer!r}")


def run_trial(spec: TrialSpec) -> dict[str, Any]:
    """Train one run; returns its spec, the validation (or, for ``"final"``, test)
    accuracy and loss at every scored step, the step it reached its target (None: it did
    not), why it stopped (``"target"``, ``"limit"``, ``"budget"``, ``"diverged"``) and its
    wall time.

    The seed fixes the initial weights, the batch order and the crops, so every optimizer
    of a seed starts from the same weights and sees the same batches. A run is scored
    every ``eval_every`` steps and at its last step; a score whose loss is not finite
    ends it (``"diverged"``)."""
    import torch
    from torch import nn

    from largebatch.recipes.build import build_model
    from largebatch.schedules.factory import make_schedule
    from largebatch.study.worker import WORKER, init_worker, phase_tensors
    from largebatch.torch import ScheduleLR
    from largebatch.training.data import augment_generator, random_crop_flip
    from largebatch.training.loop import evaluate, tensor_chunks, train_epoch

    if not WORKER:
        init_worker(torch.get_num_threads(), None, "cpu")
    x_train, y_train, x_eval, y_eval = phase_tensors("final" if spec.kind == "final" else "tune", spec.subset)
    device = x_train.device
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, 10, ghost_batch=spec.ghost_batch).to(  # type: ignore[call-overload]
        device, memory_format=torch.channels_last
    )
    optimizer = trial_optimizer(spec, model)
    schedule = make_schedule(
        "poly",
        peak_lr=spec.lr,
        total_steps=spec.steps,
        warmup_steps=round(spec.warmup * spec.steps),
        power=spec.power,
    )
    scheduler = ScheduleLR(optimizer, schedule)
    order = torch.Generator().manual_seed(spec.seed)
    per_epoch = len(y_train) // spec.batch
    limit = spec.steps if spec.limit is None else spec.limit
    curve: list[dict[str, Any]] = []
    losses: list[float] = []
    state: dict[str, Any] = {"step": 0, "stop": None}

    def batches(epoch: int) -> Iterator[tuple[Any, Any]]:
        perm = torch.randperm(len(y_train), generator=order).to(device)
        crops = augment_generator(spec.seed, epoch)
        for idx in perm[: per_epoch * spec.batch].split(spec.batch):
            if state["stop"] is not None:
                return
            x = x_train[idx]
            yield (random_crop_flip(x, crops, spec.augment) if spec.augment else x), y_train[idx]

    def after_step(_: int) -> None:
        state["step"] += 1
        step = state["step"]
        if step % spec.eval_every == 0 or step == limit:
            score = evaluate(model, tensor_chunks(x_eval, y_eval, _EVAL_CHUNK), device=device)
            curve.append({"step": step, "accuracy": score.accuracy, "loss": score.loss})
            if not math.isfinite(score.loss):
                state["stop"] = "diverged"
            elif spec.target is not None and score.accuracy >= spec.target:
                state["stop"] = "target"
        if step >= limit and state["stop"] is None:
            state["stop"] = "budget" if limit == spec.steps else "limit"

    start, cpu, epoch = time.perf_counter(), time.process_time(), 0
    loss_fn = nn.CrossEntropyLoss()
    micro = micro_batch(spec, device.type)
    statistics = StepStatistics(model) if micro else None
    while state["stop"] is None:
        before = state["step"]
        loss_sum = train_epoch(
            model,
            batches(epoch),
            optimizer,
            scheduler,
            loss_fn,
            micro_batch=micro,
            before_step=statistics.step if statistics else None,
            after_step=after_step,
        )
        losses.append(float(loss_sum) / max(1, state["step"] - before))
        epoch += 1
    reached = None if spec.target is None else steps_to({"curve": curve}, spec.target)
    # the CPU time of the run (a CPU run's cost, which a pause of the study leaves out)
    cpu_seconds = {"cpu_seconds": time.process_time() - cpu} if device.type == "cpu" else {}
    return {
        "spec": dataclasses.asdict(spec),
        "accuracy": curve[-1]["accuracy"],
        "steps_to_target": reached,
        "stopped": state["stop"],
        "steps": state["step"],
        "curve": curve,
        "train_loss": losses,
        "seconds": time.perf_counter() - start,
        "threads": torch.get_num_threads(),
        "micro_batch": micro,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        **cpu_seconds,
    }
