"""The launches of the fused path, recorded for ``compile_check``: :func:`record` drives
``largebatch.torch.LARS`` / ``LAMB(..., fused=True)`` and the functionals over
:func:`configurations` and keeps each ``@triton.jit`` launch as triton specializes it
(:class:`Launch`), without running the kernels. Needs the interpreter
(``TRITON_INTERPRET=1``), as the fused path does on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

KERNEL_MODULES = (
    "largebatch.lars.kernels.common",
    "largebatch.lars.kernels.lars",
    "largebatch.lars.kernels.lamb",
)

# ----------------------------------------------------------------------------- launches


@dataclass(frozen=True)
class Launch:
    """One specialization of a kernel, as triton keys its compiled binaries.

    ``signature`` maps every parameter to its type (``*fp32``, ``i32``, ...; ``constexpr``
    for a constexpr parameter and for an integer argument equal to 1), ``constexprs`` those
    parameters to their values (a dtype by its name, e.g. ``"bf16"``), ``attrs`` the
    pointer and integer arguments triton found 16-divisible, ``options`` the launch
    options (``num_warps``, ...) given at the launch.
    """

    kernel: str  # "module:function"
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    attrs: tuple[str, ...]
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return self.kernel.rsplit(":", 1)[1]

    def function(self) -> Any:
        """The ``@triton.jit`` function (interpreted or not, as this process defined it)."""
        module, name = self.kernel.rsplit(":", 1)
        return getattr(importlib.import_module(module), name)

    def label(self) -> str:
        """A short description: the constexprs, then the 16-divisible arguments."""
        values = " ".join(f"{k}={_short(v)}" for k, v in self.constexprs)
        options = "".join(f" {k}={v}" for k, v in self.options)
        return f"{values}{options} div16=[{','.join(self.attrs)}]"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Launch:
        return cls(
            kernel=d["kernel"],
            signature=tuple((k, v) for k, v in d["signature"]),
            constexprs=tuple((k, v) for k, v in d["constexprs"]),
            attrs=tuple(d["attrs"]),
            options=tuple((k, v) for k, v in d["options"]),
        )


def _short(v: Any) -> str:
    return str(int(v)) if isinstance(v, bool) else str(v)


def _kernels() -> list[Any]:
    """Every ``@triton.jit`` function of the kernel modules (only kernels get launched)."""
    from triton.runtime.jit import KernelInterface

    found = []
    for module in KERNEL_MODULES:
        for value in vars(importlib.import_module(module)).values():
            if isinstance(value, KernelInterface) and value not in found:
                found.append(value)
    return found


def _specialize(kernel: Any, args: tuple, kwargs: dict[str, Any]) -> Launch:
    """The specialization of one launch, by triton's own rules (``KernelParam`` for what is
    a constexpr, ``native_specialize_impl`` with the CUDA backend for the arguments)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import KernelParam

    fn = kernel.fn
    parameters = inspect.signature(fn).parameters
    names = list(parameters)
    bound = inspect.signature(fn).bind(*args, **{k: v for k, v in kwargs.items() if k in parameters})
    bound.apply_defaults()
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in parameters))
    signature, constexprs, attrs = [], [], []
    for i, name in enumerate(names):
        value = bound.arguments[name]
        param = KernelParam(i, parameters[name], False, False)
        if param.is_constexpr:
            signature.append((name, "constexpr"))
            constexprs.append((name, _encode(value)))
            continue
        kind, key = native_specialize_impl(CUDABackend, value, param.is_const, True, True)[:2]
        signature.append((name, kind))
        if kind == "constexpr":  # an integer 1
            constexprs.append((name, key))
        elif isinstance(key, str) and "D" in key:
            attrs.append(name)
    return Launch(
        f"{fn.__module__}:{fn.__name__}", tuple(signature), tuple(constexprs), tuple(attrs), options
    )


