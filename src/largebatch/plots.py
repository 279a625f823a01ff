"""The figures of ``largebatch train`` (``plot.png``: a run's metrics per epoch) and
``largebatch study`` (``study.png``: accuracy against batch, and against step), drawn by a
:class:`Plotter`, which turns any failure into a one-line warning, printed once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from largebatch.outputs import figure, plot_or_warn

__all__ = ["Plotter", "plot_history", "plot_steps", "plot_study"]


class Plotter:
    """``plotter(data)`` draws ``draw(data, path)``; a failure (say, matplotlib missing) is a
    warning of ``largebatch COMMAND``, printed once: later calls draw nothing. Returns
    whether the plot was written."""

    def __init__(self, command: str, path: Path, draw: Callable[[Any, Path], object], note: str = "") -> None:
        self.command, self.path, self.draw, self.note = command, path, draw, note
        self.failed = False

    def __call__(self, data: Any) -> bool:
        if not self.failed:
            self.failed = not plot_or_warn(
                self.command, self.path, lambda: self.draw(data, self.path), self.note
            )
        return not self.failed


def _style(
    ax: Any,
    *,
    title: str | None = None,
    xlabel: str | None = None,
    ylabel: str | None = None,
    xlog: float | None = None,
    ylog: float | None = None,
    legend: dict[str, Any] | None = None,
) -> None:
    """Titles, labels, log scales (``xlog``/``ylog``: the base) and a legend (its kwargs)."""
    if xlog is not None:
        ax.set_xscale("log", base=xlog)
    if ylog is not None:
        ax.set_yscale("log", base=ylog)
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if title is not None:
        ax.set_title(title)
    if legend is not None:
        ax.legend(**legend)


# --------------------------------------------------------------------------- train

_PANELS = [
    ("test accuracy", ["test_accuracy"]),
    ("train loss", ["train_loss"]),
    ("lr (end of epoch)", ["lr"]),
    ("trust ratio", ["trust_ratio_min", "trust_ratio_median", "trust_ratio_max"]),
]


def plot_history(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """``train``'s four panels against the epoch: test accuracy, train loss, lr, and the
    min/median/max trust ratio (log scale), at every sample the rows hold (``trust_ratios``:
    every N steps, at fractional epochs) or else at each epoch's end; a value missing in a
    row is a gap."""
    ep = [h["epoch"] for h in history]
    with figure(path, 2, 2, figsize=(10, 7)) as (fig, axes):
        for ax, (label, keys) in zip(axes.flat, _PANELS):
            trust = label == "trust ratio"
            x, rows = (_samples(history) if trust else None) or (ep, history)
            for key in keys:
                values = [h.get(key) for h in rows]
                if any(v is not None for v in values):
                    ax.plot(
                        x,
                        [float("nan") if v is None else v for v in values],
                        marker="o" if len(x) <= 30 else None,
                        label=key.removeprefix("trust_ratio_"),
                    )
            _style(ax, title=label, xlabel="epoch", ylog=10 if trust else None, legend={} if trust else None)
        fig.suptitle(title)


def _samples(history: list[dict[str, Any]]) -> tuple[list[float], list[dict[str, Any]]] | None:
    """The trust-ratio samples of the rows (their fractional epochs, and the min, median
    and max of each, as rows), or None when the rows hold none."""
    import statistics

    samples = [s for h in history for s in h.get("trust_ratios") or [] if s["ratios"]]
    if not samples:
        return None
    rows = []
    for s in samples:
        values = list(s["ratios"].values())
        rows.append(
            {
                "trust_ratio_min": min(values),
                "trust_ratio_median": statistics.median(values),
                "trust_ratio_max": max(values),
            }
        )
    return [s["epoch"] for s in samples], rows


# --------------------------------------------------------------------------- study

_STYLES = {"sgd": "-", "nesterov": ":", "lars": "--", "lamb": "-."}


def plot_study(summary: dict[str, Any], path: Path, baseline: tuple[int, str]) -> None:
    """The study's two panels: mean ± std test accuracy against the ImageNet-equivalent
    batch, one line per optimizer (``baseline``, ``(batch, optimizer)``, dashed across);
    and seed 0's test accuracy against the step, one line per row."""
    with figure(path, 1, 2, figsize=(12, 4.5)) as (_, (left, right)):
        rows = summary["rows"]
        for optimizer in dict.fromkeys(r["optimizer"] for r in rows):
            mine = [r for r in rows if r["optimizer"] == optimizer]
            left.errorbar(
                [r["imagenet_batch"] for r in mine],
                [100 * r["accuracy_mean"] for r in mine],
                yerr=[100 * r["accuracy_std"] for r in mine],
                marker="o",
                capsize=3,
                label=optimizer,
            )
        base = next((r for r in rows if (r["batch"], r["optimizer"]) == baseline), None)
        if base is not None:
            left.axhline(
                100 * base["accuracy_mean"], color="gray", linestyle="--", label=f"baseline B={baseline[0]}"
            )
        _style(
            left,
            xlog=2,
            xlabel="ImageNet-equivalent batch",
            ylabel="test accuracy (%)",
            title=f"{summary['model']} on Fashion-MNIST, {rows[0]['epochs'] if rows else '?'} epochs",
            legend={},
        )
        for r in rows:
            curve = r["curves"][0]
            right.plot(
                [c["step"] for c in curve],
                [100 * c["accuracy"] for c in curve],
                linestyle=_STYLES.get(r["optimizer"], "-"),
                label=f"B={r['batch']} {r['optimizer']}",
            )
        _style(
            right,
            xlog=10,
            xlabel="step",
            ylabel="test accuracy (%), seed 0",
            legend={"fontsize": 7, "ncol": 2},
        )


