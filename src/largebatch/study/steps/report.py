"""The report of the steps-to-target study, from its finished runs alone:
:func:`summarize` (every number, as JSON values), :func:`markdown` (the tables) and
:func:`plot` (steps to target against batch, log-log). ``largebatch steps --report``
rewrites all three from ``runs.jsonl``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from largebatch.study.steps.fits import critical_batch, critical_ratio, paired_interval, steps_ratio
from largebatch.study.steps.plan import (
    SPACES,
    StepsConfig,
    TrialSpec,
    budget_steps,
    comparisons,
    final_accuracies,
    final_pick,
    lr_dimension,
    plan,
    point_pick,
    point_trials,
    seed_runs,
    steps_to,
    target,
    train_images,
)

__all__ = ["compare", "headline", "markdown", "plot", "readings", "summarize"]

# The optimizers as the prose names them, and the pairs the study compares: each of
# LARS and LAMB against its control (Nado et al. 2021), and the two against each other.
NAMES = {"nesterov": "Nesterov", "adamw": "AdamW", "lars": "LARS", "lamb": "LAMB"}
PAIRS = (("lars", "nesterov"), ("lamb", "adamw"))

# ImageNet's 1.28M training images over the tuning split's 50,000: a batch's share of an
# epoch, as a label only (the study claims nothing about ImageNet).
IMAGENET_FACTOR = 1_281_167 / 50_000


def _positions(spec: TrialSpec, lowest: int, highest: int) -> dict[str, float]:
    """Where each of the pick's values lies in the space searched, 0 to 1 (the lr's: in
    the union of the ranges its point searched, shifts ``lowest`` to ``highest``)."""
    low = lr_dimension(spec.optimizer, spec.batch, lowest)
    high = lr_dimension(spec.optimizer, spec.batch, highest)
    out = {"lr": math.log(spec.lr / low.low) / math.log(high.high / low.low)}
    out.update({d.name: d.position(getattr(spec, d.name)) for d in SPACES[spec.optimizer]})
    return out


def _point(
    cfg: StepsConfig, results: dict[str, dict[str, Any]], batch: int, optimizer: str
) -> dict[str, Any]:
    goal = target(cfg, results)
    specs, done = point_trials(cfg, results, batch, optimizer)
    finished = [s for s in specs if s.key in results]
    row: dict[str, Any] = {
        "batch": batch,
        "optimizer": optimizer,
        "imagenet_batch": round(batch * IMAGENET_FACTOR),
        "trials": len(finished),
        "search_done": done,
        "budget_steps": budget_steps(cfg, batch),
    }
    if goal is not None:
        row["reached"] = sum(steps_to(results[s.key], goal) is not None for s in finished)
    picked = point_pick(cfg, results, batch, optimizer)
    # no pick where no trial reached the target: its final runs take its most accurate
    chosen = picked if picked is not None else final_pick(cfg, results, batch, optimizer)
    if chosen is not None:
        shifts = [s.shift for s in specs]
        row["pick" if picked is not None else "final_pick"] = {
            "index": chosen.index,
            **chosen.hyperparameters(),
        }
        row["lr_range"] = [
            lr_dimension(optimizer, batch, min(shifts)).low,
            lr_dimension(optimizer, batch, max(shifts)).high,
        ]
        row["positions"] = {k: round(v, 3) for k, v in _positions(chosen, min(shifts), max(shifts)).items()}
    seeds = seed_runs(cfg, results, batch, optimizer)
    if seeds and all(s.key in results for s in seeds):
        steps = [results[s.key]["steps_to_target"] for s in seeds]
        row["seed_steps"] = [math.inf if n is None else n for n in steps]
        row["steps_median"] = statistics.median(row["seed_steps"])
    acc = final_accuracies(cfg, results, batch, optimizer)
    if acc:
        row["final_accuracy"] = acc
        row["final_mean"] = sum(acc) / len(acc)
    mine = [r for r in results.values() if (r["spec"]["batch"], r["spec"]["optimizer"]) == (batch, optimizer)]
    row["devices"] = sorted({r.get("device", "cpu") for r in mine})  # the machines its runs came from
    return row


def summarize(cfg: StepsConfig, results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every number of the report, from the finished runs: each point's search, pick and
    steps to target; each optimizer's critical batch; the final accuracies and the paired
    comparisons."""
    points = [_point(cfg, results, b, o) for b, o in cfg.points()]
    by_point = {(p["batch"], p["optimizer"]): p for p in points}
    pending = {(s.batch, s.optimizer) for s in plan(cfg, results)}
    for p in points:  # nothing left to run: no pick, or its seeds and finals done
        p["finished"] = (p["batch"], p["optimizer"]) not in pending and bool(
            p["search_done"] and ("pick" not in p or ("seed_steps" in p and "final_accuracy" in p))
        )
    fits, seeded, no_fit = {}, {}, {}
    for optimizer in cfg.optimizers:
        mine = [p for p in points if p["optimizer"] == optimizer and "seed_steps" in p]
        reached = [p["batch"] for p in mine if math.isfinite(p["steps_median"])]
        if len(reached) >= 3:
            seeded[optimizer] = {p["batch"]: p["seed_steps"] for p in mine}
            fit = critical_batch([p["batch"] for p in mine], [p["seed_steps"] for p in mine])
            fits[optimizer] = fit._asdict()
        elif all(p["finished"] for p in points if p["optimizer"] == optimizer):
            no_fit[optimizer] = reached  # finished, short of the three batches a fit needs
    ratios, per_batch = [], []
    for a, b in PAIRS:
        for batch in cfg.batches:
            pa, pb = by_point.get((batch, a)), by_point.get((batch, b))
            if pa and pb and "seed_steps" in pa and "seed_steps" in pb:
                r = steps_ratio(pa["seed_steps"], pb["seed_steps"])
                row = {"batch": batch, "optimizer": a, "against": b, **r._asdict()}
                per_batch.append(row | _censored(pa, pb))
        if a in seeded and b in seeded:
            common = sorted(set(seeded[a]) & set(seeded[b]))
            ratio = critical_ratio(common, [seeded[a][x] for x in common], [seeded[b][x] for x in common])
            ratios.append({"optimizer": a, "against": b, **ratio._asdict()})
    compared = []
    for point, reference, threshold in comparisons(cfg):
        a = by_point[point].get("final_accuracy", [])
        b = by_point[reference].get("final_accuracy", [])
        n = min(len(a), len(b))
        if n >= 2:
            interval = paired_interval(a[:n], b[:n])
            compared.append(
                {
                    "point": list(point),
                    "reference": list(reference),
                    "threshold": threshold,
                    **interval._asdict(),
                    "crosses": interval.crosses(threshold),
                }
            )
    return {
        "settings": cfg.settings(),
        "target": target(cfg, results),
        "runs": len(results),
        "final_images": train_images(cfg.subset, "final"),
        "points": points,
        "critical_batch": fits,
        "no_fit": no_fit,
        "critical_ratios": ratios,
        "steps_ratios": per_batch,
        "comparisons": compared,
    }


