"""Which path takes a step: ``single_tensor`` (a readable loop), ``foreach`` (the
default), ``compiled`` (``_compiled``: the fast CPU path) or ``fused`` (the Triton
kernels, the CUDA default). :func:`resolve` turns the user's ``foreach``/``fused``/
``compiled`` into settings once per group, refusing the paths where ``differentiable``
or ``capturable`` does not apply; the thresholds that choose are named here."""

from __future__ import annotations

import os
from typing import Any, TypedDict

from torch import Tensor

from largebatch.lars.torch import _sharded
from largebatch.lars.torch._common import check_paths

# The compiled path pays a one-time compile (seconds, cached on disk by Inductor): by
# default it is chosen only for CPU models large enough for the step's speed to matter.
COMPILE_MIN_NUMEL = 1 << 20
PATHS = ("single_tensor", "foreach", "compiled", "fused")


class PathSettings(TypedDict):
    """What :func:`resolve` returns."""

    foreach: bool | None
    fused: bool
    compiled: bool


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve(
    foreach: Any,
    fused: Any,
    compiled: Any,
    tensors: list[Tensor],
    *,
    differentiable: bool = False,
    capturable: bool = False,
) -> PathSettings:
    """The path settings for ``tensors``, checked, with the defaults filled in.

    ``fused=None``: fused when every tensor is on CUDA and triton imports, unless
    ``foreach`` or ``compiled`` is True.
    ``compiled=None``: compiled for CPU tensors of COMPILE_MIN_NUMEL+ elements in all,
    unless fused or sharded (DTensors, which ``compiled=True`` refuses).
    ``foreach=None`` stays None (foreach, where nothing else is chosen).
    ``differentiable=True``: the single-tensor path, the one autograd can run through
    (any other path asked for is a ValueError naming it). ``capturable=True``: the fused
    path, the one whose step never reads a device value on the host (a ValueError names
    the path these tensors would take otherwise).
    """
    check_paths(foreach, fused, compiled)
    asked = f"foreach={foreach}, fused={fused}, compiled={compiled}"
    if fused and foreach:
        raise ValueError("foreach=True and fused=True cannot both be set")
    if fused and compiled:
        raise ValueError("compiled=True and fused=True cannot both be set")
    if differentiable:
        _check_differentiable(foreach, fused, compiled, capturable)
        return {"foreach": False, "fused": False, "compiled": False}
    if fused is None:
        fused = (
            not (foreach or compiled)
            and bool(tensors)
            and all(t.is_cuda for t in tensors)
            and triton_available()
        )
    elif fused:
        if not triton_available():
            raise RuntimeError("fused=True needs triton: pip install triton")
        on_cpu = [t for t in tensors if not t.is_cuda]
        if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"fused=True needs CUDA params ({len(on_cpu)} are on {on_cpu[0].device}); on the "
                "CPU the Triton kernels run only under TRITON_INTERPRET=1 (set before import)"
            )
    sharded = _sharded.any_sharded(tensors)
    if compiled and sharded:
        raise ValueError(
            "compiled=True does not apply to sharded (DTensor) params: their norms need an "
            "all-reduce between the passes; use foreach (the default) or fused"
        )
    if compiled is None:
        compiled = (
            not fused
            and not sharded
            and bool(tensors)
            and all(t.device.type == "cpu" for t in tensors)
            and sum(t.numel() for t in tensors) >= COMPILE_MIN_NUMEL
        )
    if capturable and not fused:
        path = pick(foreach, False, bool(compiled))
        raise ValueError(
            f"capturable=True applies only to the fused path (the Triton kernels, for CUDA "
            f"params with triton); these params take the {path} path ({asked}), whose step "
            "reads device values on the host (GradScaler's found_inf, the norms' overflow "
            "check, LAMB's step counts), which a CUDA graph cannot capture"
        )
    return {"foreach": foreach, "fused": bool(fused), "compiled": bool(compiled)}


def _check_differentiable(foreach: Any, fused: Any, compiled: Any, capturable: Any) -> None:
    """``differentiable=True`` with the other settings: only the single-tensor path."""
    reasons = {
        "fused": "the Triton kernels write params and state outside autograd",
        "foreach": "its torch._foreach_* updates are not written for autograd (torch's "
        "optimizers refuse foreach with differentiable too)",
        "compiled": "its torch.compile'd per-tensor body is built for speed, not for autograd",
    }
    for name, value in (("fused", fused), ("foreach", foreach), ("compiled", compiled)):
        if value:
            raise ValueError(
                f"differentiable=True does not apply to the {name} path ({name}={value!r}): "
                f"{reasons[name]}; differentiable=True takes the single-tensor path (leave "
                f"{name} unset or False)"
            )
    if capturable:
        raise ValueError(
            "differentiable=True and capturable=True cannot both be set: differentiable "
            "takes the single-tensor path, capturable the fused one"
        )


def pick(foreach: bool | None, fused: bool, compiled: bool) -> str:
    """The path for resolved settings."""
    if fused:
        return "fused"
    if compiled:
        return "compiled"
    return "single_tensor" if foreach is False else "foreach"
