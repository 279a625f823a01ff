"""Learning-rate schedules for large-batch training: one factory, the same numbers in
Python, torch and jitted JAX (docs/design.md §4)."""

from largebatch.schedules.factory import SCHEDULES, Schedule, make_schedule
from largebatch.schedules.scaling import linear_scaling, sqrt_scaling

__all__ = ["SCHEDULES", "Schedule", "linear_scaling", "make_schedule", "sqrt_scaling"]
