"""The study's report: :func:`summarize` the finished runs (one row per pair: mean ± std
test accuracy, the difference to the baseline, steps to the target accuracy; the tuning
grids), :func:`study_markdown` (the tables of ``study.md``) and :func:`plot`
(``study.png``). Pure but for the plot: the same runs give the same report.
:func:`compare_markdown` puts several studies (one per model) side by side.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

from largebatch.outputs import rounded
from largebatch.recipes.registry import TRAIN_IMAGES, imagenet_equivalent
from largebatch.study.plan import (
    BASELINE,
    StudyConfig,
    best_run,
    fastest_plan,
    pair_plan,
    steps_to,
    validation_target,
)

__all__ = ["TOLERANCES", "compare_markdown", "plot", "study_markdown", "summarize"]

# How far below its model's baseline the best of LARS/LAMB may end at each large batch: half
# a point at the 32K-equivalent batch, one point at the 64K-equivalent.
TOLERANCES = {1536: 0.005, 3072: 0.010}


def summarize(cfg: StudyConfig, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One row per (batch, optimizer) with finished final runs, plus the tuning grids."""
    rows, grids, techniques, fast_rows = [], [], [], []
    n_train = cfg.subset or TRAIN_IMAGES["fashion-mnist"]
    for batch, optimizer in cfg.pairs():
        tune, final = pair_plan(cfg, results, batch, optimizer)
        tuned = [results[s.key] for s in tune if s.key in results]
        on = [
            r
            for r in tuned
            if (r["spec"]["label_smoothing"], r["spec"]["power"]) == (cfg.label_smoothing, cfg.power)
        ]
        if on:
            grids.append(
                {
                    "batch": batch,
                    "optimizer": optimizer,
                    "runs": sorted(
                        (
                            {
                                "lr": r["spec"]["lr"],
                                "warmup_epochs": r["spec"]["warmup_epochs"],
                                "accuracy": r["accuracy"],
                                "diverged": r["diverged"],
                            }
                            for r in on
                        ),
                        key=lambda g: (g["warmup_epochs"], g["lr"]),
                    ),
                }
            )
        if len(on) < len(tuned):
            techniques.append(_techniques(batch, optimizer, on, tuned))
        row = _row(batch, optimizer, tune, final, results)
        if row is not None:
            rows.append(row)
        fast_tune, fast_final = fastest_plan(cfg, results, batch, optimizer)
        fast = _row(batch, optimizer, [*tune, *fast_tune], fast_final, results)
        if fast is not None:
            fast_rows.append(fast)
    base = next((r for r in rows if (r["batch"], r["optimizer"]) == BASELINE), None)
    target = cfg.target
    if target is None and base is not None:
        target = math.floor((base["accuracy_mean"] - 0.01) * 1000) / 1000
    _compare(rows, base, target)
    summary = {
        "quick": cfg.quick,
        "target": target,
        "n_train": n_train,
        "rows": rows,
        "grids": grids,
        "techniques": techniques,
        "model": cfg.model,
        # What the folder's runs cost: each run's own wall time, summed
        "runs": len(results),
        "run_seconds": sum(r.get("seconds", 0.0) for r in results.values()),
    }
    if cfg.time_to_accuracy:  # each pair also tuned for steps to the target (MLPerf's metric)
        fast_base = next((r for r in fast_rows if (r["batch"], r["optimizer"]) == BASELINE), None)
        _compare(fast_rows, fast_base, target)
        summary.update(validation_target=validation_target(cfg, results), fast_rows=fast_rows)
    return summary


def _row(
    batch: int, optimizer: str, tune: list[Any], final: list[Any], results: dict[str, dict[str, Any]]
) -> dict[str, Any] | None:
    """A pair's row from its finished ``final`` runs (None when none has finished)."""
    finals = [results[s.key] for s in final if s.key in results]
    if not finals:
        return None
    spec, accs = final[0], [r["accuracy"] for r in finals]
    return {
        # The full training set names the batch, whatever the subset trained on (as in
        # ``largebatch train``).
        "batch": batch,
        "imagenet_batch": imagenet_equivalent(batch, TRAIN_IMAGES["fashion-mnist"]),
        "optimizer": optimizer,
        "epochs": spec.epochs,
        "steps": spec.epochs * finals[0]["steps_per_epoch"],
        "lr": spec.lr,
        "warmup_epochs": spec.warmup_epochs,
        "label_smoothing": spec.label_smoothing,
        "power": spec.power,
        "seeds": len(accs),
        "accuracy_mean": statistics.fmean(accs),
        "accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
        "accuracies": accs,
        "curves": [r["curve"] for r in finals],
        "diverged": sum(r["diverged"] for r in finals),
        "lr_on_grid_edge": bool(tune) and spec.lr in (min(t.lr for t in tune), max(t.lr for t in tune)),
    }


