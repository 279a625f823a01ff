"""One run of the study (:func:`run_one`), in a worker process of the sweep
(``largebatch.study.run``) or inline: its data (the tuning split or the whole
training set), its model, optimizer and schedule from the recipe, its epochs, and the
progress it reports to the sweep's bar.

Torch is imported inside the functions, by the worker that trains.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from largebatch.study.plan import RunSpec, held_out, pair_recipe

__all__ = ["WORKER", "exit_with_parent", "init_worker", "phase_tensors", "run_one", "run_optimizer"]

_SPLIT_SEED = 2017  # the permutation that holds out the tuning split's validation images
_EVAL_CHUNK = 2000

WORKER: dict[str, Any] = {}


def init_worker(
    threads: int, data: str | None, device: str, parent: int | None = None, progress: Any = None
) -> None:
    """Set up a worker (or this process, for ``--jobs 1``). With ``parent`` (the study's
    process id), a watchdog thread ends the worker as soon as that process is gone, so a
    killed study never leaves its workers running. ``progress``, a queue, takes the
    runs' progress to the study's bar (:class:`_Progress`)."""
    import torch

    torch.set_num_threads(threads)
    WORKER.update(threads=threads, data=data, device=device, cache={})
    WORKER.pop("progress", None)
    if progress is not None:
        progress.cancel_join_thread()  # progress not yet sent never holds up the exit
        WORKER["progress"] = progress.put
    if parent is not None:
        threading.Thread(
            target=exit_with_parent, args=(parent,), daemon=True, name="largebatch-parent-watch"
        ).start()


def exit_with_parent(parent: int, interval: float = 0.5) -> None:
    """End this process once ``parent`` is no longer its parent (the study is gone)."""
    while os.getppid() == parent:
        time.sleep(interval)
    os._exit(1)


def phase_tensors(phase: str, subset: int | None) -> tuple[Any, Any, Any, Any]:
    """(x_train, y_train, x_eval, y_eval) for a phase, cached per worker."""
    cache = WORKER["cache"]
    if (phase, subset) not in cache:
        import torch

        from largebatch.fashion_mnist import fashion_mnist_tensors, load_fashion_mnist

        device = torch.device(WORKER["device"])
        x, y = fashion_mnist_tensors(*load_fashion_mnist("train", WORKER["data"]), subset)
        if phase == "tune":
            order = torch.randperm(len(y), generator=torch.Generator().manual_seed(_SPLIT_SEED))
            n_val = held_out(len(y), subset)
            train_idx, val_idx = order[:-n_val].sort().values, order[-n_val:].sort().values
            data = (x[train_idx], y[train_idx], x[val_idx], y[val_idx])
        else:
            x_test, y_test = fashion_mnist_tensors(*load_fashion_mnist("test", WORKER["data"]), subset)
            data = (x, y, x_test, y_test)
        cache[(phase, subset)] = tuple(
            t.to(device, memory_format=torch.channels_last) if t.ndim == 4 else t.to(device) for t in data
        )
    return cache[(phase, subset)]


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Train one run; returns its spec, accuracy after each epoch, and wall time.

    The seed fixes the initial weights and the batch order, so every optimizer of a seed
    starts from the same weights and sees the same batches. A run whose loss turns
    non-finite stops there and is scored as it stands (``"diverged": true``). Model,
    optimizer, schedule (the recipe's, with the spec's lr, warmup and poly power), loss
    (with the spec's label smoothing) and the training loop are ``largebatch train``'s
    (:mod:`largebatch.recipes.build`, :mod:`largebatch.training.loop`)."""
    import torch

    from largebatch.recipes.build import build_loss, build_model, build_schedule
    from largebatch.torch import ScheduleLR
    from largebatch.training.loop import evaluate, tensor_chunks, train_epoch

    if not WORKER:
        init_worker(torch.get_num_threads(), None, "cpu")
    x_train, y_train, x_eval, y_eval = phase_tensors(spec.phase, spec.subset)
    device = x_train.device
    recipe = dataclasses.replace(
        pair_recipe(spec.batch, spec.optimizer),
        model=spec.model,
        label_smoothing=spec.label_smoothing,
        power=spec.power,
    )
    steps_per_epoch = len(y_train) // spec.batch
    torch.manual_seed(spec.seed)
    model = build_model(recipe.model, 10).to(  # type: ignore[call-overload]  # torch's stubs
        device, memory_format=torch.channels_last
    )
    optimizer = run_optimizer(spec, recipe, model, steps_per_epoch)
    scheduler = ScheduleLR(
        optimizer,
        build_schedule(
            recipe,
            peak_lr=spec.lr,
            epochs=spec.epochs,
            n_train=len(y_train),
            batch=spec.batch,
            warmup_epochs=spec.warmup_epochs,
        ),
    )
    order = torch.Generator().manual_seed(spec.seed)
    loss_fn = build_loss(recipe)

    sim = _simulated_workers(spec, model, steps_per_epoch)
    progress = _Progress(spec.key, WORKER.get("progress"))
    curve, diverged, start = [], False, time.perf_counter()
    for epoch in range(1, spec.epochs + 1):
        perm = torch.randperm(len(y_train), generator=order).to(device)
        batches = (
            (x_train[idx], y_train[idx]) for idx in perm[: steps_per_epoch * spec.batch].split(spec.batch)
        )
        if sim is None:
            loss_sum = train_epoch(model, batches, optimizer, scheduler, loss_fn, after_step=progress.step)
        else:
            loss_sum = _train_epoch_workers(model, batches, optimizer, scheduler, loss_fn, sim, progress.step)
        train_loss = float(loss_sum) / steps_per_epoch
        progress.epoch(train_loss)
        diverged = not math.isfinite(train_loss)
        accuracy = evaluate(model, tensor_chunks(x_eval, y_eval, _EVAL_CHUNK), device=device).accuracy
        curve.append(
            {"epoch": epoch, "step": epoch * steps_per_epoch, "train_loss": train_loss, "accuracy": accuracy}
        )
        if diverged:
            break
    row = {
        "spec": dataclasses.asdict(spec),
        "accuracy": curve[-1]["accuracy"],
        "diverged": diverged,
        "steps_per_epoch": steps_per_epoch,
        "curve": curve,
        "seconds": time.perf_counter() - start,
        # CPU kernels split their sums by thread: the same spec on another thread
        # count rounds differently, and 30 epochs carry that to the last digit shown.
        "threads": torch.get_num_threads(),
    }
    if sim is not None and spec.compression != "none":
        row["compression"] = {
            "rates": sim.compression_rates(),
            "stats": sim.stats,
            "warmup_steps": sim.warmup_steps,
        }
    return row


