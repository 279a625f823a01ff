"""The one place where a step runs its path, for the optimizers and the functionals:
each group's body on the unfused paths, every group in one call of the kernels on the
fused one."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from torch import Tensor

from largebatch.lars.spec import OptimizerSpec
from largebatch.lars.torch import _fused, _paths, _sharded
from largebatch.lars.torch._common import skipped
from largebatch.lars.torch._group import Bodies, GroupStep

Counter = TypeVar("Counter", Tensor, None)  # an optimizer's count of applied steps, or None


def run(
    bodies: Bodies,
    groups: list[GroupStep],
    *,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
    counter: Counter,
    fused_options: dict[str, Any] | None = None,
    memo: _fused.Replay | None = None,
) -> Counter:
    """Take one step on ``groups`` (all on the fused path, or none; the caller checks).

    Sharded (DTensor) lists become their local blocks and a reducer that sums norms over
    the shards. The fused path takes every group in one call of the kernels (which decide
    the skip on the device, and take ``fused_options``: the optimizer's options and the
    sharded reductions); the other paths skip on ``found_inf`` (read on the host), then run
    each group's body. Returns ``counter`` (the count of applied steps, or None),
    advanced unless the step was skipped.
    """
    local = [g.local() for g in groups if g.params]
    if groups and groups[0].path == "fused":
        return _fused.step(
            [g for g, _ in local],
            counter=counter,
            grad_scale=grad_scale,
            found_inf=found_inf,
            memo=memo,
            **(fused_options or {}),
        )
    if skipped(found_inf):
        return counter
    for group, reducer in local:
        getattr(bodies, group.path)(group, grad_scale, reducer)
    if counter is not None:
        counter += 1
    return counter


def run_functional(
    spec: OptimizerSpec,
    bodies: Bodies,
    group: GroupStep,
    *,
    foreach: Any,
    fused: Any,
    compiled: Any,
    grad_scale: Tensor | None,
    found_inf: Tensor | None,
) -> None:
    """What a functional does: resolve the path for its one group and :func:`run` it."""
    path = _paths.pick(**_paths.resolve(foreach, fused, compiled, group.params))
    reducer = _sharded.reducer_for(group.params)
    if reducer is not None:  # every rank checked only its own shards
        found_inf = reducer.found_inf(found_inf)
    options = None
    if path == "fused":
        _fused.check(group.hyper, 0)
        options = reducer.fused_kwargs(spec) if reducer is not None else None
    run(
        bodies,
        [dataclasses.replace(group, path=path)],
        grad_scale=grad_scale,
        found_inf=found_inf,
        counter=None,
        fused_options=options,
    )
