"""``largebatch study``: the batch-size sweep on Fashion-MNIST, tuned the same way for every optimizer.

Pairs: the small-batch baseline (momentum SGD at B=128), then momentum SGD with gradual
warmup (Goyal et al. 2017), LARS and LAMB at B = 1536 and 3072, the ImageNet-equivalent
32K and 64K batches (``--batches`` adds 384, the 8K one; ``--optimizers`` adds Nesterov,
Nado et al. 2021). Each pair starts from its registry recipe (``fmnist-OPTIMIZER-BATCH``):
model (``fmnist_cnn``), optimizer settings, weight decay and its exclusions, 30 epochs.

Full study (the default), for every pair with the same budget:

1. **Tune** on a validation split: the last 10,000 of a fixed permutation of the 60,000
   training images are held out, the rest train. Peak lr over ``GRID_CENTRES x {1/2, 1,
   2}``, each with two warmup lengths (0 or 2 epochs at the baseline batch, 2 or 5 at the
   large ones), every run with label smoothing 0.1 and poly power 2 (the anchors'
   techniques). While the best lr lies on the edge of the grid, the grid grows by one more
   factor of 2 on that side (twice at most, ``--extend``); a best lr still on the edge is
   marked in the table. Then the best grid point runs once more with each technique
   switched off (label smoothing 0; poly power 1), and the best of all these is kept.
2. **Re-run** the kept setting on all 60,000 images with ``--seeds`` seeds (3) and
   report test accuracy as mean ± std, and the steps each run took to reach the target
   accuracy (default: the baseline's mean minus one point, rounded down to a tenth of a
   point) at the end of an epoch.

``--quick`` skips tuning: one seed of the recipes as they stand (their settings are the
full study's results) for the pairs in ``QUICK_PAIRS``. ``make demo`` runs it.

``--epochs N`` means what it means to ``largebatch train``: every run's schedule is its
recipe's scaled to N epochs, so the warmups (the recipes' and the grid's, given in epochs
of a recipe's 30) scale by N / 30. ``--subset N`` trains on the first N images; the
ImageNet-equivalent batch stays that of the full 60,000, as in ``largebatch train``.

The first line says what the study is to run; on a terminal a bar on stderr then shows
the images trained against those still to train, with an estimate of the time left.
Runs go to a pool of ``--jobs`` processes (default: one per CPU, one torch thread each). The
study's settings go to ``OUT/settings.json``; every
finished run is appended to ``OUT/runs.jsonl``; running the same command again reuses them,
so an interrupted study continues where it stopped (a line cut short by the interruption is
skipped with a warning, and its run is redone). SIGTERM or Ctrl-C stops the workers with
the study, and a worker whose parent is gone exits by itself. One study at a time holds
``OUT`` (a lock on ``OUT/.lock``). The end writes ``OUT/study.md`` (the tables),
``OUT/study.json`` and ``OUT/study.png``, each replaced atomically; ``--report`` writes
them from the finished runs without training any (a study stopped part-way), with the
settings recorded in ``OUT`` (``settings.json``; in a folder without one, those its runs
show), which the flags given with it replace. ``--compare DIR DIR ...`` prints the studies of
several models side by side (:func:`~largebatch.recipes.study.report.compare_markdown`).

The package: :mod:`~largebatch.recipes.study.plan` (what to run: :class:`StudyConfig`,
:class:`RunSpec`, :func:`plan`; pure), :mod:`~largebatch.recipes.study.worker` (training
a run), :mod:`~largebatch.recipes.study.run` (the worker pool, ``runs.jsonl``, the
progress) and :mod:`~largebatch.recipes.study.report` (the tables and the plot); this
module is the command line. A run trains as ``largebatch
train`` does: :mod:`largebatch.recipes.build` and :mod:`largebatch.recipes.loop`.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
from pathlib import Path

from largebatch.recipes.outputs import CommandError, require
from largebatch.recipes.registry import FASHION_EPOCHS, TRAIN_IMAGES

# Every name of the one-module study stays importable from here (tests, scripts).
from largebatch.recipes.study.plan import (  # noqa: F401
    BASELINE, COMPRESSIONS, DEFAULT_BATCHES, EXCHANGE_FIELDS, DEFAULT_OPTIMIZERS, FULL_BATCHES, GRID_CENTRES,
    LARGE_BATCHES,
    QUICK_PAIRS, STUDY_MODELS, STUDY_OPTIMIZERS, VAL_SIZE, RunSpec, StudyConfig, _best, _check,
    _lr, _recipe, config_from_runs, fastest_plan, pair_plan, plan, run_steps, runs_left,
    steps_to, validation_target,
)
from largebatch.recipes.study.report import plot, study_markdown, summarize  # noqa: F401
from largebatch.recipes.study.run import (  # noqa: F401
    SETTINGS, _append, _load_results, _Stopped, compare_studies, recorded_config, run_one,
    run_study,
)
from largebatch.recipes.study.worker import (  # noqa: F401
    _EVAL_CHUNK, _SPLIT_SEED, _WORKER, _exit_with_parent, _init_worker, _tensors,
)

__all__ = ["StudyConfig", "RunSpec", "config", "pair_plan", "plan", "run_one", "run_study",
           "summarize", "study_markdown", "add_arguments", "main"]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


def _default(values: tuple[float, ...]) -> str:
    return ",".join(f"{v:g}" for v in values)


# The flags that say what the study runs: with --report, those given replace the settings
# recorded in OUT, and the others keep them.
_SETTING_FLAGS = ("batches", "optimizers", "seeds", "epochs", "small_warmups", "large_warmups",
                  "label_smoothing", "power", "ablate", "extend", "target", "subset",
                  *EXCHANGE_FIELDS, "model", "time_to_accuracy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``largebatch study`` flags."""
    add = parser.add_argument
    cfg = StudyConfig()
    add("--quick", action="store_true",
        help="no tuning: one seed of the recipes' settings for "
             + ", ".join(f"{o} at {b}" for b, o in QUICK_PAIRS)
             + " unless --batches or --optimizers say otherwise (make demo)")
    add("--report", dest="report_only", action="store_true",
        help="write the tables and plot of the runs already in OUT/runs.jsonl, with the "
             "settings recorded in OUT (settings.json, else those the runs show; the flags "
             "given replace them); train nothing")
    add("--compare", nargs="+", default=None, metavar="DIR",
        help="print the studies in these folders side by side, one model per folder (each "
             "summarized from its runs and settings as --report does); train and write "
             "nothing")
    add("--out", default=None, metavar="DIR",
        help="output folder (default runs/study, or runs/study-quick)")
    add("--batches", type=_ints, default=None, metavar="B,B",
        help=f"batches, of {','.join(map(str, FULL_BATCHES))} "
             f"(default {','.join(map(str, DEFAULT_BATCHES))})")
    add("--optimizers", type=lambda t: tuple(t.split(",")), default=None,
        metavar="NAME,NAME", help=f"of {','.join(STUDY_OPTIMIZERS)} (default "
                                  f"{','.join(DEFAULT_OPTIMIZERS)})")
    add("--seeds", type=int, default=None, help="final runs per pair (default 3; quick 1)")
    add("--epochs", type=int, default=None,
        help=f"epochs per run (default: the recipes', {FASHION_EPOCHS}); as for train, another "
             "number scales each recipe's schedule to it, warmups included")
    add("--small-warmups", type=_floats, default=None, metavar="E,E",
        help=f"warmup epochs tuned at the baseline batch, of a recipe's {FASHION_EPOCHS} "
             f"(scaled with --epochs; default {_default(cfg.small_warmups)})")
    add("--large-warmups", type=_floats, default=None, metavar="E,E",
        help=f"warmup epochs tuned at the large batches, of a recipe's {FASHION_EPOCHS} "
             f"(scaled with --epochs; default {_default(cfg.large_warmups)})")
    add("--label-smoothing", type=float, default=None,
        help=f"label smoothing of the tuning runs (default {cfg.label_smoothing:g})")
    add("--power", type=float, default=None,
        help=f"poly decay power of the tuning runs (default {cfg.power:g})")
    add("--no-ablate", dest="ablate", action="store_const", const=False, default=None,
        help="skip the runs that switch label smoothing and the poly power off")
    add("--extend", type=int, default=None,
        help=f"times a tuning grid may grow past an edge holding the best lr (default "
             f"{cfg.extend})")
    add("--target", type=float, default=None,
        help="accuracy for the steps-to-target column (default: baseline mean - 0.01, "
             "rounded down to 0.001)")
    add("--jobs", type=int, default=None, help="parallel runs (default: one per CPU)")
    add("--threads", type=int, default=None, help="torch threads per run (default CPUs / jobs)")
    add("--device", default="cpu", choices=("cpu", "cuda"))
    add("--data", default=None, metavar="DIR", help="folder with the four Fashion-MNIST files")
    add("--subset", type=int, default=None, metavar="N",
        help="first N train and test images (the ImageNet-equivalent batch stays that of "
             f"the full {TRAIN_IMAGES['fashion-mnist']:,})")
    add("--workers", type=int, default=None, metavar="N",
        help="simulate N data-parallel workers in one process: each batch split N ways, "
             "each part with its own batch-norm statistics (default 1: no split)")
    add("--compression", default=None, choices=COMPRESSIONS,
        help="how the simulated workers exchange gradients: the plain average, or AdaComp "
             "after --compression-warmup epochs uncompressed (default none)")
    add("--compression-warmup", type=int, default=None, metavar="EPOCHS",
        help=f"epochs of plain exchange before AdaComp (default {cfg.compression_warmup})")
    add("--model", default=None, choices=STUDY_MODELS,
        help="the model every run trains, in place of the recipes' fmnist_cnn: AlexNet-BN "
             "or a ResNet scaled to 28x28 (default fmnist_cnn; one model per --out)")
    add("--time-to-accuracy", action="store_true", default=None,
        help="also tune each pair for steps to the validation target (MLPerf's time to "
             "accuracy: the lr grid grows past an edge holding the fastest run, as it does "
             "for accuracy), run its fastest run again, and report it in a second table; "
             "not with --quick")
    add("--freeze-variance", action="store_true", default=None,
        help="LAMB: freeze the second moment when the plain exchange ends, after "
             "--compression-warmup epochs (1-bit LAMB's frozen variance)")