# --------------------------------------------------------------------------- steps study


def plot_steps(summary: dict[str, Any], path: Path) -> None:
    """The steps-to-target study's two panels, log-log against the batch, one line per
    optimizer: the median over seeds of the steps to the target (bars: the seeds' range;
    a point no seed reached is left out), with each optimizer's fit of S(B) and the line of
    perfect scaling through the smallest batch's best; and the images to the target
    (steps times batch), where perfect scaling is flat."""
    import math

    points = summary["points"]
    with figure(path, 1, 2, figsize=(12, 4.5)) as (_, (left, right)):
        low = math.inf
        for optimizer in dict.fromkeys(p["optimizer"] for p in points):
            mine = [
                p
                for p in points
                if p["optimizer"] == optimizer and math.isfinite(p.get("steps_median", math.inf))
            ]
            if not mine:
                continue
            b = [p["batch"] for p in mine]
            med = [p["steps_median"] for p in mine]
            lo = [m - min(p["seed_steps"]) for m, p in zip(med, mine)]
            hi = [max(x for x in p["seed_steps"] if math.isfinite(x)) - m for m, p in zip(med, mine)]
            line = left.errorbar(b, med, yerr=[lo, hi], marker="o", capsize=3, label=optimizer)
            right.plot(
                b, [m * x for m, x in zip(med, b)], marker="o", label=optimizer, color=line[0].get_color()
            )
            low = min(low, med[0] * b[0])
            fit = summary["critical_batch"].get(optimizer)
            if fit is not None:
                grid = [b[0] * (b[-1] / b[0]) ** (i / 50) for i in range(51)]
                curve = [fit["s_min"] * (1 + fit["b_noise"] / x) for x in grid]
                left.plot(grid, curve, color=line[0].get_color(), alpha=0.4)
                right.plot(grid, [c * x for c, x in zip(curve, grid)], color=line[0].get_color(), alpha=0.4)
        if math.isfinite(low):
            batches = sorted({p["batch"] for p in points})
            left.plot(
                batches, [low / x for x in batches], color="gray", linestyle="--", label="perfect scaling"
            )
            right.axhline(low, color="gray", linestyle="--", label="perfect scaling")
        goal = summary["target"]
        title = f"validation target {goal:.3f}" if goal is not None else "steps to target"
        _style(left, title=title, xlabel="batch", ylabel="steps to target", xlog=2, ylog=10, legend={})
        _style(right, title="images to target", xlabel="batch", ylabel="images", xlog=2, ylog=10, legend={})
