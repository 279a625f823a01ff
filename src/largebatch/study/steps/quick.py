"""The steps study's quick version (``largebatch steps --quick``, ``make demo``): one seed
of each pick of a finished study, run again to its target, beside what the study found.

Each run is the study's seed-1 run of its point (:func:`largebatch.study.steps.plan.seed_runs`
on the study's runs): the same hyperparameters, target, budget, initial weights and data
order. Its steps to the target are set beside the study's median and range over its seeds
(the same seed on another CPU, thread count or library version rounds differently, so a
run is one more draw, not a copy). One seed settles nothing, so the report closes with the
study's readings (:func:`largebatch.study.steps.report.readings`), whose intervals do.
Imports no framework: the workers do.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from largebatch.outputs import lock_folder
from largebatch.study.run import pool_size, write_report
from largebatch.study.steps.plan import StepsConfig, TrialSpec, budget_steps, seed_runs
from largebatch.study.steps.report import NAMES, PAIRS, plot, readings, summarize
from largebatch.study.steps.run import cpu_seconds, load_trials, recorded_config, run_and_say

__all__ = ["QUICK_FROM", "QUICK_LARGEST", "quick_markdown", "quick_runs", "quick_summary", "run_quick"]

QUICK_FROM = "docs/study/steps-fmnist-cnn"
# The default batches: the study's up to this one; past it a run scores the validation
# split every step or two, and takes minutes.
QUICK_LARGEST = 4096


def quick_runs(
    study: StepsConfig,
    results: dict[str, dict[str, Any]],
    batches: Sequence[int] | None = None,
    optimizers: Sequence[str] | None = None,
) -> list[TrialSpec]:
    """The study's seed-1 run of each pick at ``batches`` (default: the study's up to
    :data:`QUICK_LARGEST`) and ``optimizers`` (default: the study's), longest first by the
    study's own times so that the jobs end together. A ValueError names a batch or an
    optimizer the study does not have, or a study whose searches have not picked."""
    batches = (
        tuple(dict.fromkeys(batches)) if batches else tuple(b for b in study.batches if b <= QUICK_LARGEST)
    )
    optimizers = tuple(dict.fromkeys(optimizers)) if optimizers else study.optimizers
    for b in batches:
        if b not in study.batches:
            raise ValueError(f"batch {b} is not one of the study's ({', '.join(map(str, study.batches))})")
    for o in optimizers:
        if o not in study.optimizers:
            raise ValueError(f"optimizer {o!r} is not one of the study's ({', '.join(study.optimizers)})")
    specs = [runs[0] for b in batches for o in optimizers if (runs := seed_runs(study, results, b, o))]
    if not specs:
        raise ValueError(f"the study in {study.out} has no pick at these batches yet")

    def cost(spec: TrialSpec) -> float:
        row = results.get(spec.key)
        return row["seconds"] if row else spec.steps * spec.batch

    return sorted(specs, key=cost, reverse=True)


def quick_summary(
    study: StepsConfig,
    results: dict[str, dict[str, Any]],
    specs: Sequence[TrialSpec],
    mine: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """The quick runs ``mine`` (by key) beside the study's: each point's steps to the target
    in the quick run, the study's median and range over its seeds and whether the run lies
    in that range, and the study's critical-batch fits (for the plot)."""
    full = summarize(study, results)
    by_point = {(p["batch"], p["optimizer"]): p for p in full["points"]}
    points = []
    for spec in specs:
        if spec.key not in mine:
            continue
        row, reference = mine[spec.key], by_point[spec.point]
        steps = math.inf if row["steps_to_target"] is None else row["steps_to_target"]
        point: dict[str, Any] = {
            "batch": spec.batch,
            "optimizer": spec.optimizer,
            "budget_steps": budget_steps(study, spec.batch),
            "steps": steps,
            "seconds": row["seconds"],
            # the plot's fields (largebatch.plots.plot_steps): one seed
            "seed_steps": [steps],
            "steps_median": steps,
        }
        if "seed_steps" in reference:
            low, high = min(reference["seed_steps"]), max(reference["seed_steps"])
            point["study_median"] = reference["steps_median"]
            point["study_range"] = [low, high]
            point["in_range"] = low <= steps <= high
        points.append(point)
    order = {(b, o): i for i, (b, o) in enumerate(study.points())}
    points.sort(key=lambda p: order[p["batch"], p["optimizer"]])
    return {
        "study": study.out,
        "model": study.model,
        "study_runs": full["runs"],
        "seeds": study.seeds,
        "target": full["target"],
        "points": points,
        "critical_batch": full["critical_batch"],
        "readings": readings(full),
    }


def _steps(n: float, budget: int) -> str:
    return f"{n:g}" if math.isfinite(n) else f"> {budget}"


def _cell(p: dict[str, Any]) -> str:
    text = _steps(p["steps"], p["budget_steps"])
    if "study_median" in p:
        low, high = (_steps(n, p["budget_steps"]) for n in p["study_range"])
        spread = low if high == low else f"{low} to {high}" if high.startswith(">") else f"{low}-{high}"
        text += f" ({_steps(p['study_median'], p['budget_steps'])}; {spread})"
    return text


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    """``a``'s steps over ``b``'s; a bound where one did not reach the target (its budget)."""
    if a is None or b is None or not (math.isfinite(a["steps"]) or math.isfinite(b["steps"])):
        return "…"
    if not math.isfinite(b["steps"]):
        return f"< {a['steps'] / b['budget_steps']:.2f}"
    if not math.isfinite(a["steps"]):
        return f"> {a['budget_steps'] / b['steps']:.2f}"
    return f"{a['steps'] / b['steps']:.2f}"


def quick_markdown(summary: dict[str, Any]) -> str:
    """The quick version's table: steps to the study's target in each run, the study's
    median and range beside it, the one-seed ratios, and the study's readings."""
    points = summary["points"]
    optimizers = list(dict.fromkeys(p["optimizer"] for p in points))
    batches = sorted({p["batch"] for p in points})
    by = {(p["batch"], p["optimizer"]): p for p in points}
    pairs = [(a, b) for a, b in PAIRS if a in optimizers and b in optimizers]
    compared = [p for p in points if "in_range" in p]
    lines = [
        f"# The steps study, quick: seed 1 of each pick of {summary['study']}",
        "",
        f"{summary['model']}: the steps to validation accuracy {100 * summary['target']:.1f}% (the "
        "study's target) of the study's pick at each point, seed 1, in this run; in brackets the "
        f'study\'s median over its {summary["seeds"]} seeds; their range; "> n": not reached within '
        "the budget of n steps; the last columns: this run's steps over its control's.",
        "",
        "| batch | "
        + " | ".join(NAMES[o] for o in optimizers)
        + "".join(f" | {NAMES[a]} / {NAMES[b]}" for a, b in pairs)
        + " |",
        "|---:|" + "---:|" * (len(optimizers) + len(pairs)),
    ]
    for b in batches:
        cells = [_cell(by[b, o]) if (b, o) in by else "…" for o in optimizers]
        cells += [_ratio(by.get((b, x)), by.get((b, y))) for x, y in pairs]
        lines.append(f"| {b:,} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"{sum(p['in_range'] for p in compared)} of {len(compared)} runs lie within the range of "
        "the study's seeds. One seed settles no comparison; what the study's intervals settle "
        f"({summary['study_runs']} runs, 95%):",
        "",
        *(f"- {line}" for line in summary["readings"]),
        "",
    ]
    return "\n".join(lines)


_say = functools.partial(print, flush=True)


def run_quick(
    study_dir: str,
    out: str,
    *,
    batches: Sequence[int] | None = None,
    optimizers: Sequence[str] | None = None,
    data: str | None = None,
    jobs: int | None = None,
    threads: int | None = None,
    device: str = "cpu",
    print_fn: Callable[[str], None] = _say,
) -> dict[str, Any]:
    """Run the quick version into ``out`` (``runs.jsonl``, resumed; ``quick.md``,
    ``quick.json``, ``quick.png``) from the study in ``study_dir``, print its table, and
    return its summary. A ValueError, before anything runs, names a folder that holds no
    study or a batch or optimizer it does not have."""
    study = recorded_config(study_dir, report_only=True)
    results = load_trials(Path(study_dir) / "runs.jsonl", warn=False)
    specs = quick_runs(study, results, batches, optimizers)
    jobs, threads = pool_size(jobs, threads, device)
    with lock_folder(out, "steps") as folder:
        log = folder / "runs.jsonl"
        mine = load_trials(log)
        todo = [s for s in specs if s.key not in mine]
        took = sum(cpu_seconds(results[s.key]) for s in todo if s.key in results)
        cost = (
            f"the study's own runs of the {len(todo)} to go took {took / 60:.1f} CPU-minutes "
            f"({took / 60 / (jobs * threads):.1f} min on {jobs} job(s) x {threads} thread(s))"
            if todo
            else "none to go"
        )
        print_fn(
            f"largebatch steps --quick: {len(specs)} runs, seed 1 of each pick of {study_dir} "
            f"({study.model}, batches {', '.join(map(str, sorted({s.batch for s in specs})))}), "
            f"{len(specs) - len(todo)} done in {log}; {cost}"
        )
        run_and_say(
            lambda have: [s for s in todo if s.key not in have],
            mine,
            log,
            jobs,
            threads,
            data,
            device,
            print_fn,
        )
        summary = quick_summary(study, results, specs, mine)
        text = quick_markdown(summary)
        wrote = write_report(folder, "quick", summary, text, plot)
    print_fn(text)
    print_fn(f"wrote {', '.join(map(str, wrote))}")
    return summary
