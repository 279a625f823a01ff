"""Fused multi-tensor Triton kernels for LARS and LAMB, the engine of the torch fused
path: ``plan.py`` the host side (FusedGroup, the launch plan, the entry points),
``common.py`` what both optimizers' kernels share, ``lars.py`` and ``lamb.py`` their own
(docs/design.md §3: tables, launches, bytes, the plan cache)."""

from largebatch.lars.kernels.plan import (
    FusedGroup,
    Plan,
    fused_lamb_step_,
    fused_lars_step_,
    launch_lamb,
    launch_lars,
    plan_for,
    set_lrs,
)

__all__ = [
    "FusedGroup",
    "Plan",
    "fused_lars_step_",
    "fused_lamb_step_",
    "plan_for",
    "set_lrs",
    "launch_lars",
    "launch_lamb",
]
