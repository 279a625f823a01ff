"""The plan of the steps-to-target study, pure (no framework, no files).

:class:`StepsConfig` says what to run; :class:`TrialSpec` is one run (its
:attr:`~TrialSpec.key` names it in ``runs.jsonl``); :func:`plan` gives every run that the
finished runs leave to run, so that a stopped study resumes where it stopped.

The method is Shallue et al. 2018 (arXiv 1811.03600, §3-4: the steps a run needs to reach
a validation target, against batch size, each point tuned by a quasi-random search) with
Nado et al. 2021's controls (arXiv 2102.06356: Nesterov momentum against LARS, AdamW
against LAMB, every optimizer searched over the same kind of space):

1. **Search.** At each (batch, optimizer) point, ``trials`` points of a scrambled Sobol
   sequence over the optimizer's space (:data:`SPACES`; the lr's range is centred on
   :func:`lr_centre`). Every trial runs on the tuning split (50,000 images; 10,000 held
   out for validation) with a linear warmup and a polynomial decay to zero over the
   batch's budget of steps (:func:`budget_steps`), and is scored every ``eval_images``
   images on the validation split.
2. **Target.** The smallest batch's trials run their whole budget first. The target is the
   lowest, over the optimizers, of their best validation accuracy, less ``margin``: every
   optimizer reaches it at the smallest batch, with that margin.
3. **Steps to target.** Every point's pick is the trial that reached the target in the
   fewest steps (the smallest batch's too). At the other batches a trial stops when it
   reaches the target, or at the fewest steps an earlier trial of its point took (it can
   no longer be the point's best), or at its budget. When the pick's lr lies in the
   lowest or highest ``1/trials`` of the lrs searched, ``trials`` more trials search a
   range moved one :data:`LR_SPAN` that way (``extend`` times at most), so that every
   pick's lr lies inside the space searched. Where no trial reached the target, the
   trial with the best validation accuracy takes the pick's place: on an edge, the range
   moves that way; inside, ``trials`` more trials continue the sequence over the same
   range, so that a point is called unreached only after ``trials x (extend + 1)`` trials,
   as many as a pick on an edge gets. (Whether the smallest batch's range extends is
   decided by its best validation accuracy: its target is not known yet.)
4. **Seeds.** The pick runs again with ``seeds`` new seeds to its target (their median
   is the point's steps to target; :mod:`largebatch.study.steps.fits` fits S(B)), and with
   seeds ``0..seeds-1`` for ``final_epochs`` epochs on the whole training set, scored on
   the test set: final accuracy at a fixed epoch budget, paired by seed across optimizers
   and batches. Where a paired interval crosses its threshold, up to ``max_seeds`` seeds.
   A point no trial brought to the target has no steps to it; its final runs take its
   most accurate trial (:func:`final_pick`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Sequence
from typing import Any

from largebatch import checks

__all__ = [
    "BATCHES",
    "LR_BASE",
    "LR_SPAN",
    "MODELS",
    "OPTIMIZERS",
    "SPACES",
    "Dimension",
    "StepsConfig",
    "TrialSpec",
    "budget_steps",
    "check_config",
    "comparisons",
    "contested",
    "eval_every",
    "final_accuracies",
    "final_pick",
    "final_runs",
    "lr_centre",
    "pick",
    "plan",
    "point_pick",
    "point_trials",
    "seed_runs",
    "sobol_points",
    "steps_to",
    "target",
    "train_images",
]

BATCHES = (64, 256, 1024, 4096, 16384)
OPTIMIZERS = ("nesterov", "adamw", "lars", "lamb")
MODELS = ("fmnist_cnn", "fmnist_alexnet_bn", "small_resnet")
TUNE_IMAGES = 50_000  # the tuning split: Fashion-MNIST's 60,000 training images less 10,000
FINAL_IMAGES = 60_000

# The lr's range at batch B: lr_centre(optimizer, B) / LR_SPAN to lr_centre * LR_SPAN, each
# extension one LR_SPAN further. The centres follow the square-root rule from a rate at
# B=256: SGD's 0.1 x 256/128 from Goyal et al.'s 0.1 per 256 scaled by the study's
# earlier 0.2 at 128; AdamW and LAMB near BERT's and You et al. 2019's rates; LARS's with
# a trust coefficient near 0.001, as in the MLPerf submissions.
LR_BASE = {"nesterov": 0.3, "adamw": 0.002, "lars": 6.0, "lamb": 0.03}
LR_SPAN = 10.0


@dataclasses.dataclass(frozen=True)
class Dimension:
    """One hyperparameter of the search: ``u`` in [0, 1) maps to ``low..high`` uniformly
    (``scale="linear"``), log-uniformly (``"log"``), or with ``1 - value`` log-uniform
    (``"log1m"``: momentum and the betas, whose distance from 1 is what matters)."""

    name: str
    low: float
    high: float
    scale: str = "log"

    def value(self, u: float) -> float:
        if self.scale == "linear":
            return self.low + u * (self.high - self.low)
        if self.scale == "log":
            return math.exp(math.log(self.low) + u * (math.log(self.high) - math.log(self.low)))
        near, far = math.log(1 - self.low), math.log(1 - self.high)
        return 1 - math.exp(near + u * (far - near))

    def position(self, value: float) -> float:
        """Where ``value`` lies in the range, from 0 (``low``) to 1 (``high``)."""
        if self.scale == "linear":
            return (value - self.low) / (self.high - self.low)
        if self.scale == "log":
            return math.log(value / self.low) / math.log(self.high / self.low)
        return math.log((1 - value) / (1 - self.low)) / math.log((1 - self.high) / (1 - self.low))


_WARMUP = Dimension("warmup", 0.0, 0.5, "linear")  # a fraction of the budget's steps
_POWER = Dimension("power", 0.5, 3.0, "linear")  # poly decay to 0: lr * (1 - t)**power
_COUPLED_DECAY = Dimension("weight_decay", 1e-5, 1e-2)  # added to the gradient (SGD, LARS)
_DECOUPLED_DECAY = Dimension("weight_decay", 1e-3, 1.0)  # times lr, off the weights (AdamW, LAMB)
_MOMENTUM = Dimension("momentum", 0.5, 0.995, "log1m")
_BETA1 = Dimension("beta1", 0.5, 0.99, "log1m")
_BETA2 = Dimension("beta2", 0.9, 0.999, "log1m")
# Every optimizer's space, the lr first (its range set per batch by lr_centre).
SPACES: dict[str, tuple[Dimension, ...]] = {
    "nesterov": (_WARMUP, _COUPLED_DECAY, _MOMENTUM, _POWER),
    "adamw": (_WARMUP, _DECOUPLED_DECAY, _BETA1, _BETA2, _POWER),
    "lars": (_WARMUP, _COUPLED_DECAY, _MOMENTUM, Dimension("trust_coefficient", 1e-4, 1e-2), _POWER),
    "lamb": (_WARMUP, _DECOUPLED_DECAY, _BETA1, _BETA2, _POWER),
}
HYPERPARAMETERS = ("lr", "warmup", "weight_decay", "momentum", "beta1", "beta2", "trust_coefficient", "power")


def lr_centre(optimizer: str, batch: int) -> float:
    """The centre of the lr's range at ``batch``: :data:`LR_BASE` times sqrt(batch / 256)."""
    return LR_BASE[optimizer] * math.sqrt(batch / 256)


