"""``largebatch steps``: the flags of the steps-to-target study, the
:class:`~largebatch.study.steps.StepsConfig` they ask for, and the run
(:func:`largebatch.study.steps.run_steps_study`), ``--report``, ``--compare`` or ``--quick``
(:func:`largebatch.study.steps.quick.run_quick`)."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path

from largebatch.outputs import CommandError, require
from largebatch.study.run import Stopped
from largebatch.study.steps import (
    BATCHES,
    OPTIMIZERS,
    StepsConfig,
    check_config,
    compare_steps,
    recorded_config,
    run_steps_study,
)
from largebatch.study.steps.plan import MODELS
from largebatch.study.steps.quick import QUICK_FROM, QUICK_LARGEST
from largebatch.study.steps.run import SETTINGS, check_resume

__all__ = ["add_arguments", "config", "main"]

QUICK_OUT = "runs/steps-quick"
# The flags that say what the study runs; the others say where and how.
_SETTINGS = (
    "model",
    "batches",
    "optimizers",
    "trials",
    "extend",
    "search_seed",
    "budget_epochs",
    "budget_batch",
    "eval_images",
    "margin",
    "seeds",
    "max_seeds",
    "final_epochs",
    "threshold",
    "ghost_batch",
    "augment",
    "subset",
)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``largebatch steps`` flags."""
    add = parser.add_argument
    d = StepsConfig()
    add(
        "--report",
        dest="report_only",
        action="store_true",
        help="write the tables and plot of the runs in OUT/runs.jsonl with the settings "
        "recorded in OUT/settings.json; train nothing",
    )
    add(
        "--compare",
        nargs="+",
        default=None,
        metavar="DIR",
        help="print the critical batches of the studies in these folders side by side (one model "
        "each, from their runs); train nothing",
    )
    add(
        "--quick",
        action="store_true",
        help="the quick version (make demo): seed 1 of each pick of the study in --from, to its "
        f"target, at --batches (default the study's up to {QUICK_LARGEST:,}) and --optimizers, "
        "beside the study's steps and readings; takes no other setting",
    )
    add(
        "--from",
        dest="study",
        default=None,
        metavar="DIR",
        help=f"with --quick: the study whose picks run (default {QUICK_FROM}, in a clone of the repository)",
    )
    add(
        "--out",
        default=None,
        metavar="DIR",
        help=f"output folder (default {d.out}; {QUICK_OUT} with --quick); one that holds a study "
        "continues it, with its settings (the settings' defaults below are for a new study)",
    )
    add("--model", default=None, choices=MODELS, help=f"the model (default {d.model})")
    add(
        "--batches",
        type=_ints,
        default=None,
        metavar="B,B",
        help=f"batch sizes, increasing (default {','.join(map(str, BATCHES))})",
    )
    add(
        "--optimizers",
        type=lambda t: tuple(t.split(",")),
        default=None,
        metavar="NAME,NAME",
        help=f"of {','.join(OPTIMIZERS)} (default all)",
    )
    add("--trials", type=int, default=None, help=f"Sobol trials per point and extension (default {d.trials})")
    add(
        "--extend",
        type=int,
        default=None,
        help=(
            "times a point's search may grow by --trials trials: its lr range moved past an"
            " edge that holds its pick (where no trial reached the target: its most accurate"
            f" trial; inside the range, the same range again) (default {d.extend})"
        ),
    )
    add("--search-seed", type=int, default=None, help="the Sobol sequence's scrambling seed (default 0)")
    add(
        "--budget-epochs",
        type=float,
        default=None,
        help="a search trial's epochs at batch B: this x (1 + B / --budget-batch) "
        f"(default {d.budget_epochs:g})",
    )
    add("--budget-batch", type=int, default=None, help=f"see --budget-epochs (default {d.budget_batch})")
    add(
        "--eval-images",
        type=int,
        default=None,
        help=f"score the validation split every this many images (default {d.eval_images:,})",
    )
    add(
        "--margin",
        type=float,
        default=None,
        help=f"the target: the smallest batch's best validation accuracy less this (default {d.margin:g})",
    )
    add("--seeds", type=int, default=None, help=f"seeds of each pick (default {d.seeds})")
    add(
        "--max-seeds",
        type=int,
        default=None,
        help=f"seeds where a paired interval crosses its threshold (default {d.max_seeds})",
    )
    add(
        "--final-epochs",
        type=int,
        default=None,
        help=f"the final runs' fixed epochs (default {d.final_epochs})",
    )
    add(
        "--threshold",
        type=float,
        default=None,
        help=f"'within' for final accuracy against the smallest batch (default {d.threshold:g})",
    )
    add("--ghost-batch", type=int, default=None, help=f"batch norm's images (default {d.ghost_batch})")
    add("--augment", type=int, default=None, help=f"the crop's padding, 0 for none (default {d.augment})")
    add("--subset", type=int, default=None, help="the first N images only (tests)")
    add("--data", default=None, metavar="DIR", help="the Fashion-MNIST .gz files (default: found)")
    add("--jobs", type=int, default=None, help="runs at once (default: one per core; 1 on cuda)")
    add("--threads", type=int, default=None, help="torch threads per run (default: the cores / jobs)")
    add("--device", default="cpu", choices=("cpu", "cuda"), help="where the runs train")


