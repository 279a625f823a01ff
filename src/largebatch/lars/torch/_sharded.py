"""Sharded params (FSDP2's DTensors): the math on each rank's local block, every norm from
the sum of squares over the whole param (docs/design.md §7). :func:`local` turns a path's
lists into local tensors and a :class:`Reducer` that sums each tensor's squares over the
process groups that shard it; plain tensors pass through."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
from torch import Tensor

from largebatch.lars.torch._common import norm, stacked_norms

try:  # torch.distributed may be absent from a build
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    dist = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _dtensor() -> Any:
    """DTensor's class, or ``()`` (an isinstance that matches nothing) while
    ``torch.distributed.tensor`` is not imported: no DTensor can exist before it is (FSDP2
    and ``distribute_tensor`` import it), and importing it here would add 0.7 s (sympy
    included) to every ``import largebatch.torch``."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", ())


# What a shard key is: the process groups that split a tensor, in mesh-dimension order.
Key = tuple[Any, ...]


def is_sharded(tensor: Any) -> TypeGuard[DTensor]:
    return isinstance(tensor, _dtensor())


def any_sharded(tensors: list[Any]) -> bool:
    return any(map(isinstance, tensors, repeat(_dtensor())))  # one C-level pass


def shard_key(param: Tensor) -> Key:
    """The process groups over which ``param``'s elements are split (empty: replicated)."""
    if not is_sharded(param):
        return ()
    mesh, groups = param.device_mesh, []
    for dim, placement in enumerate(param.placements):
        if placement.is_partial():
            raise ValueError(
                f"a param of shape {tuple(param.shape)} has the placement {placement} on mesh "
                f"dimension {dim}: params must be Shard or Replicate, not partial sums"
            )
        if placement.is_shard():
            groups.append(mesh.get_group(dim))
    return tuple(groups)


def _local(tensor: Any, param: Tensor, what: str) -> Any:
    """``tensor``'s local block, after checking it is laid out as ``param`` is."""
    if tensor is None or not is_sharded(param):
        if is_sharded(tensor):
            raise ValueError(f"a {what} is a DTensor but its param of shape {tuple(param.shape)} is not")
        return tensor
    if not is_sharded(tensor):
        if tensor.ndim == 0:  # a step count: one per param, on every rank
            return tensor
        raise ValueError(f"a param of shape {tuple(param.shape)} is a DTensor but its {what} is not")
    if tensor.placements != param.placements or tensor.device_mesh != param.device_mesh:
        raise ValueError(
            f"a {what} is sharded as {tensor.placements} on {tensor.device_mesh}, its param "
            f"of shape {tuple(param.shape)} as {param.placements} on {param.device_mesh}: "
            "they must match"
        )
    return tensor.to_local()


class Reducer:
    """Sums per-tensor squares over the groups that shard each tensor (one all-reduce per
    distinct key and call, so a whole model's norms cost one collective under FSDP2)."""

    def __init__(self, keys: list[Key]) -> None:
        self.keys = keys
        self._positions: dict[Key, list[int]] = {}
        for i, key in enumerate(keys):
            if key:
                self._positions.setdefault(key, []).append(i)

    @property
    def groups(self) -> list[Any]:
        """Every distinct group that shards some tensor, in first-seen order."""
        return list(dict.fromkeys(g for key in self._positions for g in key))

    def sum_(self, squares: Tensor) -> Tensor:
        """All-reduce (sum) ``squares[i]`` over the groups of tensor i, in place."""
        for key, positions in self._positions.items():
            if len(positions) == len(self.keys):
                chosen = squares
            else:
                index = torch.tensor(positions, device=squares.device)
                chosen = squares.index_select(0, index)
            sum_over(key)(chosen)
            if chosen is not squares:
                squares.index_copy_(0, index, chosen)
        return squares

    def norms(self, local: Sequence[Tensor], *, on_device: bool = False) -> Tensor:
        """The norms of the whole tensors whose local blocks are ``local`` (in order):
        the local norms (safe from overflow; ``on_device``: as :func:`stacked_norms`),
        squared in fp64, summed over the shards."""
        if not local:
            return torch.zeros(0)
        part = stacked_norms(local, on_device=on_device)
        return self.sum_(part.double().square()).sqrt().to(part.dtype)

    def norm_of(self, i: int) -> Callable[[Tensor], Tensor]:
        """The norm function for tensor ``i`` alone (the per-tensor loop's ``norm``)."""
        one = Reducer([self.keys[i]])
        return lambda t: one.norms([t])[0]

    def uniform(self) -> Key:
        """The one key every tensor shares (the fused kernels reduce whole tables)."""
        keys = set(self.keys)
        if len(keys) != 1:
            raise ValueError(
                "fused=True needs every param of the optimizer sharded the same way (one "
                f"FSDP2 mesh and placement); found {len(keys)} layouts: use foreach=True"
            )
        return self.keys[0]

    def fused_kwargs(self, spec: Any) -> dict[str, Callable[[Tensor], None]]:
        """The fused kernels' reduction hooks: each sums a table over the shared key."""
        key = self.uniform()
        if not key:
            return {}
        reduce = sum_over(key)
        hooks = {"reduce_norms": reduce}
        if spec.name == "LAMB":  # its global grad norm (max_grad_norm)
            hooks["reduce_global"] = reduce
        return hooks

    def found_inf(self, found_inf: Tensor | None) -> Tensor | None:
        """GradScaler's flag made the same on every rank that shares a param (the max over
        the sharding groups): each rank checked only its own shard of the grads, and a
        step skipped on one rank and taken on another would split the model."""
        if found_inf is None or not self.groups:
            return found_inf
        flag = found_inf.detach().clone()
        for group in self.groups:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return flag