def lr_dimension(optimizer: str, batch: int, shift: int = 0) -> Dimension:
    """The lr's range at ``batch``, moved ``shift`` :data:`LR_SPAN` up (or down)."""
    centre = lr_centre(optimizer, batch) * LR_SPAN**shift
    return Dimension("lr", centre / LR_SPAN, centre * LR_SPAN)


@dataclasses.dataclass(frozen=True)
class StepsConfig:
    """What the study runs (``OUT/settings.json``) and where (``out``, ``jobs``, ...)."""

    model: str = "fmnist_cnn"
    batches: tuple[int, ...] = BATCHES
    optimizers: tuple[str, ...] = OPTIMIZERS
    trials: int = 16  # per point, and per extension
    extend: int = 2
    search_seed: int = 0  # the Sobol sequence's scrambling
    # The budget in epochs at batch B: budget_epochs * (1 + B / budget_batch), as images
    # to a target grow past the critical batch (McCandlish et al. 2018, eq. 2.11)
    budget_epochs: float = 2.5
    budget_batch: int = 1024
    eval_images: int = 10_000  # the validation split is scored every this many images
    margin: float = 0.01
    seeds: int = 5
    max_seeds: int = 10
    final_epochs: int = 10
    threshold: float = 0.005  # "within": accuracy less than this below the reference
    ghost_batch: int = 128
    augment: int = 2  # the random crop's padding (0: no augmentation); flips with it
    subset: int | None = None  # the first N training and test images (tests; a sixth held out)
    out: str = "runs/steps"
    data: str | None = None
    jobs: int | None = None
    threads: int | None = None
    device: str = "cpu"
    report_only: bool = False

    def settings(self) -> dict[str, Any]:
        """What the study runs, as JSON values: every field but where and how."""
        where = {"out", "data", "jobs", "threads", "device", "report_only"}
        return {
            f.name: list(getattr(self, f.name))
            if isinstance(getattr(self, f.name), tuple)
            else getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in where
        }

    def points(self) -> list[tuple[int, str]]:
        return [(b, o) for b in self.batches for o in self.optimizers]


