"""What a recipe builds, for ``largebatch train`` and ``largebatch study`` alike: the model,
the optimizer, the lr schedule and the loss.

A :class:`~largebatch.recipes.registry.Recipe` is data; these functions turn it into torch
objects. Both commands call them, so a recipe means the same run in both: the study's
schedule keeps the recipe's milestones, its loss the recipe's label smoothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from largebatch import checks, models
from largebatch.mixed_precision.torch import NORM_LAYERS
from largebatch.recipes.registry import Recipe
from largebatch.torch import LAMB, LARS, Schedule, make_schedule, param_groups

__all__ = [
    "DTYPES",
    "MXNET_AGGREGATION",
    "build_loss",
    "build_model",
    "build_optimizer",
    "build_schedule",
    "decay_groups",
    "mxnet_first_update",
    "setup_options",
]

# ``--precision`` -> the dtype of the model's params and inputs.
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# MXNET_OPTIMIZER_AGGREGATION_SIZE of NVIDIA's MLPerf v0.7 ResNet-50 runs (every
# config_*.sh of training_results_v0.7's NVIDIA/benchmarks/resnet/implementations/mxnet):
# how many params one optimizer call of MXNet's Updater takes.
MXNET_AGGREGATION = 54

_MODELS = {
    "resnet50": models.resnet50,
    "alexnet_bn": models.alexnet_bn,
    "fmnist_cnn": models.fmnist_cnn,
    "fmnist_alexnet_bn": models.fmnist_alexnet_bn,
    "small_cnn": models.small_cnn,
    "small_resnet": models.small_resnet,
}


def build_model(name: str, num_classes: int, *, ghost_batch: int | None = None) -> nn.Module:
    """``resnet50`` (torchvision, zero-init residual BN), ``alexnet_bn``, ``fmnist_cnn``,
    ``fmnist_alexnet_bn``, ``small_cnn`` or ``small_resnet``
    (:mod:`largebatch.models`), initialised from torch's global RNG. With ``ghost_batch``,
    its batch norms normalize chunks of that many samples
    (:func:`~largebatch.models.ghost_batch_norm`); the initial params are the same."""
    if name not in _MODELS:
        raise ValueError(f"Unknown model {name!r}; known: {', '.join(_MODELS)}")
    model = _MODELS[name](num_classes)
    return model if ghost_batch is None else models.ghost_batch_norm(model, ghost_batch)


def build_optimizer(
    recipe: Recipe, model: nn.Module, lr: float, precision: str = "fp32", world: int = 1
) -> torch.optim.Optimizer:
    """The recipe's optimizer, its params in :func:`decay_groups`: weight decay (and, for
    LARS/LAMB, the trust ratio) on all but what the recipe's ``decay_exclude`` names. LARS
    and LAMB keep fp32 masters for half params; SGD and Nesterov refuse half params.

    With a recipe's ``clip_per_process`` on ``world`` > 1 processes the optimizer does
    not clip: each process clips before the all-reduce (``comm.torch.local_clip_hook``).
    On one process the two are the same clip, and the optimizer's ``max_grad_norm`` does it
    (:func:`setup_options`)."""
    kw, half = {**recipe.optimizer_kwargs, **setup_options(recipe, world)}, precision != "fp32"
    groups = decay_groups(model, recipe.weight_decay, recipe.decay_exclude)
    if recipe.optimizer in ("lars", "lamb"):
        cls = LARS if recipe.optimizer == "lars" else LAMB
        return cls(groups, lr=lr, master_weights=half, **kw)
    if half:
        raise ValueError(
            f"precision {precision!r} needs fp32 master weights, which only the LARS and "
            f"LAMB recipes keep; recipe {recipe.name!r} uses {recipe.optimizer}"
        )
    for group in groups:
        group.pop("trust_ratio", None)
    return torch.optim.SGD(groups, lr=lr, nesterov=recipe.optimizer == "nesterov", **{"momentum": 0.9, **kw})


def setup_options(recipe: Recipe, world: int) -> dict[str, Any]:
    """The optimizer's options that the run's set-up decides, not the recipe alone: with a
    recipe's ``clip_per_process``, ``max_grad_norm`` (None on ``world`` > 1 processes,
    where each process clips before the all-reduce; the recipe's clip on one). A resume
    keeps these from the optimizer built for its own set-up, never from the checkpoint,
    which may have been written on another number of processes."""
    if recipe.clip_per_process is None:
        return {}
    return {"max_grad_norm": None if world > 1 else recipe.clip_per_process}


def decay_groups(
    model: nn.Module, weight_decay: float, exclude: str, aggregate_num: int = MXNET_AGGREGATION
) -> list[dict[str, Any]]:
    """``param_groups(model, weight_decay, ...)`` with the recipe's exclusion: ``"bn_bias"``
    (normalisation params and every bias: ``param_groups``' default), ``"bn"`` (only the
    normalisation layers' scale and shift; other biases are decayed and adapted),
    ``"none"`` (nothing excluded) or ``"nvidia"``: NVIDIA's MLPerf MXNet LARS, as
    ``"bn_bias"`` but the biases of the fully connected layers decayed without the trust
    ratio (a third group), and each group split in two by :func:`mxnet_first_update`
    (``aggregate_num`` params a call): its params in the first update call keep the
    optimizer's ``lr_in_momentum`` (the recipes': False, the corrected momentum), the others
    take ``lr_in_momentum=True`` (the buffer keeps the rate: no correction), empty parts
    left out."""
    if exclude == "bn_bias":
        return param_groups(model, weight_decay)
    if exclude == "none":
        return param_groups(model, weight_decay, exclude=lambda name, p: False)
    if exclude == "bn":
        norm = _norm_params(model)
        return param_groups(model, weight_decay, exclude=lambda name, p: id(p) in norm)
    if exclude == "nvidia":  # NVIDIA's MLPerf LARS: the fc biases decayed, not adapted
        fc_bias = {id(m.bias) for m in model.modules() if isinstance(m, nn.Linear) and m.bias is not None}
        adapted, excluded = param_groups(model, weight_decay)
        decayed = [p for p in excluded["params"] if id(p) in fc_bias]
        excluded["params"] = [p for p in excluded["params"] if id(p) not in fc_bias]
        groups = [adapted, excluded, {"params": decayed, "weight_decay": weight_decay, "trust_ratio": False}]
        first = {id(p) for p in mxnet_first_update(model, aggregate_num)}
        split = []
        for group in groups:
            split.append({**group, "params": [p for p in group["params"] if id(p) in first]})
            split.append(
                {
                    **group,
                    "params": [p for p in group["params"] if id(p) not in first],
                    "lr_in_momentum": True,
                }
            )
        return [g for g in split if g["params"]]
    raise ValueError(f"Invalid decay_exclude: {exclude!r} (bn_bias, bn, none or nvidia)")


def mxnet_first_update(model: nn.Module, aggregate_num: int = MXNET_AGGREGATION) -> list[nn.Parameter]:
    """The params that NVIDIA's MLPerf MXNet LARS updates in the first optimizer call of
    each step, the only ones its momentum correction reaches.

    MXNet's ``Updater.__call__`` (python/mxnet/optimizer/optimizer.py, with aggregation)
    splits a step's params by dtype, in the order each dtype first appears, and hands each
    dtype's list to the optimizer ``aggregate_num`` params a call. ``SGDwFASTLARS._update_impl``
    (training_results_v0.7, NVIDIA/benchmarks/resnet/implementations/mxnet/common/fit.py)
    runs ``_get_lrs`` on every call, which moves ``last_lr`` up to ``cur_lr``: the momentum
    ``m * cur_lr / last_lr`` is corrected in the first call and plain ``m`` in the others.
    NVIDIA trains in fp16, where MXNet keeps the normalisation layers' scale and shift in
    fp32: the dtypes here are those, whatever the model's own. For ResNet-50 the first
    call is the 53 conv weights and the fc weight (``aggregate_num`` 54), the params LARS
    adapts; the fc bias and the batch norms' 106 params take plain momentum."""
    checks.integer("aggregate_num", aggregate_num, 1)
    norm = _norm_params(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        return []
    first_kind = id(trainable[0]) in norm
    return [p for p in trainable if (id(p) in norm) == first_kind][:aggregate_num]


def _norm_params(model: nn.Module) -> set[int]:
    """The ids of the normalisation layers' own params (scale and shift)."""
    return {id(p) for m in model.modules() if isinstance(m, NORM_LAYERS) for p in m.parameters(recurse=False)}


def build_schedule(
    recipe: Recipe,
    *,
    peak_lr: float,
    epochs: int,
    n_train: int,
    batch: int,
    warmup_epochs: float | None = None,
) -> Schedule:
    """The recipe's lr schedule (its shape, ``power`` and ``milestones``) for a run of
    ``epochs`` epochs of ``n_train`` images at ``batch``, peaking at ``peak_lr``.

    Steps follow the recipe's ``epoch_steps`` (:meth:`Recipe.epoch_length`,
    :meth:`Recipe.epoch_end`). Warmup and milestones are in epochs: scaled to ``epochs`` as
    :meth:`Recipe.with_epochs` does, then rounded to steps; a milestone that rounds into
    the warmup or to the end of the run is dropped. ``warmup_epochs``, when given, replaces
    the recipe's warmup as it is (not scaled): the study tunes it.
    """
    shape = recipe.with_epochs(epochs)
    warmup = shape.warmup_epochs if warmup_epochs is None else warmup_epochs
    per_epoch = recipe.epoch_length(n_train, batch)
    total = recipe.epoch_end(epochs, n_train, batch)
    warmup_steps = min(round(warmup * per_epoch), total)
    milestones = sorted(
        {round(m * per_epoch) for m in shape.milestones if warmup_steps <= round(m * per_epoch) < total}
    )
    return make_schedule(
        shape.schedule,
        peak_lr=peak_lr,
        total_steps=total,
        warmup_steps=warmup_steps,
        init_lr=recipe.init_lr,
        end_lr=recipe.end_lr,
        power=shape.power,
        milestones=milestones,
        offset=recipe.schedule_offset,
    )


def build_loss(recipe: Recipe) -> nn.Module:
    """Cross-entropy, with the recipe's label smoothing."""
    return nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
