"""Running the study: one training run (:func:`run_one`), and the sweep (:func:`run_study`):
the planned runs on a pool of worker processes, each finished run appended to
``OUT/runs.jsonl`` (which an interrupted study resumes from), SIGTERM and a killed parent
handled, then the report.

Runs need torch, imported by the worker that trains them; this module imports none.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from largebatch.recipes.outputs import atomic_write, lock_folder, remove_stale_temporaries
from largebatch.recipes.study.plan import VAL_SIZE, RunSpec, StudyConfig, _check, _recipe, plan
from largebatch.recipes.study.report import plot, study_markdown, summarize

__all__ = ["run_one", "run_study"]

_SPLIT_SEED = 2017  # the permutation that holds out the tuning split's validation images
_EVAL_CHUNK = 2000

# --------------------------------------------------------------------------- one run

_WORKER: dict[str, Any] = {}


def _init_worker(threads: int, data: str | None, device: str, parent: int | None = None) -> None:
    """Set up a worker (or this process, for ``--jobs 1``). With ``parent`` (the study's
    process id), a watchdog thread ends the worker as soon as that process is gone, so a
    killed study never leaves its workers running."""
    import torch

    torch.set_num_threads(threads)
    _WORKER.update(threads=threads, data=data, device=device, cache={})
    if parent is not None:
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True,
                         name="largebatch-parent-watch").start()


def _exit_with_parent(parent: int, interval: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(interval)
    os._exit(1)


def _tensors(phase: str, subset: int | None) -> tuple[Any, Any, Any, Any]:
    """(x_train, y_train, x_eval, y_eval) for a phase, cached per worker."""
    cache = _WORKER["cache"]
    if (phase, subset) not in cache:
        import torch

        from largebatch.recipes.data import fashion_mnist_tensors, load_fashion_mnist

        device = torch.device(_WORKER["device"])
        x, y = fashion_mnist_tensors(*load_fashion_mnist("train", _WORKER["data"]), subset)
        if phase == "tune":
            order = torch.randperm(len(y), generator=torch.Generator().manual_seed(_SPLIT_SEED))
            n_val = VAL_SIZE if subset is None else len(y) // 6
            train_idx, val_idx = order[:-n_val].sort().values, order[-n_val:].sort().values
            data = (x[train_idx], y[train_idx], x[val_idx], y[val_idx])
        else:
            x_test, y_test = fashion_mnist_tensors(*load_fashion_mnist("test", _WORKER["data"]),
                                                   subset)
            data = (x, y, x_test, y_test)
        cache[(phase, subset)] = tuple(
            t.to(device, memory_format=torch.channels_last) if t.ndim == 4 else t.to(device)
            for t in data)
    return cache[(phase, subset)]


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Train one run; returns its spec, accuracy after each epoch, and wall time.

    The seed fixes the initial weights and the batch order, so every optimizer of a seed
    starts from the same weights and sees the same batches. A run whose loss turns
    non-finite stops there and is scored as it stands (``"diverged": true``). Model,
    optimizer, schedule (the recipe's, with the spec's lr, warmup and poly power), loss
    (with the spec's label smoothing) and the training loop are ``largebatch train``'s
    (:mod:`largebatch.recipes.build`, :mod:`largebatch.recipes.loop`)."""
    import torch

    from largebatch.recipes.build import build_loss, build_model, build_optimizer, build_schedule
    from largebatch.recipes.loop import evaluate, tensor_chunks, train_epoch
    from largebatch.torch import ScheduleLR

    if not _WORKER:
        _init_worker(torch.get_num_threads(), None, "cpu")
    x_train, y_train, x_eval, y_eval = _tensors(spec.phase, spec.subset)
    device = x_train.device
    recipe = dataclasses.replace(_recipe(spec.batch, spec.optimizer),
                                 label_smoothing=spec.label_smoothing, power=spec.power)
    steps_per_epoch = len(y_train) // spec.batch
    torch.manual_seed(spec.seed)
    model = build_model(recipe.model, 10).to(  # type: ignore[call-overload]  # torch's stubs
        device, memory_format=torch.channels_last)
    optimizer = build_optimizer(recipe, model, spec.lr)
    scheduler = ScheduleLR(optimizer, build_schedule(
        recipe, peak_lr=spec.lr, epochs=spec.epochs, n_train=len(y_train), batch=spec.batch,
        warmup_epochs=spec.warmup_epochs))
    order = torch.Generator().manual_seed(spec.seed)
    loss_fn = build_loss(recipe)

    sim = _simulated_workers(spec, model, steps_per_epoch)
    curve, diverged, start = [], False, time.perf_counter()
    for epoch in range(1, spec.epochs + 1):
        perm = torch.randperm(len(y_train), generator=order).to(device)
        batches = ((x_train[idx], y_train[idx])
                   for idx in perm[: steps_per_epoch * spec.batch].split(spec.batch))
        if sim is None:
            loss_sum = train_epoch(model, batches, optimizer, scheduler, loss_fn)
        else:
            loss_sum = _train_epoch_workers(model, batches, optimizer, scheduler, loss_fn, sim)
        train_loss = float(loss_sum) / steps_per_epoch
        diverged = not math.isfinite(train_loss)
        accuracy = evaluate(model, tensor_chunks(x_eval, y_eval, _EVAL_CHUNK),
                            device=device).accuracy
        curve.append({"epoch": epoch, "step": epoch * steps_per_epoch, "train_loss": train_loss,
                      "accuracy": accuracy})
        if diverged:
            break
    row = {"spec": dataclasses.asdict(spec), "accuracy": curve[-1]["accuracy"],
           "diverged": diverged, "steps_per_epoch": steps_per_epoch, "curve": curve,
           "seconds": time.perf_counter() - start}
    if sim is not None and spec.compression != "none":
        row["compression"] = {"rates": sim.compression_rates(), "stats": sim.stats,
                              "warmup_steps": sim.warmup_steps}
    return row


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
    return SimulatedWorkers([n for n, _ in params], [p.shape for _, p in params], spec.workers,
                            warmup_steps=warmup)


