"""LARS and LAMB as optax gradient transformations (docs/jax.md). One job a module:
``optimizers`` (``lars``, ``lamb``: checks and chains), ``transforms`` (the transformations
they chain), ``masks`` (``exclusion_mask``, how masks combine), ``norms`` (overflow-safe
L2 norms). Import from here, or from ``largebatch.jax``."""

from largebatch.lars.jax.masks import exclusion_mask
from largebatch.lars.jax.optimizers import lamb, lars
from largebatch.lars.jax.transforms import (
    LarsTrustRatioState,
    divide_by_global_norm,
    scale_by_lamb_trust_ratio,
    scale_by_lars_trust_ratio,
    scale_by_uncorrected_adam,
)

__all__ = [
    "LarsTrustRatioState",
    "divide_by_global_norm",
    "exclusion_mask",
    "lamb",
    "lars",
    "scale_by_lamb_trust_ratio",
    "scale_by_lars_trust_ratio",
    "scale_by_uncorrected_adam",
]
