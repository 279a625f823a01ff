"""``largebatch study``: the batch-size sweep on Fashion-MNIST, tuned the same way for every optimizer.

Pairs: the small-batch baseline (momentum SGD at B=128), then momentum SGD with gradual
warmup (Goyal et al. 2017), Nesterov (Nado et al. 2021), LARS and LAMB at B = 384, 1536 and
3072, the ImageNet-equivalent 8K, 32K and 64K batches. Each pair starts from its registry
recipe (``fmnist-OPTIMIZER-BATCH``): model, optimizer settings, weight decay, poly decay.

Full study (the default), for every pair with the same budget:

1. **Tune** on a validation split: the last 10,000 of a fixed permutation of the 60,000
   training images are held out, the rest train. Peak lr over ``recipe lr x {1/2, 1, 2}``
   (log-spaced), each with two warmup lengths (0 or 1 epoch at the baseline batch, 1 or 3
   epochs at the large ones). While the best lr lies on the edge of the grid, the grid
   grows by one more factor of 2 on that side (twice at most, ``--extend``); a best lr
   still on the edge is marked in the table.
2. **Re-run** the best (lr, warmup) on all 60,000 images with ``--seeds`` seeds (3) and
   report test accuracy as mean ± std, and the steps each run took to reach the target
   accuracy (default: the baseline's mean minus one point) at the end of an epoch.

``--quick`` skips tuning: one seed of the recipes as they stand (their lrs and warmups are
the full study's results), at B = 128, 1536 and 3072. ``make demo`` runs it.

Runs go to a pool of ``--jobs`` processes (default: one per CPU, one torch thread each). Every
finished run is appended to ``OUT/runs.jsonl``; running the same command again reuses them,
so an interrupted study continues where it stopped (a line cut short by the interruption is
skipped with a warning, and its run is redone). SIGTERM or Ctrl-C stops the workers with
the study, and a worker whose parent is gone exits by itself. One study at a time holds
``OUT`` (a lock on ``OUT/.lock``). The end writes ``OUT/study.md`` (the tables),
``OUT/study.json`` and ``OUT/study.png``, each replaced atomically.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from largebatch.recipes.outputs import (
    CommandError, atomic_write, figure, lock_folder, plot_or_warn, remove_stale_temporaries,
    require,
)
from largebatch.recipes.registry import TRAIN_IMAGES, Recipe, get_recipe, imagenet_equivalent

__all__ = ["StudyConfig", "RunSpec", "pair_plan", "plan", "run_one", "run_study", "summarize",
           "study_markdown", "add_arguments", "main"]

BASELINE = (128, "sgd")
LARGE_BATCHES = (384, 1536, 3072)
FULL_BATCHES = (BASELINE[0], *LARGE_BATCHES)
QUICK_BATCHES = (BASELINE[0], 1536, 3072)
STUDY_OPTIMIZERS = ("sgd", "nesterov", "lars", "lamb")
VAL_SIZE = 10_000  # held out from the 60,000 training images for tuning
_SPLIT_SEED = 2017
_EVAL_CHUNK = 2000


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """What to run. The defaults are the full study; ``quick=True`` is ``make demo``'s."""

    quick: bool = False
    batches: tuple[int, ...] = FULL_BATCHES
    optimizers: tuple[str, ...] = STUDY_OPTIMIZERS
    epochs: int | None = None  # None: the recipes' epochs
    seeds: int = 3
    lr_factors: tuple[float, ...] = (0.5, 1.0, 2.0)
    small_warmups: tuple[float, ...] = (0.0, 1.0)  # epochs, at the baseline batch
    large_warmups: tuple[float, ...] = (1.0, 3.0)
    extend: int = 2  # how many times a grid may grow past an edge that holds the best lr
    target: float | None = None  # None: the baseline's mean test accuracy minus 0.01
    subset: int | None = None  # first N train (and test) images
    data: str | None = None
    out: str = "runs/study"
    jobs: int | None = None
    threads: int | None = None
    device: str = "cpu"

    def pairs(self) -> list[tuple[int, str]]:
        """``(batch, optimizer)`` in the order of the table: the baseline, then by batch."""
        out = [BASELINE] if BASELINE[0] in self.batches and BASELINE[1] in self.optimizers else []
        return out + [(b, o) for b in self.batches if b != BASELINE[0] for o in self.optimizers]

    def warmups(self, batch: int) -> tuple[float, ...]:
        return self.small_warmups if batch == BASELINE[0] else self.large_warmups


