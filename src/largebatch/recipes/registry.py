"""Named training recipes as data: model, data set, optimizer, schedule, precision, batch.

A :class:`Recipe` is one row; :data:`RECIPES` holds them by name, each with its source
(docs/design.md §6, docs/recipes.md). This module imports no framework.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from largebatch import checks
from largebatch.lars.sources import SOURCES, source_keywords
from largebatch.outputs import rounded

__all__ = [
    "COMPRESSIONS",
    "DATA_SETS",
    "FASHION_SETTINGS",
    "OPTIMIZERS",
    "PRECISIONS",
    "TRAIN_IMAGES",
    "Recipe",
    "RECIPES",
    "get_recipe",
    "imagenet_equivalent",
    "recipes_markdown",
    "recipes_table",
]

DATA_SETS = ("imagenet", "fashion-mnist")
OPTIMIZERS = ("lars", "lamb", "sgd", "nesterov")
PRECISIONS = ("fp32", "fp16", "bf16")
# How data-parallel workers exchange gradients (``largebatch train`` and ``largebatch study``).
COMPRESSIONS = ("none", "adacomp")
MODELS = ("resnet50", "alexnet_bn", "fmnist_cnn", "fmnist_alexnet_bn", "small_cnn", "small_resnet")
DECAY_EXCLUDES = ("bn_bias", "bn", "none", "nvidia")
# How a source turns epochs into steps (``Recipe.epoch_steps``):
#   floor: an epoch is N // B steps of a fresh shuffle, the last N % B images unused
#          (PyTorch's drop_last; this package's own recipes);
#   ceil:  an epoch is ceil(N / B) steps, taken from one stream of shuffled passes over
#          the data, so an epoch's last batch runs on into the next pass (NVIDIA's MLPerf
#          MXNet, common/fit.py: the epoch size rounded up, DALI's reader never stops);
#   exact: the same stream, epoch e ending at step round(e * N / B) (the LAMB authors'
#          code takes its warmup and total step counts as flags: run.sh's 782 and 3,519
#          for 20 and 90 epochs at B = 32,768).
EPOCH_STEPS = ("floor", "ceil", "exact")
TRAIN_IMAGES = {"imagenet": 1_281_167, "fashion-mnist": 60_000}


def imagenet_equivalent(batch: int, n_train: int) -> int:
    """The ImageNet batch taking the same fraction of an epoch per step: ``B * 1,281,167 / N``.

    >>> imagenet_equivalent(1536, 60_000)
    32798
    """
    checks.integer("batch", batch, 1)
    checks.integer("n_train", n_train, 1)
    return round(batch * TRAIN_IMAGES["imagenet"] / n_train)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One training recipe. Give ``lr`` (the peak rate) or ``base_lr`` (at ``base_batch``,
    scaled linearly to ``batch_size``), not both. ``milestones`` (epochs) are for the
    ``step`` schedule; ``power`` for ``poly``."""

    name: str
    model: str
    data: str
    optimizer: str
    batch_size: int
    epochs: int
    lr: float | None = None
    base_lr: float | None = None
    base_batch: int = 256
    optimizer_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    schedule: str = "poly"
    warmup_epochs: float = 0.0
    power: float = 2.0
    milestones: tuple[float, ...] = ()
    precision: str = "fp32"
    label_smoothing: float = 0.0
    weight_decay: float = 0.0
    # no decay or adaptation on: bn_bias, bn (only) or none; nvidia: as bn_bias, but the
    # fully connected layers' biases decayed (not adapted), as NVIDIA's MLPerf LARS
    decay_exclude: str = "bn_bias"
    init_lr: float = 0.0  # the rate the warmup starts from
    end_lr: float = 0.0  # the rate poly or cosine decay ends at
    schedule_offset: int = 0  # the schedule's counter at the first step (MXNet's: 1)
    epoch_steps: str = "floor"  # the source's step arithmetic: EPOCH_STEPS
    # Each process clips its own gradients to this global norm before the all-reduce,
    # which then sums them (the LAMB authors' TPU cores): ``largebatch train`` registers
    # comm.torch.local_clip_hook under torchrun, in place of the optimizer's clipping.
    clip_per_process: float | None = None
    paper: str = ""
    source: str = ""  # where each value comes from: arXiv id + table/section, or repo + file
    unstated: str = ""  # what the source leaves open, and the value used here
    published_top1: float | None = None
    note: str = ""

    def __post_init__(self) -> None:
        for field, allowed in (
            ("model", MODELS),
            ("data", DATA_SETS),
            ("optimizer", OPTIMIZERS),
            ("precision", PRECISIONS),
        ):
            if getattr(self, field) not in allowed:
                raise ValueError(
                    f"Recipe {self.name!r}: unknown {field} {getattr(self, field)!r}; "
                    f"known: {', '.join(allowed)}"
                )
        if (self.lr is None) == (self.base_lr is None):
            raise ValueError(f"Recipe {self.name!r}: give exactly one of lr and base_lr")
        if self.epoch_steps not in EPOCH_STEPS:
            raise ValueError(
                f"Recipe {self.name!r}: unknown epoch_steps {self.epoch_steps!r}; "
                f"known: {', '.join(EPOCH_STEPS)}"
            )
        if self.decay_exclude not in DECAY_EXCLUDES:
            raise ValueError(
                f"Recipe {self.name!r}: unknown decay_exclude "
                f"{self.decay_exclude!r}; known: {', '.join(DECAY_EXCLUDES)}"
            )
        for field in ("batch_size", "epochs", "base_batch"):
            if not (isinstance(getattr(self, field), int) and getattr(self, field) > 0):
                raise ValueError(f"Recipe {self.name!r}: invalid {field} {getattr(self, field)!r}")

    @property
    def peak_lr(self) -> float:
        """The rate at the end of warmup for ``batch_size`` (linear scaling if ``base_lr``)."""
        return self.lr_for(self.batch_size)

    def lr_for(self, batch_size: int) -> float:
        """The peak rate at ``batch_size``, scaled linearly from ``lr`` at the recipe's own
        batch or from ``base_lr`` at ``base_batch``; at the recipe's own batch, exactly
        ``lr`` (``0.09 * 3072 / 3072`` is not 0.09 in floating point)."""
        if self.lr is not None:
            return self.lr * (batch_size / self.batch_size)
        assert self.base_lr is not None  # __post_init__: exactly one of lr and base_lr
        return self.base_lr * batch_size / self.base_batch

    def with_epochs(self, epochs: int) -> Recipe:
        """This recipe over ``epochs`` epochs, its schedule stretched or shrunk to match:
        warmup and milestones scale by ``epochs / self.epochs``, so a shortened run keeps
        the recipe's shape (warmup, then decay) instead of ending inside its warmup."""
        checks.integer("epochs", epochs, 1)
        if epochs == self.epochs:
            return self
        scale = epochs / self.epochs
        return dataclasses.replace(
            self,
            epochs=epochs,
            warmup_epochs=self.warmup_epochs * scale,
            milestones=tuple(m * scale for m in self.milestones),
        )

    def epoch_length(self, n_train: int, batch: int) -> float:
        """Steps per epoch of ``n_train`` images at ``batch`` under the recipe's
        ``epoch_steps``: ``N // B``, ``ceil(N / B)`` or, for ``exact``, ``N / B``
        (fractional). Warmup and milestones, in epochs, become ``round(epochs * this)``."""
        checks.integer("n_train", n_train, 1)
        checks.integer("batch", batch, 1)
        if self.epoch_steps == "floor":
            return n_train // batch
        if self.epoch_steps == "ceil":
            return -(-n_train // batch)
        return n_train / batch

    def epoch_end(self, epoch: int, n_train: int, batch: int) -> int:
        """The number of steps run when ``epoch`` epochs of ``n_train`` images at ``batch``
        are done: ``epoch`` whole epochs, or for ``exact`` ``round(epoch * N / B)``,
        computed in integers."""
        length = self.epoch_length(n_train, batch)  # checks n_train and batch
        if self.epoch_steps == "exact":
            return (2 * epoch * n_train + batch) // (2 * batch)  # halves round up
        return epoch * int(length)

    def steps_at(self, n_train: int, batch: int, epochs: int | None = None) -> tuple[int, int]:
        """(warmup, total) steps of a run of ``epochs`` (default: the recipe's) epochs of
        ``n_train`` images at ``batch``, the warmup scaled with the epochs as
        :meth:`with_epochs` does."""
        shape = self.with_epochs(self.epochs if epochs is None else epochs)
        total = shape.epoch_end(shape.epochs, n_train, batch)
        return min(round(shape.warmup_epochs * shape.epoch_length(n_train, batch)), total), total

    @property
    def steps(self) -> tuple[int, int]:
        """(warmup, total) steps of a full run at the recipe's own data set, batch and
        epochs, under its source's step arithmetic (``epoch_steps``)."""
        return self.steps_at(TRAIN_IMAGES[self.data], self.batch_size)

    @property
    def imagenet_batch(self) -> int:
        return imagenet_equivalent(self.batch_size, TRAIN_IMAGES[self.data])

    @property
    def schedule_text(self) -> str:
        warm = f"{rounded(self.warmup_epochs)}-epoch warmup, " if self.warmup_epochs else ""
        if self.schedule == "step":
            return warm + "x0.1 at " + "/".join(rounded(m) for m in self.milestones)
        if self.schedule == "poly":
            return warm + f"poly {self.power:g}"
        return warm + self.schedule


GOYAL = "Goyal et al. 2017, https://arxiv.org/abs/1706.02677"
YOU_LARS = "You, Gitman, Ginsburg 2017, https://arxiv.org/abs/1708.03888"
LAMB_CODE = (
    "You et al. 2019 (LAMB, https://arxiv.org/abs/1904.00962): the authors' "
    "ResNet-50 code, https://github.com/fastalgo/imagenet_resnet50_lamb"
)
MLPERF_NVIDIA = (
    "MLPerf Training v0.7, NVIDIA's closed-division ResNet-50 (MXNet, LARS), "
    "https://github.com/mlcommons/training_results_v0.7"
)
OURS = "largebatch (this project)"

_NVIDIA_DIR = "NVIDIA/benchmarks/resnet/implementations/mxnet"
_NVIDIA_OPEN = SOURCES["nvidia-mxnet"].open
_LARS_V3 = "arXiv:1708.03888v3"


def _alexnet_bn_lars(batch: int, *, lr: float, top1: float, note: str = "") -> Recipe:
    """An AlexNet-BN row of You, Gitman, Ginsburg 2017 (v3), Table 3(b): the rows differ
    only in batch, lr and top-1."""
    return Recipe(
        f"alexnet-bn-lars-{batch // 1024}k",
        "alexnet_bn",
        "imagenet",
        "lars",
        batch,
        100,
        lr=lr,
        optimizer_kwargs={"momentum": 0.9, "trust_coefficient": 0.001, "eps": 0.0},
        schedule="poly",
        power=2.0,
        warmup_epochs=5,
        weight_decay=5e-4,
        paper=YOU_LARS,
        published_top1=top1,
        source=f"{_LARS_V3} Table 3(b) (AlexNet-BN, warmup 5 epochs: B={batch // 1024}K, lr "
        f"{lr:g}, {top1:g}% top-1), footnote 6 (100 epochs, momentum 0.9, weight decay "
        "5e-4, poly(2), eta 0.001)",
        unstated="eps (none in Algorithm 1; 0 here); which params skip decay and adaptation "
        "(BN and biases here); precision (fp32 here). Checked against the ICLR 2018 "
        "version of the paper (Table 3(b), §5: the same values, in the text rather "
        "than a footnote); v3 itself not checked",
        note=note,
    )


_IMAGENET = [
    Recipe(
        "resnet50-goyal-8k",
        "resnet50",
        "imagenet",
        "nesterov",
        8192,
        90,
        base_lr=0.1,
        optimizer_kwargs={"momentum": 0.9},
        schedule="step",
        warmup_epochs=5,
        init_lr=0.1,
        milestones=(30, 60, 80),
        weight_decay=1e-4,
        decay_exclude="bn",
        paper=GOYAL,
        published_top1=76.26,
        source="arXiv:1706.02677 §5.1 (lr 0.1 x kn/256, x0.1 at epochs 30/60/80, 90 epochs, "
        "Nesterov momentum 0.9, weight decay 1e-4 not on BN gamma/beta, last BN gamma "
        "of each residual block 0), §2.2 and §5.2 (gradual warmup from 0.1 to 3.2 "
        "over 5 epochs; kn = 256 x 32 = 8k), Table 1 (23.74 ± 0.09 % top-1 error)",
        unstated="precision (fp32 here); decay of the fc bias (decayed here); label "
        "smoothing (none mentioned; 0 here)",
        note="BN statistics over each worker's 32 images; momentum correction when the lr "
        "changes (§3); top-1 is the median of the last 5 epochs, mean of 5 runs",
    ),
    Recipe(
        "resnet50-lars-32k",
        "resnet50",
        "imagenet",
        "lars",
        32768,
        90,
        lr=2.9,
        optimizer_kwargs={"momentum": 0.9, "trust_coefficient": 0.001, "eps": 0.0},
        schedule="poly",
        power=2.0,
        warmup_epochs=5,
        weight_decay=1e-4,
        paper=YOU_LARS,
        published_top1=72.3,
        source=f"{_LARS_V3} Table 4 (B=32K: LARS + poly(2), lr 2.9, 5 warmup epochs, 72.3% "
        "top-1; baseline B=256: 73.0%), §5 (momentum 0.9, weight decay 1e-4, 90 "
        "epochs, poly power 2)",
        unstated="trust coefficient for ResNet-50 (0.001 here: the paper's AlexNet value, "
        "footnote 6); eps (none in Algorithm 1; 0 here); which params skip decay "
        "and adaptation (BN and biases here); precision (fp32 here). Open: these v3 "
        "values are not checked against a copy of v3; the ICLR 2018 version's "
        "Table 4 reads B=32K lr 40, 12 warmup epochs, 72.5% (baseline 73.8%), "
        "with weight decay 5e-4 over 100 epochs",
    ),
    Recipe(
        "resnet50-lamb-32k",
        "resnet50",
        "imagenet",
        "lamb",
        32768,
        90,
        lr=0.04,
        optimizer_kwargs=source_keywords("lamb-authors"),
        epoch_steps="exact",
        clip_per_process=1.0,
        schedule="poly",
        power=1.0,
        warmup_epochs=20,
        weight_decay=1.5,
        decay_exclude="bn",
        label_smoothing=0.1,
        precision="bf16",
        paper=LAMB_CODE,
        published_top1=76.34,
        source="github.com/fastalgo/imagenet_resnet50_lamb: run.sh (batch 32768, lr 0.04, "
        "782 warmup steps = 20 epochs, 3519 steps = 90 epochs, weight decay 1.5, "
        "label smoothing 0.1), optimization.py (linear warmup from 0, linear decay "
        "to 0, decay skips batch_normalization only, gradients clipped to global "
        "norm 1.0, no bias correction: largebatch.lars.sources 'lamb-authors'), "
        "resnet_main.py (betas 0.9/0.999, eps 1e-6, bfloat16), log.out "
        "(top_1_accuracy = 0.7633667 at step 3519)",
        unstated="the number of processes: each clips its own gradients and the "
        "all-reduce sums them, as the source's TPU cores did (clip_per_process), "
        "but the source's files do not state its core count, which sets the size "
        "of the sum; the paper's own ResNet-50 tables are not what this row "
        "restates",
        note="LAMB's decoupled weight decay; the trust ratio only on decayed params",
    ),
    Recipe(
        "resnet50-mlperf-lars-34k",
        "resnet50",
        "imagenet",
        "lars",
        34560,
        59,
        lr=21.6,
        optimizer_kwargs={"momentum": 0.94, **source_keywords("nvidia-mxnet")},
        decay_exclude="nvidia",
        schedule_offset=1,
        epoch_steps="ceil",
        schedule="poly",
        power=2.0,
        warmup_epochs=17,
        end_lr=1e-4,
        weight_decay=2.5e-5,
        label_smoothing=0.1,
        precision="fp16",
        paper=MLPERF_NVIDIA,
        published_top1=76.07,
        source=f"mlcommons/training_results_v0.7 {_NVIDIA_DIR}/"
        "config_DGXA100_multi_96x8x45.sh (96 x 8 x 45 = 34,560 images, lr 21.6, 17 "
        "warmup epochs, 59 epochs, momentum 0.94, weight decay 2.5e-5, LARS eta "
        "0.001, label smoothing 0.1, pow2 decay), common/fit.py (end lr 1e-4, LARS "
        "eps 0, no LARS on gamma/beta/bias, weight decay on weights and the fc bias, "
        "the rate outside the momentum buffer (SGDwFASTLARS: largebatch.lars.sources "
        "'nvidia-mxnet'), fp16 with fp32 masters); "
        "NVIDIA/results/dgxa100_n96_ngc20.06_mxnet/resnet/result_0..4.txt "
        "(76.068, 75.952, 76.106, 76.084, 76.12 % top-1: mean 76.07)",
        unstated=_NVIDIA_OPEN,
        note="MLPerf's quality target is 75.9% top-1",
    ),
    Recipe(
        "resnet50-mlperf-lars-64k",
        "resnet50",
        "imagenet",
        "lars",
        64400,
        90,
        lr=24.699,
        optimizer_kwargs={"momentum": 0.951807, **source_keywords("nvidia-mxnet")},
        decay_exclude="nvidia",
        schedule_offset=1,
        epoch_steps="ceil",
        schedule="poly",
        power=2.0,
        warmup_epochs=31,
        end_lr=1e-4,
        weight_decay=1e-4,
        label_smoothing=0.1,
        precision="fp16",
        paper=MLPERF_NVIDIA,
        source=f"mlcommons/training_results_v0.7 {_NVIDIA_DIR}/"
        "config_DGXA100_multi_230x8x35.sh (230 x 8 x 35 = 64,400 images, lr 24.699, "
        "31 warmup epochs, 90 epochs, momentum 0.951807, weight decay 1e-4, LARS eta "
        "0.001, label smoothing 0.1, pow2 decay), common/fit.py (end lr 1e-4, LARS "
        "eps 0, fp16 with fp32 masters)",
        unstated="top-1 (not restated: this configuration's result logs were not checked); " + _NVIDIA_OPEN,
        note="the 64K-equivalent point of the Fashion-MNIST study; MLPerf's target is 75.9%",
    ),
    _alexnet_bn_lars(8192, lr=14.0, top1=60.1),
    _alexnet_bn_lars(
        32768, lr=22.0, top1=57.8, note="Table 5: 59.9% top-1 at 32K when trained for 200 epochs"
    ),
]


# Fashion-MNIST: (peak lr, warmup epochs, label smoothing, poly power) for each (optimizer,
# batch), 30 epochs. A row the 30-epoch ``largebatch study`` has settled carries what it
# chose on the validation split (docs/study.md); the others are its grid's starting points
# (``study.plan.GRID_CENTRES``). ``largebatch study --quick`` re-runs them.
FASHION_EPOCHS = 30
FASHION_SETTINGS: dict[tuple[str, int], tuple[float, float, float, float]] = {
    ("sgd", 128): (0.2, 0.0, 0.1, 2.0),
    ("sgd", 384): (0.6, 2.0, 0.1, 2.0),
    ("nesterov", 384): (0.6, 2.0, 0.1, 2.0),
    ("lars", 384): (8.0, 2.0, 0.1, 2.0),
    ("lamb", 384): (0.064, 2.0, 0.1, 2.0),
    ("sgd", 1536): (2.4, 5.0, 0.1, 2.0),
    ("nesterov", 1536): (2.4, 2.0, 0.1, 2.0),
    ("lars", 1536): (16.0, 2.0, 0.1, 2.0),
    ("lamb", 1536): (0.064, 5.0, 0.1, 1.0),
    ("sgd", 3072): (2.4, 5.0, 0.1, 2.0),
    ("nesterov", 3072): (4.8, 2.0, 0.1, 2.0),
    ("lars", 3072): (24.0, 2.0, 0.1, 2.0),
    ("lamb", 3072): (0.09, 2.0, 0.1, 1.0),
}
# The pairs whose row above is the 30-epoch study's choice (docs/study/headline/study.json;
# a test keeps the two equal); the others hold their grid's starting point.
FASHION_TUNED: frozenset[tuple[str, int]] = frozenset(
    {("sgd", 128), *((o, b) for o in ("sgd", "lars", "lamb") for b in (1536, 3072))}
)
_FASHION_KWARGS = {
    "sgd": {"momentum": 0.9},
    "nesterov": {"momentum": 0.9},
    "lars": {"momentum": 0.9, "trust_coefficient": 0.001},
    "lamb": {},
}


def _fashion(optimizer: str, batch: int) -> Recipe:
    lr, warmup, smoothing, power = FASHION_SETTINGS[optimizer, batch]
    role = "small-batch baseline; " if batch == 128 else ""
    return Recipe(
        f"fmnist-{optimizer}-{batch}",
        "fmnist_cnn",
        "fashion-mnist",
        optimizer,
        batch,
        FASHION_EPOCHS,
        lr=lr,
        optimizer_kwargs=_FASHION_KWARGS[optimizer],
        schedule="poly",
        power=power,
        warmup_epochs=warmup,
        label_smoothing=smoothing,
        weight_decay=0.01 if optimizer == "lamb" else 5e-4,
        paper=OURS,
        source="docs/study.md (largebatch study, validation split)",
        note=role
        + (
            "lr, warmup, label smoothing and poly power: the 30-epoch study's choice"
            if (optimizer, batch) in FASHION_TUNED
            else "lr and warmup: the 30-epoch study's grid starting point, not yet tuned"
        ),
    )


_FASHION = [_fashion(optimizer, batch) for optimizer, batch in FASHION_SETTINGS]

RECIPES: dict[str, Recipe] = {r.name: r for r in (*_IMAGENET, *_FASHION)}
DEFAULT_RECIPE = "fmnist-lars-1536"


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; ValueError listing the known names otherwise."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"Unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}") from None