def _train_epoch_workers(model: Any, batches: Any, optimizer: Any, scheduler: Any, loss_fn: Any,
                         sim: Any) -> Any:
    """:func:`largebatch.recipes.loop.train_epoch` for simulated workers: each batch split
    over ``sim.n`` workers, their gradients exchanged by ``sim``
    (:func:`largebatch.comm.torch.simulate_step`), then the optimizer and schedule step."""
    import torch

    from largebatch.comm.torch import simulate_step

    loss_sum = torch.zeros((), dtype=torch.float64)
    for x, y in batches:
        parts = list(zip(x.chunk(sim.n), y.chunk(sim.n)))
        loss_sum += sum(simulate_step(model, sim, parts, loss_fn)) / sim.n
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return loss_sum


# --------------------------------------------------------------------------- the sweep


def _load_results(path: Path) -> dict[str, dict[str, Any]]:
    """The finished runs in ``path`` by :attr:`RunSpec.key`. A line that holds no complete
    run (cut short when a study was killed mid-write) is skipped with a warning naming the
    file and the line; its run is planned again."""
    results = {}
    if path.is_file():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                results[RunSpec(**row["spec"]).key] = row
            except (ValueError, TypeError, KeyError) as err:
                reason = " ".join(f"{type(err).__name__}: {err}".split())
                print(f"largebatch study: warning: {path}, line {number}: not a complete run "
                      f"record ({reason}); skipped, its run is planned again",
                      file=sys.stderr, flush=True)
    return results