def _censored(pa: dict[str, Any], pb: dict[str, Any]) -> dict[str, Any]:
    """Where one median seed did not reach the target, its steps are only known to be
    more than its budget (its seeds stop there), so the ratio of the medians is a bound:
    ``{"side": "<", "bound": a / budget}`` (the second's median not reached) or
    ``{"side": ">", "bound": budget / b}``; empty where both are known (or neither)."""
    a, b = pa["steps_median"], pb["steps_median"]
    if math.isfinite(a) and not math.isfinite(b):
        return {"side": "<", "bound": a / pb["budget_steps"]}
    if math.isfinite(b) and not math.isfinite(a):
        return {"side": ">", "bound": pa["budget_steps"] / b}
    return {}


def _ratio_cell(r: dict[str, Any]) -> str:
    """The ratio of the medians with its interval; a bound where a median is censored."""
    return _ratio_interval(r, f"{r['side']} {_off(r['bound'], 1.0)}" if "side" in r else None)


def _steps_cell(p: dict[str, Any]) -> str:
    if "seed_steps" not in p:
        return "not reached" if p.get("search_done") and "pick" not in p else "…"
    steps = p["seed_steps"]
    finite = [s for s in steps if math.isfinite(s)]
    if not math.isfinite(p["steps_median"]):
        return f"> {p['budget_steps']} ({len(finite)}/{len(steps)})"
    if len(finite) == len(steps):
        return f"{p['steps_median']:g} [{min(finite):g}-{max(finite):g}]"
    # a seed that ran out its budget took more steps than it: the range's top is a bound
    return f"{p['steps_median']:g} [{min(finite):g} to > {p['budget_steps']}] ({len(finite)}/{len(steps)})"


