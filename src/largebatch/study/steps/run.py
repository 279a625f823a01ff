"""The steps-to-target study's run (:func:`run_steps_study`): its settings in
``OUT/settings.json`` (a resume refuses others), its cost before it starts, the planned
runs on a pool of worker processes, each finished run appended to ``OUT/runs.jsonl``, then
the report (``steps.md``, ``steps.json``, ``steps.png``). Imports no framework: the
workers do.
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from largebatch.outputs import atomic_write, lock_folder, remove_stale_temporaries
from largebatch.study.run import load_results, pool_size, run_planned, write_report
from largebatch.study.steps.plan import (
    StepsConfig,
    TrialSpec,
    budget_steps,
    check_config,
    plan,
    point_trials,
    train_images,
)
from largebatch.study.steps.report import compare, markdown, plot, summarize
from largebatch.study.steps.trial import run_trial

__all__ = [
    "SETTINGS",
    "batch_speeds",
    "check_resume",
    "compare_steps",
    "cpu_seconds",
    "estimate",
    "load_trials",
    "recorded_config",
    "run_and_say",
    "run_steps_study",
]

SETTINGS = "settings.json"
# Images a second one CPU thread trains, with the study's scoring and augmentation, before
# a study has finished runs to measure it from (2-core x86 machine, torch 2.14, 2026-11).
IMAGES_PER_THREAD_SECOND = {"fmnist_cnn": 8_000.0, "fmnist_alexnet_bn": 6_000.0, "small_resnet": 5_000.0}


def load_trials(path: Path, warn: bool = True) -> dict[str, dict[str, Any]]:
    """The finished runs in ``path`` by :attr:`TrialSpec.key`, read as the sweep reads its
    own (:func:`largebatch.study.run.load_results`): a line cut short by a kill is skipped,
    with a warning (``warn``), and its run planned again."""
    return load_results(path, warn, TrialSpec, "steps")


def recorded_config(out: str, **environment: Any) -> StepsConfig:
    """The settings of the study in ``out`` (its ``settings.json``) with ``environment``
    (``out``, ``jobs``, ...). A ValueError says what is missing or wrong."""
    path = Path(out) / SETTINGS
    try:
        settings = json.loads(path.read_text())
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()}
        cfg = StepsConfig(**values, out=out, **environment)
        check_config(cfg)
    except FileNotFoundError:
        raise ValueError(f"{out} holds no steps study: no {SETTINGS}") from None
    except (OSError, ValueError, TypeError) as err:
        reason = " ".join(str(err).split())
        raise ValueError(f"cannot read the study's settings from {path}: {reason}") from None
    return cfg


def compare_steps(folders: list[str]) -> str:
    """The critical batches of the studies in ``folders`` side by side (``--compare``, one
    model each), each summarized from its runs and settings as ``--report`` does; nothing
    is written. A ValueError names a folder that holds no study."""
    summaries = []
    for folder in folders:
        cfg = recorded_config(folder, report_only=True)
        summaries.append(summarize(cfg, load_trials(Path(folder) / "runs.jsonl", warn=False)))
    return compare(summaries)


def estimate(cfg: StepsConfig, results: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """``(images, CPU-hours)`` of the runs still to run, at most: every search trial of
    every point to its budget (the blocks of ``trials`` begun so far: an extension not
    yet decided is not counted), the seeds to the budget and the final runs, less the runs
    finished. Each batch's images take the time of the finished runs at that batch
    (:func:`batch_speeds`): an image costs more in a large batch than in a small one, so
    the mean speed of the runs so far, most of them small batches, would understate what
    the large batches still to run cost."""
    images: dict[int, float] = {}
    for batch, optimizer in cfg.points():
        per_run = budget_steps(cfg, batch) * batch
        specs, _ = point_trials(cfg, results, batch, optimizer)
        blocks = 1 + max((s.index // cfg.trials for s in specs), default=0)
        searched = sum(1 for r in results.values() if _at(r, "search", batch, optimizer))
        seeded = sum(1 for r in results.values() if _at(r, "steps", batch, optimizer))
        finals = sum(1 for r in results.values() if _at(r, "final", batch, optimizer))
        images[batch] = images.get(batch, 0.0) + (
            max(0, blocks * cfg.trials - searched) * per_run
            + max(0, cfg.seeds - seeded) * per_run
            + max(0, cfg.seeds - finals)
            * cfg.final_epochs
            * (train_images(cfg.subset, "final") // batch)
            * batch
        )
    speeds = batch_speeds(cfg, results)
    return sum(images.values()), sum(n / speeds[b] for b, n in images.items()) / 3600


def batch_speeds(cfg: StepsConfig, results: dict[str, dict[str, Any]]) -> dict[int, float]:
    """Images per CPU second at each of the study's batches: those of its finished runs
    on ``cfg.device``'s kind (a run's ``cpu_seconds``, or where it has none its wall ``seconds``
    times its threads; a run from a GPU does not time the CPU's); a batch with none takes
    the speed of the nearest batch that has some (the larger of two as near), and a study
    with no such run :data:`IMAGES_PER_THREAD_SECOND`."""
    done: dict[int, list[float]] = {}
    for r in results.values():
        on_cpu = r.get("device", "cpu") == "cpu"  # a GPU's run names its GPU
        if r.get("threads") and r["seconds"] > 0 and on_cpu == (cfg.device == "cpu"):
            mine = done.setdefault(r["spec"]["batch"], [0.0, 0.0])
            mine[0] += r["steps"] * r["spec"]["batch"]
            mine[1] += cpu_seconds(r)
    measured = {b: n / t for b, (n, t) in done.items()}
    if not measured:
        return dict.fromkeys(cfg.batches, IMAGES_PER_THREAD_SECOND[cfg.model])
    return {b: measured[min(measured, key=lambda m: (abs(math.log(m / b)), -m))] for b in cfg.batches}


def cpu_seconds(row: dict[str, Any]) -> float:
    """A finished run's CPU time: its ``cpu_seconds``, or where it has none (a run from
    before they were recorded) its wall ``seconds`` times its threads."""
    return float(row.get("cpu_seconds", row["seconds"] * row["threads"]))


def _at(row: dict[str, Any], kind: str, batch: int, optimizer: str) -> bool:
    spec = row["spec"]
    return (spec["kind"], spec["batch"], spec["optimizer"]) == (kind, batch, optimizer)


_say = functools.partial(print, flush=True)


def run_steps_study(cfg: StepsConfig, print_fn: Callable[[str], None] = _say) -> dict[str, Any]:
    """Run every planned run (reusing those in ``OUT/runs.jsonl``), then write the report.
    A folder whose ``settings.json`` holds other settings is refused (ValueError naming
    the first that differs), before anything runs."""
    check_config(cfg)
    with lock_folder(cfg.out, "steps") as out:
        remove_stale_temporaries(out, ("steps.json", "steps.md", "steps.png", SETTINGS))
        log = out / "runs.jsonl"
        results = load_trials(log)
        if not cfg.report_only:
            check_resume(cfg)
            atomic_write(out / SETTINGS, json.dumps(cfg.settings(), indent=2) + "\n")
            _train(cfg, results, log, print_fn)
        summary = summarize(cfg, results)
        text = markdown(summary)
        wrote = write_report(out, "steps", summary, text, plot)
        print_fn(text)
        print_fn(f"wrote {', '.join(map(str, wrote))}")
        return summary


def check_resume(cfg: StepsConfig) -> None:
    """A ValueError, naming the first setting that differs, when ``OUT/settings.json``
    records a study with other settings: its runs are not this study's."""
    out = Path(cfg.out)
    path = out / SETTINGS
    if not path.is_file():
        return
    recorded = json.loads(path.read_text())
    for name, value in cfg.settings().items():
        if recorded.get(name) != value:
            raise ValueError(
                f"{out} holds a study run with {name} {recorded.get(name)!r}, not {value!r}: "
                "use another --out, or the same settings to resume it"
            )


