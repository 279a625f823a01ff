"""The study's sweep (:func:`run_study`): its settings in ``OUT/settings.json``, the planned
runs on a pool of worker processes, each finished run appended to ``OUT/runs.jsonl`` (an
interrupted study resumes from it), then the report; :func:`recorded_config` reads the
settings back (``--report``). Imports no framework: the workers do.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from largebatch.outputs import atomic_write, lock_folder, remove_stale_temporaries
from largebatch.study.plan import (
    RunSpec,
    StudyConfig,
    check_config,
    config_from_runs,
    pair_recipe,
    plan,
    run_steps,
    runs_left,
)
from largebatch.study.report import compare_markdown, plot, study_markdown, summarize
from largebatch.study.worker import WORKER, init_worker, run_one

__all__ = [
    "SETTINGS",
    "Stopped",
    "append_run",
    "compare_studies",
    "load_results",
    "recorded_config",
    "pool_size",
    "run_one",
    "run_planned",
    "run_study",
    "write_report",
]

SETTINGS = "settings.json"  # OUT/settings.json: StudyConfig.settings() of the last study in OUT
# Off a terminal (make demo > log), a progress line at most this often, in seconds, where a
# terminal shows the bar: the runs in flight, their epochs and losses, and the time left.
PROGRESS_EVERY = 60.0


# --------------------------------------------------------------------------- the sweep


def load_results(
    path: Path, warn: bool = True, spec_type: Any = RunSpec, command: str = "study"
) -> dict[str, dict[str, Any]]:
    """The finished runs in ``path`` by their spec's ``key`` (``spec_type``: the sweep's
    :class:`RunSpec`, or the steps study's ``TrialSpec``), each spec with every field (a
    record that predates a field ran as its default does). A line that holds no complete
    run (cut short when a study was killed mid-write) is skipped, with a warning of
    ``largebatch COMMAND`` naming the file and the line (``warn``); its run is planned
    again."""
    results = {}
    if path.is_file():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                spec = spec_type(**row["spec"])
            except (ValueError, TypeError, KeyError) as err:
                if not warn:
                    continue
                reason = " ".join(f"{type(err).__name__}: {err}".split())
                print(
                    f"largebatch {command}: warning: {path}, line {number}: not a complete run "
                    f"record ({reason}); skipped, its run is planned again",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            results[spec.key] = {**row, "spec": dataclasses.asdict(spec)}
    return results


def recorded_config(out: str | os.PathLike, given: dict[str, Any] | None = None) -> StudyConfig:
    """The settings of the study in the folder ``out`` (``--report``): its ``settings.json``,
    or in a folder without one what its ``runs.jsonl`` holds (:func:`config_from_runs`,
    ``given`` settling what the runs leave open). A ValueError says what is missing."""
    folder = Path(out)
    if not folder.is_dir():
        raise ValueError(f"{folder} holds no study: no such folder")
    path = folder / SETTINGS
    if path.is_file():
        try:
            settings = json.loads(path.read_text())
            if not isinstance(settings, dict):
                raise ValueError("not a JSON object")
            cfg = StudyConfig.from_settings(settings)
            check_config(cfg)
        except (OSError, ValueError, TypeError) as err:
            reason = " ".join(str(err).split())
            raise ValueError(f"cannot read the study's settings from {path}: {reason}") from None
        return cfg
    results = load_results(folder / "runs.jsonl", warn=False)
    if not results:
        raise ValueError(f"{folder} holds no study: neither {SETTINGS} nor a finished run in runs.jsonl")
    try:
        return config_from_runs(results, given)
    except ValueError as err:
        raise ValueError(f"{folder} has no {SETTINGS}, and {err}") from None


def compare_studies(folders: list[str]) -> str:
    """The studies in ``folders`` side by side (``--compare``, one model per folder): each
    summarized from its runs and settings as ``--report`` does, nothing written. A
    ValueError names a folder that holds no study."""
    summaries = []
    for folder in folders:
        cfg = recorded_config(folder)
        summaries.append(summarize(cfg, load_results(Path(folder) / "runs.jsonl", warn=False)))
    return compare_markdown(summaries)


def append_run(path: Path, row: dict[str, Any]) -> None:
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


class Stopped(BaseException):
    """SIGTERM reached the study: unwinds it like Ctrl-C does."""


def _raise_stopped(signum: int, frame: Any) -> None:
    raise Stopped(signum)


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


_say = functools.partial(print, flush=True)


def run_study(cfg: StudyConfig = StudyConfig(), print_fn: Callable[[str], None] = _say) -> dict[str, Any]:
    """Run every planned run (reusing those in ``OUT/runs.jsonl``), then summarize."""
    check_config(cfg)
    with lock_folder(cfg.out, "study") as out:
        remove_stale_temporaries(out, ("study.json", "study.md", "study.png", SETTINGS))
        return _run_study(cfg, print_fn)


def _run_study(cfg: StudyConfig, print_fn: Callable[[str], None]) -> dict[str, Any]:
    out = Path(cfg.out)
    log = out / "runs.jsonl"
    results = load_results(log)
    start = time.perf_counter()
    if cfg.report_only:
        print_fn(
            f"largebatch study: the report of the {len(results)} finished runs in {log}; "
            f"{len(plan(cfg, results))} runs are planned next (and more once they "
            "finish)"
        )
    else:
        atomic_write(out / SETTINGS, json.dumps(cfg.settings(), indent=2) + "\n")
        _train_planned(cfg, results, log, print_fn)

    summary = summarize(cfg, results)
    text = study_markdown(summary)
    wrote = write_report(out, "study", summary, text, plot)
    print_fn("")
    print_fn(text)
    print_fn(f"wrote {', '.join(map(str, wrote))} ({time.perf_counter() - start:.0f}s)")
    return summary


def write_report(
    out: Path, name: str, summary: dict[str, Any], text: str, draw: Callable[[dict[str, Any], Path], bool]
) -> list[Path]:
    """A study's report in ``out``, each file replaced atomically: ``NAME.md`` (``text``),
    ``NAME.json`` (``summary``) and ``NAME.png`` where ``draw(summary, path)`` writes it.
    Returns the paths written."""
    atomic_write(out / f"{name}.json", json.dumps(summary, indent=2) + "\n")
    atomic_write(out / f"{name}.md", text)
    wrote = [out / f"{name}.md", out / f"{name}.json"]
    if draw(summary, out / f"{name}.png"):
        wrote.append(out / f"{name}.png")
    return wrote


def _header(cfg: StudyConfig, todo: list[RunSpec], jobs: int, threads: int, log: Path, reused: int) -> str:
    """The study's first line: what it runs, and where."""
    what = (
        "quick study: the recipes' tuned settings, no tuning"
        if cfg.quick
        else "full study: tune lr and warmup on a validation split, then re-run the best"
    )
    pairs = cfg.pairs()
    own = sorted({pair_recipe(b, o).epochs for b, o in pairs})
    epochs = (
        f"{cfg.epochs} epoch{'s' * (cfg.epochs != 1)} (the recipes' schedules scaled from "
        f"{'/'.join(map(str, own))})"
        if cfg.epochs and own != [cfg.epochs]
        else f"{'/'.join(map(str, own))} epochs"
    )
    return (
        f"largebatch study ({what}): {', '.join(f'B={b} {o}' for b, o in pairs)}; "
        f"{epochs}, {cfg.seeds} seed{'s' * (cfg.seeds != 1)}; "
        f"{'' if cfg.quick else 'at least '}{len(todo)} run{'s' * (len(todo) != 1)}, "
        f"{sum(map(run_steps, todo)):,} steps to go; {jobs} job(s) x {threads} thread(s) on "
        f"{cfg.device}; runs in {log}" + (f", {reused} reused" if reused else "")
    )


