"""One param group's share of a step: its tensors, its lr and its typed hyperparameters."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from largebatch.lars.spec import Hyperparams
from largebatch.lars.torch import _sharded


@dataclass
class GroupStep:
    """The params of one group that have grads, with what a step reads and writes.

    ``state`` holds one list per state key of the optimizer's spec (LARS
    ``momentum_buffer``; LAMB ``exp_avg``, ``exp_avg_sq``); ``masters`` has None where a
    param has no fp32 master; ``steps`` are the params' step counts. ``lr`` is a float or
    a 0-dim Tensor; ``path`` the resolved path; ``key`` names the group's lr buffer on the
    fused path. ``maximize``: the step ascends (every path negates the grads first, as
    torch's optimizers do); ``differentiable``: the single-tensor body keeps autograd's
    graph whole (it reads copies of what it writes in place)."""

    params: list[Tensor]
    grads: list[Tensor]
    state: dict[str, list[Tensor]]
    masters: list[Tensor | None]
    steps: list[Tensor]
    lr: float | Tensor
    hyper: Hyperparams
    path: str = "foreach"
    key: Any = None
    maximize: bool = False
    differentiable: bool = False

    def local(self) -> tuple[GroupStep, _sharded.Reducer | None]:
        """This group with each sharded (DTensor) list as its local blocks, and the
        reducer that sums norms over the shards (None when nothing is sharded)."""
        names = tuple(self.state)
        lists, reducer = _sharded.local(
            (self.params, self.grads, self.masters, self.steps, *(self.state[k] for k in names))
        )
        if reducer is None:
            return self, None
        params, grads, masters, steps, *state = lists
        return dataclasses.replace(
            self, params=params, grads=grads, masters=masters, steps=steps, state=dict(zip(names, state))
        ), reducer

    def select(self, indices: list[int]) -> GroupStep:
        """This group restricted to the tensors at ``indices``."""

        def take(xs: list) -> list:
            return [xs[i] for i in indices]

        return dataclasses.replace(
            self,
            params=take(self.params),
            grads=take(self.grads),
            masters=take(self.masters),
            steps=take(self.steps),
            state={k: take(v) for k, v in self.state.items()},
        )


Body = Callable[[GroupStep, "Tensor | None", "_sharded.Reducer | None"], None]


@dataclass(frozen=True)
class Bodies:
    """An optimizer's unfused paths, each a body that updates one group in place from
    ``(group, grad_scale, reducer)``: ``grad_scale`` divides every grad, ``reducer`` sums
    the norms of sharded params over their shards (None: whole params)."""

    single_tensor: Body
    foreach: Body
    compiled: Body
    # The single-tensor update of a group's one tensor, with ``norm`` for its norms;
    # returns the trust ratio it applied (``trust_ratios`` runs it on copies).
    one_tensor: Callable[[GroupStep, "Tensor | None", Callable[[Tensor], Tensor]], Tensor]
