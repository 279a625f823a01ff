"""LARS and LAMB as optax gradient transformations (docs/jax.md), one module an optimizer
as in ``torch/``: ``_lars`` (``lars()`` and ``scale_by_lars_trust_ratio``), ``_lamb``
(``lamb()`` and the transformations it chains), and what both share: ``common`` (checks of
traced values, the rate, ``keep_dtypes``), ``masks`` (``exclusion_mask``, how masks
combine), ``norms`` (overflow-safe L2 norms), ``telemetry`` (``trust_ratios``); the fused
path (``fused=True``): ``fused`` (its steps), ``packed`` (the layout, ``PackedParams``),
``rows`` (the Pallas kernels). Import from here, or from ``largebatch.jax``."""

from largebatch.lars.jax._lamb import (
    divide_by_global_norm,
    lamb,
    scale_by_lamb_trust_ratio,
    scale_by_uncorrected_adam,
)
from largebatch.lars.jax._lars import LarsTrustRatioState, lars, scale_by_lars_trust_ratio
from largebatch.lars.jax.fused import FusedLambState, FusedLarsState
from largebatch.lars.jax.masks import exclusion_mask
from largebatch.lars.jax.packed import PackedParams
from largebatch.lars.jax.telemetry import trust_ratios

__all__ = [
    "FusedLambState",
    "FusedLarsState",
    "LarsTrustRatioState",
    "PackedParams",
    "divide_by_global_norm",
    "exclusion_mask",
    "lamb",
    "lars",
    "scale_by_lamb_trust_ratio",
    "scale_by_lars_trust_ratio",
    "scale_by_uncorrected_adam",
    "trust_ratios",
]
