"""Everything a PyTorch user imports from largebatch.

>>> from largebatch.torch import LARS, LAMB, make_schedule, ScheduleLR, param_groups
"""

from largebatch.comm.torch import AdaCompState, adacomp_hook
from largebatch.lars.torch import (
    LAMB,
    LARS,
    default_exclude,
    lamb,
    lars,
    named_trust_ratios,
    param_groups,
    trust_ratios,
)
from largebatch.mixed_precision.torch import to_half
from largebatch.schedules import Schedule, linear_scaling, make_schedule, sqrt_scaling
from largebatch.schedules.torch import ScheduleLR

__all__ = [
    "LARS",
    "LAMB",
    "lars",
    "lamb",
    "param_groups",
    "default_exclude",
    "trust_ratios",
    "named_trust_ratios",
    "Schedule",
    "make_schedule",
    "linear_scaling",
    "sqrt_scaling",
    "ScheduleLR",
    "to_half",
    "AdaCompState",
    "adacomp_hook",
]