def local(lists: tuple[list, ...]) -> tuple[tuple[list, ...], Reducer | None]:
    """A path's lists (params first; then grads, state, masters and step counts) as local
    tensors, and the :class:`Reducer` of the params; ``(lists, None)`` when none is a DTensor."""
    params = lists[0]
    if not any_sharded(params):
        return lists, None
    what = ["param"] + ["grad or state tensor"] * (len(lists) - 1)
    out = tuple([_local(t, p, w) for t, p in zip(xs, params)] for w, xs in zip(what, lists))
    return out, Reducer([shard_key(p) for p in params])


def reducer_for(params: list[Tensor]) -> Reducer | None:
    """The :class:`Reducer` of ``params`` (None when none is a DTensor)."""
    return Reducer([shard_key(p) for p in params]) if any_sharded(params) else None


def sum_over(groups: Key) -> Callable[[Tensor], None]:
    """A function that all-reduces (sums) a tensor in place over each of ``groups`` (None:
    the default group)."""

    def reduce(table: Tensor) -> None:
        for group in groups:
            dist.all_reduce(table, group=group)

    return reduce


def check_default_group(what: str) -> None:
    """``what`` needs torch.distributed's default process group: say so if there is none."""
    if dist is None or not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"{what} sums over torch.distributed's default process group, and there is none: "
            "call torch.distributed.init_process_group first"
        )


def partitioned_norm(local: list[Tensor], device: torch.device, *, on_device: bool = False) -> Tensor:
    """The norm of all grads of a model whose params are partitioned between the ranks of
    the default group (each rank holds ``local``): the squares summed over every rank
    (``on_device``: the local norms as :func:`stacked_norms` takes them)."""
    squares = torch.zeros((), dtype=torch.float64, device=device)
    if local:
        squares += stacked_norms(local, on_device=on_device).double().square().sum().to(device)
    dist.all_reduce(squares)
    return squares.sqrt().float()


def whole_norm(param: Tensor, local_block: Tensor, *, on_device: bool = False) -> Tensor:
    """The norm of the whole tensor laid out as ``param`` whose local block is given
    (``on_device``: no host read, as :func:`stacked_norms`)."""
    if not is_sharded(param):
        return norm(local_block, on_device=on_device)
    return Reducer([shard_key(param)]).norms([local_block], on_device=on_device)[0]


def laid_out_as(param: Tensor, state: dict[str, Any]) -> dict[str, Any]:
    """A sharded param's loaded state, each whole tensor (a checkpoint of the unsharded
    model, or one gathered whole) cut into this rank's block as the param is (a collective
    per tensor); other state is returned as it is."""
    if not is_sharded(param):
        return state
    from torch.distributed.tensor import distribute_tensor

    return {
        k: distribute_tensor(v, param.device_mesh, param.placements)
        if isinstance(v, Tensor) and v.ndim and not is_sharded(v)
        else v
        for k, v in state.items()
    }


def check_not_flat(params: list[Tensor]) -> None:
    """Refuse FSDP1's flat params: they cut a param at arbitrary element ranges, often in the
    middle of a row, and a flat shard's norm is no param's norm."""
    for p in params:
        if getattr(p, "_fsdp_flattened", False) or type(p).__name__ == "FlatParameter":
            raise ValueError(
                f"a param of shape {tuple(p.shape)} is a flattened FSDP (FSDP1) param: LARS and "
                "LAMB need each whole param's norm, which a flat shard does not give. Shard the "
                "model with torch.distributed.fsdp.fully_shard (FSDP2) instead"
            )