class _StudyBar:
    """The study's progress bar (tqdm on stderr, shown on a terminal only): the images
    trained by the runs of this invocation, against those its runs still to run take
    (:func:`runs_left`), hence tqdm's estimate of the time left; the runs done and the last
    epoch's training loss a run reported. With ``lines`` (a print function: stdout is no
    terminal), the same as a line at most every :data:`PROGRESS_EVERY` seconds."""

    def __init__(
        self, cfg: StudyConfig, todo: list[RunSpec], lines: Callable[[str], None] | None = None
    ) -> None:
        from tqdm import tqdm

        self.cfg = cfg
        self.running: dict[str, int] = {}  # key -> steps done, of the runs in flight
        self.batch: dict[str, int] = {}
        self.specs: dict[str, RunSpec] = {}
        self.losses: dict[str, float] = {}
        self.done, self.done_images, self.left = 0, 0, len(todo)
        self.total = sum(_images(s) for s in todo)
        self.loss: float | None = None
        self.lines = lines
        self.t0 = self.shown = time.perf_counter()
        self.bar = tqdm(
            total=sum(_images(s) for s in todo),
            desc="study",
            unit="img",
            unit_scale=True,
            leave=False,
            disable=None,
            smoothing=0.1,
        )

    def start(self, spec: RunSpec) -> None:
        self.running[spec.key], self.batch[spec.key], self.specs[spec.key] = 0, spec.batch, spec

    def progress(self, message: tuple[str, int, float | None]) -> None:
        """A run's ``(key, steps done, last epoch's loss)`` (:class:`_Progress`); a
        message of a run already finished is dropped."""
        key, steps, loss = message
        if key not in self.running:
            return
        self.bar.update((steps - self.running[key]) * self.batch[key])
        self.running[key] = steps
        if loss is not None:
            self.loss = self.losses[key] = loss
            self._postfix()
        if self.lines is not None and time.perf_counter() - self.shown >= PROGRESS_EVERY:
            self.shown = time.perf_counter()
            self.lines(self.line())

    def finish(self, spec: RunSpec, results: dict[str, dict[str, Any]]) -> None:
        """Counts ``spec`` (now in ``results``) as done, and the study's total anew."""
        self.bar.update((run_steps(spec) - self.running.pop(spec.key, 0)) * spec.batch)
        self.specs.pop(spec.key, None)
        self.losses.pop(spec.key, None)
        self.done += 1
        self.done_images += _images(spec)
        todo = runs_left(self.cfg, results)
        self.left = len(todo)
        self.total = self.bar.total = self.done_images + sum(_images(s) for s in todo)
        self._postfix()

    def line(self) -> str:
        """The progress as one line: the share of the images trained, the runs done, the
        time left at the rate so far, and each run in flight with its epoch and loss."""
        elapsed = time.perf_counter() - self.t0
        images = self.done_images + sum(steps * self.batch[key] for key, steps in self.running.items())
        share = images / self.total if self.total else 1.0
        left = f", about {_duration(elapsed * (self.total - images) / images)} left" if images else ""
        runs = []
        for key, steps in self.running.items():
            spec = self.specs[key]
            epoch = steps * spec.epochs // max(1, run_steps(spec))
            loss = f", loss {self.losses[key]:.3f}" if key in self.losses else ""
            runs.append(f"B={spec.batch} {spec.optimizer} ({spec.phase}) epoch {epoch}/{spec.epochs}{loss}")
        return (
            f"[{self.done:>3} {elapsed:6.0f}s] study {share:.0%} of its images, "
            f"runs {self.done}/{self.done + self.left} done{left}"
            + ("; running " + "; ".join(runs) if runs else "")
        )

    def write(self, print_fn: Callable[[str], None], line: str) -> None:
        """``print_fn(line)`` above the bar."""
        self.bar.clear()
        print_fn(line)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()

    def _postfix(self) -> None:
        self.bar.set_postfix_str(
            f"runs {self.done}/{self.done + self.left}"
            + ("" if self.loss is None else f", loss {self.loss:.3f}")
        )