def _encode(value: Any) -> Any:
    """A constexpr as JSON: a triton dtype by its name, other values as they are."""
    import triton.language as tl

    if isinstance(value, tl.constexpr):
        value = value.value
    if isinstance(value, tl.dtype):
        return str(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    raise TypeError(f"constexpr of unexpected type {type(value).__name__}: {value!r}")


def decode(value: Any) -> Any:
    import triton.language as tl

    return tl.dtype(value) if isinstance(value, str) else value


@contextlib.contextmanager
def recording() -> Iterator[set[Launch]]:
    """Within the block, kernel launches are recorded into the yielded set, not run."""
    launches: set[Launch] = set()
    kernels = _kernels()

    def recorder(kernel: Any) -> Any:
        def run(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
            launches.add(_specialize(kernel, args, kwargs))

        return run

    for kernel in kernels:
        kernel.run = recorder(kernel)
    try:
        yield launches
    finally:
        for kernel in kernels:
            del kernel.run


# ----------------------------------------------------------------------------- configurations

# name: (param dtype, master_weights)
KINDS = {
    "fp32": ("float32", False),
    "fp16+masters": ("float16", True),
    "bf16+masters": ("bfloat16", True),
    "fp16": ("float16", False),
    "bf16": ("bfloat16", False),
}
# The largest tensor's size: one of each launch shape (BLOCK, TILES) of plan._launch_shape.
SIZES = (100, 200, 500, 1000, 2000, 3000, 5000)
# GradScaler inputs: what the optimizer gets from torch.amp.GradScaler (scaler.step:
# grad_scale and found_inf; after scaler.unscale_: found_inf only); the functionals take
# any of the four.
AMP = ("none", "scale+found_inf", "found_inf", "scale")
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    "LARS": {
        "plain": {},
        "nesterov+trust_clip": dict(nesterov=True, trust_clip=True, weight_decay=1e-4),
        "decayed_norm": dict(decayed_norm=True, lr_in_momentum=False, weight_decay=1e-4),
        "zero_norm_skip": dict(zero_norm_skip=True, trust_clip=True, weight_decay=1e-4),
    },
    "LAMB": {
        "plain": {},
        "max_grad_norm": dict(max_grad_norm=1.0, weight_decay=1e-2),
        "l2": dict(adam_w_mode=False, grad_averaging=False, bias_correction=False, weight_decay=1e-2),
    },
}


@dataclass(frozen=True)
class Config:
    """One way of taking a fused step (see :func:`drive`)."""

    optimizer: str  # "LARS" | "LAMB"
    kind: str  # a KINDS key
    numel: int  # the largest tensor's size
    aligned: bool  # False: params and grads are views at odd offsets into flat buffers
    amp: str  # an AMP entry
    counter: bool  # the optimizer (which counts its steps) or the functional
    variant: str  # a VARIANTS[optimizer] key
    n_params: int = 3


# The quick sample: the largest launch shapes, aligned and not, each optimizer, fp32 and
# a low-precision kind, with and without GradScaler and LAMB's clipping.
QUICK = (
    ("LAMB", "fp32", 5000, False, "scale+found_inf", True, "max_grad_norm"),
    ("LAMB", "fp32", 3000, False, "none", True, "plain"),
    ("LAMB", "bf16+masters", 5000, True, "scale+found_inf", True, "plain"),
    ("LARS", "fp32", 5000, False, "scale+found_inf", True, "plain"),
    ("LARS", "fp32", 5000, True, "none", True, "plain"),
    ("LARS", "fp16", 5000, True, "none", True, "decayed_norm"),
)


def configurations(quick: bool = False) -> list[Config]:
    """Every combination that a fused step can take (what GradScaler and the optimizer
    allow), or with ``quick`` the sample :data:`QUICK`."""
    out = []
    for optimizer, variants in VARIANTS.items():
        for kind, numel, aligned, amp, counter, variant in itertools.product(
            KINDS, SIZES, (True, False), AMP, (True, False), variants
        ):
            if counter and amp == "scale":  # GradScaler passes found_inf with a scale
                continue
            if counter and amp == "found_inf" and KINDS[kind][0] == "float16":
                continue  # GradScaler.unscale_ refuses fp16 grads
            if not counter and variant == "max_grad_norm":  # an optimizer option
                continue
            # Step counters: 1, 16 and other counts (1 and 16-divisible counts specialize).
            n_params = (15 if counter else 16) if numel == 5000 else 1 if numel == 100 else 3
            out.append(Config(optimizer, kind, numel, aligned, amp, counter, variant, n_params))
    if quick:
        return [c for c in out if dataclasses.astuple(c)[:-1] in QUICK]
    return out


def drive(config: Config) -> None:
    """One fused step as ``config`` says: an optimizer (with GradScaler where ``amp`` asks)
    or a functional call, on ``n_params`` tensors of which the largest has ``numel``
    elements. Needs ``TRITON_INTERPRET=1`` (CPU tensors)."""
    import torch

    from largebatch.lars.spec import LAMB_SPEC, LARS_SPEC
    from largebatch.torch import LAMB, LARS, lamb, lars

    gen = torch.Generator().manual_seed(0)
    dtype = getattr(torch, KINDS[config.kind][0])
    masters = KINDS[config.kind][1]
    sizes = [config.numel] + [
        min(config.numel, s) for s in itertools.islice(itertools.cycle((7, 33, 1, 64)), config.n_params - 1)
    ]

    def tensors(scale: float) -> list[torch.Tensor]:
        values = [torch.randn(n, generator=gen).mul_(scale).to(dtype) for n in sizes]
        if config.aligned:
            return values
        flat = torch.zeros(sum(sizes) + len(sizes) + 1, dtype=dtype)  # the first view at element 1
        views, at = [], 1
        for v in values:
            views.append(flat[at : at + v.numel()].copy_(v))
            at += v.numel() + 1
        return views

    params = [torch.nn.Parameter(w) for w in tensors(1.0)]
    grads = tensors(0.1)
    hyper = dict(VARIANTS[config.optimizer][config.variant])
    scale = found_inf = None
    if config.amp in ("scale", "scale+found_inf"):
        scale = torch.tensor(1024.0)
        for g in grads:
            g.mul_(1024.0)
    if config.amp in ("found_inf", "scale+found_inf"):
        found_inf = torch.zeros(())
    if config.counter:
        cls = LARS if config.optimizer == "LARS" else LAMB
        opt = cls(params, lr=0.1, fused=True, master_weights=masters, **hyper)
        for p, g in zip(params, grads):
            p.grad = g
        if config.amp == "none":
            opt.step()
            return
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(torch.ones(()))
        if config.amp == "found_inf":
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        return
    spec = LARS_SPEC if config.optimizer == "LARS" else LAMB_SPEC
    values = {**{k: spec.defaults[k] for k in spec.group_keys}, **hyper, "lr": 0.1}
    weights = [p.detach().float() if masters and dtype != torch.float32 else None for p in params]
    like = [p if w is None else w for p, w in zip(params, weights)]
    state = [[torch.zeros_like(x) for x in like] for _ in spec.state]
    steps = [torch.zeros(()) for _ in params]
    step: Any = lars if config.optimizer == "LARS" else lamb
    step(
        [p.detach() for p in params],
        grads,
        *state,
        weights,
        steps,
        fused=True,
        grad_scale=scale,
        found_inf=found_inf,
        **values,
    )


def record(configs: Iterable[Config]) -> list[Launch]:
    """The distinct launches of the fused steps of ``configs`` (sorted); needs the
    interpreter (``TRITON_INTERPRET=1`` before triton is imported)."""
    with recording() as launches:
        for config in configs:
            drive(config)
    return sorted(launches, key=lambda x: json.dumps(x.to_json(), sort_keys=True))
