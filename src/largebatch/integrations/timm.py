"""Our LARS and LAMB in timm's optimizer factory: after :func:`register`,
``timm.optim.create_optimizer_v2(model, opt="lblars")`` builds :class:`~largebatch.torch.LARS`
with the package's groups (biases and normalization params get neither weight decay nor
the trust ratio)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

from timm.optim import OptimInfo, OptimizerRegistry, _optim_factory
from torch import Tensor

from largebatch.torch import LAMB, LARS

__all__ = ["LARS_NAME", "LAMB_NAME", "register", "split_groups", "timm_lars", "timm_lamb"]

# timm reads "a_b" as the prefix "a" (lookahead) and the optimizer "b": our names have no "_".
LARS_NAME = "lblars"
LAMB_NAME = "lblamb"


def split_groups(params: Iterable[Any]) -> list[Any]:
    """timm's param groups (or plain Tensors) with the package's rule added: each group
    without a ``trust_ratio`` key is split in two, its params of two or more dimensions
    as they were, and its biases and normalization params (one dimension or none) with
    ``weight_decay=0`` and ``trust_ratio=False``, as :func:`~largebatch.torch.param_groups`
    makes them. A group that names ``trust_ratio`` is kept as it is; empty groups are
    dropped. Plain Tensors count as one group."""
    entries: list[Any] = [params] if isinstance(params, Tensor) else list(params)
    if entries and not isinstance(entries[0], dict):
        entries = [{"params": entries}]
    out: list[dict[str, Any]] = []
    for group in entries:
        if "trust_ratio" in group:
            out.append(group)
            continue
        given = group["params"]
        tensors: list[Tensor] = [given] if isinstance(given, Tensor) else list(given)
        adapted = [p for p in tensors if p.ndim > 1]
        excluded = [p for p in tensors if p.ndim <= 1]
        if adapted:
            out.append({**group, "params": adapted})
        if excluded:
            out.append({**group, "params": excluded, "weight_decay": 0.0, "trust_ratio": False})
    return out


def timm_lars(params: Iterable[Any], **kwargs: Any) -> LARS:
    """:class:`~largebatch.torch.LARS` over :func:`split_groups` of timm's groups."""
    return LARS(split_groups(params), **kwargs)


def timm_lamb(params: Iterable[Any], **kwargs: Any) -> LAMB:
    """:class:`~largebatch.torch.LAMB` over :func:`split_groups` of timm's groups."""
    return LAMB(split_groups(params), **kwargs)


def _check_name(registry: OptimizerRegistry, name: str, factory: Any) -> bool:
    """Whether ``name`` still has to be registered; a ValueError for a name timm cannot
    parse or one it already gives to another optimizer."""
    if not name or "_" in name or name != name.lower():
        raise ValueError(f"Invalid timm optimizer name {name!r}: lower case, without '_' (timm splits on it)")
    if name not in registry.list_optimizers():
        return True
    if registry.get_optimizer_info(name).opt_class is factory:
        return False
    raise ValueError(f"timm already has an optimizer named {name!r}; choose another name")


def register(
    lars: str = LARS_NAME, lamb: str = LAMB_NAME, registry: OptimizerRegistry | None = None
) -> tuple[str, str]:
    """Register our LARS and LAMB with timm's optimizer factory as ``lars`` and ``lamb``
    (default "lblars" and "lblamb"); returns the two names. Registering again is a no-op.

    ``create_optimizer_v2(model, opt="lblars", lr=..., weight_decay=...)`` then builds
    our optimizer over timm's groups split by :func:`split_groups`: timm's own ``Lars``
    and ``Lamb`` keep the trust ratio on biases and norms, ours do not (whatever
    ``filter_bias_and_bn`` says; give groups with a ``trust_ratio`` key through
    ``param_group_fn`` to choose otherwise). timm passes ``momentum=0.9`` to LARS unless
    told otherwise, as to every optimizer with momentum; ``lookahead_lblars`` works as
    timm's prefixes do. ``registry``: timm's default registry unless given.

    Raises:
      ValueError: for a name with "_" or upper case, or one timm already uses.
    """
    registry = _optim_factory.default_registry if registry is None else registry
    infos = (
        (lars, timm_lars, "largebatch LARS: no trust ratio or decay on biases and norms", False),
        (lamb, timm_lamb, "largebatch LAMB: no trust ratio or decay on biases and norms", True),
    )
    todo = [info for info in infos if _check_name(registry, info[0], info[1])]
    for name, factory, description, betas in todo:
        # timm's OptimInfo names a class; any callable taking (params, **kwargs) works.
        opt_class = cast(Any, factory)
        registry.register(OptimInfo(name, opt_class, description, has_momentum=not betas, has_betas=betas))
    return lars, lamb