class _Progress:
    """One run's progress for the study's bar: ``(run key, steps done, the last epoch's
    training loss or None)``, given to ``send`` at most every ``interval`` seconds and at
    the end of every epoch (nothing without ``send``)."""

    def __init__(
        self, key: str, send: Callable[[tuple[str, int, float | None]], object] | None, interval: float = 0.5
    ) -> None:
        self.key, self.send, self.interval = key, send, interval
        self.steps, self.sent = 0, time.monotonic()
        self.loss: float | None = None

    def step(self, _: int) -> None:
        self.steps += 1
        if time.monotonic() - self.sent >= self.interval:
            self._send()

    def epoch(self, loss: float) -> None:
        self.loss = loss
        self._send()

    def _send(self) -> None:
        if self.send is not None:
            self.send((self.key, self.steps, self.loss))
        self.sent = time.monotonic()


def run_optimizer(spec: RunSpec, recipe: Any, model: Any, steps_per_epoch: int) -> Any:
    """The recipe's optimizer at the spec's lr; with ``spec.freeze_variance``, LAMB's
    ``freeze_step`` at the end of the plain exchange (``compression_warmup`` epochs)."""
    from largebatch.recipes.build import build_optimizer

    optimizer = build_optimizer(recipe, model, spec.lr)
    if spec.freeze_variance and spec.optimizer == "lamb":
        for group in optimizer.param_groups:
            group["freeze_step"] = spec.compression_warmup * steps_per_epoch
    return optimizer


def _simulated_workers(spec: RunSpec, model: Any, steps_per_epoch: int) -> Any:
    """The exchange of ``spec.workers`` simulated workers (None for one): plain averages
    for ``compression="none"``, AdaComp after ``spec.compression_warmup`` epochs of them for
    ``"adacomp"``."""
    if spec.workers == 1:
        return None
    from largebatch.comm.torch import SimulatedWorkers

    params = list(model.named_parameters())
    steps = spec.epochs * steps_per_epoch
    warmup = steps if spec.compression == "none" else spec.compression_warmup * steps_per_epoch
    return SimulatedWorkers(
        [n for n, _ in params], [p.shape for _, p in params], spec.workers, warmup_steps=warmup
    )


def _train_epoch_workers(
    model: Any,
    batches: Any,
    optimizer: Any,
    scheduler: Any,
    loss_fn: Any,
    sim: Any,
    after_step: Callable[[int], object] | None = None,
) -> Any:
    """:func:`largebatch.training.loop.train_epoch` for simulated workers: each batch split
    over ``sim.n`` workers, their gradients exchanged by ``sim``
    (:func:`largebatch.comm.torch.simulate_step`), then the optimizer and schedule step,
    then ``after_step(step)``."""
    import torch

    from largebatch.comm.torch import simulate_step

    loss_sum = torch.zeros((), dtype=torch.float64)
    for step, (x, y) in enumerate(batches):
        parts = list(zip(x.chunk(sim.n), y.chunk(sim.n)))
        loss_sum += sum(simulate_step(model, sim, parts, loss_fn)) / sim.n
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if after_step is not None:
            after_step(step)
    return loss_sum