def _compare(rows: list[dict[str, Any]], base: dict[str, Any] | None, target: float | None) -> None:
    """Each row's difference to ``base`` (of the means as shown: two decimals of a
    percent) and that difference's standard error (:func:`_standard_error`; None for
    ``base`` itself), its runs' steps to ``target``, and how many times fewer than
    ``base``'s."""
    for row in rows:
        row["delta_vs_baseline"] = None if base is None else _points(row, base) / 100
        row["delta_vs_baseline_se"] = None if base is None or row is base else _standard_error(row, base)
        row["steps_to_target"] = [steps_to(c, target) for c in row["curves"]] if target is not None else []
    base_steps = _mean_steps(base["steps_to_target"]) if base is not None else None
    for row in rows:
        mean_steps = _mean_steps(row["steps_to_target"])
        row["fewer_steps"] = None if base_steps is None or mean_steps is None else base_steps / mean_steps


def _points(row: dict[str, Any], other: dict[str, Any]) -> float:
    """``row``'s mean test accuracy minus ``other``'s, in points, of the means as shown (two
    decimals of a percent), so that a difference is that of the numbers in the table."""
    return round(100 * row["accuracy_mean"], 2) - round(100 * other["accuracy_mean"], 2)


def _mean_steps(steps: Sequence[int | None]) -> float | None:
    """The mean steps to target when every run reached it, else None."""
    return statistics.fmean(cast("Sequence[int]", steps)) if steps and None not in steps else None


def _techniques(
    batch: int, optimizer: str, on: list[dict[str, Any]], tuned: list[dict[str, Any]]
) -> dict[str, Any]:
    """The validation accuracy of the pair's best grid point with every technique on, and
    with each switched off: the other warmup of the grid at the same lr, label smoothing
    0, poly power 1."""
    best = best_run(on)
    spec = best["spec"]
    other_warmup = [r for r in on if r["spec"]["lr"] == spec["lr"] and r is not best]
    off = {}
    for r in tuned:
        if r["spec"]["label_smoothing"] != spec["label_smoothing"]:
            off["no_label_smoothing"] = r["accuracy"]
        elif r["spec"]["power"] != spec["power"]:
            off["power_1"] = r["accuracy"]
    return {
        "batch": batch,
        "optimizer": optimizer,
        "lr": spec["lr"],
        "warmup_epochs": spec["warmup_epochs"],
        "label_smoothing": spec["label_smoothing"],
        "power": spec["power"],
        "accuracy": best["accuracy"],
        "other_warmup": [
            {"warmup_epochs": r["spec"]["warmup_epochs"], "accuracy": r["accuracy"]} for r in other_warmup
        ],
        **off,
        "chosen": best_run(tuned)["spec"],
    }


def _steps_text(steps: Sequence[int | None]) -> str:
    reached = [s for s in steps if s is not None]
    if not steps:
        return "-"
    if len(reached) < len(steps):
        return f"{len(reached)}/{len(steps)} reached" if reached else "not reached"
    return f"{statistics.fmean(reached):,.0f}"


def _table(rows: list[dict[str, Any]], reach: str) -> list[str]:
    """The results table's lines: one per pair's row."""
    lines = [
        "| batch | ImageNet-eq. | optimizer | epochs | steps | peak lr | warmup (epochs) "
        f"| label smoothing, decay | test acc. (mean ± std, seeds) | vs baseline (± s.e.) "
        f"| steps to {reach} | fewer steps than baseline |",
        "|---:|---:|---|---:|---:|---:|---:|---|---|---:|---:|---:|",
    ]
    for r in rows:
        delta = (
            "-"
            if r["delta_vs_baseline"] is None
            else _shown(100 * r["delta_vs_baseline"], r.get("delta_vs_baseline_se"))
        )
        div = f", {r['diverged']} diverged" if r["diverged"] else ""
        lines.append(
            f"| {r['batch']:,} | {r['imagenet_batch']:,} | {r['optimizer']} | {r['epochs']} | "
            f"{r['steps']:,} | {r['lr']:g}{' (edge)' if r['lr_on_grid_edge'] else ''} | "
            f"{rounded(r['warmup_epochs'])} | {r['label_smoothing']:g}, poly {r['power']:g} | "
            f"{_mean_std(r)} ({r['seeds']}{div}) "
            f"| {delta} | {_steps_text(r['steps_to_target'])} | "
            f"{'-' if r['fewer_steps'] is None else format(r['fewer_steps'], '.1f') + 'x'} |"
        )
    return lines


