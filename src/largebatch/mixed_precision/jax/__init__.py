"""Mixed precision for JAX (docs/mixed_precision.md): ``loss_scale`` (dynamic, static and
no-op loss scales as pytrees), ``finite`` (finiteness checks and step skipping) and
``policy`` (the precision policy). Import from here, or from ``largebatch.jax``."""

from largebatch.mixed_precision.jax.finite import (
    SkipIfNonfiniteState,
    all_finite,
    select_tree,
    skip_if_nonfinite,
)
from largebatch.mixed_precision.jax.loss_scale import (
    MAX_LOSS_SCALE,
    DynamicLossScale,
    NoOpLossScale,
    StaticLossScale,
)
from largebatch.mixed_precision.jax.policy import Policy, get_policy

__all__ = [
    "MAX_LOSS_SCALE",
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "all_finite",
    "select_tree",
    "skip_if_nonfinite",
    "SkipIfNonfiniteState",
    "Policy",
    "get_policy",
]
