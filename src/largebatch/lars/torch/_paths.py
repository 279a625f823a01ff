"""Which path takes a step, and the machinery of the compiled one.

Four paths compute the same update (``largebatch.lars.reference``):

- ``single_tensor``: a readable loop over the tensors;
- ``foreach``: ``torch._foreach_*`` ops over a group's tensors (the default);
- ``compiled``: each large tensor through ``torch.compile`` (a norm kernel and one fused
  elementwise kernel), the small ones through one foreach pass: the fast CPU path;
- ``fused``: the multi-tensor Triton kernels of ``largebatch.lars.kernels`` (CUDA).

:func:`resolve` turns the user's ``foreach``/``fused``/``compiled`` (each True, False or
None) into settings, once: the optimizers call it for each param group as it is added,
the functionals on every call. The size thresholds that choose are named here and
nowhere else. :func:`run` is the one dispatch point: the optimizers' ``step`` and the
functionals both hand it their groups (:class:`Work`); it builds the fused path's groups
(``_fused.fused_group``) and calls the other paths' bodies by keyword.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar

import torch
from torch import Tensor

from largebatch.lars.spec import OptimizerSpec
from largebatch.lars.torch import _sharded
from largebatch.lars.torch._common import check_paths, skipped

# The compiled path pays a one-time compile (seconds, cached on disk by Inductor): by
# default it is chosen only for CPU models large enough for the step's speed to matter.
COMPILE_MIN_NUMEL = 1 << 20
# Each compiled call costs a fixed ~0.2 ms of dispatch on the host: tensors below this
# size go through one foreach pass instead (in ResNet-50 they are 107 of 161 tensors
# and 0.3% of the elements).
COMPILE_MIN_TENSOR = 1 << 16

PATHS = ("single_tensor", "foreach", "compiled", "fused")

_Counter = TypeVar("_Counter", Tensor, None)  # an optimizer's count of applied steps, or None

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
        fused = (not (foreach or compiled) and bool(tensors) and all(t.is_cuda for t in tensors)
                 and triton_available())
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
        compiled = (not fused and not sharded and bool(tensors)
                    and all(t.device.type == "cpu" for t in tensors)
                    and sum(t.numel() for t in tensors) >= COMPILE_MIN_NUMEL)
    return {"foreach": foreach, "fused": bool(fused), "compiled": bool(compiled)}


def pick(foreach: bool | None, fused: bool, compiled: bool) -> str:
    """The path for resolved settings."""
    if fused:
        return "fused"
    if compiled:
        return "compiled"
    return "single_tensor" if foreach is False else "foreach"


def list_names(spec: OptimizerSpec) -> tuple[str, ...]:
    """The names of a group's tensor lists, as the functionals and the bodies take them:
    ``params``, ``grads``, one list per state key (``momentum_buffers``; ``exp_avgs``,
    ``exp_avg_sqs``), ``masters`` (None where a param has none), ``state_steps``."""
    return ("params", "grads", *(f"{key}s" for key in spec.state), "masters", "state_steps")


@dataclass(frozen=True)
class Work:
    """One group's share of a step: its lists (keys :func:`list_names`), its
    hyperparameters (the spec's names; ``lr`` a float or a one-element Tensor), its
    resolved path, and the key of its lr buffer on the fused path."""

    tensors: dict[str, list]
    hyper: dict[str, Any]
    path: str
    key: Any = None


def run(spec: OptimizerSpec, bodies: dict[str, Callable[..., None]], work: list[Work], *,
        grad_scale: Tensor | None, found_inf: Tensor | None, counter: _Counter,
        fused_options: dict[str, Any] | None = None, lr_buffers: dict | None = None) -> _Counter:
    """The one place where a step's path runs, for the optimizers and the functionals.

    Sharded (DTensor) lists become their local blocks and a reducer that sums norms over
    the shards. The fused path takes every group in one call of the kernels (which decide
    the skip on the device, and take ``fused_options``: the optimizer's options and the
    sharded reductions); the other paths skip on ``found_inf`` (read on the host), then
    call each group's body by keyword. Returns ``counter`` (the count of applied steps,
    or None), advanced unless the step was skipped.
    """
    names = list_names(spec)
    local = []
    for w in work:
        if w.tensors["params"]:
            lists, reducer = _sharded.local(tuple(w.tensors[k] for k in names))
            local.append((w, dict(zip(names, lists)), reducer))
    if work and work[0].path == "fused":  # then every group's (the optimizer checks)
        from largebatch.lars.torch import _fused

        groups = [
            _fused.fused_group(spec, tensors, w.hyper, _fused.device_lr(
                w.hyper["lr"], tensors["params"][0].device, lr_buffers, w.key))
            for w, tensors, _ in local
        ]
        return _fused.fused_step(spec, groups, counter=counter, grad_scale=grad_scale,
                                 found_inf=found_inf, **(fused_options or {}))
    if skipped(found_inf):
        return counter
    for w, tensors, reducer in local:
        bodies[w.path](**tensors, **w.hyper, grad_scale=grad_scale, reduce=reducer)
    if counter is not None:
        counter += 1
    return counter


def dispatch(spec: OptimizerSpec, bodies: dict[str, Callable[..., None]], tensors: dict[str, list], *,
             foreach: Any, fused: Any, compiled: Any, grad_scale: Tensor | None,
             found_inf: Tensor | None, hyper: dict[str, Any]) -> None:
    """What a functional does: resolve the path for its group (``tensors``, keyed by
    :func:`list_names`) and :func:`run` it with ``hyper``."""
    path = pick(**resolve(foreach, fused, compiled, tensors["params"]))
    reducer = _sharded.reducer_for(tensors["params"])
    if reducer is not None:  # every rank checked only its own shards
        found_inf = reducer.found_inf(found_inf)
    options = reducer.fused_kwargs(spec) if reducer is not None and path == "fused" else None
    run(spec, bodies, [Work(tensors, hyper, path)], grad_scale=grad_scale, found_inf=found_inf,
        counter=None, fused_options=options)


def compiled_path(spec: OptimizerSpec, single_tensor: Callable[..., None],
                  foreach: Callable[..., None]) -> Callable[..., None]:
    """The compiled path from an optimizer's two bodies: its large contiguous tensors
    through ``single_tensor(..., compiled=True)``, the rest through ``foreach``."""
    names = list_names(spec)

    def run(*, reduce: Any = None, **kwargs: Any) -> None:
        if reduce is not None:  # resolve() keeps sharded params off this path
            raise RuntimeError("the compiled path does not take sharded params")
        large, small = split_for_compile(tuple(kwargs.pop(k) for k in names))
        single_tensor(**dict(zip(names, large)), compiled=True, **kwargs)
        foreach(**dict(zip(names, small)), **kwargs)

    return run


# --------------------------------------------------------------------------- compiled path


@functools.cache
def compiled_body(body: Callable[..., Any],
                  flags: tuple[tuple[str, bool], ...] = ()) -> Callable[..., Any]:
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
    copy = types.FunctionType(body.__code__.replace(), body.__globals__, body.__name__,
                              body.__defaults__, body.__closure__)
    copy.__kwdefaults__ = body.__kwdefaults__
    copy.__qualname__, copy.__module__ = body.__qualname__, body.__module__
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


def split_for_compile(lists: tuple[list, ...]) -> tuple[tuple[list, ...], tuple[list, ...]]:
    """``lists`` (params first) cut in two: the entries of contiguous params of
    COMPILE_MIN_TENSOR+ elements, for the compiled body, and the rest, for foreach."""
    large = [i for i, p in enumerate(lists[0]) if p.numel() >= COMPILE_MIN_TENSOR and p.is_contiguous()]
    chosen = set(large)
    small = [i for i in range(len(lists[0])) if i not in chosen]
    return tuple([xs[i] for i in large] for xs in lists), tuple([xs[i] for i in small] for xs in lists)


def pick_body(body: Callable, compiled: Callable | None,
              tensors: dict[str, Tensor | None]) -> tuple[Callable, dict[str, Tensor | None]]:
    """The compiled body on flat views of contiguous tensors of 2+ elements, else the
    eager one (sizes 0 and 1 would each cost a compile of their own); ``tensors`` are
    the body's tensor keywords (None where a param has no master)."""
    present = [t for t in tensors.values() if t is not None]
    if compiled is None or present[0].numel() < 2 or not all(t.is_contiguous() for t in present):
        return body, tensors
    return compiled, {k: None if t is None else t.view(-1) for k, t in tensors.items()}
