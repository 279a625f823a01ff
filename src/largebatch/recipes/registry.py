"""Named training recipes as data: model, data set, optimizer, schedule, precision, batch.

A :class:`Recipe` is one row; :data:`RECIPES` holds them by name. ``largebatch train
--recipe NAME`` runs one, ``largebatch recipes`` prints the table. This module imports
no framework.

ImageNet rows restate what their paper states (``published_top1`` only where the paper
gives a number for exactly that setting; ``note`` says the rest). Fashion-MNIST rows are
ours: their peak lr and warmup are those the tuned batch-size study found
(``largebatch study``, docs/study.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = [
    "DATA_SETS", "FASHION_SETTINGS", "OPTIMIZERS", "PRECISIONS", "TRAIN_IMAGES", "Recipe",
    "RECIPES", "get_recipe", "imagenet_equivalent", "recipes_table",
]

DATA_SETS = ("imagenet", "fashion-mnist")
OPTIMIZERS = ("lars", "lamb", "sgd", "nesterov")
PRECISIONS = ("fp32", "fp16", "bf16")
MODELS = ("resnet50", "alexnet_bn", "small_cnn")
TRAIN_IMAGES = {"imagenet": 1_281_167, "fashion-mnist": 60_000}


def imagenet_equivalent(batch: int, n_train: int) -> int:
    """The ImageNet batch taking the same fraction of an epoch per step: ``B * 1,281,167 / N``.

    >>> imagenet_equivalent(1536, 60_000)
    32798
    """
    if not (isinstance(batch, int) and batch > 0):
        raise ValueError(f"Invalid batch: {batch!r} (must be a positive integer)")
    if not (isinstance(n_train, int) and n_train > 0):
        raise ValueError(f"Invalid n_train: {n_train!r} (must be a positive integer)")
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
    paper: str = ""
    published_top1: float | None = None
    note: str = ""

    def __post_init__(self) -> None:
        for field, allowed in (("model", MODELS), ("data", DATA_SETS),
                               ("optimizer", OPTIMIZERS), ("precision", PRECISIONS)):
            if getattr(self, field) not in allowed:
                raise ValueError(
                    f"Recipe {self.name!r}: unknown {field} {getattr(self, field)!r}; "
                    f"known: {', '.join(allowed)}"
                )
        if (self.lr is None) == (self.base_lr is None):
            raise ValueError(f"Recipe {self.name!r}: give exactly one of lr and base_lr")
        for field in ("batch_size", "epochs", "base_batch"):
            if not (isinstance(getattr(self, field), int) and getattr(self, field) > 0):
                raise ValueError(f"Recipe {self.name!r}: invalid {field} {getattr(self, field)!r}")

    @property
    def peak_lr(self) -> float:
        """The rate at the end of warmup for ``batch_size`` (linear scaling if ``base_lr``)."""
        return self.lr_for(self.batch_size)

    def lr_for(self, batch_size: int) -> float:
        """The peak rate at ``batch_size``, scaled linearly from ``lr`` at ``batch_size`` or
        from ``base_lr`` at ``base_batch``."""
        if self.lr is not None:
            return self.lr * batch_size / self.batch_size
        return self.base_lr * batch_size / self.base_batch

    def with_epochs(self, epochs: int) -> Recipe:
        """This recipe over ``epochs`` epochs, its schedule stretched or shrunk to match:
        warmup and milestones scale by ``epochs / self.epochs``, so a shortened run keeps
        the recipe's shape (warmup, then decay) instead of ending inside its warmup."""
        if not (isinstance(epochs, int) and epochs > 0):
            raise ValueError(f"Invalid epochs: {epochs!r} (must be a positive integer)")
        if epochs == self.epochs:
            return self
        scale = epochs / self.epochs
        return dataclasses.replace(
            self, epochs=epochs, warmup_epochs=self.warmup_epochs * scale,
            milestones=tuple(m * scale for m in self.milestones))

    @property
    def imagenet_batch(self) -> int:
        return imagenet_equivalent(self.batch_size, TRAIN_IMAGES[self.data])

    @property
    def schedule_text(self) -> str:
        warm = f"{self.warmup_epochs:g}-epoch warmup, " if self.warmup_epochs else ""
        if self.schedule == "step":
            return warm + "x0.1 at " + "/".join(f"{m:g}" for m in self.milestones)
        if self.schedule == "poly":
            return warm + f"poly {self.power:g}"
        return warm + self.schedule


GOYAL = "Goyal et al. 2017, https://arxiv.org/abs/1706.02677"
YOU_LARS = "You, Gitman, Ginsburg 2017, https://arxiv.org/abs/1708.03888"
JIA = "Jia et al. 2018, https://arxiv.org/abs/1807.11205"
LAMB_PAPER = "You et al. 2019, https://arxiv.org/abs/1904.00962"
MLPERF = "MLPerf Training ResNet-50 reference (TF, LARS), https://github.com/mlcommons/training"
OURS = "largebatch (this project)"

