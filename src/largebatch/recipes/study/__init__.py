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
   accuracy (default: the baseline's mean minus one point) at the end of an epoch.

``--quick`` skips tuning: one seed of the recipes as they stand (their settings are the
full study's results) for the pairs in ``QUICK_PAIRS``. ``make demo`` runs it.

Runs go to a pool of ``--jobs`` processes (default: one per CPU, one torch thread each). Every
finished run is appended to ``OUT/runs.jsonl``; running the same command again reuses them,
so an interrupted study continues where it stopped (a line cut short by the interruption is
skipped with a warning, and its run is redone). SIGTERM or Ctrl-C stops the workers with
the study, and a worker whose parent is gone exits by itself. One study at a time holds
``OUT`` (a lock on ``OUT/.lock``). The end writes ``OUT/study.md`` (the tables),
``OUT/study.json`` and ``OUT/study.png``, each replaced atomically; ``--report`` writes
them from the finished runs without training any (a study stopped part-way).

The package: :mod:`~largebatch.recipes.study.plan` (what to run: :class:`StudyConfig`,
:class:`RunSpec`, :func:`plan`; pure), :mod:`~largebatch.recipes.study.run` (training a
run, the worker pool, ``runs.jsonl``) and :mod:`~largebatch.recipes.study.report` (the
tables and the plot); this module is the command line. A run trains as ``largebatch
train`` does: :mod:`largebatch.recipes.build` and :mod:`largebatch.recipes.loop`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from largebatch.recipes.outputs import CommandError, require

# Every name of the one-module study stays importable from here (tests, scripts).
from largebatch.recipes.study.plan import (  # noqa: F401
    BASELINE, COMPRESSIONS, DEFAULT_BATCHES, DEFAULT_OPTIMIZERS, FULL_BATCHES, GRID_CENTRES,
    LARGE_BATCHES,
    QUICK_PAIRS, STUDY_OPTIMIZERS, VAL_SIZE, RunSpec, StudyConfig, _best, _check,
    _lr, _recipe, pair_plan, plan,
)
from largebatch.recipes.study.report import plot, study_markdown, summarize  # noqa: F401
from largebatch.recipes.study.run import (  # noqa: F401
    _EVAL_CHUNK, _SPLIT_SEED, _WORKER, _append, _exit_with_parent, _init_worker, _load_results,
    _Stopped, _tensors, run_one, run_study,
)

__all__ = ["StudyConfig", "RunSpec", "config", "pair_plan", "plan", "run_one", "run_study",
           "summarize", "study_markdown", "add_arguments", "main"]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(v) for v in text.split(","))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``largebatch study`` flags."""
    add = parser.add_argument
    add("--quick", action="store_true",
        help="no tuning: one seed of the recipes' settings for "
             + ", ".join(f"{o} at {b}" for b, o in QUICK_PAIRS)
             + " unless --batches or --optimizers say otherwise (make demo)")
    add("--report", dest="report_only", action="store_true",
        help="write the tables and plot of the runs already in OUT/runs.jsonl; train nothing")
    add("--out", default=None, metavar="DIR",
        help="output folder (default runs/study, or runs/study-quick)")
    add("--batches", type=_ints, default=None, metavar="B,B",
        help=f"batches, of {','.join(map(str, FULL_BATCHES))} "
             f"(default {','.join(map(str, DEFAULT_BATCHES))})")
    add("--optimizers", type=lambda t: tuple(t.split(",")), default=None,
        metavar="NAME,NAME", help=f"of {','.join(STUDY_OPTIMIZERS)} (default "
                                  f"{','.join(DEFAULT_OPTIMIZERS)})")
    add("--seeds", type=int, default=None, help="final runs per pair (default 3; quick 1)")
    add("--epochs", type=int, default=None, help="epochs per run (default: the recipes')")
    add("--small-warmups", type=_floats, default=StudyConfig.small_warmups, metavar="E,E",
        help="warmup epochs tuned at the baseline batch (default %(default)s)")
    add("--large-warmups", type=_floats, default=StudyConfig.large_warmups, metavar="E,E",
        help="warmup epochs tuned at the large batches (default %(default)s)")
    add("--label-smoothing", type=float, default=StudyConfig.label_smoothing,
        help="label smoothing of the tuning runs (default %(default)s)")
    add("--power", type=float, default=StudyConfig.power,
        help="poly decay power of the tuning runs (default %(default)s)")
    add("--no-ablate", dest="ablate", action="store_false",
        help="skip the runs that switch label smoothing and the poly power off")
    add("--extend", type=int, default=StudyConfig.extend,
        help="times a tuning grid may grow past an edge holding the best lr (default %(default)s)")
    add("--target", type=float, default=None,
        help="accuracy for the steps-to-target column (default: baseline mean - 0.01)")
    add("--jobs", type=int, default=None, help="parallel runs (default: one per CPU)")
    add("--threads", type=int, default=None, help="torch threads per run (default CPUs / jobs)")
    add("--device", default="cpu", choices=("cpu", "cuda"))
    add("--data", default=None, metavar="DIR", help="folder with the four Fashion-MNIST files")
    add("--subset", type=int, default=None, metavar="N", help="first N train and test images")
    add("--workers", type=int, default=1, metavar="N",
        help="simulate N data-parallel workers in one process: each batch split N ways, "
             "each part with its own batch-norm statistics (default 1: no split)")
    add("--compression", default="none", choices=COMPRESSIONS,
        help="how the simulated workers exchange gradients: the plain average, or AdaComp "
             "after --compression-warmup epochs uncompressed (default %(default)s)")
    add("--compression-warmup", type=int, default=StudyConfig.compression_warmup,
        metavar="EPOCHS", help="epochs of plain exchange before AdaComp (default %(default)s)")


def config(args: argparse.Namespace) -> StudyConfig:
    """The :class:`StudyConfig` that parsed ``largebatch study`` arguments ask for."""
    return StudyConfig(
        quick=args.quick,
        batches=args.batches or DEFAULT_BATCHES,
        optimizers=args.optimizers or DEFAULT_OPTIMIZERS, epochs=args.epochs,
        only=QUICK_PAIRS if args.quick and not (args.batches or args.optimizers) else None,
        small_warmups=args.small_warmups, large_warmups=args.large_warmups,
        label_smoothing=args.label_smoothing, power=args.power, ablate=args.ablate,
        seeds=(1 if args.quick else 3) if args.seeds is None else args.seeds,
        extend=args.extend, target=args.target, report_only=args.report_only,
        subset=args.subset, data=args.data, jobs=args.jobs, threads=args.threads,
        device=args.device, workers=args.workers, compression=args.compression,
        compression_warmup=args.compression_warmup,
        out=args.out or ("runs/study-quick" if args.quick else "runs/study"),
    )


def main(args: argparse.Namespace) -> int:
    """Run the study from parsed arguments."""
    cfg = config(args)
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

