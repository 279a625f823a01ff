"""The compiled path: each large tensor's update through ``torch.compile`` (a norm
kernel and one fused elementwise kernel), the small ones through one foreach pass."""

from __future__ import annotations

import functools
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from largebatch.lars.torch._group import Body, GroupStep

# Each compiled call costs a fixed ~0.2 ms of dispatch on the host: tensors below this
# size go through one foreach pass instead (in ResNet-50 they are 107 of 161 tensors
# and 0.3% of the elements).
COMPILE_MIN_TENSOR = 1 << 16


def compiled_path(single_tensor: Callable[..., None], foreach: Body) -> Body:
    """The compiled path from an optimizer's two bodies: its large contiguous tensors
    through ``single_tensor(..., compiled=True)``, the rest through ``foreach``."""

    def run(group: GroupStep, grad_scale: Tensor | None, reduce: Any) -> None:
        if reduce is not None:  # resolve() keeps sharded params off this path
            raise RuntimeError("the compiled path does not take sharded params")
        large, small = split_for_compile(group)
        single_tensor(large, grad_scale, None, compiled=True)
        foreach(small, grad_scale, None)

    return run


class _NoCudaRuntimeNotice(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." record. Inductor's CPU
    code generation imports ``torch.utils.cpp_extension``, which logs it on any machine
    with a CUDA toolkit and no GPU; it concerns CUDA extension builds, which the CPU step
    never makes. Every other record of that logger passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def quiet_cuda_runtime_notice() -> None:
    """Adds :class:`_NoCudaRuntimeNotice` to ``torch.utils.cpp_extension``'s logger (once)."""
    logger = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _NoCudaRuntimeNotice) for f in logger.filters):
        logger.addFilter(_NoCudaRuntimeNotice())


@functools.cache
def compiled_body(body: Callable[..., Any], flags: tuple[tuple[str, bool], ...] = ()) -> Callable[..., Any]:
    """``body`` through ``torch.compile`` with dynamic sizes: one compiled kernel pair
    (norms, then the fused elementwise update) serves every tensor of a given dtype and
    set of flags, whatever its size.

    One compiled function per set of ``flags`` (the body's bool keywords, as sorted
    pairs), each on its own copy of the body's code: Dynamo keeps at most
    ``recompile_limit`` (8) graphs per code object, and each set of flags takes one per
    dtype and master combination, so many sets on one code object (several param groups
    with different options, or several optimizers in one process) would exhaust it.

    Every number the body uses (lr, the hyperparameters, bias corrections) reaches it as
    a 0-dim tensor, an input of the compiled graph, never as a Python float: Inductor's
    on-disk cache may serve a float baked in as a constant by another process with other
    values. Flags stay Python bools; they choose the graph's code and so its cache key.
    """
    copy = types.FunctionType(
        body.__code__.replace(), body.__globals__, body.__name__, body.__defaults__, body.__closure__
    )
    copy.__kwdefaults__ = body.__kwdefaults__
    copy.__qualname__, copy.__module__ = body.__qualname__, body.__module__
    quiet_cuda_runtime_notice()
    return torch.compile(copy, dynamic=True, fullgraph=True)


def compiled_norm(tensor: Tensor) -> Tensor:
    """The norm inside a compiled body: fp64 accumulation, which cannot overflow and, on
    a kernel that only loads its input, costs no more than fp32; the result in fp32
    (fp64 for fp64 tensors)."""
    out = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(tensor, 2, dtype=torch.float64).to(out)


def compiled_plain_norm(tensor: Tensor) -> Tensor:
    """The norm inside a compiled body, accumulated in fp32 (fp64 for fp64 tensors):
    the caller handles a result that overflowed."""
    dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(tensor, 2, dtype=dtype)


# The norms a compiled body is called with (each body keeps its own code object, and so
# its own compiled variants, because these go in as arguments).
COMPILED_NORMS = dict(norm=compiled_norm, plain_norm=compiled_plain_norm)


def as_tensors(*values: Any) -> tuple[Tensor, ...]:
    """Numbers for a compiled body: fp64 0-dim CPU tensors (see :func:`compiled_body`)."""
    return tuple(torch.as_tensor(v, dtype=torch.float64) for v in values)


def split_for_compile(group: GroupStep) -> tuple[GroupStep, GroupStep]:
    """``group`` cut in two: its contiguous params of COMPILE_MIN_TENSOR+ elements, for
    the compiled body, and the rest, for foreach."""
    large = [i for i, p in enumerate(group.params) if p.numel() >= COMPILE_MIN_TENSOR and p.is_contiguous()]
    chosen = set(large)
    small = [i for i in range(len(group.params)) if i not in chosen]
    return group.select(large), group.select(small)


def pick_body(
    body: Callable, compiled: Callable | None, tensors: dict[str, Tensor | None]
) -> tuple[Callable, dict[str, Any]]:
    """The compiled body on flat views of contiguous tensors of 2+ elements, else the
    eager one (sizes 0 and 1 would each cost a compile of their own); ``tensors`` are
    the body's tensor keywords (None where a param has no master)."""
    present = [t for t in tensors.values() if t is not None]
    if compiled is None or present[0].numel() < 2 or not all(t.is_contiguous() for t in present):
        return body, tensors
    return compiled, {k: None if t is None else t.view(-1) for k, t in tensors.items()}