_IMAGENET = [
    Recipe("resnet50-goyal-8k", "resnet50", "imagenet", "sgd", 8192, 90, base_lr=0.1,
           optimizer_kwargs={"momentum": 0.9}, schedule="step", warmup_epochs=5,
           milestones=(30, 60, 80), weight_decay=1e-4, paper=GOYAL, published_top1=76.3,
           note="gradual warmup; zero-init last BN gamma of each residual block"),
    Recipe("resnet50-lars-32k", "resnet50", "imagenet", "lars", 32768, 90, lr=29.0,
           schedule="poly", warmup_epochs=5, weight_decay=5e-4, paper=YOU_LARS,
           note="the paper states ResNet-50 scales to 32K without loss in accuracy vs its "
                "baseline; lr, warmup and weight decay here are provisional, not restated from it"),
    Recipe("resnet50-lars-fp16-64k", "resnet50", "imagenet", "lars", 65536, 90, lr=32.0,
           schedule="poly", warmup_epochs=14, precision="fp16", weight_decay=1e-4, paper=JIA,
           published_top1=75.8,
           note="mixed precision with fp32 masters; 75.8% in 6.6 min on 2048 GPUs; lr and "
                "warmup taken from the MLPerf LARS rule for >= 32K"),
    Recipe("resnet50-mlperf-lars-32k", "resnet50", "imagenet", "lars", 32768, 90, lr=32.0,
           schedule="poly", warmup_epochs=14, weight_decay=1e-4, paper=MLPERF,
           note="reference rule: plr 10/25/32 and 5/5/14 warmup epochs below 16K / 32K / from "
                "32K on; MLPerf's quality target is 75.9% top-1"),
    Recipe("resnet50-lamb-32k", "resnet50", "imagenet", "lamb", 32768, 90, lr=0.01,
           schedule="poly", power=1.0, warmup_epochs=5, weight_decay=0.01, paper=LAMB_PAPER,
           note="the paper reports LAMB beating earlier large-batch optimizers on ResNet-50; "
                "lr, warmup, decay power and weight decay here are provisional"),
    Recipe("alexnet-bn-lars-8k", "alexnet_bn", "imagenet", "lars", 8192, 100, lr=10.0,
           schedule="poly", warmup_epochs=2, weight_decay=5e-4, paper=YOU_LARS,
           note="the paper states AlexNet-BN scales to 8K with LARS without loss in accuracy; "
                "lr and warmup here are provisional"),
    Recipe("alexnet-bn-lars-32k", "alexnet_bn", "imagenet", "lars", 32768, 100, lr=22.0,
           schedule="poly", warmup_epochs=5, weight_decay=5e-4, paper=YOU_LARS,
           note="AlexNet-BN at 32K with LARS; lr and warmup here are provisional"),
]


# Fashion-MNIST: (peak lr, warmup epochs) for each (optimizer, batch), as tuned by the full
# ``largebatch study`` (docs/study.md); ``largebatch study --quick`` re-runs them.
FASHION_SETTINGS: dict[tuple[str, int], tuple[float, float]] = {
    ("sgd", 128): (0.4, 0.0),
    ("sgd", 384): (1.2, 1.0), ("nesterov", 384): (1.2, 1.0),
    ("lars", 384): (20.0, 3.0), ("lamb", 384): (0.064, 1.0),
    ("sgd", 1536): (2.4, 1.0), ("nesterov", 1536): (1.2, 3.0),
    ("lars", 1536): (40.0, 3.0), ("lamb", 1536): (0.128, 1.0),
    ("sgd", 3072): (4.8, 3.0), ("nesterov", 3072): (0.6, 3.0),
    ("lars", 3072): (16.0, 3.0), ("lamb", 3072): (0.192, 1.0),
}
_FASHION_KWARGS = {
    "sgd": {"momentum": 0.9}, "nesterov": {"momentum": 0.9},
    "lars": {"momentum": 0.9, "trust_coefficient": 0.001}, "lamb": {},
}


def _fashion(optimizer: str, batch: int) -> Recipe:
    lr, warmup = FASHION_SETTINGS[optimizer, batch]
    role = "small-batch baseline; " if batch == 128 else ""
    return Recipe(
        f"fmnist-{optimizer}-{batch}", "small_cnn", "fashion-mnist", optimizer, batch, 10, lr=lr,
        optimizer_kwargs=_FASHION_KWARGS[optimizer], schedule="poly", warmup_epochs=warmup,
        weight_decay=0.01 if optimizer == "lamb" else 5e-4, paper=OURS,
        note=role + "peak lr and warmup tuned by the batch-size study (docs/study.md)")


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
    """Every recipe as a fixed-width text table."""
    head = ("name", "model", "data", "batch", "ImageNet-eq", "optimizer", "peak lr",
            "schedule", "epochs", "precision", "top-1", "paper")
    rows = [head] + [
        (r.name, r.model, r.data, f"{r.batch_size:,}", f"{r.imagenet_batch:,}", r.optimizer,
         f"{r.peak_lr:g}", r.schedule_text, str(r.epochs), r.precision,
         "-" if r.published_top1 is None else f"{r.published_top1:.1f}%", r.paper)
        for r in RECIPES.values()
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows
    )


def add_arguments(parser: Any) -> None:
    """``largebatch recipes`` takes no flags."""


def main(args: Any) -> int:
    """Print the recipes table."""
    print(recipes_table())
    return 0
