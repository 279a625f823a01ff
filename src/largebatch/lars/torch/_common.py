"""What every torch path of LARS and LAMB shares: param groups, argument checks, norms
and the small tensor helpers."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from largebatch.lars.spec import LARS_SPEC, as_flag

LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- param groups


def default_exclude(name: str, param: Tensor) -> bool:
    """Biases and every param with ndim <= 1 (normalization scales and shifts)."""
    return param.ndim <= 1 or name.endswith(".bias")


def param_groups(
    model: torch.nn.Module,
    weight_decay: float,
    exclude: Callable[[str, Tensor], bool] | None = None,
) -> list[dict[str, Any]]:
    """Split ``model``'s trainable params into the two groups large-batch recipes use.

    Returns ``[{"params": adapted, "weight_decay": weight_decay},
    {"params": excluded, "weight_decay": 0.0, "trust_ratio": False}]``. A param is excluded
    when ``exclude(name, param)`` is true; the default excludes biases and params with
    ``ndim <= 1`` (BatchNorm/LayerNorm), as the MLPerf ResNet-50 reference does. Excluded
    params get trust ratio 1 and no weight decay (``weight_decay`` and ``trust_ratio`` are
    independent per group; this split sets both). Either group may be empty.
    """
    LARS_SPEC.hyper("weight_decay").check(weight_decay)
    exclude = default_exclude if exclude is None else exclude
    adapted: list[Tensor] = []
    excluded: list[Tensor] = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (excluded if exclude(name, param) else adapted).append(param)
    return [
        {"params": adapted, "weight_decay": weight_decay},
        {"params": excluded, "weight_decay": 0.0, "trust_ratio": False},
    ]


def group_params(params: Any) -> list:
    """A group's params as a list, read once (a generator is consumed here and only here)."""
    if isinstance(params, Tensor):
        return [params]
    if isinstance(params, set):
        raise TypeError("params must be an ordered iterable of Tensors (a set's order changes between runs)")
    return list(params)


def param_list(params: Any) -> list:
    """The constructor's ``params``: a list of Tensors or of group dicts with listed params."""
    if isinstance(params, Tensor):
        raise TypeError(
            "params argument given to the optimizer should be an iterable of Tensors or dicts, "
            f"but got {torch.typename(params)}"
        )
    entries = group_params(params)
    return [{**e, "params": group_params(e["params"])} if isinstance(e, dict) else e for e in entries]


def tensor_of(entry: Any) -> Any:
    """A params entry's tensor: the entry itself, or the second item of a ``(name,
    tensor)`` pair (``model.named_parameters()``, which torch.optim takes too)."""
    return entry[1] if isinstance(entry, tuple) and len(entry) == 2 else entry


def tensors_of(params: list[Any]) -> list[Tensor]:
    """Every Tensor of a constructor's ``params`` (Tensors, ``(name, tensor)`` pairs or
    group dicts)."""
    entries = (entry["params"] if isinstance(entry, dict) else [entry] for entry in params)
    flat = (p for entry in entries for p in ([entry] if isinstance(entry, (Tensor, tuple)) else entry))
    return [t for t in map(tensor_of, flat) if isinstance(t, Tensor)]


# Where :meth:`named_trust_ratios` finds names: a module, a mapping of names to params, or
# None (the names the param groups carry).
ParamNames = torch.nn.Module | Mapping[str, Tensor] | None


def param_names(groups: list[dict[str, Any]], names: ParamNames = None) -> Callable[[Tensor], str]:
    """A function from each param of ``groups`` to its name: from ``names`` (a module's
    ``named_parameters()``, or a mapping of names to params), or when None from the
    ``"param_names"`` torch.optim keeps in a group given named params. A ValueError names
    the param (group, index, shape) that has none."""
    if names is None:
        by_id = {
            id(p): n for g in groups if "param_names" in g for n, p in zip(g["param_names"], g["params"])
        }
        source = 'the param groups (no "param_names": pass model.named_parameters(), or names=model)'
    else:
        pairs = names.named_parameters() if isinstance(names, torch.nn.Module) else names.items()
        by_id = {id(p): n for n, p in pairs}
        source = f"the {type(names).__name__} given as names"
    where = {id(p): (i, j) for i, g in enumerate(groups) for j, p in enumerate(g["params"])}

    def name_of(param: Tensor) -> str:
        name = by_id.get(id(param))
        if name is None:
            i, j = where.get(id(param), ("?", "?"))
            raise ValueError(
                f"param {j} of param group {i} (shape {tuple(param.shape)}) has no name in {source}"
            )
        return name

    return name_of