def _gpu_mark(p: dict[str, Any]) -> str:
    """ "†" where some of the point's runs ran on a GPU."""
    return "†" if any(d != "cpu" for d in p["devices"]) else ""


def _gpu_note(summary: dict[str, Any]) -> list[str]:
    """The lines that say what "†" means, naming the GPUs (none where every run was the CPU's)."""
    gpus = sorted({d for p in summary["points"] for d in p["devices"] if d != "cpu"})
    if not gpus:
        return []
    return ["", f"† some of the point's runs ran on a GPU ({', '.join(gpus)}); the others on the CPU."]


def markdown(summary: dict[str, Any]) -> str:
    """The report's tables: steps to target, critical batches, final accuracy and the
    paired comparisons, the picks."""
    s = summary["settings"]
    optimizers = s["optimizers"]
    by_point = {(p["batch"], p["optimizer"]): p for p in summary["points"]}
    goal = summary["target"]
    lines = [
        f"# Steps to a validation target against batch size: {s['model']}",
        "",
        f"{summary['runs']} runs. Target: validation accuracy "
        + (f"{goal:.3f}" if goal is not None else "(set when the smallest batch's search ends)")
        + f"; {s['trials']} Sobol trials a point; ghost batch norm over {s['ghost_batch']} images; "
        f"random crop (padding {s['augment']}) and flip.",
        "",
        "## In brief",
        "",
        headline(summary).rstrip("\n"),
    ]
    if summary["critical_batch"]:
        fitted = list(summary["critical_batch"])
        lines += [
            "",
            "## Each batch as a multiple of each optimizer's critical batch (B / B_crit)",
            "",
            "| batch | " + " | ".join(fitted) + " |",
            "|---:|" + "---:|" * len(fitted),
        ]
        for b in s["batches"]:
            ratios = [f"{b / summary['critical_batch'][o]['b_noise']:.2g}" for o in fitted]
            lines.append(f"| {b:,} | " + " | ".join(ratios) + " |")
    lines += [
        "",
        f"## Final test accuracy, {s['final_epochs']} epochs (mean over seeds)",
        "",
        "| batch | " + " | ".join(optimizers) + " |",
        "|---:|" + "---:|" * len(optimizers),
    ]
    for b in s["batches"]:
        cells = []
        for o in optimizers:
            p = by_point[b, o]
            n = len(p.get("final_accuracy", []))
            cells.append(f"{100 * p['final_mean']:.2f} (n={n}){_gpu_mark(p)}" if n else "…")
        lines.append(f"| {b:,} | " + " | ".join(cells) + " |")
    lines += _gpu_note(summary)
    if summary["comparisons"]:
        lines += [
            "",
            "## Paired differences of final accuracy (points, 95% t interval; seeds shared)",
            "",
            "| batch, optimizer | against | difference | 95% interval | n | threshold | settled |",
            "|---|---|---:|---:|---:|---:|---|",
        ]
        for c in summary["comparisons"]:
            (b, o), (rb, ro) = c["point"], c["reference"]
            lines.append(
                f"| {b:,} {o} | {rb:,} {ro} | {_points(c, 'mean')} | {_points(c, 'low')} to "
                f"{_points(c, 'high')} | {c['n']} | {100 * c['threshold']:+.1f} | "
                f"{'no' if c['crosses'] else 'yes'} |"
            )
    lines += [
        "",
        "## The picks (position of each value in its range, 0 to 1; * in its outer sixteenth)",
        "",
    ]
    lines += ["| batch | optimizer | trials | reached | pick | positions |", "|---:|---|---:|---:|---|---|"]
    for p in summary["points"]:
        chosen = p.get("pick") or p.get("final_pick")
        if chosen:
            hp = ", ".join(f"{k} {v:.3g}" for k, v in chosen.items() if k != "index")
            edge = 1 / s["trials"]
            pos = ", ".join(
                f"{k} {v:.2f}" + ("*" if v < edge or v > 1 - edge else "") for k, v in p["positions"].items()
            )
            none = "" if "pick" in p else "none reached the target; the final runs take the most accurate, "
            lines.append(
                f"| {p['batch']:,} | {p['optimizer']} | {p['trials']} | {p.get('reached', '-')} | "
                f"{none}#{chosen['index']}: {hp} | {pos} |"
            )
    return "\n".join(lines) + "\n"