def _check(cfg: StudyConfig) -> None:
    for b in cfg.batches:
        if b not in FULL_BATCHES:
            raise ValueError(f"Invalid batch {b}: the study's recipes cover "
                             f"{', '.join(map(str, FULL_BATCHES))}")
    for o in cfg.optimizers:
        if o not in STUDY_OPTIMIZERS:
            raise ValueError(f"Invalid optimizer {o!r}: known {', '.join(STUDY_OPTIMIZERS)}")
    if not cfg.pairs():
        raise ValueError("No (batch, optimizer) pair to run: the baseline is sgd at 128, the "
                         f"other batches are {', '.join(map(str, LARGE_BATCHES))}")
    for name, low in (("seeds", 1), ("epochs", 1), ("subset", 1), ("jobs", 1), ("threads", 1)):
        value = getattr(cfg, name)
        if value is not None and not (isinstance(value, int) and value >= low):
            raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= {low})")
    if cfg.subset is not None and cfg.subset - cfg.subset // 6 < max(cfg.batches):
        raise ValueError(f"Invalid subset: {cfg.subset} (its tuning split, five sixths, must "
                         f"hold one batch of {max(cfg.batches)})")
    if cfg.extend < 0:
        raise ValueError(f"Invalid extend: {cfg.extend} (must be >= 0)")
    if cfg.target is not None and not 0 < cfg.target <= 1:
        raise ValueError(f"Invalid target: {cfg.target} (an accuracy in (0, 1])")
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"Invalid device: {cfg.device!r} (cpu or cuda)")


def _recipe(batch: int, optimizer: str) -> Recipe:
    return get_recipe(f"fmnist-{optimizer}-{batch}")


def _lr(value: float) -> float:
    return float(f"{value:.4g}")  # stable keys: 0.6 * 2 == 1.2, not 1.2000000000000002


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run. ``phase`` ``"tune"`` trains on the training split minus the
    validation images and scores the validation images; ``"final"`` trains on every training
    image and scores the test set."""

    phase: str
    batch: int
    optimizer: str
    lr: float
    warmup_epochs: float
    seed: int
    epochs: int
    subset: int | None = None

    @property
    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def describe(self) -> str:
        return (f"{self.phase:<5} B={self.batch:<5} {self.optimizer:<8} lr={self.lr:<7g} "
                f"warmup={self.warmup_epochs:g} seed={self.seed}")


def _best(runs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The run with the highest final accuracy (ties: the smaller lr, then shorter warmup)."""
    return max(runs, key=lambda r: (r["accuracy"], -r["spec"]["lr"], -r["spec"]["warmup_epochs"]))


