"""The study's plan, pure (no framework, no files): :class:`StudyConfig` says what to run,
:class:`RunSpec` is one run (its :attr:`~RunSpec.key` names it in ``runs.jsonl``), and
:func:`plan` gives every run a set of finished runs still leaves to run: the same results,
the same plan, so an interrupted study continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from largebatch import checks
from largebatch.outputs import rounded
from largebatch.recipes.registry import COMPRESSIONS, TRAIN_IMAGES, Recipe, get_recipe

__all__ = [
    "BASELINE",
    "COMPRESSIONS",
    "DEFAULT_BATCHES",
    "DEFAULT_OPTIMIZERS",
    "EXCHANGE_FIELDS",
    "FULL_BATCHES",
    "GRID_CENTRES",
    "LARGE_BATCHES",
    "QUICK_PAIRS",
    "STUDY_MODELS",
    "STUDY_OPTIMIZERS",
    "VAL_SIZE",
    "RunSpec",
    "StudyConfig",
    "best_run",
    "check_config",
    "config_from_runs",
    "fastest_plan",
    "held_out",
    "pair_plan",
    "pair_recipe",
    "plan",
    "round_lr",
    "runs_left",
    "run_steps",
    "steps_to",
    "validation_target",
]

BASELINE = (128, "sgd")
LARGE_BATCHES = (384, 1536, 3072)
FULL_BATCHES = (BASELINE[0], *LARGE_BATCHES)
STUDY_OPTIMIZERS = ("sgd", "nesterov", "lars", "lamb")
# The models a study may train: the recipes' own, then the mission's other families scaled
# to 28x28 (largebatch.models): AlexNet-BN and a ResNet.
STUDY_MODELS = ("fmnist_cnn", "fmnist_alexnet_bn", "small_resnet")
# The headline study: the baseline, and the 32K- and 64K-equivalent batches with large-batch
# SGD (Goyal et al.'s warmup), LARS and LAMB. ``--batches`` and ``--optimizers`` add 384
# (8K-equivalent) and Nesterov.
DEFAULT_BATCHES = (BASELINE[0], 1536, 3072)
DEFAULT_OPTIMIZERS = ("sgd", "lars", "lamb")
# ``--quick`` (``make demo``): the baseline, LARS and LAMB at the 32K-equivalent batch with
# the 30-epoch study's settings, one seed each: three runs, within 10 minutes on 2 cores.
QUICK_PAIRS = ((BASELINE[0], BASELINE[1]), (1536, "lars"), (1536, "lamb"))
VAL_SIZE = 10_000  # held out from the 60,000 training images for tuning
FASHION_IMAGES = TRAIN_IMAGES["fashion-mnist"]
# The simulated exchange's settings: one value per study folder (RunSpec's fields).
EXCHANGE_FIELDS = ("workers", "compression", "compression_warmup", "freeze_variance")

# Where each pair's lr grid starts (the grid is this times 1/2, 1, 2, and grows past an edge).
# Fixed here, apart from the recipes, so that the recipes can carry the study's results
# without moving the grid of the study that produced them. SGD and Nesterov: 0.2 at B=128,
# scaled linearly (Goyal et al.); LARS: lr x trust coefficient 0.001 = 0.008-0.024; LAMB:
# the square-root rule from 0.064 at 384.
GRID_CENTRES: dict[tuple[str, int], float] = {
    ("sgd", 128): 0.2,
    **{(o, b): 0.2 * b / 128 for o in ("sgd", "nesterov") for b in LARGE_BATCHES},
    ("lars", 384): 8.0,
    ("lars", 1536): 16.0,
    ("lars", 3072): 24.0,
    ("lamb", 384): 0.064,
    ("lamb", 1536): 0.128,
    ("lamb", 3072): 0.18,
}


# The fields of a StudyConfig that say where and how a study runs, not what it runs.
ENVIRONMENT = ("report_only", "data", "out", "jobs", "threads", "device")


@dataclasses.dataclass(frozen=True)
class StudyConfig:
    """What to run. The defaults are the full study; ``quick=True`` is ``make demo``'s."""

    quick: bool = False
    batches: tuple[int, ...] = DEFAULT_BATCHES
    optimizers: tuple[str, ...] = DEFAULT_OPTIMIZERS
    # None: the recipes' epochs. Another number N scales every run's schedule to N epochs,
    # as ``largebatch train --epochs N`` does (:meth:`Recipe.with_epochs`): the recipes'
    # warmups (``quick``) and the grid's (``small_warmups``, ``large_warmups``, epochs of
    # a recipe's run) by N / the recipe's epochs.
    epochs: int | None = None
    seeds: int = 3
    lr_factors: tuple[float, ...] = (0.5, 1.0, 2.0)
    small_warmups: tuple[float, ...] = (0.0, 2.0)  # epochs of a recipe's run, at the baseline batch
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
    # LAMB's second moment frozen when those epochs end (1-bit LAMB): RunSpec.freeze_variance
    freeze_variance: bool = False
    # The model every run trains in place of the recipes' (fmnist_cnn): one per folder
    model: str = "fmnist_cnn"
    # Also re-run, per pair, the tuning run that reaches the validation target in the
    # fewest steps (MLPerf's time to accuracy): fastest_plan
    time_to_accuracy: bool = False
    # False: ``epochs`` leaves the warmups as they are, in epochs of the shorter or longer
    # run. The runs of a study folder without ``settings.json`` were planned so, and
    # :func:`config_from_runs` reads them back with it.
    scale_warmups: bool = True

    def pairs(self) -> list[tuple[int, str]]:
        """``(batch, optimizer)`` in the order of the table: the baseline, then by batch."""
        out = [BASELINE] if BASELINE[0] in self.batches and BASELINE[1] in self.optimizers else []
        out += [(b, o) for b in self.batches if b != BASELINE[0] for o in self.optimizers]
        return out if self.only is None else [p for p in out if p in self.only]

    def warmups(self, batch: int) -> tuple[float, ...]:
        return self.small_warmups if batch == BASELINE[0] else self.large_warmups

    def warmup(self, warmup_epochs: float, recipe: Recipe) -> float:
        """A warmup of ``warmup_epochs`` epochs of ``recipe``'s run, in epochs of this
        study's run of it: scaled by ``epochs / recipe.epochs`` as
        :meth:`Recipe.with_epochs` scales the recipe's own."""
        epochs = self.epochs or recipe.epochs
        if not self.scale_warmups or epochs == recipe.epochs:
            return warmup_epochs
        return warmup_epochs * (epochs / recipe.epochs)

    def settings(self) -> dict[str, Any]:
        """What the study runs, as JSON values (``OUT/settings.json``): every field but
        those saying where and how it runs (:data:`ENVIRONMENT`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ENVIRONMENT}

    @classmethod
    def from_settings(cls, settings: dict[str, Any], **environment: Any) -> StudyConfig:
        """The configuration whose :meth:`settings` are ``settings`` (JSON values: lists
        for tuples), with the ``environment`` fields given. A ValueError names a field
        that is not a setting."""
        known = {f.name for f in dataclasses.fields(cls)} - set(ENVIRONMENT)
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"unknown setting {unknown[0]!r}")

        def value(v: Any) -> Any:
            return tuple(value(x) for x in v) if isinstance(v, list) else v

        return cls(**{k: value(v) for k, v in settings.items()}, **environment)


# The StudyConfig fields that are True or False.
_FLAGS = ("quick", "ablate", "report_only", "time_to_accuracy", "freeze_variance", "scale_warmups")
# The fields that are lists (tuples here), none of them empty.
_LISTS = ("batches", "optimizers", "lr_factors", "small_warmups", "large_warmups")


def _listed(value: Any) -> Any:
    """``value`` with its tuples as lists, as settings.json writes them."""
    return [_listed(v) for v in value] if isinstance(value, tuple) else value


def _check_kinds(cfg: StudyConfig) -> None:
    """Each field's kind, before the checks that use it: a flag is a bool (the string "no"
    is not False), a list is a non-empty list, ``only`` None or a list of ``[batch,
    optimizer]`` pairs; the numbers of the lists are checked as numbers."""
    for name in _FLAGS:
        value = getattr(cfg, name)
        if not isinstance(value, bool):
            raise ValueError(f"Invalid {name}: {value!r} (must be True or False)")
    for name in _LISTS:
        value = getattr(cfg, name)
        if not isinstance(value, tuple) or not value:
            raise ValueError(f"Invalid {name}: {_listed(value)!r} (must be a non-empty list)")
    for f in cfg.lr_factors:
        checks.number("lr_factors", f, 0.0)
        if math.log2(f) != round(math.log2(f)):
            raise ValueError(
                f"Invalid lr_factors: {f!r} (each must be a power of 2: the grid steps by factors of 2)"
            )
    for name in ("small_warmups", "large_warmups"):
        for w in getattr(cfg, name):
            checks.number(name, w, 0.0, strict=False)
    checks.number("label_smoothing", cfg.label_smoothing, 0.0, strict=False)
    checks.integer("extend", cfg.extend, 0)
    if cfg.target is not None:
        checks.number("target", cfg.target, 0.0, high=1.0)
    if cfg.only is not None and not (
        isinstance(cfg.only, tuple)
        and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[1], str) for p in cfg.only)
    ):
        raise ValueError(
            f"Invalid only: {_listed(cfg.only)!r} (must be null or a list of [batch, optimizer] pairs)"
        )


def check_config(cfg: StudyConfig) -> None:
    """Raise ValueError, in one line, for the first setting of ``cfg`` a study cannot run."""
    _check_kinds(cfg)
    for b in cfg.batches:
        if b not in FULL_BATCHES:
            raise ValueError(
                f"Invalid batch {b}: the study's recipes cover {', '.join(map(str, FULL_BATCHES))}"
            )
    for o in cfg.optimizers:
        if o not in STUDY_OPTIMIZERS:
            raise ValueError(f"Invalid optimizer {o!r}: known {', '.join(STUDY_OPTIMIZERS)}")
    if not cfg.pairs():
        raise ValueError(
            "No (batch, optimizer) pair to run: the baseline is sgd at 128, the "
            f"other batches are {', '.join(map(str, LARGE_BATCHES))}"
        )
    for name, low in (("seeds", 1), ("epochs", 1), ("subset", 1), ("jobs", 1), ("threads", 1)):
        if getattr(cfg, name) is not None:
            checks.integer(name, getattr(cfg, name), low)
    largest = max(b for b, _ in cfg.pairs())
    if cfg.subset is not None and cfg.quick and min(cfg.subset, FASHION_IMAGES) < largest:
        raise ValueError(
            f"Invalid subset: {cfg.subset} (the runs train on it: it must hold one batch of {largest})"
        )
    if cfg.subset is not None and not cfg.quick and cfg.subset - cfg.subset // 6 < largest:
        raise ValueError(
            f"Invalid subset: {cfg.subset} (its tuning split, five sixths, must hold one batch of {largest})"
        )
    if not 0 <= cfg.label_smoothing < 1:
        raise ValueError(f"Invalid label_smoothing: {cfg.label_smoothing} (must be in [0, 1))")
    checks.number("power", cfg.power, 0.0)
    checks.choice("device", cfg.device, ("cpu", "cuda"))
    checks.choice("model", cfg.model, STUDY_MODELS)
    if cfg.time_to_accuracy not in (True, False):
        raise ValueError(f"Invalid time_to_accuracy: {cfg.time_to_accuracy!r} (must be True or False)")
    if cfg.time_to_accuracy and cfg.quick:
        raise ValueError(
            "Invalid time_to_accuracy with quick: it picks among the tuning runs, and a quick study has none"
        )
    checks.integer("workers", cfg.workers, 1)
    for b in cfg.batches:
        if b % cfg.workers:
            raise ValueError(f"Invalid workers: {cfg.workers} does not divide the batch {b}")
    checks.choice("compression", cfg.compression, COMPRESSIONS)
    if cfg.compression != "none" and cfg.workers < 2:
        raise ValueError(f"Invalid compression: {cfg.compression} needs --workers 2 or more")
    checks.integer("compression_warmup", cfg.compression_warmup, 0)
    if cfg.freeze_variance not in (True, False):
        raise ValueError(f"Invalid freeze_variance: {cfg.freeze_variance!r} (must be True or False)")
    if cfg.freeze_variance and "lamb" not in cfg.optimizers:
        raise ValueError(
            "Invalid freeze_variance: only LAMB has a second moment to freeze "
            f"(optimizers: {','.join(cfg.optimizers)})"
        )
    if cfg.freeze_variance and cfg.compression_warmup < 1:
        raise ValueError(
            "Invalid freeze_variance with compression_warmup 0: the variance is "
            "frozen when the plain exchange ends, and it needs an epoch of it"
        )


def pair_recipe(batch: int, optimizer: str) -> Recipe:
    """The registry recipe a (batch, optimizer) pair starts from."""
    return get_recipe(f"fmnist-{optimizer}-{batch}")


def round_lr(value: float) -> float:
    """``value`` to 4 significant digits, as every lr of a run's key is written."""
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
    # LAMB: v frozen (``freeze_step``) after compression_warmup epochs, when AdaComp starts;
    # the other optimizers' runs are the same either way
    freeze_variance: bool = False
    model: str = "fmnist_cnn"  # the recipe's model replaced (STUDY_MODELS)

    @property
    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def describe(self) -> str:
        return (
            f"{self.phase:<5} B={self.batch:<5} {self.optimizer:<8} lr={self.lr:<7g} "
            f"warmup={rounded(self.warmup_epochs)} ls={self.label_smoothing:g} "
            f"power={self.power:g} seed={self.seed}"
            + (f" workers={self.workers} {self.compression}" if self.workers > 1 else "")
            + (f" after {self.compression_warmup}" if self.compression != "none" else "")
            + (
                f" v frozen after {self.compression_warmup}"
                if self.freeze_variance and self.optimizer == "lamb"
                else ""
            )
            + (f" {self.model}" if self.model != "fmnist_cnn" else "")
        )