def _off(v: float, line: float, sign: str = "") -> str:
    """``v`` to two decimals, or to more (up to six) where two would print ``line`` and
    ``v`` is not on it: a bound that settles a reading never reads as the line it clears."""
    for digits in range(2, 7):
        text = f"{v:{sign}.{digits}f}"
        if v == line or float(text) != line:
            break
    return text


def _interval(mean: float, low: float, high: float, fmt: str = ".2f") -> str:
    return f"{mean:{fmt}} ({low:{fmt}}-{high:{fmt}})"


def _ratio_interval(r: dict[str, Any], shown: str | None = None) -> str:
    """A ratio (or ``shown`` in its place) with its interval, each off the line of 1."""
    shown = _off(r["mean"], 1.0) if shown is None else shown
    return f"{shown} ({_off(r['low'], 1.0)}-{_off(r['high'], 1.0)})"


def _no_fit(summary: dict[str, Any], optimizer: str) -> str:
    """Why a finished optimizer has no critical batch: the batches where its median seed
    reached the target, fewer than the three a fit needs."""
    batches = summary["no_fit"][optimizer]
    where = f" ({_in_words([f'{b:,}' for b in batches])})" if batches else ""
    return (
        f"{NAMES[optimizer]}'s median seed reaches the target at "
        f"{len(batches)} batch{'' if len(batches) == 1 else 'es'}{where}, where a fit needs 3"
    )


def _b_crit(fit: dict[str, Any]) -> str:
    return _interval(fit["b_noise"], fit["b_noise_low"], fit["b_noise_high"], ",.0f")


def _points(c: dict[str, Any], key: str) -> str:
    """A paired difference's ``key`` (mean, low, high) in points, off its threshold."""
    return _off(100 * c[key], 100 * c["threshold"], "+")


def _points_interval(c: dict[str, Any]) -> str:
    return f"{_points(c, 'mean')} ({_points(c, 'low')} to {_points(c, 'high')}), n={c['n']}"


def _status(summary: dict[str, Any]) -> str:
    points = summary["points"]
    if all(p["finished"] for p in points):
        return f"complete, {summary['runs']} runs"
    batches = [
        b for b in summary["settings"]["batches"] if all(p["finished"] for p in points if p["batch"] == b)
    ]
    return (
        f"running, {summary['runs']} runs so far; "
        + (f"finished at B = {', '.join(f'{b:,}' for b in batches)}" if batches else "no batch finished")
        + ": the critical batches and every interval will move"
    )


def _in_words(items: Sequence[str]) -> str:
    """``A``, ``A and B``, ``A, B and C``: a list as a sentence names it."""
    return " and ".join(filter(None, (", ".join(items[:-1]), items[-1])))


def _no_pick(by_point: dict[tuple[int, str], dict[str, Any]], batch: int, optimizers: Sequence[str]) -> str:
    """What a cell that compares the steps of ``optimizers`` at ``batch`` shows when it has
    no number: which of them reached no target in its search, or "…" (still running). A
    final-accuracy cell without a number is always "…": a point whose search reached no
    target still has final runs, of its most accurate trial."""
    missed = [
        NAMES[o] for o in optimizers if by_point[batch, o]["finished"] and "pick" not in by_point[batch, o]
    ]
    return _in_words(missed) + " not reached" if missed else "…"


