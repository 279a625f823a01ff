"""Which path takes a step: ``single_tensor`` (a readable loop), ``foreach`` (the
default), ``compiled`` (``_compiled``: the fast CPU path) or ``fused`` (the Triton
kernels, the CUDA default). :func:`resolve` turns the user's ``foreach``/``fused``/
``compiled`` into settings once per group; the thresholds that choose are named here."""

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


def resolve(foreach: Any, fused: Any, compiled: Any, tensors: list[Tensor]) -> PathSettings:
    """The path settings for ``tensors``, checked, with the defaults filled in.

    ``fused=None``: fused when every tensor is on CUDA and triton imports, unless
    ``foreach`` or ``compiled`` is True.
    ``compiled=None``: compiled for CPU tensors of COMPILE_MIN_NUMEL+ elements in all,
    unless fused or sharded (DTensors, which ``compiled=True`` refuses).
    ``foreach=None`` stays None (foreach, where nothing else is chosen).
    """
    check_paths(foreach, fused, compiled)
    if fused and foreach:
        raise ValueError("foreach=True and fused=True cannot both be set")
    if fused and compiled:
        raise ValueError("compiled=True and fused=True cannot both be set")
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
    return {"foreach": foreach, "fused": bool(fused), "compiled": bool(compiled)}


def pick(foreach: bool | None, fused: bool, compiled: bool) -> str:
    """The path for resolved settings."""
    if fused:
        return "fused"
    if compiled:
        return "compiled"
    return "single_tensor" if foreach is False else "foreach"
