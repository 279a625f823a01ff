"""``largebatch study``: the flags, the :class:`~largebatch.study.StudyConfig` they ask for,
and the run (:func:`largebatch.study.run_study`), ``--report`` or ``--compare``."""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path

from largebatch.outputs import CommandError, require
from largebatch.recipes.registry import COMPRESSIONS, FASHION_EPOCHS, TRAIN_IMAGES
from largebatch.study import (
    DEFAULT_BATCHES,
    DEFAULT_OPTIMIZERS,
    EXCHANGE_FIELDS,
    FULL_BATCHES,
    QUICK_PAIRS,
    STUDY_MODELS,
    STUDY_OPTIMIZERS,
    Stopped,
    StudyConfig,
    check_config,
    compare_studies,
    recorded_config,
    run_study,
)

__all__ = ["add_arguments", "config", "main"]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


def _default(values: tuple[float, ...]) -> str:
    return ",".join(f"{v:g}" for v in values)


# The flags that say what the study runs: with --report, those given replace the settings
# recorded in OUT, and the others keep them.
_SETTING_FLAGS = (
    "batches",
    "optimizers",
    "seeds",
    "epochs",
    "small_warmups",
    "large_warmups",
    "label_smoothing",
    "power",
    "ablate",
    "extend",
    "target",
    "subset",
    *EXCHANGE_FIELDS,
    "model",
    "time_to_accuracy",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``largebatch study`` flags."""
    add = parser.add_argument
    cfg = StudyConfig()
    add(
        "--quick",
        action="store_true",
        help="no tuning: one seed of the recipes' settings for "
        + ", ".join(f"{o} at {b}" for b, o in QUICK_PAIRS)
        + " unless --batches or --optimizers say otherwise (make demo)",
    )
    add(
        "--report",
        dest="report_only",
        action="store_true",
        help="write the tables and plot of the runs already in OUT/runs.jsonl, with the "
        "settings recorded in OUT (settings.json, else those the runs show; the flags "
        "given replace them); train nothing",
    )
    add(
        "--compare",
        nargs="+",
        default=None,
        metavar="DIR",
        help="print the studies in these folders side by side, one model per folder (each "
        "summarized from its runs and settings as --report does); train and write "
        "nothing",
    )
    add("--out", default=None, metavar="DIR", help="output folder (default runs/study, or runs/study-quick)")
    add(
        "--batches",
        type=_ints,
        default=None,
        metavar="B,B",
        help=f"batches, of {','.join(map(str, FULL_BATCHES))} "
        f"(default {','.join(map(str, DEFAULT_BATCHES))})",
    )
    add(
        "--optimizers",
        type=lambda t: tuple(t.split(",")),
        default=None,
        metavar="NAME,NAME",
        help=f"of {','.join(STUDY_OPTIMIZERS)} (default {','.join(DEFAULT_OPTIMIZERS)})",
    )
    add("--seeds", type=int, default=None, help="final runs per pair (default 3; quick 1)")
    add(
        "--epochs",
        type=int,
        default=None,
        help=f"epochs per run (default: the recipes', {FASHION_EPOCHS}); as for train, another "
        "number scales each recipe's schedule to it, warmups included",
    )
    add(
        "--small-warmups",
        type=_floats,
        default=None,
        metavar="E,E",
        help=f"warmup epochs tuned at the baseline batch, of a recipe's {FASHION_EPOCHS} "
        f"(scaled with --epochs; default {_default(cfg.small_warmups)})",
    )
    add(
        "--large-warmups",
        type=_floats,
        default=None,
        metavar="E,E",
        help=f"warmup epochs tuned at the large batches, of a recipe's {FASHION_EPOCHS} "
        f"(scaled with --epochs; default {_default(cfg.large_warmups)})",
    )
    add(
        "--label-smoothing",
        type=float,
        default=None,
        help=f"label smoothing of the tuning runs (default {cfg.label_smoothing:g})",
    )
    add(
        "--power",
        type=float,
        default=None,
        help=f"poly decay power of the tuning runs (default {cfg.power:g})",
    )
    add(
        "--no-ablate",
        dest="ablate",
        action="store_const",
        const=False,
        default=None,
        help="skip the runs that switch label smoothing and the poly power off",
    )
    add(
        "--extend",
        type=int,
        default=None,
        help=f"times a tuning grid may grow past an edge holding the best lr (default {cfg.extend})",
    )
    add(
        "--target",
        type=float,
        default=None,
        help="accuracy for the steps-to-target column (default: baseline mean - 0.01, rounded down to 0.001)",
    )
    add("--jobs", type=int, default=None, help="parallel runs (default: one per CPU)")
    add("--threads", type=int, default=None, help="torch threads per run (default CPUs / jobs)")
    add("--device", default="cpu", choices=("cpu", "cuda"))
    add("--data", default=None, metavar="DIR", help="folder with the four Fashion-MNIST files")
    add(
        "--subset",
        type=int,
        default=None,
        metavar="N",
        help="first N train and test images (the ImageNet-equivalent batch stays that of "
        f"the full {TRAIN_IMAGES['fashion-mnist']:,})",
    )
    add(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help="simulate N data-parallel workers in one process: each batch split N ways, "
        "each part with its own batch-norm statistics (default 1: no split)",
    )
    add(
        "--compression",
        default=None,
        choices=COMPRESSIONS,
        help="how the simulated workers exchange gradients: the plain average, or AdaComp "
        "after --compression-warmup epochs uncompressed (default none)",
    )
    add(
        "--compression-warmup",
        type=int,
        default=None,
        metavar="EPOCHS",
        help=f"epochs of plain exchange before AdaComp (default {cfg.compression_warmup})",
    )
    add(
        "--model",
        default=None,
        choices=STUDY_MODELS,
        help="the model every run trains, in place of the recipes' fmnist_cnn: AlexNet-BN "
        "or a ResNet scaled to 28x28 (default fmnist_cnn; one model per --out)",
    )
    add(
        "--time-to-accuracy",
        action="store_true",
        default=None,
        help="also tune each pair for steps to the validation target (MLPerf's time to "
        "accuracy: the lr grid grows past an edge holding the fastest run, as it does "
        "for accuracy), run its fastest run again, and report it in a second table; "
        "not with --quick",
    )
    add(
        "--freeze-variance",
        action="store_true",
        default=None,
        help="LAMB: freeze the second moment when the plain exchange ends, after "
        "--compression-warmup epochs (1-bit LAMB's frozen variance)",
    )


def _out(args: argparse.Namespace) -> str:
    return args.out or ("runs/study-quick" if args.quick else "runs/study")


def config(args: argparse.Namespace, recorded: StudyConfig | None = None) -> StudyConfig:
    """The :class:`StudyConfig` that parsed ``largebatch study`` arguments ask for. With
    ``recorded`` (``--report``: the settings of the study in OUT), the flags given replace
    its settings and the others keep them; whether it is quick is its own."""
    given = {name: getattr(args, name) for name in _SETTING_FLAGS if getattr(args, name) is not None}
    if recorded is None:
        recorded = StudyConfig(
            quick=args.quick, seeds=1 if args.quick else 3, only=QUICK_PAIRS if args.quick else None
        )
    only = None if {"batches", "optimizers"} & set(given) else recorded.only
    return dataclasses.replace(
        recorded,
        **given,
        only=only,
        report_only=args.report_only,
        data=args.data,
        jobs=args.jobs,
        threads=args.threads,
        device=args.device,
        out=_out(args),
    )


def main(args: argparse.Namespace) -> int:
    """Run the study from parsed arguments."""
    if args.compare is not None:
        try:
            print(compare_studies(args.compare), end="")
        except ValueError as err:
            raise CommandError("study", f"--compare: {err}") from None
        return 0
    recorded = None
    if args.report_only:
        try:
            recorded = recorded_config(
                _out(args),
                {
                    name: getattr(args, name)
                    for name in ("epochs", "subset", "model", *EXCHANGE_FIELDS)
                    if getattr(args, name) is not None
                },
            )
        except ValueError as err:
            raise CommandError("study", f"--report: {err}") from None
    cfg = config(args, recorded)
    try:
        check_config(cfg)
    except ValueError as err:
        raise CommandError("study", str(err)) from None
    require("study", ("torch", "tqdm", "matplotlib"))
    if not cfg.report_only:
        from largebatch.training import check_device

        check_device(cfg.device, "study")
    if cfg.data is not None and not Path(cfg.data).is_dir():
        raise CommandError("study", f"data directory not found: {cfg.data}")
    from largebatch.fashion_mnist import fashion_mnist_dir

    try:
        fashion_mnist_dir(cfg.data)
    except FileNotFoundError as err:
        raise CommandError("study", str(err)) from None
    try:
        run_study(cfg)
    except Stopped:
        print(
            f"largebatch study: stopped by SIGTERM; the finished runs are in "
            f"{Path(cfg.out) / 'runs.jsonl'}, and the same command continues from them",
            file=sys.stderr,
            flush=True,
        )
        return 128 + signal.SIGTERM
    return 0