# --------------------------------------------------------------------------- checks


def lr_number(lr: Any) -> Any:
    """A group's lr for the spec's check: a one-element floating Tensor as its value."""
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Invalid lr: Tensor lr must be 1-element, got shape {tuple(lr.shape)}")
        if not lr.is_floating_point():
            raise ValueError(f"Invalid lr: a Tensor lr must be floating point, got {lr.dtype}")
        return lr.item()
    return lr


def check_paths(foreach: Any, fused: Any, compiled: Any) -> None:
    """The path flags are True, False or None (a string such as "False" is refused)."""
    for name, value in (("foreach", foreach), ("fused", fused), ("compiled", compiled)):
        if value is not None:
            as_flag(name, value)


def lr_value(lr: float | Tensor) -> float | Tensor:
    """A group's lr for the math: a one-element Tensor (shape (), (1,) or (1, 1)) as 0-dim."""
    return lr.reshape(()) if isinstance(lr, Tensor) else lr


# --------------------------------------------------------------------------- norms


def stacked_norms(tensors: Sequence[Tensor], *, on_device: bool = False) -> Tensor:
    """Per-tensor L2 norms as one vector (fp64 for fp64 tensors, else fp32) that cannot
    overflow for finite inputs: a sum of squares past the fp32 range (||x|| > ~1.8e19) is
    recomputed with fp64 accumulation. The common case costs one fp32 pass and one host
    read (whether any norm overflowed); ``on_device=True``, and any call under
    ``torch.compile`` (where that read would break the graph), reads nothing on the host
    and takes the fp64 norms of every tensor, kept where the fp32 ones overflowed (the
    same values)."""
    if not tensors:
        return torch.zeros(0)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    norms = torch.stack(torch._foreach_norm(list(tensors), 2, dtype=dtype))
    if dtype == torch.float32 and (on_device or torch.compiler.is_compiling()):
        wide = torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float64)).to(dtype)
        return torch.where(torch.isfinite(norms), norms, wide)
    if dtype == torch.float32 and not bool(torch.isfinite(norms).all()):
        for i in torch.nonzero(~torch.isfinite(norms)).flatten().tolist():
            norms[i] = torch.linalg.vector_norm(tensors[i], 2, dtype=torch.float64)
    return norms


def norm(tensor: Tensor, *, on_device: bool = False) -> Tensor:
    """:func:`stacked_norms` of one tensor, as a 0-dim tensor."""
    return stacked_norms([tensor], on_device=on_device)[0]


def safe_ratio(numerator: Tensor, denominator: Tensor, w_norm: Tensor, other_norm: Tensor) -> Tensor:
    """``numerator / denominator``, or 1 where either norm is zero (no host sync)."""
    ok = (w_norm > 0) & (other_norm > 0)
    return torch.where(ok, numerator / torch.where(ok, denominator, 1.0), 1.0)


# --------------------------------------------------------------------------- tensors


def unscaled(grad: Tensor, like: Tensor, divisor: Tensor | None) -> Tensor:
    """``grad`` in ``like``'s dtype, divided by ``divisor``; a new tensor, or ``grad`` itself
    when nothing changes (the caller never writes to it)."""
    g = grad if grad.dtype == like.dtype else grad.to(like.dtype)
    return g if divisor is None else g / divisor


def weights(params: list[Tensor], masters: list[Tensor | None]) -> list[Tensor]:
    """The tensors the math runs on: each param's fp32 master where it has one."""
    return [p if m is None else m for p, m in zip(params, masters)]


def write_back(params: list[Tensor], masters: list[Tensor | None]) -> None:
    """Rewrite each param that has a master from it (cast to the param's dtype)."""
    pairs = [(p, m) for p, m in zip(params, masters) if m is not None]
    if pairs:
        torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])


def skipped(found_inf: Tensor | None) -> bool:
    """A GradScaler found inf or NaN: the step must change nothing (read on the host)."""
    return found_inf is not None and bool(found_inf.item())