def recipes_table() -> str:
    """Every recipe as a fixed-width text table, then each recipe's source: where its values
    and its top-1 come from, and what that source leaves open."""
    head = (
        "name",
        "model",
        "data",
        "batch",
        "ImageNet-eq",
        "optimizer",
        "peak lr",
        "schedule",
        "epochs",
        "precision",
        "top-1",
        "paper",
    )
    rows = [head] + [
        (
            r.name,
            r.model,
            r.data,
            f"{r.batch_size:,}",
            f"{r.imagenet_batch:,}",
            r.optimizer,
            f"{r.peak_lr:g}",
            r.schedule_text,
            str(r.epochs),
            r.precision,
            "-" if r.published_top1 is None else f"{r.published_top1:.2f}%",
            r.paper,
        )
        for r in RECIPES.values()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    table = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    sources = ["", "Sources (each recipe's values and top-1):"]
    for r in RECIPES.values():
        sources.append(f"{r.name}: {r.source}")
        if r.unstated:
            sources.append(f"{' ' * len(r.name)}  open: {r.unstated}")
        warmup, total = r.steps
        sources.append(
            f"{' ' * len(r.name)}  steps: {warmup:,} warmup, {total:,} in all (epoch_steps {r.epoch_steps!r})"
        )
    return "\n".join(table + sources)


def recipes_markdown() -> str:
    """The recipes as the Markdown table of docs/recipes.md (a test keeps them equal)."""
    lines = [
        "| name | model | batch | ImageNet-eq. | optimizer | peak lr | schedule | label "
        "smoothing | epochs | precision | published top-1 |",
        "|---|---|---:|---:|---|---:|---|---:|---:|---|---:|",
    ]
    for r in RECIPES.values():
        top1 = "-" if r.published_top1 is None else f"{r.published_top1:.2f}%"
        lines.append(
            f"| `{r.name}` | {r.model} | {r.batch_size:,} | {r.imagenet_batch:,} | "
            f"{r.optimizer} | {r.peak_lr:g} | {r.schedule_text} | {r.label_smoothing:g} | "
            f"{r.epochs} | {r.precision} | {top1} |"
        )
    return "\n".join(lines) + "\n"