def pair_plan(cfg: StudyConfig, results: dict[str, dict[str, Any]], batch: int,
              optimizer: str) -> tuple[list[RunSpec], list[RunSpec]]:
    """One pair's ``(tuning runs, final runs)`` as far as the finished ``results`` (by
    :attr:`RunSpec.key`) settle them; the final runs stay empty while tuning is incomplete.

    The tuning grid grows by one factor of 2 beyond an edge that holds the best lr
    (``cfg.extend`` times at most). ``--quick`` has no tuning: its finals take the recipe's
    lr and warmup."""
    recipe = _recipe(batch, optimizer)
    epochs = cfg.epochs or recipe.epochs

    def finals(lr: float, warmup: float) -> list[RunSpec]:
        return [RunSpec("final", batch, optimizer, lr, warmup, seed, epochs, cfg.subset)
                for seed in range(cfg.seeds)]

    if cfg.quick:
        return [], finals(_lr(recipe.peak_lr), recipe.warmup_epochs)
    exponents = sorted({round(math.log2(f)) for f in cfg.lr_factors})
    for grown in range(cfg.extend + 1):
        grid = [RunSpec("tune", batch, optimizer, _lr(recipe.peak_lr * 2.0**k), w, 0, epochs,
                        cfg.subset) for k in exponents for w in cfg.warmups(batch)]
        if any(s.key not in results for s in grid):
            return grid, []
        best = _best(results[s.key] for s in grid)["spec"]
        k = round(math.log2(best["lr"] / recipe.peak_lr))
        if grown == cfg.extend or k not in (exponents[0], exponents[-1]):
            break
        exponents = sorted([*exponents, k + 1 if k == exponents[-1] else k - 1])
    return grid, finals(best["lr"], best["warmup_epochs"])


def plan(cfg: StudyConfig, results: dict[str, dict[str, Any]]) -> list[RunSpec]:
    """Every run still needed, given the finished ``results``. Pure: the same results give
    the same plan, so an interrupted study continues where it stopped."""
    needed = []
    for pair in cfg.pairs():
        tune, final = pair_plan(cfg, results, *pair)
        needed += [s for s in (*tune, *final) if s.key not in results]
    return needed


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
    non-finite stops there and is scored as it stands (``"diverged": true``)."""
    import torch
    from torch import nn

    from largebatch.recipes.train import build_model, build_optimizer
    from largebatch.torch import ScheduleLR, make_schedule

    if not _WORKER:
        _init_worker(torch.get_num_threads(), None, "cpu")
    x_train, y_train, x_eval, y_eval = _tensors(spec.phase, spec.subset)
    recipe = _recipe(spec.batch, spec.optimizer)
    steps_per_epoch = len(y_train) // spec.batch
    total = spec.epochs * steps_per_epoch
    torch.manual_seed(spec.seed)
    model = build_model(recipe.model, 10).to(x_train.device, memory_format=torch.channels_last)
    optimizer = build_optimizer(recipe, model, spec.lr)
    schedule = make_schedule(
        recipe.schedule, peak_lr=spec.lr, total_steps=total, power=recipe.power,
        warmup_steps=min(round(spec.warmup_epochs * steps_per_epoch), total))
    scheduler = ScheduleLR(optimizer, schedule)
    order = torch.Generator().manual_seed(spec.seed)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)

    curve, diverged, start = [], False, time.perf_counter()
    for epoch in range(1, spec.epochs + 1):
        perm = torch.randperm(len(y_train), generator=order).to(x_train.device)
        loss_sum = torch.zeros((), device=x_train.device)
        for i in range(steps_per_epoch):
            idx = perm[i * spec.batch : (i + 1) * spec.batch]
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach()
        train_loss = float(loss_sum) / steps_per_epoch
        diverged = not math.isfinite(train_loss)
        curve.append({"epoch": epoch, "step": epoch * steps_per_epoch, "train_loss": train_loss,
                      "accuracy": _accuracy(model, x_eval, y_eval)})
        if diverged:
            break
    return {"spec": dataclasses.asdict(spec), "accuracy": curve[-1]["accuracy"],
            "diverged": diverged, "steps_per_epoch": steps_per_epoch, "curve": curve,
            "seconds": time.perf_counter() - start}


def _accuracy(model: Any, x: Any, y: Any) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        correct = sum(int((model(xb).argmax(1) == yb).sum())
                      for xb, yb in zip(x.split(_EVAL_CHUNK), y.split(_EVAL_CHUNK)))
    model.train()
    return correct / len(y)


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
            busy = {s.key for s in in_flight.values()}
            for spec in plan(cfg, results):
                if spec.key not in busy:
                    in_flight[submit(run_one, spec)] = spec
                    if pool is None:
                        break  # one at a time, logged before the next: re-plan after each run
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
    summary = summarize(cfg, results)
    atomic_write(out / "study.json", json.dumps(summary, indent=2) + "\n")
    text = study_markdown(summary)
    atomic_write(out / "study.md", text)
    wrote = [out / "study.md", out / "study.json"]
    if plot_or_warn("study", out / "study.png", lambda: _plot(summary, out / "study.png")):
        wrote.append(out / "study.png")
    print_fn("")
    print_fn(text)
    print_fn(f"wrote {', '.join(map(str, wrote))} ({time.perf_counter() - start:.0f}s)")
    return summary


def _run_inline(fn: Callable[[RunSpec], dict[str, Any]],
                spec: RunSpec) -> concurrent.futures.Future:
    """``fn(spec)`` in this process, as an already finished future (the one-job path)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(fn(spec))
    return future


