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

from largebatch.recipes.registry import Recipe, get_recipe

__all__ = ["BASELINE", "FULL_BATCHES", "LARGE_BATCHES", "QUICK_BATCHES", "STUDY_OPTIMIZERS",
           "VAL_SIZE", "RunSpec", "StudyConfig", "pair_plan", "plan"]

BASELINE = (128, "sgd")
LARGE_BATCHES = (384, 1536, 3072)
FULL_BATCHES = (BASELINE[0], *LARGE_BATCHES)
QUICK_BATCHES = (BASELINE[0], 1536, 3072)
STUDY_OPTIMIZERS = ("sgd", "nesterov", "lars", "lamb")
VAL_SIZE = 10_000  # held out from the 60,000 training images for tuning


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """What to run. The defaults are the full study; ``quick=True`` is ``make demo``'s."""

    quick: bool = False
    batches: tuple[int, ...] = FULL_BATCHES
    optimizers: tuple[str, ...] = STUDY_OPTIMIZERS
    epochs: int | None = None  # None: the recipes' epochs
    seeds: int = 3
    lr_factors: tuple[float, ...] = (0.5, 1.0, 2.0)
    small_warmups: tuple[float, ...] = (0.0, 1.0)  # epochs, at the baseline batch
    large_warmups: tuple[float, ...] = (1.0, 3.0)
    extend: int = 2  # how many times a grid may grow past an edge that holds the best lr
    target: float | None = None  # None: the baseline's mean test accuracy minus 0.01
    subset: int | None = None  # first N train (and test) images
    data: str | None = None
    out: str = "runs/study"
    jobs: int | None = None
    threads: int | None = None
    device: str = "cpu"

    def pairs(self) -> list[tuple[int, str]]:
        """``(batch, optimizer)`` in the order of the table: the baseline, then by batch."""
        out = [BASELINE] if BASELINE[0] in self.batches and BASELINE[1] in self.optimizers else []
        return out + [(b, o) for b in self.batches if b != BASELINE[0] for o in self.optimizers]

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
        value = getattr(cfg, name)
        if value is not None and not (isinstance(value, int) and value >= low):
            raise ValueError(f"Invalid {name}: {value!r} (must be an integer >= {low})")
    if cfg.subset is not None and cfg.subset - cfg.subset // 6 < max(cfg.batches):
        raise ValueError(f"Invalid subset: {cfg.subset} (its tuning split, five sixths, must "
                         f"hold one batch of {max(cfg.batches)})")
    if cfg.extend < 0:
        raise ValueError(f"Invalid extend: {cfg.extend} (must be >= 0)")
    if cfg.target is not None and not 0 < cfg.target <= 1:
        raise ValueError(f"Invalid target: {cfg.target} (an accuracy in (0, 1])")
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"Invalid device: {cfg.device!r} (cpu or cuda)")


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

    @property
    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def describe(self) -> str:
        return (f"{self.phase:<5} B={self.batch:<5} {self.optimizer:<8} lr={self.lr:<7g} "
                f"warmup={self.warmup_epochs:g} seed={self.seed}")


def _best(runs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The run with the highest final accuracy (ties: the smaller lr, then shorter warmup)."""
    return max(runs, key=lambda r: (r["accuracy"], -r["spec"]["lr"], -r["spec"]["warmup_epochs"]))


def pair_plan(cfg: StudyConfig, results: dict[str, dict[str, Any]], batch: int,
              optimizer: str) -> tuple[list[RunSpec], list[RunSpec]]:
    """One pair's ``(tuning runs, final runs)`` as far as the finished ``results`` (by
    :attr:`RunSpec.key`) settle them; the final runs stay empty while tuning is incomplete.

    The tuning grid grows by one factor of 2 beyond an edge that holds the best lr
    (``cfg.extend`` times at most). ``--quick`` has no tuning: its finals take the recipe's
    lr and warmup."""
    recipe = _recipe(batch, optimizer)
    epochs = cfg.epochs or recipe.epochs

    def finals(lr: float, warmup: float) -> list[RunSpec]:
        return [RunSpec("final", batch, optimizer, lr, warmup, seed, epochs, cfg.subset)
                for seed in range(cfg.seeds)]

    if cfg.quick:
        return [], finals(_lr(recipe.peak_lr), recipe.warmup_epochs)
    exponents = sorted({round(math.log2(f)) for f in cfg.lr_factors})
    for grown in range(cfg.extend + 1):
        grid = [RunSpec("tune", batch, optimizer, _lr(recipe.peak_lr * 2.0**k), w, 0, epochs,
                        cfg.subset) for k in exponents for w in cfg.warmups(batch)]
        if any(s.key not in results for s in grid):
            return grid, []
        best = _best(results[s.key] for s in grid)["spec"]
        k = round(math.log2(best["lr"] / recipe.peak_lr))
        if grown == cfg.extend or k not in (exponents[0], exponents[-1]):
            break
        exponents = sorted([*exponents, k + 1 if k == exponents[-1] else k - 1])
    return grid, finals(best["lr"], best["warmup_epochs"])


def plan(cfg: StudyConfig, results: dict[str, dict[str, Any]]) -> list[RunSpec]:
    """Every run still needed, given the finished ``results``. Pure: the same results give
    the same plan, so an interrupted study continues where it stopped."""
    needed = []
    for pair in cfg.pairs():
        tune, final = pair_plan(cfg, results, *pair)
        needed += [s for s in (*tune, *final) if s.key not in results]
    return needed

