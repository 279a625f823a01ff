"""Where the fused path's tests run, and a recorder of what would make the host wait.

The suite has two modes (tests/conftest.py): the default runs the Triton kernels on CPU
tensors under Triton's interpreter; ``LARGEBATCH_CUDA_TESTS=1`` compiles them for the GPU
and runs the tests marked ``gpu``. :data:`FUSED_DEVICES` parametrizes a test over the
devices the current mode can run the fused kernels on.

:class:`HostSyncs` records, while it is active, each operation of largebatch's own code
that makes the host wait for the device on CUDA: a read of a tensor's value on the host
(``.item()``, ``bool()``, ``float()``, ``int()``, ``.tolist()``: ``aten._local_scalar_dense``
and friends), and a copy to a device that is not ``non_blocking`` (``torch.tensor(...,
device=...)``, ``.to(device)``, ``.cuda()``, ``copy_`` across devices). On the CPU nothing
syncs, so it records what would; operations that Triton itself makes (its interpreter
copies every argument) are not largebatch's and are left out.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import largebatch

CUDA_MODE = os.environ.get("LARGEBATCH_CUDA_TESTS") == "1"
FUSED_DEVICES = ([] if CUDA_MODE else ["cpu"]) + [pytest.param("cuda", marks=pytest.mark.gpu)]

_LARGEBATCH = os.path.dirname(os.path.abspath(largebatch.__file__)) + os.sep
try:
    import triton

    _TRITON = os.path.dirname(os.path.abspath(triton.__file__)) + os.sep
except ImportError:  # pragma: no cover
    _TRITON = None

_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"}
_UPLOADS = {"tensor", "as_tensor"}
_SCALAR_OPS = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::nonzero"}


def _caller() -> str | None:
    """``file:line`` of the nearest largebatch frame, or None when Triton's own code (or
    no largebatch code at all) is nearer."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if _TRITON and path.startswith(_TRITON):
            return None
        if path.startswith(_LARGEBATCH):
            return f"{path[len(_LARGEBATCH) :]}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _names_device(args: tuple, kwargs: dict) -> bool:
    return kwargs.get("device") is not None or any(
        isinstance(a, (torch.device, str, int)) and not isinstance(a, bool) for a in args
    )


class _Functions(TorchFunctionMode):
    def __init__(self, record: list[str]) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        what = None
        if name in _READS:
            what = f"{name}()"
        elif name in _UPLOADS and kwargs.get("device") is not None:
            what = f"torch.{name}(..., device={kwargs['device']})"
        elif (
            name in ("to", "cuda")
            and not kwargs.get("non_blocking", False)
            and (name == "cuda" or _names_device(args[1:], kwargs))
        ):
            what = f".{name}(device) not non_blocking"
        elif (
            name == "copy_"
            and not kwargs.get("non_blocking", False)
            and len(args) > 1
            and isinstance(args[1], torch.Tensor)
            and args[1].device != args[0].device
        ):
            what = "copy_ across devices not non_blocking"
        if what is not None:
            where = _caller()
            if where is not None:
                self.record.append(f"{what} at {where}")
        return func(*args, **kwargs)


class _Dispatch(TorchDispatchMode):
    def __init__(self, record: list[str]) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func._schema.name in _SCALAR_OPS:
            where = _caller()
            if where is not None:
                self.record.append(f"{func._schema.name} at {where}")
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """``with HostSyncs() as syncs: ...``; then ``syncs.record``: one line per operation
    of largebatch's code that would make the host wait for the device."""

    def __init__(self) -> None:
        self.record: list[str] = []
        self._modes = (_Functions(self.record), _Dispatch(self.record))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