def _grouped(
    verdicts: Sequence[tuple[int, str, tuple[str, float] | None]],
    fits: Sequence[dict[str, Any]],
    unit: str,
) -> str:
    """``"more at B = 64, 256 (1.22x to 1.44x; 0.04-0.29 B_crit); not resolved at ..."``:
    each verdict with the batches it holds at, in the order of the first batch of each,
    the lowest and highest of their values (``unit`` ``"x"``: a ratio; ``"points"``: a
    difference of accuracies, shown in points), and those batches over the critical
    batches in ``fits``."""
    order: dict[str, list[tuple[int, tuple[str, float] | None]]] = {}
    for batch, verdict, value in verdicts:
        order.setdefault("running" if verdict == "…" else verdict, []).append((batch, value))
    parts = []
    for verdict, held in order.items():
        # a value is ("", number), or ("< ", bound) for a ratio whose median is censored
        values = sorted((v for _, v in held if v is not None), key=lambda x: x[1])
        shown = [
            f"{side}{v:.2f}x" if unit == "x" else f"{100 * v:+.2f}" for side, v in values[:1] + values[-1:]
        ]
        notes = [" to ".join(dict.fromkeys(shown)) + ("" if unit == "x" else " points")] if values else []
        scale = sorted({f"{b / f['b_noise']:.2g}" for b, _ in held for f in fits}, key=float)
        notes += [f"{'-'.join(dict.fromkeys((scale[0], scale[-1])))} B_crit"] if scale else []
        batches = ", ".join(f"{b:,}" for b, _ in held)
        parts.append(f"{verdict} at B = {batches}" + (f" ({'; '.join(notes)})" if notes else ""))
    return "; ".join(parts)


def _side(low: float, high: float, line: float, below: str, above: str) -> str:
    return below if high < line else above if low > line else "not resolved"


def _verdict(
    interval: dict[str, Any] | None, line: float, words: tuple[str, str], missing: str
) -> tuple[str, tuple[str, float] | None]:
    if interval is None:
        return missing, None
    side = _side(interval["low"], interval["high"], line, *words)
    if "side" in interval:  # a censored ratio: its bound
        return side, (f"{interval['side']} ", interval["bound"])
    return side, ("", interval["mean"])


def readings(summary: dict[str, Any]) -> list[str]:
    """What the intervals settle, one line each, from the numbers alone: at which
    batches (also as B / B_crit) LARS and LAMB need fewer or more steps than their
    controls (the ratio's interval below or above 1), whether their critical batches lie
    beyond their controls', where their final accuracy is higher or lower, and at which
    batches each optimizer stays within the threshold of its smallest-batch accuracy."""
    s = summary["settings"]
    optimizers = s["optimizers"]
    by_point = {(p["batch"], p["optimizer"]): p for p in summary["points"]}
    ratios = {(r["batch"], r["optimizer"]): r for r in summary["steps_ratios"]}
    compared = {(tuple(c["point"]), tuple(c["reference"])): c for c in summary["comparisons"]}
    critical = {(r["optimizer"], r["against"]): r for r in summary["critical_ratios"]}
    fits = summary["critical_batch"]
    out = []
    for a, b in [(a, b) for a, b in PAIRS if a in optimizers and b in optimizers]:
        steps, final = [], []
        for batch in s["batches"]:
            missing = _no_pick(by_point, batch, (a, b))
            steps.append((batch, *_verdict(ratios.get((batch, a)), 1.0, ("fewer", "more"), missing)))
            c = compared.get(((batch, a), (batch, b)))
            final.append((batch, *_verdict(c, 0.0, ("lower", "higher"), "…")))
        mine = [fits[o] for o in (a, b) if o in fits]
        text = (
            f"**{NAMES[a]} against {NAMES[b]}.** Steps to the target, {NAMES[a]}'s over {NAMES[b]}'s: "
            f"{_grouped(steps, mine, 'x')}."
        )
        r = critical.get((a, b))
        unfitted = [o for o in (b, a) if o in summary.get("no_fit", {})]
        if unfitted:
            text += f" Critical batch: no fit; {'; '.join(_no_fit(summary, o) for o in unfitted)}."
        if r:
            text += (
                f" Critical batch: {_ratio_interval(r)} times {NAMES[b]}'s, "
                + {
                    "fewer": "below 1: perfect scaling ends at smaller batches.",
                    "more": "above 1: perfect scaling reaches larger batches.",
                    "not resolved": "an interval that holds 1.",
                }[_side(r["low"], r["high"], 1.0, "fewer", "more")]
            )
        out.append(
            text + f" Final accuracy, {NAMES[a]}'s less {NAMES[b]}'s: {_grouped(final, mine, 'points')}."
        )
    smallest, line = s["batches"][0], -s["threshold"]
    for o in optimizers:
        within = []
        for batch in s["batches"][1:]:
            c = compared.get(((batch, o), (smallest, o)))
            within.append((batch, *_verdict(c, line, ("below", "within"), "…")))
        own = [fits[o]] if o in fits else []
        out.append(
            f"**{NAMES[o]} against itself at B = {smallest}**, final accuracy within "
            f"{100 * s['threshold']:.1f} points: {_grouped(within, own, 'points')}."
        )
    return out