def check_config(cfg: StepsConfig) -> None:
    """Raise ValueError, in one line naming the value, for a setting the study cannot run."""
    checks.choice("model", cfg.model, MODELS)
    if not cfg.batches or not cfg.optimizers:
        raise ValueError("Invalid batches or optimizers: both must name at least one")
    if cfg.subset is not None:
        checks.integer("subset", cfg.subset, 6)
    for b in cfg.batches:
        checks.integer("batch", b, 1)
        if b > train_images(cfg.subset, "search"):
            raise ValueError(
                f"Invalid batch {b}: more than the {train_images(cfg.subset, 'search'):,} tuning images"
            )
        if b > cfg.ghost_batch and b % cfg.ghost_batch:
            raise ValueError(f"Invalid batch {b}: not a multiple of the ghost batch {cfg.ghost_batch}")
    if list(cfg.batches) != sorted(set(cfg.batches)):
        raise ValueError(f"Invalid batches {list(cfg.batches)}: they must increase")
    for o in cfg.optimizers:
        checks.choice("optimizer", o, OPTIMIZERS)
    for name, low in (
        ("trials", 2),
        ("extend", 0),
        ("search_seed", 0),
        ("budget_batch", 1),
        ("eval_images", 1),
    ):
        checks.integer(name, getattr(cfg, name), low)
    for name, low in (("seeds", 2), ("final_epochs", 1), ("ghost_batch", 1), ("augment", 0)):
        checks.integer(name, getattr(cfg, name), low)
    checks.integer("max_seeds", cfg.max_seeds, cfg.seeds)
    checks.number("budget_epochs", cfg.budget_epochs, 0.0)
    checks.number("margin", cfg.margin, 0.0, high=1.0, strict=False)
    checks.number("threshold", cfg.threshold, 0.0, high=1.0, strict=False)
    checks.choice("device", cfg.device, ("cpu", "cuda"))
    for name in ("jobs", "threads"):
        if getattr(cfg, name) is not None:
            checks.integer(name, getattr(cfg, name), 1)


def train_images(subset: int | None, kind: str) -> int:
    """The images a run of ``kind`` trains on: the tuning split (the training set less
    10,000, or less a sixth of a ``subset``) or, for ``"final"``, the whole training set."""
    if subset is None:
        return FINAL_IMAGES if kind == "final" else TUNE_IMAGES
    return subset if kind == "final" else subset - subset // 6


def budget_steps(cfg: StepsConfig, batch: int) -> int:
    """The steps of a search trial's schedule at ``batch``: ``budget_epochs * (1 + batch /
    budget_batch)`` epochs of the tuning split, rounded up."""
    epochs = cfg.budget_epochs * (1 + batch / cfg.budget_batch)
    return math.ceil(epochs * train_images(cfg.subset, "search") / batch)


def eval_every(cfg: StepsConfig, batch: int) -> int:
    """Steps between two scores of the validation split: ``eval_images`` images, at least 1."""
    return max(1, round(cfg.eval_images / batch))


def _round(value: float) -> float:
    return float(f"{value:.4g}")  # stable keys: 4 significant digits