# --------------------------------------------------------------------------- the report


def _steps_to(curve: Sequence[dict[str, Any]], target: float) -> int | None:
    return next((c["step"] for c in curve if c["accuracy"] >= target), None)


def summarize(cfg: StudyConfig, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One row per (batch, optimizer) with finished final runs, plus the tuning grids."""
    rows, grids = [], []
    n_train = cfg.subset or TRAIN_IMAGES["fashion-mnist"]
    for batch, optimizer in cfg.pairs():
        tune, final = pair_plan(cfg, results, batch, optimizer)
        tuned = [results[s.key] for s in tune if s.key in results]
        if tuned:
            grids.append({"batch": batch, "optimizer": optimizer, "runs": sorted(
                ({"lr": r["spec"]["lr"], "warmup_epochs": r["spec"]["warmup_epochs"],
                  "accuracy": r["accuracy"], "diverged": r["diverged"]} for r in tuned),
                key=lambda g: (g["warmup_epochs"], g["lr"]))})
        finals = [results[s.key] for s in final if s.key in results]
        if not finals:
            continue
        spec, accs = final[0], [r["accuracy"] for r in finals]
        rows.append({
            "batch": batch, "imagenet_batch": imagenet_equivalent(batch, n_train),
            "optimizer": optimizer, "epochs": spec.epochs,
            "steps": spec.epochs * finals[0]["steps_per_epoch"], "lr": spec.lr,
            "warmup_epochs": spec.warmup_epochs, "seeds": len(accs),
            "accuracy_mean": statistics.fmean(accs),
            "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "accuracies": accs, "curves": [r["curve"] for r in finals],
            "diverged": sum(r["diverged"] for r in finals),
            "lr_on_grid_edge": bool(tune) and spec.lr in (min(t.lr for t in tune),
                                                          max(t.lr for t in tune)),
        })
    base = next((r for r in rows if (r["batch"], r["optimizer"]) == BASELINE), None)
    target = cfg.target
    if target is None and base is not None:
        target = math.floor((base["accuracy_mean"] - 0.01) * 1000) / 1000
    for row in rows:
        row["delta_vs_baseline"] = None if base is None else row["accuracy_mean"] - base[
            "accuracy_mean"]
        steps = [_steps_to(c, target) for c in row["curves"]] if target is not None else []
        row["steps_to_target"] = steps
    return {"quick": cfg.quick, "target": target, "n_train": n_train, "rows": rows,
            "grids": grids, "model": _recipe(*BASELINE).model}


def _steps_text(steps: Sequence[int | None]) -> str:
    reached = [s for s in steps if s is not None]
    if not steps:
        return "-"
    if len(reached) < len(steps):
        return f"{len(reached)}/{len(steps)} reached" if reached else "not reached"
    return f"{statistics.fmean(reached):,.0f}"


def study_markdown(summary: dict[str, Any]) -> str:
    """The results table (and, for a full study, the tuning grids) as Markdown."""
    target = summary["target"]
    lines = [
        "| batch | ImageNet-eq. | optimizer | epochs | steps | peak lr | warmup (epochs) "
        f"| test acc. (mean ± std, seeds) | vs baseline | steps to {target:.1%} |"
        if target is not None else "| batch | ImageNet-eq. | optimizer | epochs | steps | "
        "peak lr | warmup (epochs) | test acc. (mean ± std, seeds) | vs baseline | steps to target |",
        "|---:|---:|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in summary["rows"]:
        delta = "-" if r["delta_vs_baseline"] is None else f"{100 * r['delta_vs_baseline']:+.2f}"
        div = f", {r['diverged']} diverged" if r["diverged"] else ""
        lines.append(
            f"| {r['batch']:,} | {r['imagenet_batch']:,} | {r['optimizer']} | {r['epochs']} | "
            f"{r['steps']:,} | {r['lr']:g}{' (edge)' if r['lr_on_grid_edge'] else ''} | "
            f"{r['warmup_epochs']:g} | "
            f"{_mean_std(r)} ({r['seeds']}{div}) "
            f"| {delta} | {_steps_text(r['steps_to_target'])} |")
    if any(r["lr_on_grid_edge"] for r in summary["rows"]):
        lines += ["", "(edge): the best lr lies on the edge of the tuned grid, after it grew."]
    if summary["grids"]:
        lines += ["", "Tuning (validation accuracy, %; best of each pair in bold; "
                  "`div` marks a run whose loss turned non-finite):", ""]
        for g in summary["grids"]:
            lrs = sorted({run["lr"] for run in g["runs"]})
            warmups = sorted({run["warmup_epochs"] for run in g["runs"]})
            best = _best({"accuracy": run["accuracy"], "spec": run} for run in g["runs"])["spec"]
            cell = {(run["lr"], run["warmup_epochs"]): run for run in g["runs"]}
            lines.append(f"B={g['batch']:,} {g['optimizer']}: "
                         + "; ".join(f"warmup {w:g}: " + ", ".join(
                             _grid_cell(cell.get((lr, w)), lr, cell.get((lr, w)) is best)
                             for lr in lrs) for w in warmups))
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _mean_std(row: dict[str, Any]) -> str:
    mean = f"{100 * row['accuracy_mean']:.2f}"
    return mean if row["seeds"] == 1 else f"{mean} ± {100 * row['accuracy_std']:.2f}"


def _grid_cell(run: dict[str, Any] | None, lr: float, best: bool) -> str:
    if run is None:
        return f"lr {lr:g} -"
    text = f"{100 * run['accuracy']:.2f}" + (" div" if run["diverged"] else "")
    return f"lr {lr:g} **{text}**" if best else f"lr {lr:g} {text}"


def _plot(summary: dict[str, Any], path: Path) -> None:
    with figure(path, 1, 2, figsize=(12, 4.5)) as (_, (left, right)):
        _draw(summary, left, right)


def _draw(summary: dict[str, Any], left: Any, right: Any) -> None:
    rows = summary["rows"]
    for optimizer in dict.fromkeys(r["optimizer"] for r in rows):
        mine = [r for r in rows if r["optimizer"] == optimizer]
        left.errorbar([r["imagenet_batch"] for r in mine],
                      [100 * r["accuracy_mean"] for r in mine],
                      yerr=[100 * r["accuracy_std"] for r in mine], marker="o", capsize=3,
                      label=optimizer)
    base = next((r for r in rows if (r["batch"], r["optimizer"]) == BASELINE), None)
    if base is not None:
        left.axhline(100 * base["accuracy_mean"], color="gray", linestyle="--",
                     label=f"baseline B={BASELINE[0]}")
    left.set_xscale("log", base=2)
    left.set_xlabel("ImageNet-equivalent batch")
    left.set_ylabel("test accuracy (%)")
    left.set_title(f"{summary['model']} on Fashion-MNIST, {rows[0]['epochs'] if rows else '?'} "
                   "epochs")
    left.legend()
    styles = {"sgd": "-", "nesterov": ":", "lars": "--", "lamb": "-."}
    for r in rows:
        curve = r["curves"][0]
        right.plot([c["step"] for c in curve], [100 * c["accuracy"] for c in curve],
                   linestyle=styles.get(r["optimizer"], "-"),
                   label=f"B={r['batch']} {r['optimizer']}")
    right.set_xscale("log")
    right.set_xlabel("step")
    right.set_ylabel("test accuracy (%), seed 0")
    right.legend(fontsize=7, ncol=2)


# --------------------------------------------------------------------------- command line


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``largebatch study`` flags."""
    add = parser.add_argument
    add("--quick", action="store_true",
        help="no tuning: one seed of the recipes' settings at B=128, 1536, 3072 (make demo)")
    add("--out", default=None, metavar="DIR",
        help="output folder (default runs/study, or runs/study-quick)")
    add("--batches", type=_ints, default=None, metavar="B,B",
        help=f"batches (default {','.join(map(str, FULL_BATCHES))}; quick: "
             f"{','.join(map(str, QUICK_BATCHES))})")
    add("--optimizers", type=lambda t: tuple(t.split(",")), default=STUDY_OPTIMIZERS,
        metavar="NAME,NAME", help=f"default {','.join(STUDY_OPTIMIZERS)}")
    add("--seeds", type=int, default=None, help="final runs per pair (default 3; quick 1)")
    add("--epochs", type=int, default=None, help="epochs per run (default: the recipes')")
    add("--extend", type=int, default=StudyConfig.extend,
        help="times a tuning grid may grow past an edge holding the best lr (default %(default)s)")
    add("--target", type=float, default=None,
        help="accuracy for the steps-to-target column (default: baseline mean - 0.01)")
    add("--jobs", type=int, default=None, help="parallel runs (default: one per CPU)")
    add("--threads", type=int, default=None, help="torch threads per run (default CPUs / jobs)")
    add("--device", default="cpu", choices=("cpu", "cuda"))
    add("--data", default=None, metavar="DIR", help="folder with the four Fashion-MNIST files")
    add("--subset", type=int, default=None, metavar="N", help="first N train and test images")


def main(args: argparse.Namespace) -> int:
    """Run the study from parsed arguments."""
    cfg = StudyConfig(
        quick=args.quick,
        batches=args.batches or (QUICK_BATCHES if args.quick else FULL_BATCHES),
        optimizers=args.optimizers, epochs=args.epochs,
        seeds=(1 if args.quick else 3) if args.seeds is None else args.seeds,
        extend=args.extend, target=args.target,
        subset=args.subset, data=args.data, jobs=args.jobs, threads=args.threads,
        device=args.device,
        out=args.out or ("runs/study-quick" if args.quick else "runs/study"),
    )
    try:
        _check(cfg)
    except ValueError as err:
        raise CommandError("study", str(err)) from None
    require("study", ("torch", "matplotlib"))
    if cfg.data is not None and not Path(cfg.data).is_dir():
        raise CommandError("study", f"data directory not found: {cfg.data}")
    from largebatch.recipes.data import fashion_mnist_dir

    try:
        fashion_mnist_dir(cfg.data)
    except FileNotFoundError as err:
        raise CommandError("study", str(err)) from None
    try:
        run_study(cfg)
    except _Stopped:
        print(f"largebatch study: stopped by SIGTERM; the finished runs are in "
              f"{Path(cfg.out) / 'runs.jsonl'}, and the same command continues from them",
              file=sys.stderr, flush=True)
        return 128 + signal.SIGTERM
    return 0