def best_run(runs: Iterable[dict[str, Any]]) -> dict[str, Any]:
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


def _grid(cfg: StudyConfig, batch: int, optimizer: str, exponents: Sequence[int]) -> list[RunSpec]:
    """The tuning runs at lr :data:`GRID_CENTRES` times ``2**k`` for each ``k`` of
    ``exponents``, crossed with the batch's warmups, every technique on."""
    recipe = pair_recipe(batch, optimizer)
    centre, epochs = GRID_CENTRES[optimizer, batch], cfg.epochs or recipe.epochs
    return [
        RunSpec(
            "tune",
            batch,
            optimizer,
            round_lr(centre * 2.0**k),
            cfg.warmup(w, recipe),
            0,
            epochs,
            cfg.subset,
            cfg.label_smoothing,
            cfg.power,
            cfg.workers,
            cfg.compression,
            cfg.compression_warmup,
            cfg.freeze_variance,
            cfg.model,
        )
        for k in exponents
        for w in cfg.warmups(batch)
    ]


def pair_plan(
    cfg: StudyConfig, results: dict[str, dict[str, Any]], batch: int, optimizer: str
) -> tuple[list[RunSpec], list[RunSpec]]:
    """One pair's ``(tuning runs, final runs)`` as far as the finished ``results`` (by
    :attr:`RunSpec.key`) settle them; the final runs stay empty while tuning is incomplete.

    The grid is :data:`GRID_CENTRES` times ``cfg.lr_factors``, crossed with the batch's
    warmups, every run with ``cfg.label_smoothing`` and ``cfg.power``. It grows by one
    factor of 2 beyond an edge that holds the best lr (``cfg.extend`` times at most). Then,
    with ``cfg.ablate``, the best grid point runs again with each technique switched off;
    the final runs take the best of all these on the validation split. ``--quick`` has
    no tuning: its finals take the recipe's lr, warmup, label smoothing and power. Every
    warmup, the grid's and the recipe's, is scaled to ``cfg.epochs`` (:meth:`StudyConfig.warmup`)."""
    recipe = pair_recipe(batch, optimizer)
    epochs = cfg.epochs or recipe.epochs

    def finals(best: RunSpec) -> list[RunSpec]:
        return [dataclasses.replace(best, phase="final", seed=seed) for seed in range(cfg.seeds)]

    if cfg.quick:
        return [], finals(
            RunSpec(
                "final",
                batch,
                optimizer,
                round_lr(recipe.peak_lr),
                cfg.warmup(recipe.warmup_epochs, recipe),
                0,
                epochs,
                cfg.subset,
                recipe.label_smoothing,
                recipe.power,
                cfg.workers,
                cfg.compression,
                cfg.compression_warmup,
                cfg.freeze_variance,
                cfg.model,
            )
        )
    centre = GRID_CENTRES[optimizer, batch]
    exponents = sorted({round(math.log2(f)) for f in cfg.lr_factors})
    for grown in range(cfg.extend + 1):
        grid = _grid(cfg, batch, optimizer, exponents)
        if any(s.key not in results for s in grid):
            return grid, []
        best = RunSpec(**best_run(results[s.key] for s in grid)["spec"])
        k = round(math.log2(best.lr / centre))
        if grown == cfg.extend or k not in (exponents[0], exponents[-1]):
            break
        exponents = sorted([*exponents, k + 1 if k == exponents[-1] else k - 1])
    tune = grid + (_without_techniques(cfg, best) if cfg.ablate else [])
    if any(s.key not in results for s in tune):
        return tune, []
    return tune, finals(RunSpec(**best_run(results[s.key] for s in tune)["spec"]))