def _images(spec: RunSpec) -> int:
    return run_steps(spec) * spec.batch


def _duration(seconds: float) -> str:
    """``seconds`` as a reader takes them in: 45 s, 12 min, 3.4 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _drain(source: Any, handle: Callable[[Any], None]) -> None:
    """``handle`` every message waiting in the queue ``source`` (None: none)."""
    while source is not None:
        try:
            handle(source.get_nowait())
        except queue.Empty:
            return


def _train_planned(
    cfg: StudyConfig, results: dict[str, dict[str, Any]], log: Path, print_fn: Callable[[str], None]
) -> None:
    """Train every planned run on the pool (:func:`run_planned`), each finished run into
    ``results`` and ``log``. The first line says what is to run; a bar shows the progress."""
    jobs, threads = pool_size(cfg.jobs, cfg.threads, cfg.device)
    todo = runs_left(cfg, results)
    print_fn(_header(cfg, todo, jobs, threads, log, len(results)))
    start, done = time.perf_counter(), 0
    bar = _StudyBar(cfg, todo, lines=None if sys.stdout.isatty() else print_fn)

    def finished(spec: RunSpec, row: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        bar.finish(spec, results)
        bar.write(
            print_fn,
            (
                f"[{done:>3} {time.perf_counter() - start:6.0f}s] {spec.describe():<58} "
                f"{'val' if spec.phase == 'tune' else 'test'} "
                f"{row['accuracy']:7.2%}{'  diverged' if row['diverged'] else ''}  "
                f"({row['seconds']:.0f}s)"
            ),
        )

    try:
        run_planned(
            functools.partial(plan, cfg),
            run_one,
            results,
            log,
            jobs=jobs,
            threads=threads,
            data=cfg.data,
            device=cfg.device,
            started=bar.start,
            progress=bar.progress,
            finished=finished,
        )
    finally:
        bar.close()


def pool_size(jobs: int | None, threads: int | None, device: str) -> tuple[int, int]:
    """``(jobs, threads per job)``: by default one job on a GPU, one per core on the CPU,
    and the cores shared among the jobs."""
    jobs = jobs or (1 if device == "cuda" else _cpus())
    return jobs, threads or max(1, _cpus() // jobs)


def run_planned(
    planner: Callable[[dict[str, dict[str, Any]]], list[Any]],
    runner: Callable[[Any], dict[str, Any]],
    results: dict[str, dict[str, Any]],
    log: Path,
    *,
    jobs: int,
    threads: int,
    data: str | None,
    device: str,
    started: Callable[[Any], None] | None = None,
    progress: Callable[[tuple[str, int, float | None]], None] | None = None,
    finished: Callable[[Any, dict[str, Any]], None] | None = None,
) -> None:
    """Run ``runner(spec)`` for every spec ``planner(results)`` gives, ``jobs`` at a time
    on a pool of worker processes (in this process for one job), planning again as runs
    finish: each finished run goes into ``results`` (by its spec's ``key``) and is appended
    to ``log`` before the next starts. ``started(spec)``, ``progress(message)`` (a run's
    reports, :class:`~largebatch.study.worker._Progress`) and ``finished(spec, row)`` follow
    the runs. SIGTERM or Ctrl-C ends the workers at once, mid-run."""
    spawn = multiprocessing.get_context("spawn")
    reports = spawn.Queue() if jobs > 1 else None
    pool = (
        concurrent.futures.ProcessPoolExecutor(
            jobs,
            mp_context=spawn,
            initializer=init_worker,
            initargs=(threads, data, device, os.getpid(), reports),
        )
        if jobs > 1
        else None
    )
    if pool is None:
        init_worker(threads, data, device)
        if progress is not None:
            WORKER["progress"] = progress
    submit = pool.submit if pool is not None else _run_inline
    previous = (
        signal.signal(signal.SIGTERM, _raise_stopped)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    finished_cleanly = False
    try:
        in_flight: dict[concurrent.futures.Future, Any] = {}
        while True:
            # At most one run per job in flight, taken in the plan's order: each run is
            # planned with every result finished before it.
            busy = {s.key for s in in_flight.values()}
            for spec in planner(results):
                if len(in_flight) >= jobs:
                    break
                if spec.key not in busy:
                    if started is not None:
                        started(spec)
                    in_flight[submit(runner, spec)] = spec
            if not in_flight:
                break
            done: set[concurrent.futures.Future] = set()
            while not done:
                done, _ = concurrent.futures.wait(in_flight, timeout=0.5, return_when="FIRST_COMPLETED")
                _drain(reports, progress or (lambda _: None))
            for future in done:
                spec = in_flight.pop(future)
                row = future.result()
                results[spec.key] = row
                append_run(log, row)
                if finished is not None:
                    finished(spec, row)
        finished_cleanly = True
    finally:
        WORKER.pop("progress", None)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if pool is not None:
            if finished_cleanly:
                pool.shutdown(cancel_futures=True)
            else:  # SIGTERM, Ctrl-C or a failed run: the workers go now, not after their runs
                _stop_workers(pool)
        if reports is not None:
            reports.close()


def _run_inline(fn: Callable[[Any], dict[str, Any]], spec: Any) -> concurrent.futures.Future:
    """``fn(spec)`` in this process, as an already finished future (the one-job path)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(fn(spec))
    return future
