"""The study's plan, pure (no framework, no files): what to run, and what a set of finished
runs still leaves to run.

:class:`StudyConfig` says what to run; :class:`RunSpec` is one training run (its
:attr:`~RunSpec.key` identifies it in ``runs.jsonl``). :func:`pair_plan` gives one
(batch, optimizer) pair's tuning grid and final runs as far as the finished results
settle them; :func:`plan` every run still needed. The same results give the same plan,
which is what lets an interrupted study continue where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from typing import Any

from largebatch import checks
from largebatch.recipes.registry import Recipe, get_recipe

__all__ = ["BASELINE", "COMPRESSIONS", "DEFAULT_BATCHES", "DEFAULT_OPTIMIZERS", "FULL_BATCHES",
           "GRID_CENTRES", "LARGE_BATCHES", "QUICK_PAIRS", "STUDY_OPTIMIZERS", "VAL_SIZE",
           "RunSpec", "StudyConfig", "pair_plan", "plan"]

BASELINE = (128, "sgd")
LARGE_BATCHES = (384, 1536, 3072)
FULL_BATCHES = (BASELINE[0], *LARGE_BATCHES)
STUDY_OPTIMIZERS = ("sgd", "nesterov", "lars", "lamb")
# The headline study: the baseline, and the 32K- and 64K-equivalent batches with large-batch
# SGD (Goyal et al.'s warmup), LARS and LAMB. ``--batches`` and ``--optimizers`` add 384
# (8K-equivalent) and Nesterov.
DEFAULT_BATCHES = (BASELINE[0], 1536, 3072)
DEFAULT_OPTIMIZERS = ("sgd", "lars", "lamb")
# ``--quick`` (``make demo``): the baseline, LARS and LAMB at the 32K-equivalent batch with
# the 30-epoch study's settings, one seed each: three runs, within 10 minutes on 2 cores.
QUICK_PAIRS = ((BASELINE[0], BASELINE[1]), (1536, "lars"), (1536, "lamb"))
VAL_SIZE = 10_000  # held out from the 60,000 training images for tuning
# How data-parallel workers exchange gradients (here and in ``largebatch train``).
COMPRESSIONS = ("none", "adacomp")

# Where each pair's lr grid starts (the grid is this times 1/2, 1, 2, and grows past an edge).
# Fixed here, apart from the recipes, so that the recipes can carry the study's results
# without moving the grid of the study that produced them. SGD and Nesterov: 0.2 at B=128,
# scaled linearly (Goyal et al.); LARS: lr x trust coefficient 0.001 = 0.008-0.024; LAMB:
# the square-root rule from 0.064 at 384.
GRID_CENTRES: dict[tuple[str, int], float] = {
    ("sgd", 128): 0.2,
    **{(o, b): 0.2 * b / 128 for o in ("sgd", "nesterov") for b in LARGE_BATCHES},
    ("lars", 384): 8.0, ("lars", 1536): 16.0, ("lars", 3072): 24.0,
    ("lamb", 384): 0.064, ("lamb", 1536): 0.128, ("lamb", 3072): 0.18,
}


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """What to run. The defaults are the full study; ``quick=True`` is ``make demo``'s."""

    quick: bool = False
    batches: tuple[int, ...] = DEFAULT_BATCHES
    optimizers: tuple[str, ...] = DEFAULT_OPTIMIZERS
    epochs: int | None = None  # None: the recipes' epochs
    seeds: int = 3
    lr_factors: tuple[float, ...] = (0.5, 1.0, 2.0)
    small_warmups: tuple[float, ...] = (0.0, 2.0)  # epochs, at the baseline batch
    large_warmups: tuple[float, ...] = (2.0, 5.0)
    # The anchors' techniques: every tuning run uses them; then each is switched off
    # (label smoothing 0, poly power 1) at the pair's best grid point, and the final runs
    # take whichever scored best on the validation split.
    label_smoothing: float = 0.1
    power: float = 2.0
    ablate: bool = True
    extend: int = 2  # how many times a grid may grow past an edge that holds the best lr
    only: tuple[tuple[int, str], ...] | None = None  # keep only these (batch, optimizer) pairs
    report_only: bool = False  # write the report of the finished runs; train nothing
    target: float | None = None  # None: the baseline's mean test accuracy minus 0.01
    subset: int | None = None  # first N train (and test) images
    data: str | None = None
    out: str = "runs/study"
    jobs: int | None = None
    threads: int | None = None
    device: str = "cpu"
    # Data parallelism simulated in one process: each batch split over ``workers`` (each
    # with its own normalization statistics, as under DDP) and their gradients exchanged
    # plainly ("none") or with AdaComp (:class:`largebatch.comm.torch.SimulatedWorkers`).
    workers: int = 1
    compression: str = "none"
    compression_warmup: int = 1  # epochs of plain exchange before AdaComp starts

    def pairs(self) -> list[tuple[int, str]]:
        """``(batch, optimizer)`` in the order of the table: the baseline, then by batch."""
        out = [BASELINE] if BASELINE[0] in self.batches and BASELINE[1] in self.optimizers else []
        out += [(b, o) for b in self.batches if b != BASELINE[0] for o in self.optimizers]
        return out if self.only is None else [p for p in out if p in self.only]

    def warmups(self, batch: int) -> tuple[float, ...]:
        return self.small_warmups if batch == BASELINE[0] else self.large_warmups