def steps_to(curve: Sequence[dict[str, Any]], target: float) -> int | None:
    """The step of a run's first epoch whose accuracy reaches ``target`` (None: never)."""
    return next((c["step"] for c in curve if c["accuracy"] >= target), None)


def validation_target(cfg: StudyConfig, results: dict[str, dict[str, Any]]) -> float | None:
    """The tuning runs' target for time to accuracy: the baseline's best validation
    accuracy minus 0.01, rounded down to 0.001 (the test target's rule), once the
    baseline's tuning is done (None before)."""
    tune, _ = pair_plan(cfg, results, *BASELINE)
    if not tune or any(s.key not in results for s in tune):
        return None
    return math.floor((best_run(results[s.key] for s in tune)["accuracy"] - 0.01) * 1000) / 1000


def fastest_plan(
    cfg: StudyConfig, results: dict[str, dict[str, Any]], batch: int, optimizer: str
) -> tuple[list[RunSpec], list[RunSpec]]:
    """With ``cfg.time_to_accuracy``: the pair tuned for time to accuracy, as
    ``(tuning runs beyond pair_plan's, final runs)``. The pick is the tuning run that
    reaches :func:`validation_target` in the fewest steps (ties: the higher final accuracy,
    then the smaller lr and warmup); its final runs take ``cfg.seeds`` seeds.

    Tuned as :func:`pair_plan` tunes for accuracy, with a grid of its own: when the pick's
    lr is an edge of the lrs tried, the grid grows by one factor of 2 past that edge (every
    warmup of the batch, the techniques on), ``cfg.extend`` times at most. The accuracy
    pick keeps its own grid, so that asking for time to accuracy leaves the accuracy rows
    as they are. Empty until the pair's tuning and the baseline's are done, and the finals
    stay empty when no tuning run reaches the target."""
    if not cfg.time_to_accuracy:
        return [], []
    tune, _ = pair_plan(cfg, results, batch, optimizer)
    target = validation_target(cfg, results)
    if target is None or any(s.key not in results for s in tune):
        return [], []
    centre = GRID_CENTRES[optimizer, batch]
    extra: list[RunSpec] = []
    for grown in range(cfg.extend + 1):
        timed = [(steps_to(r["curve"], target), r) for r in (results[s.key] for s in (*tune, *extra))]
        reached = [(n, r) for n, r in timed if n is not None]
        if not reached:
            return extra, []
        _, best = min(
            reached,
            key=lambda x: (x[0], -x[1]["accuracy"], x[1]["spec"]["lr"], x[1]["spec"]["warmup_epochs"]),
        )
        spec = RunSpec(**best["spec"])
        lrs = [s.lr for s in (*tune, *extra)]
        if grown == cfg.extend or spec.lr not in (min(lrs), max(lrs)):
            break
        more = _grid(
            cfg, batch, optimizer, [round(math.log2(spec.lr / centre)) + (1 if spec.lr == max(lrs) else -1)]
        )
        extra += more
        if any(s.key not in results for s in more):
            return extra, []
    return extra, [dataclasses.replace(spec, phase="final", seed=seed) for seed in range(cfg.seeds)]


