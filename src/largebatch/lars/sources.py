"""The published LARS and LAMB implementations, by name: the keywords that reproduce each.
A :class:`Source` names the file and function it restates, the keywords that make
``largebatch.torch.LARS``/``LAMB`` and ``largebatch.jax.lars``/``lamb`` take its update
step for step, how its params split into groups, and what of it stays open. Each is tested
against a NumPy port of the source's own update (``tests/test_sources.py``). This module
imports no framework."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from largebatch.lars.spec import LAMB_SPEC, LARS_SPEC

__all__ = ["SOURCES", "Source", "source_keywords"]


@dataclasses.dataclass(frozen=True)
class Source:
    """One published implementation."""

    name: str
    optimizer: str  # "lars" or "lamb"
    keywords: Mapping[str, Any]  # the torch constructor's names
    where: str  # repository, file and function restated
    groups: str  # which params are adapted and which decayed
    open: str  # what this package does not reproduce ("" where nothing)

    def __post_init__(self) -> None:
        spec = LARS_SPEC if self.optimizer == "lars" else LAMB_SPEC
        spec.check(dict(self.keywords))


_PARAM_GROUPS = "param_groups(model, wd): biases and norm layers neither adapted nor decayed"

SOURCES: dict[str, Source] = {
    s.name: s
    for s in [
        Source(
            "mlperf-tf",
            "lars",
            {"trust_coefficient": 0.001, "eps": 0.0, "lr_in_momentum": True},
            "mlcommons/training, image_classification/tensorflow/official/resnet/"
            "mlperf_lars_optimizer.py, MLPERF_LARSOptimizer.compute_lr and "
            "_resource_apply_dense (the TF1 reference, eps as given)",
            _PARAM_GROUPS + " (its skip list: batch_normalization, bias, bn)",
            "the variant image_classification/tensorflow2/lars_optimizer.py, LARSOptimizer, "
            "turns eps=0 into Keras's default 1e-7 (epsilon or backend_config.epsilon()): pass "
            "eps=1e-7 for it",
        ),
        Source(
            "nvidia-mxnet",
            "lars",
            {"trust_coefficient": 0.001, "eps": 0.0, "lr_in_momentum": False},
            "mlcommons/training_results_v0.7, NVIDIA/benchmarks/resnet/implementations/mxnet/"
            "common/fit.py, SGDwFASTLARS._update_impl, with MXNet's multi_lars and "
            "lars_multi_mp_sgd_mom_update kernels (momentum times lr_t / lr_t-1)",
            "LARS on every weight; BN gamma/beta neither adapted nor decayed; the classifier's "
            "bias decayed without LARS; the momentum correction only in the first of MXNet's "
            "update calls of a step (the fp16 params, 54 a call: ResNet-50's conv and fc "
            "weights), the other params lr_in_momentum=True (largebatch recipes: "
            "decay_exclude='nvidia', recipes.build.mxnet_first_update)",
            "the norms are of the fp16 weights, not the fp32 masters; one update before the "
            "first step, on zero gradients",
        ),
        Source(
            "apex-larc",
            "lars",
            {
                "trust_coefficient": 0.02,
                "eps": 1e-8,
                "trust_clip": True,
                "zero_norm_skip": True,
                "lr_in_momentum": False,
            },
            "NVIDIA/apex, apex/parallel/LARC.py, LARC.step (clip=True), around torch.optim.SGD "
            "(torch/optim/sgd.py, _single_tensor_sgd; dampening 0)",
            "every param of the wrapped optimizer's groups, with that group's weight decay",
            "",
        ),
        Source(
            "timm",
            "lars",
            {"trust_coefficient": 0.001, "eps": 1e-8, "lr_in_momentum": False},
            "huggingface/pytorch-image-models, timm/optim/lars.py, Lars.step (trust_clip as "
            "given: the clipped fallback min(1 / lr, 1) at a zero norm, as here)",
            "only groups with weight_decay != 0 are adapted (timm's param groups give biases and "
            "ndim <= 1 params weight decay 0): " + _PARAM_GROUPS,
            "always_adapt=True (adapting a group without weight decay) is a group with "
            "trust_ratio=True and weight_decay=0 here",
        ),
        Source(
            "optax",
            "lars",
            {"trust_coefficient": 0.001, "eps": 0.0, "lr_in_momentum": True, "decayed_norm": True},
            "google-deepmind/optax, optax/_src/alias.py, lars (add_decayed_weights, then "
            "scale_by_trust_ratio of optax/_src/transform.py, then scale_by_learning_rate, then "
            "trace)",
            "its two masks, independently (pass weight_decay_mask)",
            "",
        ),
        Source(
            "lamb-authors",
            "lamb",
            {"betas": (0.9, 0.999), "eps": 1e-6, "bias_correction": False, "max_grad_norm": 1.0},
            "fastalgo/imagenet_resnet50_lamb, optimization.py, LAMBOptimizer.apply_gradients "
            "and create_optimizer (clip_by_global_norm 1.0)",
            "every param but batch-norm's decayed and adapted, biases included (largebatch "
            "recipes: decay_exclude='bn')",
            "each TPU core clips its own gradients (global norm 1.0) and the cross-replica sum "
            "adds them: the optimizer's keywords clip the averaged gradient once, and the DDP "
            "hook comm.torch.local_clip_hook does what the cores did (largebatch recipes: "
            "clip_per_process); the source's core count is not in its files",
        ),
        Source(
            "apex-fusedlamb",
            "lamb",
            {
                "betas": (0.9, 0.999),
                "eps": 1e-6,
                "bias_correction": True,
                "max_grad_norm": 1.0,
                "adapt_without_decay": False,
            },
            "NVIDIA/apex, apex/optimizers/fused_lamb.py, FusedLAMB.step, and "
            "csrc/multi_tensor_lamb.cu, LAMBStage1Functor / LAMBStage2Functor (its default "
            "weight_decay is 0.01; its adam_w_mode and grad_averaging are the keywords of the "
            "same names, use_nvlamb=True is adapt_without_decay=True)",
            "the trust ratio only in groups whose weight_decay is nonzero",
            "",
        ),
        Source(
            "timm-lamb",
            "lamb",
            {
                "betas": (0.9, 0.999),
                "eps": 1e-6,
                "bias_correction": True,
                "max_grad_norm": 1.0,
                "adapt_without_decay": False,
            },
            "huggingface/pytorch-image-models, timm/optim/lamb.py, Lamb.step (grad_averaging "
            "is the keyword of that name, always_adapt=True is adapt_without_decay=True)",
            "the trust ratio only in groups whose weight_decay is nonzero (timm's groups: "
            "biases and ndim <= 1 params have none)",
            "trust_clip (the ratio capped at 1), decoupled_decay and corrected_weight_decay",
        ),
        Source(
            "tfa",
            "lamb",
            {"betas": (0.9, 0.999), "eps": 1e-6, "bias_correction": True},
            "tensorflow/addons, tensorflow_addons/optimizers/lamb.py, LAMB._resource_apply_dense",
            "exclude_from_layer_adaptation (default: exclude_from_weight_decay) is "
            "trust_ratio=False; exclude_from_weight_decay is weight_decay=0",
            "",
        ),
        Source(
            "optax-lamb",
            "lamb",
            {"betas": (0.9, 0.999), "eps": 1e-6, "bias_correction": True},
            "google-deepmind/optax, optax/_src/alias.py, lamb (scale_by_adam, "
            "add_decayed_weights, scale_by_trust_ratio)",
            "the trust ratio on every leaf; weight decay where its mask says",
            "eps_root > 0 (inside the square root)",
        ),
    ]
}


def source_keywords(name: str, framework: str = "torch") -> dict[str, Any]:
    """The keywords of the source ``name`` (:data:`SOURCES`), by the torch constructor's
    names, or by the JAX factory's (``framework="jax"``: LAMB's ``betas`` as ``b1``,
    ``b2``).

    >>> source_keywords("apex-larc")["trust_coefficient"]
    0.02
    >>> source_keywords("lamb-authors", framework="jax")["b1"]
    0.9
    """
    if name not in SOURCES:
        raise ValueError(f"Unknown source {name!r}; known: {', '.join(SOURCES)}")
    if framework not in ("torch", "jax"):
        raise ValueError(f"Invalid framework: {framework!r} (torch or jax)")
    keywords = dict(SOURCES[name].keywords)
    if framework == "jax" and "betas" in keywords:
        keywords["b1"], keywords["b2"] = keywords.pop("betas")
    return keywords