def _check(cfg: StudyConfig) -> None:
    for b in cfg.batches:
        if b not in FULL_BATCHES:
            raise ValueError(f"Invalid batch {b}: the study's recipes cover "
                             f"{', '.join(map(str, FULL_BATCHES))}")
    for o in cfg.optimizers:
        if o not in STUDY_OPTIMIZERS:
            raise ValueError(f"Invalid optimizer {o!r}: known {', '.join(STUDY_OPTIMIZERS)}")
    if not cfg.pairs():
        raise ValueError("No (batch, optimizer) pair to run: the baseline is sgd at 128, the "
                         f"other batches are {', '.join(map(str, LARGE_BATCHES))}")
    for name, low in (("seeds", 1), ("epochs", 1), ("subset", 1), ("jobs", 1), ("threads", 1)):
        if getattr(cfg, name) is not None:
            checks.integer(name, getattr(cfg, name), low)
    if cfg.subset is not None and cfg.subset - cfg.subset // 6 < max(cfg.batches):
        raise ValueError(f"Invalid subset: {cfg.subset} (its tuning split, five sixths, must "
                         f"hold one batch of {max(cfg.batches)})")
    if not 0 <= cfg.label_smoothing < 1:
        raise ValueError(f"Invalid label_smoothing: {cfg.label_smoothing} (must be in [0, 1))")
    checks.number("power", cfg.power, 0.0)
    for name in ("small_warmups", "large_warmups"):
        values = getattr(cfg, name)
        if not values or any(not (math.isfinite(w) and w >= 0) for w in values):
            raise ValueError(f"Invalid {name}: {values} (epochs, each finite and >= 0)")
    if cfg.extend < 0:
        raise ValueError(f"Invalid extend: {cfg.extend} (must be >= 0)")
    if cfg.target is not None and not 0 < cfg.target <= 1:
        raise ValueError(f"Invalid target: {cfg.target} (an accuracy in (0, 1])")
    checks.choice("device", cfg.device, ("cpu", "cuda"))
    checks.integer("workers", cfg.workers, 1)
    for b in cfg.batches:
        if b % cfg.workers:
            raise ValueError(f"Invalid workers: {cfg.workers} does not divide the batch {b}")
    checks.choice("compression", cfg.compression, COMPRESSIONS)
    if cfg.compression != "none" and cfg.workers < 2:
        raise ValueError(f"Invalid compression: {cfg.compression} needs --workers 2 or more")
    checks.integer("compression_warmup", cfg.compression_warmup, 0)


def _recipe(batch: int, optimizer: str) -> Recipe:
    return get_recipe(f"fmnist-{optimizer}-{batch}")