def _append(path: Path, row: dict[str, Any]) -> None:
    """Append one run to ``path`` on a line of its own, flushed to disk."""
    with path.open("ab") as f:
        if f.tell() > 0:
            with path.open("rb") as r:
                r.seek(-1, os.SEEK_END)
                if r.read(1) != b"\n":  # the previous writer was cut short mid-line
                    f.write(b"\n")
        f.write((json.dumps(row) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


class _Stopped(BaseException):
    """SIGTERM reached the study: unwinds it like Ctrl-C does."""


def _raise_stopped(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def _stop_workers(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """End the pool's worker processes now, mid-run if need be."""
    terminate = getattr(pool, "terminate_workers", None)
    if terminate is not None:
        terminate()
    else:
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.terminate()
    pool.shutdown(wait=False, cancel_futures=True)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def run_study(cfg: StudyConfig = StudyConfig(),
              print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every planned run (reusing those in ``OUT/runs.jsonl``), then summarize."""
    _check(cfg)
    with lock_folder(cfg.out, "study") as out:
        remove_stale_temporaries(out, ("study.json", "study.md", "study.png"))
        return _run_study(cfg, print_fn)


def _run_study(cfg: StudyConfig, print_fn: Callable[[str], None]) -> dict[str, Any]:
    out = Path(cfg.out)
    log = out / "runs.jsonl"
    results = _load_results(log)
    start = time.perf_counter()
    if cfg.report_only:
        print_fn(f"largebatch study: the report of the {len(results)} finished runs in {log}; "
                 f"{len(plan(cfg, results))} runs are planned next (and more once they "
                 "finish)")
    else:
        _train_planned(cfg, results, log, print_fn)

    summary = summarize(cfg, results)
    atomic_write(out / "study.json", json.dumps(summary, indent=2) + "\n")
    text = study_markdown(summary)
    atomic_write(out / "study.md", text)
    wrote = [out / "study.md", out / "study.json"]
    if plot(summary, out / "study.png"):
        wrote.append(out / "study.png")
    print_fn("")
    print_fn(text)
    print_fn(f"wrote {', '.join(map(str, wrote))} ({time.perf_counter() - start:.0f}s)")
    return summary


def _train_planned(cfg: StudyConfig, results: dict[str, dict[str, Any]], log: Path,
                   print_fn: Callable[[str], None]) -> None:
    """Train every planned run on the pool (``jobs`` at a time, in the plan's order),
    re-planning as runs finish; each finished run goes into ``results`` and is appended
    to ``log``."""
    jobs = cfg.jobs or (1 if cfg.device == "cuda" else _cpus())
    threads = cfg.threads or max(1, _cpus() // jobs)
    reused = len(results)
    what = ("quick study: the recipes' tuned settings, no tuning" if cfg.quick else
            "full study: tune lr and warmup on a validation split, then re-run the best")
    print_fn(f"largebatch study ({what}); {jobs} job(s) x {threads} thread(s) on "
             f"{cfg.device}; runs in {log}" + (f", {reused} reused" if reused else ""))

    start, done = time.perf_counter(), 0
    pool = (concurrent.futures.ProcessPoolExecutor(
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker,
        initargs=(threads, cfg.data, cfg.device, os.getpid())) if jobs > 1 else None)
    if pool is None:
        _init_worker(threads, cfg.data, cfg.device)
    submit = pool.submit if pool is not None else _run_inline
    previous = (signal.signal(signal.SIGTERM, _raise_stopped)
                if threading.current_thread() is threading.main_thread() else None)
    finished_cleanly = False
    try:
        in_flight: dict[concurrent.futures.Future, RunSpec] = {}
        while True:
            # At most one run per job in flight, taken in the plan's order (pair by pair):
            # the pairs finish one after another, so a study stopped part-way has whole
            # rows, and each run is planned with every result finished before it.
            busy = {s.key for s in in_flight.values()}
            for spec in plan(cfg, results):
                if len(in_flight) >= jobs:
                    break
                if spec.key not in busy:
                    in_flight[submit(run_one, spec)] = spec
            if not in_flight:
                break
            finished, _ = concurrent.futures.wait(in_flight, return_when="FIRST_COMPLETED")
            for future in finished:
                spec = in_flight.pop(future)
                row = future.result()
                results[spec.key] = row
                _append(log, row)
                done += 1
                print_fn(f"[{done:>3} {time.perf_counter() - start:6.0f}s] {spec.describe():<58} "
                         f"{'val' if spec.phase == 'tune' else 'test'} "
                         f"{row['accuracy']:7.2%}{'  diverged' if row['diverged'] else ''}  "
                         f"({row['seconds']:.0f}s)")
        finished_cleanly = True
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if pool is not None:
            if finished_cleanly:
                pool.shutdown(cancel_futures=True)
            else:  # SIGTERM, Ctrl-C or a failed run: the workers go now, not after their runs
                _stop_workers(pool)


def _run_inline(fn: Callable[[RunSpec], dict[str, Any]],
                spec: RunSpec) -> concurrent.futures.Future:
    """``fn(spec)`` in this process, as an already finished future (the one-job path)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(fn(spec))
    return future

