"""The fused path: every group of a step in one call of the Triton kernels
(``largebatch.lars.kernels``), which count the steps on the device unless GradScaler's
``found_inf`` skips the step; and :class:`Replay`, an optimizer's memory of its last
fused step, which runs the next one on the same plan when nothing has moved."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from itertools import chain, compress, repeat
from operator import attrgetter, is_, is_not, itemgetter
from typing import TYPE_CHECKING, Any, cast, overload

import torch
from torch import Tensor

from largebatch.lars.spec import LAMB_SPEC, LARS_SPEC, Hyperparams, LambHyperparams
from largebatch.lars.torch import _sharded
from largebatch.lars.torch._common import lr_value
from largebatch.lars.torch._group import GroupStep

if TYPE_CHECKING:
    from largebatch.lars.kernels import Plan


def check(hyper: Hyperparams, group: int) -> None:
    """What the kernels need beyond the spec (LAMB's eps > 0), checked when a fused
    group's hyperparameters are made, before any state exists."""
    from largebatch.lars.kernels.plan import check_fused

    check_fused(hyper, group)


@overload
def step(
    groups: list[GroupStep],
    *,
    counter: Tensor,
    found_inf: Tensor | None,
    memo: Replay | None = None,
    **kwargs: Any,
) -> Tensor: ...
@overload
def step(
    groups: list[GroupStep],
    *,
    counter: None,
    found_inf: Tensor | None,
    memo: Replay | None = None,
    **kwargs: Any,
) -> None: ...
def step(
    groups: list[GroupStep],
    *,
    counter: Tensor | None,
    found_inf: Tensor | None,
    memo: Replay | None = None,
    **kwargs: Any,
) -> Tensor | None:
    """One step of the kernels on ``groups`` (each with params); returns ``counter``,
    moved to the params' device if it was elsewhere (it is counted where the kernels
    run). ``kwargs`` go to the kernels' launches (``grad_scale``, ``max_grad_norm``,
    ``reduce_norms``/``reduce_global`` for sharded params). ``memo`` (an optimizer's)
    keeps the groups' lr buffers and receives the step's plan. Nothing here reads a
    device value on the host: the skip is decided on the device, also when no param
    has a grad."""
    from largebatch.lars import kernels

    if memo is not None:
        memo.plan = None
    if not groups:  # nothing to update: count the step unless GradScaler skips it
        if counter is None:
            return counter
        if found_inf is None:
            return counter.add_(1)
        if counter.device != found_inf.device and found_inf.device.type != "cpu":
            counter = counter.to(found_inf.device, non_blocking=True)
        return counter.add_(found_inf.reshape(()) == 0)
    device = groups[0].params[0].device
    if counter is not None and counter.device != device:
        counter = counter.to(device, non_blocking=True)
    fused = [
        kernels.FusedGroup(
            params=g.params,
            grads=g.grads,
            masters=g.masters,
            state=g.state,
            steps=g.steps,
            lr=device_lr(g.lr, device, None if memo is None else memo.lr_buffers, g.key),
            hyper=g.hyper,
            maximize=g.maximize,
        )
        for g in groups
    ]
    lamb = isinstance(groups[0].hyper, LambHyperparams)
    plan = kernels.plan_for(LAMB_SPEC if lamb else LARS_SPEC, fused, counter)
    if plan is not None:
        (kernels.launch_lamb if lamb else kernels.launch_lars)(plan, found_inf=found_inf, **kwargs)
    if memo is not None:
        memo.plan = plan
    return counter


def device_lr(
    lr: float | Tensor, device: torch.device, buffers: dict | None = None, key: Any = None
) -> Tensor:
    """``lr`` as an fp32 0-dim tensor on ``device``: ``lr`` itself when it is one (the
    CUDA-graph-friendly way, read in place), else a buffer filled with it, kept in
    ``buffers[key]`` so that the kernels' lr address table stays valid between steps
    (with the number it holds: a float lr that did not change is not written again)."""
    if isinstance(lr, Tensor) and lr.device == device and lr.dtype == torch.float32 and lr.numel() == 1:
        return lr.reshape(())
    buffer, held = (None, None) if buffers is None else buffers.get(key, (None, None))
    if buffer is None or buffer.device != device:
        buffer, held = torch.zeros((), dtype=torch.float32, device=device), None
    if buffers is not None:
        buffers[key] = (buffer, None if isinstance(lr, Tensor) else lr)
    if not isinstance(lr, Tensor):
        return buffer if held is not None and held == lr else buffer.fill_(lr)
    if lr.device.type == "cpu":  # read on the host: no wait
        return buffer.fill_(lr.reshape(()))
    return buffer.copy_(lr.reshape(()))


_GRAD = attrgetter("grad")
_PARAMS = itemgetter("params")
_SPARSE = attrgetter("is_sparse")

# What the next step of an optimizer can reuse (Replay.check): everything ("replay"),
# everything but the grads, which are new tensors ("new grads"), or nothing ("full").
REPLAY, NEW_GRADS, FULL = "replay", "new grads", "full"


_LOCAL = attrgetter("_local_tensor")  # a DTensor's local block


_DEREF = weakref.ref.__call__  # a weak reference's object (None once it is freed)


def _addresses(tensors: Iterable[Tensor], sharded: bool) -> tuple[int, ...]:
    """The data addresses of ``tensors`` (of their local blocks: ``sharded``, every one a
    DTensor), in one C-level pass."""
    return tuple(map(Tensor.data_ptr, map(_LOCAL, tensors) if sharded else tensors))


def _present(grads: list[Tensor | None]) -> list[bool]:
    """Where a param has a grad, in one C-level pass."""
    return list(map(is_not, grads, repeat(None)))


@dataclass
class Replay:
    """An optimizer's memory of its last fused step: its groups' lr buffers, the kernels'
    plan, and what the step ran on (docs/design.md §3, "A step with no work per tensor").

    :meth:`check` compares the next step with it, with no Python loop over the tensors
    (each comparison one C-level pass over the params):

    - the same groups, hyperparameters, params and grads (the same objects at the same
      addresses, of their local blocks for FSDP2's DTensors: grads zeroed in place, DDP's
      ``gradient_as_bucket_view``, FSDP2's sharded grads) and the same state: :meth:`run`
      launches the kernels on the plan, nothing else;
    - only the grads are new tensors (``zero_grad()``'s default), in the same places:
      :meth:`with_new_grads` gives the last step's groups with them, and the step finds
      its plan by their addresses, without gathering params and state again;
    - anything else (a param moved or added, a grad gone or come, a changed
      hyperparameter, a loaded state dict) takes the full step, which is recorded.

    State tensors are the optimizer's: changed in place, replaced only by
    ``load_state_dict``. Grads are held by weak references only: ``zero_grad()`` frees
    them before the next backward, as it would without this memory."""

    lr_buffers: dict = field(default_factory=dict)
    plan: Plan | None = None  # set by :func:`step`: the plan of the last fused step
    lamb: bool = False
    groups: list[dict] = field(default_factory=list)  # the optimizer's param groups
    steps: list[GroupStep] = field(default_factory=list)  # the last step's, grads left out
    planned: list[dict] = field(default_factory=list)  # their param groups
    hypers: list[Hyperparams] = field(default_factory=list)
    params: list[Tensor] = field(default_factory=list)
    grads: list[weakref.ref] = field(default_factory=list)  # the grads, where present
    present: list[bool] = field(default_factory=list)  # where a param has a grad
    addresses: tuple[int, ...] | None = None  # the params' then the grads' (where present)
    counter: Tensor | None = None
    state: Any = None  # the optimizer's state mapping, and its size
    n_state: int = -1
    reducer: _sharded.Reducer | None = None  # for sharded (DTensor) params, their norms' sums
    seen: list[Tensor] = field(default_factory=list)  # the grads check() found, until used
    moved: bool = False  # whether they were other tensors than the last step's

    def record(
        self,
        param_groups: list[dict],
        hypers: list[Hyperparams],
        steps: list[GroupStep],
        counter: Tensor | None,
        state: Any,
        reducer: _sharded.Reducer | None,
    ) -> None:
        """Remember what the full step just taken (with :func:`step` and this memo) ran on;
        ``reducer``: its sharded params' (every param then a DTensor), else None."""
        params = list(chain.from_iterable(map(_PARAMS, param_groups)))
        if self.plan is None or (reducer is not None and not all(map(_sharded.is_sharded, params))):
            self.forget()
            return
        grads = list(map(_GRAD, params))
        self.params, self.present = params, _present(grads)
        live = cast("list[Tensor]", list(compress(grads, self.present)))
        self.grads = list(map(weakref.ref, live))
        self.lamb = isinstance(hypers[0], LambHyperparams)
        self.groups, self.hypers = list(param_groups), list(hypers)
        self.steps = [replace(s, grads=[]) for s in steps if s.params]
        self.planned = [g for g, s in zip(param_groups, steps) if s.params]
        self.reducer = reducer
        self.addresses = self._addresses_of(params, live)
        self.counter, self.state, self.n_state = counter, state, len(state)
        self.seen = []

    def _addresses_of(self, params: list[Tensor], grads: list[Tensor]) -> tuple[int, ...]:
        """The params' (where a param has a grad) then ``grads``' data addresses."""
        sharded = self.reducer is not None
        return _addresses(compress(params, self.present), sharded) + _addresses(grads, sharded)

    def forget(self) -> None:
        """Take the next step in full."""
        self.plan, self.groups, self.steps, self.params, self.grads, self.seen = None, [], [], [], [], []

    def check(
        self, param_groups: list[dict], hypers: list[Hyperparams], counter: Tensor | None, state: Any
    ) -> str:
        """What the next step may reuse: :data:`REPLAY`, :data:`NEW_GRADS` or :data:`FULL`."""
        if self.plan is None or counter is not self.counter or state is not self.state:
            return FULL
        if len(state) != self.n_state or len(param_groups) != len(self.groups):
            return FULL
        if not (all(map(is_, param_groups, self.groups)) and all(map(is_, hypers, self.hypers))):
            return FULL
        params = list(chain.from_iterable(map(_PARAMS, param_groups)))
        if len(params) != len(self.params) or not all(map(is_, params, self.params)):
            return FULL
        grads = list(map(_GRAD, params))
        if _present(grads) != self.present:
            return FULL
        self.seen = live = cast("list[Tensor]", list(compress(grads, self.present)))
        self.moved = not all(map(is_, live, map(_DEREF, self.grads)))
        if self.moved or self.addresses is None:  # new grads, or the last step's were: look the plan up
            return NEW_GRADS
        if self._addresses_of(params, live) == self.addresses:
            self.seen = []
            return REPLAY
        return FULL

    def run(self, *, grad_scale: Tensor | None, found_inf: Tensor | None, options: dict[str, Any]) -> Tensor:
        """The step on the recorded plan (after :meth:`check` said :data:`REPLAY`);
        returns the optimizer's counter."""
        from largebatch.lars import kernels

        assert self.plan is not None
        device = self.plan.ws.device
        lrs = [device_lr(lr_value(g["lr"]), device, self.lr_buffers, id(g)) for g in self.planned]
        kernels.set_lrs(self.plan, lrs)
        launch = kernels.launch_lamb if self.lamb else kernels.launch_lars
        launch(self.plan, grad_scale=grad_scale, found_inf=found_inf, **options)
        return cast(Tensor, self.counter)

    def new_grads(self) -> list[Tensor]:
        """The grads :meth:`check` found (after it said :data:`NEW_GRADS`), where present."""
        return self.seen

    def with_new_grads(self) -> list[GroupStep]:
        """The last step's groups with the grads :meth:`check` found and their lrs now;
        from here on those grads are the ones a replay expects. Their addresses are read
        only when the next step finds the same grads: while grads move at every step,
        nothing is read per tensor but by the plan's lookup."""
        grads, at, out = self.new_grads(), 0, []
        for s, g in zip(self.steps, self.planned):
            out.append(replace(s, grads=grads[at : at + len(s.params)], lr=lr_value(g["lr"])))
            at += len(s.params)
        if self.moved:
            self.addresses = None
        else:  # the same grads twice: a replay may follow
            self.addresses = self._addresses_of(self.params, grads)
        self.grads, self.seen = list(map(weakref.ref, grads)), []
        return out

    @staticmethod
    def unusual(grads: list[Tensor]) -> bool:
        """Whether some grad is sparse or complex (the full step's checks raise then)."""
        return any(map(_SPARSE, grads)) or any(map(Tensor.is_complex, grads))