def _train(
    cfg: StepsConfig, results: dict[str, dict[str, Any]], log: Path, print_fn: Callable[[str], None]
) -> None:
    jobs, threads = pool_size(cfg.jobs, cfg.threads, cfg.device)
    images, hours = estimate(cfg, results)
    print_fn(
        f"largebatch steps: {cfg.model}, batches {', '.join(map(str, cfg.batches))}, "
        f"{', '.join(cfg.optimizers)}; {len(results)} runs done in {log}; at most "
        f"{images / 1e6:,.1f}M images to go, {hours:,.1f} CPU-hours "
        f"({hours / (jobs * threads):,.1f} h on {jobs} job(s) x {threads} thread(s) on {cfg.device}; "
        "the early stops take a fraction of it)"
    )
    run_and_say(functools.partial(plan, cfg), results, log, jobs, threads, cfg.data, cfg.device, print_fn)


def run_and_say(
    planner: Callable[[dict[str, dict[str, Any]]], list[TrialSpec]],
    results: dict[str, dict[str, Any]],
    log: Path,
    jobs: int,
    threads: int,
    data: str | None,
    device: str,
    print_fn: Callable[[str], None],
) -> None:
    """Run what ``planner`` gives on the study's pool (:func:`largebatch.study.run.run_planned`),
    a line for each finished run: its count and time, the run, its score, where it stopped."""
    start, done = time.perf_counter(), 0

    def finished(spec: TrialSpec, row: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        reached = row["steps_to_target"]
        print_fn(
            f"[{done:>4} {time.perf_counter() - start:7.0f}s] {spec.describe()}  "
            f"{'test' if spec.kind == 'final' else 'val'} {row['accuracy']:.4f} "
            f"{row['stopped']} at {row['steps']}"
            + (f", target at {reached}" if reached is not None and row["stopped"] != "target" else "")
            + f" ({row['seconds']:.0f}s)"
        )

    run_planned(
        planner,
        run_trial,
        results,
        log,
        jobs=jobs,
        threads=threads,
        data=data,
        device=device,
        finished=finished,
    )
