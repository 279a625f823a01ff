"""Mixed precision for JAX: loss scaling as a pytree, finiteness checks, step skipping
and a precision policy.

Training in float16 keeps float32 *master* parameters, runs the forward and backward
pass in half precision and multiplies the loss by a scale ``S`` so that small
gradients do not flush to zero in float16 (Micikevicius et al. 2018)::

    grads = unscale(grad(S * loss)(params))       unscale(g) = g * (1 / S), in float32
    finite = all_finite(grads)
    S, opt_state, params updated only from finite gradients (skip_if_nonfinite)
    S = adjust(S, finite)

:class:`DynamicLossScale` follows ``torch.amp.GradScaler``'s rule and defaults: start
at ``2**16``, halve on every step whose gradients hold an inf or a NaN, double after
``2000`` finite steps in a row. Every object here is a pytree or a pure function, so
the whole step, the scale's update included, lives inside one ``jax.jit`` with no
host synchronisation. bfloat16 has float32's exponent range and normally trains
without loss scaling (:class:`NoOpLossScale`; Kalamkar et al. 2019).

The package: ``loss_scale`` (:class:`DynamicLossScale`, :class:`StaticLossScale`,
:class:`NoOpLossScale`), ``finite`` (:func:`all_finite`, :func:`select_tree`,
:func:`skip_if_nonfinite`) and ``policy`` (:class:`Policy`, :func:`get_policy`). Import
from here, or from ``largebatch.jax``.

References:
  Micikevicius et al., `Mixed Precision Training <https://arxiv.org/abs/1710.03740>`_, 2018.
  Kalamkar et al., `A Study of BFLOAT16 for Deep Learning Training
  <https://arxiv.org/abs/1905.12322>`_, 2019.
"""

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