def _lr(value: float) -> float:
    return float(f"{value:.4g}")  # stable keys: 0.6 * 2 == 1.2, not 1.2000000000000002


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run. ``phase`` ``"tune"`` trains on the training split minus the
    validation images and scores the validation images; ``"final"`` trains on every training
    image and scores the test set."""

    phase: str
    batch: int
    optimizer: str
    lr: float
    warmup_epochs: float
    seed: int
    epochs: int
    subset: int | None = None
    label_smoothing: float = 0.0
    power: float = 2.0
    workers: int = 1
    compression: str = "none"
    compression_warmup: int = 1

    @property
    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def describe(self) -> str:
        return (f"{self.phase:<5} B={self.batch:<5} {self.optimizer:<8} lr={self.lr:<7g} "
                f"warmup={self.warmup_epochs:g} ls={self.label_smoothing:g} "
                f"power={self.power:g} seed={self.seed}"
                + (f" workers={self.workers} {self.compression}" if self.workers > 1 else "")
                + (f" after {self.compression_warmup}" if self.compression != "none" else ""))


def _best(runs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The run with the highest final accuracy (ties: the smaller lr, then shorter warmup)."""
    return max(runs, key=lambda r: (r["accuracy"], -r["spec"]["lr"], -r["spec"]["warmup_epochs"]))


def _without_techniques(cfg: StudyConfig, best: RunSpec) -> list[RunSpec]:
    """``best`` with each of the anchors' techniques switched off, one at a time: label
    smoothing 0, poly power 1 (linear decay). Warmup is already a dimension of the grid."""
    out = []
    if cfg.label_smoothing:
        out.append(dataclasses.replace(best, label_smoothing=0.0))
    if cfg.power != 1:
        out.append(dataclasses.replace(best, power=1.0))
    return out


def pair_plan(cfg: StudyConfig, results: dict[str, dict[str, Any]], batch: int,
              optimizer: str) -> tuple[list[RunSpec], list[RunSpec]]:
    """One pair's ``(tuning runs, final runs)`` as far as the finished ``results`` (by
    :attr:`RunSpec.key`) settle them; the final runs stay empty while tuning is incomplete.

    The grid is :data:`GRID_CENTRES` times ``cfg.lr_factors``, crossed with the batch's
    warmups, every run with ``cfg.label_smoothing`` and ``cfg.power``. It grows by one
    factor of 2 beyond an edge that holds the best lr (``cfg.extend`` times at most). Then,
    with ``cfg.ablate``, the best grid point runs again with each technique switched off;
    the final runs take the best of all these on the validation split. ``--quick`` has
    no tuning: its finals take the recipe's lr, warmup, label smoothing and power."""
    recipe = _recipe(batch, optimizer)
    epochs = cfg.epochs or recipe.epochs

    def finals(best: RunSpec) -> list[RunSpec]:
        return [dataclasses.replace(best, phase="final", seed=seed) for seed in range(cfg.seeds)]

    if cfg.quick:
        return [], finals(RunSpec("final", batch, optimizer, _lr(recipe.peak_lr),
                                  recipe.warmup_epochs, 0, epochs, cfg.subset,
                                  recipe.label_smoothing, recipe.power, cfg.workers,
                                  cfg.compression, cfg.compression_warmup))
    centre = GRID_CENTRES[optimizer, batch]
    exponents = sorted({round(math.log2(f)) for f in cfg.lr_factors})
    for grown in range(cfg.extend + 1):
        grid = [RunSpec("tune", batch, optimizer, _lr(centre * 2.0**k), w, 0, epochs,
                        cfg.subset, cfg.label_smoothing, cfg.power, cfg.workers, cfg.compression,
                        cfg.compression_warmup)
                for k in exponents for w in cfg.warmups(batch)]
        if any(s.key not in results for s in grid):
            return grid, []
        best = RunSpec(**_best(results[s.key] for s in grid)["spec"])
        k = round(math.log2(best.lr / centre))
        if grown == cfg.extend or k not in (exponents[0], exponents[-1]):
            break
        exponents = sorted([*exponents, k + 1 if k == exponents[-1] else k - 1])
    tune = grid + (_without_techniques(cfg, best) if cfg.ablate else [])
    if any(s.key not in results for s in tune):
        return tune, []
    return tune, finals(RunSpec(**_best(results[s.key] for s in tune)["spec"]))


def plan(cfg: StudyConfig, results: dict[str, dict[str, Any]]) -> list[RunSpec]:
    """Every run still needed, given the finished ``results``. Pure: the same results give
    the same plan, so an interrupted study continues where it stopped."""
    needed = []
    for pair in cfg.pairs():
        tune, final = pair_plan(cfg, results, *pair)
        needed += [s for s in (*tune, *final) if s.key not in results]
    return needed