def _out(args: argparse.Namespace) -> str:
    return args.out or ("runs/study-quick" if args.quick else "runs/study")


def config(args: argparse.Namespace, recorded: StudyConfig | None = None) -> StudyConfig:
    """The :class:`StudyConfig` that parsed ``largebatch study`` arguments ask for. With
    ``recorded`` (``--report``: the settings of the study in OUT), the flags given replace
    its settings and the others keep them; whether it is quick is its own."""
    given = {name: getattr(args, name) for name in _SETTING_FLAGS
             if getattr(args, name) is not None}
    if recorded is None:
        recorded = StudyConfig(quick=args.quick, seeds=1 if args.quick else 3,
                               only=QUICK_PAIRS if args.quick else None)
    only = None if {"batches", "optimizers"} & set(given) else recorded.only
    return dataclasses.replace(
        recorded, **given, only=only, report_only=args.report_only, data=args.data,
        jobs=args.jobs, threads=args.threads, device=args.device, out=_out(args))


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
            recorded = recorded_config(_out(args), {name: getattr(args, name) for name in (
                "epochs", "subset", "model", *EXCHANGE_FIELDS) if getattr(args, name) is not None})
        except ValueError as err:
            raise CommandError("study", f"--report: {err}") from None
    cfg = config(args, recorded)
    try:
        _check(cfg)
    except ValueError as err:
        raise CommandError("study", str(err)) from None
    require("study", ("torch", "tqdm", "matplotlib"))
    if not cfg.report_only:
        from largebatch.recipes.distributed import check_device

        check_device(cfg.device, "study")
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