def study_markdown(summary: dict[str, Any]) -> str:
    """The results table (and, for a full study, the tuning grids) as Markdown."""
    target = summary["target"]
    reach = f"{target:.1%}" if target is not None else "target"
    lines = _table(summary["rows"], reach)
    if "fast_rows" in summary:
        val = summary["validation_target"]
        lines += [
            "",
            f"Tuned for time to accuracy: each pair's tuning run that reached "
            f"{'the validation target' if val is None else format(val, '.1%')} on "
            "validation in the fewest steps (the baseline's best validation accuracy "
            "minus one point), run again on the test set:",
            "",
            *_table(summary["fast_rows"], reach),
        ]
    if any(r["lr_on_grid_edge"] for r in (*summary["rows"], *summary.get("fast_rows", []))):
        lines += ["", "(edge): the best lr lies on the edge of the tuned grid, after it grew."]
    if summary["grids"]:
        lines += [
            "",
            "Tuning (validation accuracy, %; best of each pair in bold; "
            "`div` marks a run whose loss turned non-finite):",
            "",
        ]
        for g in summary["grids"]:
            lrs = sorted({run["lr"] for run in g["runs"]})
            warmups = sorted({run["warmup_epochs"] for run in g["runs"]})
            best = best_run({"accuracy": run["accuracy"], "spec": run} for run in g["runs"])["spec"]
            cell = {(run["lr"], run["warmup_epochs"]): run for run in g["runs"]}
            lines.append(
                f"B={g['batch']:,} {g['optimizer']}: "
                + "; ".join(
                    f"warmup {rounded(w)}: "
                    + ", ".join(_grid_cell(cell.get((lr, w)), lr, cell.get((lr, w)) is best) for lr in lrs)
                    for w in warmups
                )
            )
            lines.append("")
    if summary.get("techniques"):
        lines += [
            "",
            "Techniques switched off one at a time at each pair's best grid point "
            "(validation accuracy, %, seed 0; the final runs use the best of the row):",
            "",
            "| batch | optimizer | best grid point | all on | other warmup "
            "| no label smoothing | poly power 1 | chosen |",
            "|---:|---|---|---:|---|---:|---:|---|",
        ]
        for t in summary["techniques"]:
            other = (
                ", ".join(
                    f"{100 * o['accuracy']:.2f} ({rounded(o['warmup_epochs'])} ep.)"
                    for o in t["other_warmup"]
                )
                or "-"
            )
            chosen = t["chosen"]
            lines.append(
                f"| {t['batch']:,} | {t['optimizer']} | lr {t['lr']:g}, warmup "
                f"{rounded(t['warmup_epochs'])} | {100 * t['accuracy']:.2f} | {other} | "
                f"{_pct(t.get('no_label_smoothing'))} | {_pct(t.get('power_1'))} | "
                f"ls {chosen['label_smoothing']:g}, poly {chosen['power']:g}, warmup "
                f"{rounded(chosen['warmup_epochs'])} |"
            )
    if summary.get("runs"):
        lines += [
            "",
            f"Run time: {summary['runs']} runs, {summary['run_seconds'] / 3600:.1f} h "
            "of training, each run's wall time summed (runs side by side share the "
            "machine: divide by the jobs at a time for the folder's wall time).",
        ]
    return "\n".join(lines).rstrip() + "\n"