def headline(summary: dict[str, Any]) -> str:
    """The study in brief, as docs/study.md quotes it: steps to target at each batch with
    B / B_crit and LARS's and LAMB's steps over their controls', the critical batches and
    their ratios, and the paired differences of final accuracy, every one with its 95%
    interval."""
    s = summary["settings"]
    optimizers = s["optimizers"]
    by_point = {(p["batch"], p["optimizer"]): p for p in summary["points"]}
    fits = summary["critical_batch"]
    goal = summary["target"]
    ratios = {(r["batch"], r["optimizer"]): r for r in summary["steps_ratios"]}
    pairs = [(a, b) for a, b in PAIRS if a in optimizers and b in optimizers]
    lines = [
        f"**{s['model']}: {_status(summary)}.** Target: validation accuracy "
        + (f"{100 * goal:.1f}%" if goal is not None else "(set when the smallest batch's search ends)")
        + f". Steps to it: the median of {s['seeds']} seeds of each point's pick [their range]; "
        '"(k/n)": k of its n seeds reached the target within the budget, the others count as more '
        'steps than the budget ("> budget"); '
        "B / B_crit: the batch over the critical batch of each optimizer with a fit (lowest-highest); "
        "a ratio of steps below 1: the first optimizer needs fewer (95% bootstrap interval); "
        '"< r" (or "> r"): the second\'s (or the first\'s) median seed did not reach the target '
        "within its budget, so the ratio is below (or above) r.",
        "",
        "| batch | ImageNet label | B / B_crit | "
        + " | ".join(NAMES[o] for o in optimizers)
        + "".join(f" | {NAMES[a]} / {NAMES[b]} steps" for a, b in pairs)
        + " |",
        "|---:|---:|---:|" + "---:|" * (len(optimizers) + len(pairs)),
    ]
    for b in s["batches"]:
        scale = sorted(b / f["b_noise"] for f in fits.values())
        cells = [f"{scale[0]:.2g}-{scale[-1]:.2g}" if scale else "…"]
        cells += [_steps_cell(by_point[b, o]) + _gpu_mark(by_point[b, o]) for o in optimizers]
        for a, c in pairs:
            r = ratios.get((b, a))
            cells.append(_ratio_cell(r) if r else _no_pick(by_point, b, (a, c)))
        lines.append(
            f"| {b:,} | {by_point[b, optimizers[0]]['imagenet_batch']:,} | " + " | ".join(cells) + " |"
        )
    lines += _gpu_note(summary)
    lines += ["", "Critical batch, B_noise of S(B) = S_min (1 + B_noise / B) (95% bootstrap interval):", ""]
    if fits:
        lines += ["| | " + " | ".join(NAMES[o] for o in fits) + " |", "|---|" + "---:|" * len(fits)]
        lines.append("| B_crit | " + " | ".join(_b_crit(f) for f in fits.values()) + " |")
        lines.append(
            "| S_min | "
            + " | ".join(_interval(f["s_min"], f["s_min_low"], f["s_min_high"], ".0f") for f in fits.values())
            + " |"
        )
        lines += [""] + [
            f"{NAMES[r['optimizer']]}'s critical batch over {NAMES[r['against']]}'s: "
            f"{_ratio_interval(r)}." + ("" if i == len(summary["critical_ratios"]) - 1 else "  ")
            for i, r in enumerate(summary["critical_ratios"])
        ]
    else:
        lines.append("(needs three batches with their seeds' steps)")
    for o in summary.get("no_fit", {}):
        lines += ["", f"No fit: {_no_fit(summary, o)}."]
    compared = {(tuple(c["point"]), tuple(c["reference"])): c for c in summary["comparisons"]}
    between = [(a, b) for a, b in (*pairs, ("lamb", "lars")) if a in optimizers and b in optimizers]
    lines += [
        "",
        f"Final test accuracy after {s['final_epochs']} epochs: paired differences in points "
        "(95% t interval; seeds shared), between optimizers at each batch:",
        "",
        "| batch | " + " | ".join(f"{NAMES[a]} - {NAMES[b]}" for a, b in between) + " |",
        "|---:|" + "---:|" * len(between),
    ]
    for b in s["batches"]:
        found = [compared.get(((b, a), (b, r))) for a, r in between]
        lines.append(f"| {b:,} | " + " | ".join(_points_interval(c) if c else "…" for c in found) + " |")
    unreached: dict[int, list[str]] = {}
    for p in summary["points"]:
        if "final_pick" in p:
            unreached.setdefault(p["batch"], []).append(NAMES[p["optimizer"]])
    if unreached:
        groups = [f"for {_in_words(unreached[b])} at B = {b:,}" for b in sorted(unreached)]
        lines += [
            "",
            f"No trial reached the target {_in_words(groups)}: the final runs there "
            "take the trial of the search with the best validation accuracy.",
        ]
    smallest = s["batches"][0]
    lines += [
        "",
        f"and each optimizer against itself at B = {smallest} (within {100 * s['threshold']:.1f} points "
        "where the interval lies above the line):",
        "",
        "| batch | " + " | ".join(NAMES[o] for o in optimizers) + " |",
        "|---:|" + "---:|" * len(optimizers),
    ]
    for b in s["batches"][1:]:
        own = [compared.get(((b, o), (smallest, o))) for o in optimizers]
        lines.append(f"| {b:,} | " + " | ".join(_points_interval(c) if c else "…" for c in own) + " |")
    lines += ["", 'What the intervals settle (95%; "not resolved": the interval holds the line):', ""]
    lines += [f"- {text}" for text in readings(summary)]
    return "\n".join(lines) + "\n"


