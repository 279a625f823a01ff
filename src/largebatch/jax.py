"""largebatch for JAX: everything a JAX user imports (docs/jax.md).

>>> from largebatch.jax import lamb, lars, exclusion_mask, make_schedule, linear_scaling
>>> sched = make_schedule("poly", peak_lr=linear_scaling(0.1, 8192), total_steps=1000,
...                       warmup_steps=100)
>>> opt = lars(sched, weight_decay=5e-4, trust_ratio_mask=exclusion_mask)
"""

from largebatch.comm.jax import (
    AdaCompState,
    adacomp,
    adacomp_init_state,
    adacomp_state_specs,
)
from largebatch.lars.jax import (
    FusedLambState,
    FusedLarsState,
    LarsTrustRatioState,
    PackedParams,
    divide_by_global_norm,
    exclusion_mask,
    lamb,
    lars,
    scale_by_lamb_trust_ratio,
    scale_by_lars_trust_ratio,
    scale_by_uncorrected_adam,
    trust_ratios,
)
from largebatch.mixed_precision.jax import (
    MAX_LOSS_SCALE,
    DynamicLossScale,
    NoOpLossScale,
    Policy,
    SkipIfNonfiniteState,
    StaticLossScale,
    all_finite,
    get_policy,
    select_tree,
    skip_if_nonfinite,
)
from largebatch.schedules import SCHEDULES, Schedule
from largebatch.schedules.jax import (
    OptaxSchedule,
    as_optax_schedule,
    linear_scaling,
    make_schedule,
    sqrt_scaling,
)

__all__ = [
    # optimizers (largebatch.lars.jax)
    "lamb",
    "lars",
    "exclusion_mask",
    # the fused path (fused=True): its states, params kept packed
    "FusedLarsState",
    "FusedLambState",
    "PackedParams",
    # their transformations
    "LarsTrustRatioState",
    "divide_by_global_norm",
    "scale_by_lamb_trust_ratio",
    "scale_by_lars_trust_ratio",
    "scale_by_uncorrected_adam",
    # telemetry: the trust ratio of each leaf, under jit
    "trust_ratios",
    # schedules (largebatch.schedules.jax)
    "SCHEDULES",
    "OptaxSchedule",
    "Schedule",
    "as_optax_schedule",
    "linear_scaling",
    "make_schedule",
    "sqrt_scaling",
    # mixed precision (largebatch.mixed_precision.jax)
    "DynamicLossScale",
    "StaticLossScale",
    "NoOpLossScale",
    "MAX_LOSS_SCALE",
    "all_finite",
    "select_tree",
    "skip_if_nonfinite",
    "SkipIfNonfiniteState",
    "Policy",
    "get_policy",
    # gradient compression (largebatch.comm.jax)
    "adacomp",
    "AdaCompState",
    "adacomp_init_state",
    "adacomp_state_specs",
]