def compare_markdown(summaries: Sequence[dict[str, Any]]) -> str:
    """Studies of several models side by side (:func:`summarize`'s output, one per model):
    at each large batch, the baseline, tuned SGD, LARS and LAMB on test, the best of
    LARS/LAMB against the baseline and its tolerance (:data:`TOLERANCES`), LARS and LAMB
    against SGD with the standard error of the difference of the means, and the most
    times fewer steps to the target any optimizer takes than the baseline when each pair is
    tuned for it (a study run with ``--time-to-accuracy``); then each study's run time."""
    lines = [
        "| model | batch (ImageNet-eq.) | baseline | sgd | lars | lamb "
        "| best of lars/lamb vs baseline | lars vs sgd | lamb vs sgd "
        "| fewer steps than baseline, tuned for speed |",
        "|---|---:|---|---|---|---|---|---:|---:|---:|",
    ]
    for summary in summaries:
        rows = {(r["batch"], r["optimizer"]): r for r in summary["rows"]}
        base = rows.get(BASELINE)
        for batch in sorted({b for b, _ in rows} - {BASELINE[0]}):
            sgd, lars, lamb = (rows.get((batch, o)) for o in ("sgd", "lars", "lamb"))
            fast = [
                r
                for r in summary.get("fast_rows", [])
                if r["batch"] == batch and r["fewer_steps"] is not None
            ]
            fastest = max(fast, key=lambda r: r["fewer_steps"], default=None)
            speed = "-" if fastest is None else (f"{fastest['fewer_steps']:.1f}x ({fastest['optimizer']})")
            lines.append(
                f"| {summary['model']} | {batch:,} ({imagenet_equivalent(batch, summary['n_train']):,}) "
                f"| {_cell(base)} | {_cell(sgd)} | {_cell(lars)} | {_cell(lamb)} "
                f"| {_against_baseline([r for r in (lars, lamb) if r], base, TOLERANCES.get(batch))} "
                f"| {_difference(lars, sgd)} | {_difference(lamb, sgd)} "
                f"| {speed} |"
            )
    lines += ["", "| model | runs | hours of training (each run's wall time, summed) |", "|---|---:|---:|"]
    lines += [f"| {s['model']} | {s['runs']} | {s['run_seconds'] / 3600:.1f} |" for s in summaries]
    return "\n".join(lines) + "\n"


def _cell(row: dict[str, Any] | None) -> str:
    return "-" if row is None else _mean_std(row)


def _standard_error(row: dict[str, Any], other: dict[str, Any]) -> float | None:
    """The standard error of ``row``'s mean minus ``other``'s, from each row's seeds
    (independent runs: ``sqrt(s1^2 / n1 + s2^2 / n2)``); None where a row has one seed,
    which has no spread to go by."""
    if min(row["seeds"], other["seeds"]) < 2:
        return None
    return math.sqrt(row["accuracy_std"] ** 2 / row["seeds"] + other["accuracy_std"] ** 2 / other["seeds"])


def _difference(row: dict[str, Any] | None, other: dict[str, Any] | None) -> str:
    """``row``'s mean minus ``other``'s (of the means as shown), ± the standard error of that
    difference (:func:`_standard_error`, where both rows have two seeds or more)."""
    if row is None or other is None:
        return "-"
    return _shown(_points(row, other), _standard_error(row, other))


def _shown(points: float, error: float | None) -> str:
    """A difference in ``points``, ± its standard ``error`` (a fraction) where there is one."""
    return f"{points:+.2f}" if error is None else f"{points:+.2f} ± {100 * error:.2f}"


def _against_baseline(
    rows: list[dict[str, Any]], base: dict[str, Any] | None, tolerance: float | None
) -> str:
    """The best row's difference to ``base`` ± its standard error, and whether it is within
    ``tolerance`` by the one rule of every table: the difference of the means as shown
    (two decimals) at least ``-tolerance``."""
    if not rows or base is None:
        return "-"
    best = max(rows, key=lambda r: r["accuracy_mean"])
    delta = _points(best, base)
    verdict = (
        ""
        if tolerance is None
        else (f", {'within' if delta >= -100 * tolerance - 1e-9 else 'beyond'} {100 * tolerance:.1f}")
    )
    return f"{_difference(best, base)} ({best['optimizer']}{verdict})"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}"


def _mean_std(row: dict[str, Any]) -> str:
    mean = f"{100 * row['accuracy_mean']:.2f}"
    return mean if row["seeds"] == 1 else f"{mean} ± {100 * row['accuracy_std']:.2f}"


def _grid_cell(run: dict[str, Any] | None, lr: float, best: bool) -> str:
    if run is None:
        return f"lr {lr:g} -"
    text = f"{100 * run['accuracy']:.2f}" + (" div" if run["diverged"] else "")
    return f"lr {lr:g} **{text}**" if best else f"lr {lr:g} {text}"


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Draw ``study.png`` (:func:`largebatch.plots.plot_study`) once some pair has
    final runs; a failure is a one-line warning. Returns whether it was written."""
    from largebatch.plots import Plotter, plot_study

    if not summary["rows"]:
        return False  # nothing to draw before the first pair's final runs
    return Plotter("study", path, lambda s, p: plot_study(s, p, BASELINE))(summary)