def compare(summaries: list[dict[str, Any]]) -> str:
    """The critical batches of several studies side by side (one model each), with the
    ratios of LARS's and LAMB's over their controls': "no fit" for an optimizer whose
    runs have finished without the three batches a fit needs, "…" for one still running."""
    names = list(NAMES)
    lines = [
        "| model | target | runs | "
        + " | ".join(f"B_crit {NAMES[o]}" for o in names)
        + "".join(f" | {NAMES[a]} / {NAMES[b]}" for a, b in PAIRS)
        + " |",
        "|---|---:|---:|" + "---:|" * (len(names) + len(PAIRS)),
    ]
    for summary in summaries:
        fits = summary["critical_batch"]
        unfitted = summary.get("no_fit", {})
        cells = [_b_crit(fits[o]) if o in fits else "no fit" if o in unfitted else "…" for o in names]
        ratios = {(r["optimizer"], r["against"]): r for r in summary["critical_ratios"]}
        cells += [
            _ratio_interval(r) if (r := ratios.get(pair)) else "no fit" if set(pair) & set(unfitted) else "…"
            for pair in PAIRS
        ]
        goal = summary["target"]
        lines.append(
            f"| {summary['settings']['model']} | {f'{100 * goal:.1f}%' if goal is not None else '…'} | "
            f"{summary['runs']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> bool:
    """Draw the steps to target against batch (:func:`largebatch.plots.plot_steps`) once
    some point has its seeds' steps; a failure is a one-line warning."""
    from largebatch.plots import Plotter, plot_steps

    if not any("seed_steps" in p for p in summary["points"]):
        return False
    return Plotter("steps", path, plot_steps)(summary)