@dataclasses.dataclass(frozen=True)
class TrialSpec:
    """One run. ``kind``: ``"search"`` (Sobol point ``index`` of its point, seed 0),
    ``"steps"`` (the pick again, another seed, to the target) or ``"final"`` (the pick on the
    whole training set for ``steps`` steps, scored on the test set). A run stops at
    ``limit`` steps (None: at ``steps``, the length of its schedule) or, with a
    ``target``, when the validation accuracy reaches it."""

    kind: str
    model: str
    batch: int
    optimizer: str
    index: int
    seed: int
    lr: float
    warmup: float
    weight_decay: float
    power: float
    steps: int
    eval_every: int
    momentum: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    trust_coefficient: float | None = None
    limit: int | None = None
    target: float | None = None
    ghost_batch: int = 128
    augment: int = 2
    subset: int | None = None
    shift: int = 0  # the lr's range: lr_dimension(optimizer, batch, shift)

    @functools.cached_property
    def key(self) -> str:
        """The run's identity in ``runs.jsonl``: every field, as sorted JSON. Computed once
        per spec (the plan looks runs up by it thousands of times); every field is a
        scalar, so the fields' values are the dict ``dataclasses.asdict`` would copy."""
        return json.dumps({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, sort_keys=True)

    @property
    def point(self) -> tuple[int, str]:
        return self.batch, self.optimizer

    def value(self, name: str) -> float:
        """The run's ``name`` (a ValueError when its optimizer has none)."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"a {self.optimizer} run has no {name}")
        return float(value)

    def hyperparameters(self) -> dict[str, float]:
        """The searched values, by name (:data:`HYPERPARAMETERS`; those the optimizer has)."""
        values = {name: getattr(self, name) for name in HYPERPARAMETERS}
        return {k: v for k, v in values.items() if v is not None}

    def describe(self) -> str:
        hp = " ".join(f"{k}={v:.3g}" for k, v in self.hyperparameters().items())
        return f"{self.kind:<6} B={self.batch:<5} {self.optimizer:<8} #{self.index:<2} seed={self.seed} {hp}"


@functools.lru_cache(maxsize=64)
def sobol_points(dimension: int, n: int, seed: int) -> tuple[tuple[float, ...], ...]:
    """The first ``n`` points of the scrambled Sobol sequence in ``dimension`` dimensions
    (``torch.quasirandom.SobolEngine``, in float64): the same points on every machine."""
    import torch

    engine = torch.quasirandom.SobolEngine(dimension, scramble=True, seed=seed)
    return tuple(map(tuple, engine.draw(n, dtype=torch.float64).tolist()))


def _search_spec(
    cfg: StepsConfig, batch: int, optimizer: str, index: int, u: Sequence[float], shift: int
) -> TrialSpec:
    """Search trial ``index`` of a point: Sobol point ``u`` mapped to the optimizer's space,
    the lr's range moved ``shift`` :data:`LR_SPAN` (:func:`lr_dimension`)."""
    values = {"lr": lr_dimension(optimizer, batch, shift).value(u[0])}
    values.update({d.name: d.value(x) for d, x in zip(SPACES[optimizer], u[1:])})
    fields: dict[str, Any] = {k: _round(v) for k, v in values.items()}
    return TrialSpec(
        "search",
        cfg.model,
        batch,
        optimizer,
        index,
        0,
        steps=budget_steps(cfg, batch),
        eval_every=eval_every(cfg, batch),
        ghost_batch=cfg.ghost_batch,
        augment=cfg.augment,
        subset=cfg.subset,
        shift=shift,
        **fields,
    )


def point_trials(
    cfg: StepsConfig, results: dict[str, dict[str, Any]], batch: int, optimizer: str
) -> tuple[list[TrialSpec], bool]:
    """The search trials of a point as far as ``results`` settle them, and whether its
    search is done (module docstring, steps 1-3). Past the smallest batch, each trial's
    ``limit`` follows from the trials before it, so they run one after another; trials
    past the first ``trials`` are the extensions, each block ``trials`` Sobol points
    further along the sequence."""
    points = sobol_points(1 + len(SPACES[optimizer]), cfg.trials * (cfg.extend + 1), cfg.search_seed)
    smallest = batch == cfg.batches[0]
    goal = None if smallest else target(cfg, results)
    if goal is None and not smallest:
        return [], False
    specs: list[TrialSpec] = []
    shifts = [0]
    for block in range(cfg.extend + 1):
        for index in range(block * cfg.trials, (block + 1) * cfg.trials):
            spec = _search_spec(cfg, batch, optimizer, index, points[index], shifts[-1])
            if goal is not None:
                best = _fewest_steps(specs, results, goal)
                spec = dataclasses.replace(
                    spec, target=goal, limit=None if best is None or best >= spec.steps else best
                )
            specs.append(spec)
            if goal is not None and spec.key not in results:
                return specs, False  # the next trial's limit waits for this one
        if any(s.key not in results for s in specs):
            return specs, False
        if block == cfg.extend:
            break
        chosen = pick(specs, results, goal)
        unreached = chosen is None
        if unreached:  # no trial reached the target: the best validation accuracy leads
            chosen = pick(specs, results, None)
        assert chosen is not None  # every trial of the block has finished
        lrs = sorted(s.lr for s in specs)
        edge = len(lrs) // cfg.trials  # the lowest or highest 1/trials of the lrs tried
        if chosen.lr in lrs[:edge]:
            shifts.append(min(shifts) - 1)
        elif chosen.lr in lrs[-edge:]:
            shifts.append(max(shifts) + 1)
        elif unreached:
            shifts.append(shifts[-1])  # the next Sobol points, over the same range
        else:
            break
    return specs, True


def steps_to(row: dict[str, Any], goal: float) -> int | None:
    """The first scored step of a run whose validation accuracy reaches ``goal`` (None:
    never, within the steps it ran)."""
    return next((c["step"] for c in row["curve"] if c["accuracy"] >= goal), None)


def _fewest_steps(specs: Iterable[TrialSpec], results: dict[str, dict[str, Any]], goal: float) -> int | None:
    steps = [steps_to(results[s.key], goal) for s in specs if s.key in results]
    reached = [n for n in steps if n is not None]
    return min(reached) if reached else None


def pick(
    specs: Sequence[TrialSpec], results: dict[str, dict[str, Any]], goal: float | None
) -> TrialSpec | None:
    """The trial that reached ``goal`` in the fewest steps (ties: the first); with ``goal``
    None (the smallest batch's search, before the target is set, and a point no trial
    reached: whether and which way its search goes on) the one with the best validation
    accuracy."""
    if goal is None:
        done = [s for s in specs if s.key in results]
        return max(done, key=lambda s: max(c["accuracy"] for c in results[s.key]["curve"]), default=None)
    timed = [(steps_to(results[s.key], goal), s.index, s) for s in specs if s.key in results]
    reached = [t for t in timed if t[0] is not None]
    return min(reached, key=lambda t: (t[0], t[1]))[2] if reached else None


def target(cfg: StepsConfig, results: dict[str, dict[str, Any]]) -> float | None:
    """The validation target (module docstring, step 2), once the smallest batch's search
    is done (None before): the lowest over the optimizers of their best trial's best
    validation accuracy, less ``margin``, rounded down to 0.001."""
    best = []
    for optimizer in cfg.optimizers:
        specs, done = point_trials(cfg, results, cfg.batches[0], optimizer)
        if not done:
            return None
        best.append(max(c["accuracy"] for s in specs for c in results[s.key]["curve"]))
    return math.floor((min(best) - cfg.margin) * 1000 + 1e-9) / 1000


def point_pick(
    cfg: StepsConfig, results: dict[str, dict[str, Any]], batch: int, optimizer: str
) -> TrialSpec | None:
    """The point's pick: of its finished search, the trial that reached the target in the
    fewest steps, at every batch alike (at the smallest batch too, once the target is
    known: its trials ran their whole budget, so each one's steps to the target are
    known). None while the search or the target is not settled, or where no trial
    reached the target."""
    specs, done = point_trials(cfg, results, batch, optimizer)
    goal = target(cfg, results)
    return pick(specs, results, goal) if done and goal is not None else None


def seed_runs(
    cfg: StepsConfig, results: dict[str, dict[str, Any]], batch: int, optimizer: str
) -> list[TrialSpec]:
    """The pick of a finished search again with seeds ``1..seeds``, each to the target
    (module docstring, step 4); empty until the search and the target are settled."""
    chosen, goal = point_pick(cfg, results, batch, optimizer), target(cfg, results)
    if chosen is None or goal is None:
        return []
    again = dataclasses.replace(chosen, kind="steps", target=goal, limit=None)
    return [dataclasses.replace(again, seed=seed) for seed in range(1, cfg.seeds + 1)]


def final_pick(
    cfg: StepsConfig, results: dict[str, dict[str, Any]], batch: int, optimizer: str
) -> TrialSpec | None:
    """The trial whose settings the final runs take: the point's pick, or, where its
    search ended with no trial reaching the target, its trial with the best validation
    accuracy (as at the smallest batch before the target is known), so that final
    accuracy at the fixed budget is compared at every point. None while the search or the
    target is not settled."""
    chosen = point_pick(cfg, results, batch, optimizer)
    if chosen is not None or target(cfg, results) is None:
        return chosen
    specs, done = point_trials(cfg, results, batch, optimizer)
    return pick(specs, results, None) if done else None


def final_runs(
    cfg: StepsConfig, results: dict[str, dict[str, Any]], batch: int, optimizer: str, seeds: int
) -> list[TrialSpec]:
    """The final pick (:func:`final_pick`) trained for ``final_epochs`` epochs on the whole
    training set with seeds ``0..seeds-1``, its schedule (warmup fraction, decay) over those
    steps, scored on the test set once an epoch; empty until the pick is settled."""
    chosen = final_pick(cfg, results, batch, optimizer)
    if chosen is None:
        return []
    per_epoch = train_images(cfg.subset, "final") // batch
    final = dataclasses.replace(
        chosen,
        kind="final",
        steps=cfg.final_epochs * per_epoch,
        eval_every=per_epoch,
        limit=None,
        target=None,
    )
    return [dataclasses.replace(final, seed=seed) for seed in range(seeds)]


def comparisons(cfg: StepsConfig) -> list[tuple[tuple[int, str], tuple[int, str], float]]:
    """The paired comparisons of final accuracy the study reports, as ``(point, reference
    point, threshold)``: at each batch LARS against Nesterov and LAMB against AdamW (Nado
    et al. 2021's pairs) and LAMB against LARS, against 0; each point against its optimizer
    at the smallest batch, against ``-threshold`` (within ``threshold`` of it)."""
    out = []
    pairs = (("lars", "nesterov"), ("lamb", "adamw"), ("lamb", "lars"))
    for b in cfg.batches:
        out += [((b, x), (b, y), 0.0) for x, y in pairs if x in cfg.optimizers and y in cfg.optimizers]
    small = cfg.batches[0]
    out += [((b, o), (small, o), -cfg.threshold) for b in cfg.batches[1:] for o in cfg.optimizers]
    return out


def final_accuracies(
    cfg: StepsConfig, results: dict[str, dict[str, Any]], batch: int, optimizer: str
) -> list[float]:
    """The test accuracies of a point's final runs, by seed, as far as they are finished
    in order (seed 0, 1, ... up to the first missing one)."""
    out = []
    for spec in final_runs(cfg, results, batch, optimizer, cfg.max_seeds):
        if spec.key not in results:
            break
        out.append(results[spec.key]["accuracy"])
    return out


def contested(cfg: StepsConfig, results: dict[str, dict[str, Any]]) -> set[tuple[int, str]]:
    """The points whose final runs take ``max_seeds`` seeds: those in a comparison
    (:func:`comparisons`) whose interval over ``seeds`` seeds crosses its threshold."""
    from largebatch.study.steps.fits import paired_interval

    out: set[tuple[int, str]] = set()
    for point, reference, threshold in comparisons(cfg):
        a, b = final_accuracies(cfg, results, *point), final_accuracies(cfg, results, *reference)
        if min(len(a), len(b)) >= cfg.seeds and cfg.max_seeds > cfg.seeds:
            n = cfg.seeds
            if paired_interval(a[:n], b[:n]).crosses(threshold):
                out |= {point, reference}
    return out


def plan(cfg: StepsConfig, results: dict[str, dict[str, Any]]) -> list[TrialSpec]:
    """Every run that can start now, given the finished ``results``, in the order to run
    them: the smallest batch's searches (the target waits for them), then batch by batch
    its searches, seeds and final runs, so that a study stopped part-way has whole rows.
    A point's searches run one after another, so the points of a batch and its seeds
    keep the jobs busy. Pure: a stopped study plans the same runs again."""
    more = contested(cfg, results)
    order: list[TrialSpec] = []
    for optimizer in cfg.optimizers:  # the target waits for these
        order += point_trials(cfg, results, cfg.batches[0], optimizer)[0]
    for batch in cfg.batches:
        searches, seeds, finals = [], [], []
        for optimizer in cfg.optimizers:
            searches += point_trials(cfg, results, batch, optimizer)[0]
            seeds += seed_runs(cfg, results, batch, optimizer)
            n = cfg.max_seeds if (batch, optimizer) in more else cfg.seeds
            finals += final_runs(cfg, results, batch, optimizer, n)
        order += searches + seeds + finals
    needed: dict[str, TrialSpec] = {}
    for spec in order:
        if spec.key not in results:
            needed.setdefault(spec.key, spec)
    return list(needed.values())