def plan(cfg: StudyConfig, results: dict[str, dict[str, Any]]) -> list[RunSpec]:
    """Every run still needed, given the finished ``results``. Pure: the same results give
    the same plan, so an interrupted study continues where it stopped."""
    needed: dict[str, RunSpec] = {}
    for pair in cfg.pairs():
        tune, final = pair_plan(cfg, results, *pair)
        fast_tune, fast_final = fastest_plan(cfg, results, *pair)
        for s in (*tune, *final, *fast_tune, *fast_final):
            if s.key not in results:
                needed.setdefault(s.key, s)
    return list(needed.values())


def held_out(n: int, subset: int | None) -> int:
    """How many of ``n`` training images a tuning run holds out for validation:
    :data:`VAL_SIZE` of the full set, a sixth of a ``subset``."""
    return VAL_SIZE if subset is None else n // 6


def run_steps(spec: RunSpec) -> int:
    """The optimizer steps ``spec`` takes: its epochs of ``N // batch`` steps, N the images
    it trains on (the training set or its first ``subset`` images, less those a tuning run
    holds out)."""
    n = FASHION_IMAGES if spec.subset is None else min(spec.subset, FASHION_IMAGES)
    if spec.phase == "tune":
        n -= held_out(n, spec.subset)
    return spec.epochs * (n // spec.batch)


def runs_left(cfg: StudyConfig, results: dict[str, dict[str, Any]]) -> list[RunSpec]:
    """The runs the study has still to run, at least: those :func:`plan` gives, and for
    each pair still tuning those it takes once its grid is done (the techniques switched
    off, the final runs, as if at the grid's first point). A grid that grows past an edge
    adds to them, and so may the runs of :func:`fastest_plan`."""
    todo = []
    for batch, optimizer in cfg.pairs():
        tune, final = pair_plan(cfg, results, batch, optimizer)
        fast_tune, fast = fastest_plan(cfg, results, batch, optimizer)
        todo += [s for s in (*tune, *final) if s.key not in results]
        todo += [s for s in (*fast_tune, *fast) if s.key not in results and s not in final]
        if not final and tune:
            if cfg.ablate and all(
                (s.label_smoothing, s.power) == (cfg.label_smoothing, cfg.power) for s in tune
            ):
                todo += _without_techniques(cfg, tune[0])
            todo += [dataclasses.replace(tune[0], phase="final", seed=seed) for seed in range(cfg.seeds)]
    return todo


def config_from_runs(results: dict[str, dict[str, Any]], given: dict[str, Any] | None = None) -> StudyConfig:
    """The settings of the study whose finished runs are ``results``, read from the runs
    alone (a study folder without ``settings.json``), with ``scale_warmups`` False: each
    run's warmup is taken as it is recorded.

    The pairs are those the runs hold, in the table's order. A study with tuning runs
    takes its label smoothing, poly power and warmups from its grids; ``extend`` and
    ``ablate`` come from a pair that reached its final runs where there is one (the
    defaults otherwise); ``seeds`` is the most any pair ran. Epochs, subset and the
    simulated workers must be the same for every run, unless ``given`` (values of
    these fields) says which to take. A ValueError says what the runs leave open."""
    given = given or {}
    specs = [RunSpec(**row["spec"]) for row in results.values()]
    if not specs:
        raise ValueError("no finished run to read the study's settings from")

    def one(name: str) -> Any:
        if name in given:
            return given[name]
        values = sorted({getattr(s, name) for s in specs}, key=repr)
        if len(values) > 1:
            raise ValueError(
                f"its runs differ in {name} ({', '.join(map(str, values))}): give --{name.replace('_', '-')}"
            )
        return values[0]

    def order(optimizer: str) -> tuple[int, str]:
        known = optimizer in STUDY_OPTIMIZERS
        return (STUDY_OPTIMIZERS.index(optimizer) if known else len(STUDY_OPTIMIZERS), optimizer)

    common = {name: one(name) for name in ("epochs", "subset", "model", *EXCHANGE_FIELDS)}
    specs = [s for s in specs if all(getattr(s, k) == v for k, v in common.items())]
    if not specs:
        raise ValueError(
            "none of its runs has "
            + ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in given.items())
        )
    pairs = sorted({(s.batch, s.optimizer) for s in specs}, key=lambda p: (p[0], order(p[1])))
    batches = tuple(sorted({b for b, _ in pairs}))
    optimizers = tuple(sorted({o for _, o in pairs}, key=order))
    finals = [s for s in specs if s.phase == "final"]
    tune = [s for s in specs if s.phase == "tune"]
    seeds = max(s.seed for s in finals) + 1 if finals else 1 if not tune else StudyConfig.seeds
    base = StudyConfig(
        quick=not tune,
        batches=batches,
        optimizers=optimizers,
        only=tuple(pairs),
        seeds=seeds,
        scale_warmups=False,
        **common,
    )
    if not tune:
        return base
    techniques = max(
        {(s.label_smoothing, s.power) for s in tune},
        key=lambda t: sum((s.label_smoothing, s.power) == t for s in tune),
    )
    grid = [s for s in tune if (s.label_smoothing, s.power) == techniques]
    small = tuple(sorted({s.warmup_epochs for s in grid if s.batch == BASELINE[0]}))
    large = tuple(sorted({s.warmup_epochs for s in grid if s.batch != BASELINE[0]}))
    ablate, extend = StudyConfig.ablate, StudyConfig.extend
    done = [p for p in pairs if any((s.batch, s.optimizer) == p for s in finals)]
    if done:
        # A pair with final runs has finished tuning: it ran the techniques' switches if
        # and only if ``ablate``, and its grid stopped growing inside (extend at least the
        # times it grew) or on an edge (extend exactly that).
        ablate = any((s.batch, s.optimizer) == done[0] and s not in grid for s in tune)
        factors = len({round(math.log2(f)) for f in StudyConfig.lr_factors})
        grown, on_edge = [0], []
        for batch, optimizer in done:
            mine = [results[s.key] for s in grid if (s.batch, s.optimizer) == (batch, optimizer)]
            if mine:
                lrs = {r["spec"]["lr"] for r in mine}
                grown.append(len(lrs) - factors)
                if best_run(mine)["spec"]["lr"] in (min(lrs), max(lrs)):
                    on_edge.append(grown[-1])
        extend = on_edge[0] if on_edge else max(extend, *grown)
    return dataclasses.replace(
        base,
        label_smoothing=techniques[0],
        power=techniques[1],
        ablate=ablate,
        extend=extend,
        small_warmups=small or StudyConfig.small_warmups,
        large_warmups=large or StudyConfig.large_warmups,
    )