def config(args: argparse.Namespace) -> StepsConfig:
    """The configuration the flags ask for. With ``--report``, or where ``--out`` already
    holds a study (its ``settings.json``), the study's recorded settings with the flags
    given on top, so that ``--out`` alone continues it (a flag that differs is refused
    by :func:`check_resume`). A ValueError for ``--report`` on a folder without a study."""
    environment = {"data": args.data, "jobs": args.jobs, "threads": args.threads, "device": args.device}
    given = {name: getattr(args, name) for name in _SETTINGS if getattr(args, name) is not None}
    out = args.out or StepsConfig.out
    if args.report_only or (Path(out) / SETTINGS).is_file():
        recorded = recorded_config(out, **environment, report_only=args.report_only)
        return dataclasses.replace(recorded, **given)
    return StepsConfig(out=out, **environment, **given)


def quick(args: argparse.Namespace) -> int:
    """``--quick``: the study's picks again (:func:`largebatch.study.steps.quick.run_quick`).
    A setting of the study's own, ``--report`` or ``--compare`` beside it is refused."""
    from largebatch.study.steps.quick import run_quick

    own = [name for name in _SETTINGS if name not in ("batches", "optimizers")]
    given = [f"--{name.replace('_', '-')}" for name in own if getattr(args, name) is not None]
    if args.report_only or args.compare is not None:
        given.insert(0, "--report" if args.report_only else "--compare")
    if given:
        raise CommandError("steps", f"--quick takes its settings from the study in --from, not {given[0]}")
    _check_data(args.data, args.device)
    try:
        run_quick(
            args.study or QUICK_FROM,
            args.out or QUICK_OUT,
            batches=args.batches,
            optimizers=args.optimizers,
            data=args.data,
            jobs=args.jobs,
            threads=args.threads,
            device=args.device,
        )
    except ValueError as err:
        hint = (
            " (run it in a clone of the repository, or name a study with --from DIR)"
            if args.study is None and "holds no steps study" in str(err)
            else ""
        )
        raise CommandError("steps", f"--quick: {err}{hint}") from None
    except Stopped:
        return _stopped(args.out or QUICK_OUT)
    return 0


def _check_data(data: str | None, device: str) -> None:
    """A CommandError for a device this machine lacks or data it cannot find."""
    from largebatch.fashion_mnist import fashion_mnist_dir
    from largebatch.training import check_device

    require("steps", ("torch", "matplotlib"))
    check_device(device, "steps")
    if data is not None and not Path(data).is_dir():
        raise CommandError("steps", f"data directory not found: {data}")
    try:
        fashion_mnist_dir(data)
    except FileNotFoundError as err:
        raise CommandError("steps", str(err)) from None


def _stopped(out: str) -> int:
    print(
        f"largebatch steps: stopped by SIGTERM; the finished runs are in "
        f"{Path(out) / 'runs.jsonl'}, and the same command continues from them",
        file=sys.stderr,
        flush=True,
    )
    return 128 + signal.SIGTERM


def main(args: argparse.Namespace) -> int:
    """Run the study from parsed arguments."""
    if args.quick:
        return quick(args)
    if args.study is not None:
        raise CommandError("steps", "--from goes with --quick")
    if args.compare is not None:
        try:
            print(compare_steps(args.compare), end="")
        except ValueError as err:
            raise CommandError("steps", f"--compare: {err}") from None
        return 0
    try:
        cfg = config(args)
        check_config(cfg)
        if not cfg.report_only:
            check_resume(cfg)
    except ValueError as err:
        raise CommandError("steps", str(err)) from None
    if cfg.report_only:
        require("steps", ("torch", "matplotlib"))
    else:
        _check_data(cfg.data, cfg.device)
    try:
        run_steps_study(cfg)
    except Stopped:
        return _stopped(cfg.out)
    return 0
