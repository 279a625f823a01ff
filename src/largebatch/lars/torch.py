"""LARS and LAMB as ``torch.optim.Optimizer`` subclasses: single-tensor, foreach and fused paths.

Layout follows ``torch.optim``: the class validates and holds groups and state; the
functional entries :func:`lars` and :func:`lamb` dispatch to ``_single_tensor_*`` (the
readable loop), ``_foreach_*`` (``torch._foreach_*`` ops, the default) or the fused
Triton kernels, all with one keyword-only signature. The math is
``largebatch.lars.reference`` (DESIGN §2); every path is tested against it.

Mixed precision: with ``master_weights=True``, fp16/bf16 params get an fp32 master copy
in the optimizer state (saved by ``state_dict``); the update runs on the master and the
model's param is rewritten from it. The optimizers follow the ``torch.amp.GradScaler``
contract (``_step_supports_amp_scaling``): gradients are unscaled inside the step
(``p.grad`` is never written) and a step with ``found_inf`` set changes nothing.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["LARS", "LAMB", "lars", "lamb", "param_groups", "default_exclude"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


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
    params get trust ratio 1 and no weight decay. Either group may be empty.
    """
    _check_range("weight_decay value", weight_decay, 0.0, math.inf)
    exclude = default_exclude if exclude is None else exclude
    adapted, excluded = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (excluded if exclude(name, param) else adapted).append(param)
    return [
        {"params": adapted, "weight_decay": weight_decay},
        {"params": excluded, "weight_decay": 0.0, "trust_ratio": False},
    ]


# --------------------------------------------------------------------------- checks


def _check_range(name: str, value: Any, low: float, high: float, *, low_open: bool = False) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    ok = ok and (low < value if low_open else low <= value) and value < high
    if not ok:
        bounds = f"{'(' if low_open else '['}{low}, {high})"
        raise ValueError(f"Invalid {name}: {value!r} (must be in {bounds})")


def _check_flag(name: str, value: Any, *, allow_none: bool = False) -> None:
    """Flags are real bools: a truthy string such as "False" would silently turn them on."""
    if not (isinstance(value, bool) or (allow_none and value is None)):
        rule = "True, False or None" if allow_none else "True or False"
        raise TypeError(f"Invalid {name}: {value!r} (must be {rule})")


def _check_lr(lr: Any) -> None:
    if isinstance(lr, Tensor):
        if lr.numel() != 1:
            raise ValueError(f"Invalid lr: a Tensor lr must have one element, got shape {tuple(lr.shape)}")
        if not lr.is_floating_point():
            raise ValueError(f"Invalid lr: a Tensor lr must be floating point, got {lr.dtype}")
        lr = lr.item()
    _check_range("learning rate value", lr, 0.0, math.inf)


def _group_params(params: Any) -> list:
    """A group's params as a list, read once (a generator is consumed here and only here)."""
    if isinstance(params, Tensor):
        return [params]
    if isinstance(params, set):
        raise TypeError("params must be an ordered iterable of Tensors (a set's order changes between runs)")
    return list(params)


def _param_list(params: Any) -> list:
    """The constructor's ``params``: a list of Tensors or of group dicts with listed params."""
    if isinstance(params, Tensor):
        raise TypeError(
            f"params must be an iterable of Tensors or dicts, but got {torch.typename(params)}"
        )
    entries = _group_params(params)
    return [{**e, "params": _group_params(e["params"])} if isinstance(e, dict) else e for e in entries]


# --------------------------------------------------------------------------- norms


def _stacked_norms(tensors: list[Tensor]) -> Tensor:
    """Per-tensor L2 norms as one vector (fp64 for fp64 tensors, else fp32) that cannot
    overflow for finite inputs: a sum of squares past the fp32 range (||x|| > ~1.8e19) is
    recomputed with fp64 accumulation. The common case costs one fp32 pass."""
    if not tensors:
        return torch.zeros(0)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=dtype))
    if dtype == torch.float32 and not bool(torch.isfinite(norms).all()):
        for i in torch.nonzero(~torch.isfinite(norms)).flatten().tolist():
            norms[i] = torch.linalg.vector_norm(tensors[i], 2, dtype=torch.float64)
    return norms


def _norm(tensor: Tensor) -> Tensor:
    """``_stacked_norms`` of one tensor, as a 0-dim tensor."""
    return _stacked_norms([tensor])[0]


def _compiled_norm(tensor: Tensor) -> Tensor:
    """The norm inside a compiled body: fp64 accumulation, which cannot overflow and, on
    a kernel that only loads its input, costs no more than fp32; the result in fp32
    (fp64 for fp64 tensors)."""
    out = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(tensor, 2, dtype=torch.float64).to(out)


def _compiled_plain_norm(tensor: Tensor) -> Tensor:
    """The norm inside a compiled body, accumulated in fp32 (fp64 for fp64 tensors):
    the caller handles a result that overflowed."""
    dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(tensor, 2, dtype=dtype)


def _safe_ratio(numerator: Tensor, denominator: Tensor, w_norm: Tensor, other_norm: Tensor) -> Tensor:
    """``numerator / denominator``, or 1 where either norm is zero (no host sync)."""
    ok = (w_norm > 0) & (other_norm > 0)
    return torch.where(ok, numerator / torch.where(ok, denominator, 1.0), 1.0)


# --------------------------------------------------------------------------- shared base


def _step_device(param: Tensor, group: dict[str, Any]) -> torch.device:
    """Where a param's step count lives: on its device for the fused kernels (which count
    on the device), on the CPU otherwise (read on the host for bias corrections)."""
    return param.device if group["fused"] else torch.device("cpu")


# Chosen by the constructor, kept by load_state_dict: which path runs and whether fp16/bf16
# params get fp32 masters are settings of this optimizer, not of the checkpoint.
_CONSTRUCTOR_KEYS = ("master_weights", "foreach", "fused", "compiled")


class _LayerwiseOptimizer(Optimizer):
    """What LARS and LAMB share: validation, master weights, the GradScaler contract,
    state-dict checks and the count of applied steps."""

    _step_supports_amp_scaling = True
    _state_keys: tuple[str, ...] = ()
    _group_keys: tuple[str, ...] = ()  # the keys a state dict of this optimizer's groups holds
    _flags: tuple[str, ...] = ()  # bool hyperparameters

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        if defaults["fused"] and defaults["foreach"]:
            raise ValueError("foreach=True and fused=True cannot both be set")
        self._applied = torch.zeros((), dtype=torch.float32)
        super().__init__(params, defaults)

    # Validation runs on every group, including those added later, before it is stored.
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {torch.typename(param_group)}")
        param_group = {**param_group, "params": _group_params(param_group["params"])}
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        self._validate(merged)
        for p in param_group["params"]:
            if isinstance(p, Tensor) and p.dtype not in _SUPPORTED_DTYPES:
                raise ValueError(
                    f"{type(self).__name__} supports float64/32/16 and bfloat16 params, "
                    f"got a {p.dtype} param of shape {tuple(p.shape)}"
                )
        super().add_param_group(param_group)

    def _validate(self, group: dict[str, Any]) -> None:
        _check_lr(group["lr"])
        _check_range("weight_decay value", group["weight_decay"], 0.0, math.inf)
        _check_range("eps value", group["eps"], 0.0, math.inf)
        for name in (*self._flags, "trust_ratio", "master_weights"):
            _check_flag(name, group[name])
        _check_paths(group["foreach"], group["fused"], group["compiled"])

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim pickles defaults, state and groups only: keep the count of applied
        # steps (and LAMB's max_grad_norm) through copy.deepcopy, pickle and torch.save.
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in self._extra_state}}

    _extra_state: tuple[str, ...] = ("_applied",)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_applied", torch.zeros((), dtype=torch.float32))
        for group in self.param_groups:
            for key in (*self._group_keys, *_CONSTRUCTOR_KEYS):
                group.setdefault(key, self.defaults[key])

    @property
    def num_steps(self) -> int:
        """Steps applied so far: ``step()`` calls that were not skipped by a GradScaler,
        whichever params had grads. ``ScheduleLR(..., follow_optimizer=True)`` reads it."""
        return int(self._applied)

    # ------------------------------------------------------------------ state dicts

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["num_steps"] = self.num_steps
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer, after checking all of it.

        Refused with a ValueError, before anything changes: another optimizer's state
        dict, a state tensor whose shape is not its param's, an invalid hyperparameter.
        Kept from this optimizer, not taken from the checkpoint: ``master_weights``,
        ``foreach``, ``fused`` and ``compiled``. Then fp16/bf16 params get an fp32 master
        when ``master_weights`` is on (from the param, if the checkpoint has none) and lose
        it when it is off; moments keep their saved precision where a master holds the
        math and take the param's dtype elsewhere; steps may be plain numbers.
        """
        state_dict = dict(state_dict)
        extra = {k: state_dict.pop(k) for k in ("num_steps", "max_grad_norm") if k in state_dict}
        if "num_steps" in extra:
            _check_range("num_steps", extra["num_steps"], 0, math.inf)
        if extra.get("max_grad_norm") is not None:
            _check_range("max_grad_norm value", extra["max_grad_norm"], 0.0, math.inf, low_open=True)
        by_id = self._check_loadable(state_dict)
        kept = [{k: g[k] for k in _CONSTRUCTOR_KEYS} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, keys in zip(self.param_groups, kept):
            group.update(keys)
        groups = {p: g for g in self.param_groups for p in g["params"]}
        for pid, saved in state_dict["state"].items():
            param = by_id[pid]
            self.state[param] = self._loaded_state(param, groups[param], saved)
        if "num_steps" not in extra:  # a state dict of another version: the longest count
            extra["num_steps"] = max((int(s["step"]) for s in self.state.values()), default=0)
        self._applied = torch.tensor(float(extra["num_steps"]))
        if "max_grad_norm" in extra:
            self.max_grad_norm = extra["max_grad_norm"]

    def _check_loadable(self, state_dict: dict[str, Any]) -> dict[Any, Tensor]:
        """Every check of load_state_dict; returns the saved param ids -> our params."""
        name = type(self).__name__
        if not {"state", "param_groups"} <= state_dict.keys():
            raise ValueError(f"not an optimizer state dict: keys {sorted(state_dict)}")
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"loaded state dict has {len(saved_groups)} param groups, {name} has {len(self.param_groups)}"
            )
        by_id = {}
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            missing = [k for k in self._group_keys if k not in saved]
            if missing:
                raise ValueError(
                    f"not a {name} state dict: its param group {i} lacks {missing} (it has {sorted(saved)})"
                )
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"loaded param group {i} has {len(saved['params'])} params, {name}'s has {len(group['params'])}"
                )
            merged = {**group, **{k: v for k, v in saved.items() if k not in _CONSTRUCTOR_KEYS}}
            self._validate(merged)
            by_id.update(zip(saved["params"], group["params"]))
        allowed = {"step", "master_param", *self._state_keys}
        for pid, entry in state_dict["state"].items():
            if pid not in by_id:
                raise ValueError(f"loaded state refers to param {pid!r}, which no param group holds")
            param = by_id[pid]
            if not set(entry) <= allowed or not {"step", *self._state_keys} <= set(entry):
                raise ValueError(
                    f"not a {name} state dict: param {pid!r} holds {sorted(entry)}, expected "
                    f"{sorted(allowed)} (master_param optional)"
                )
            step = entry["step"]
            if not (isinstance(step, numbers.Real) or (isinstance(step, Tensor) and step.numel() == 1)):
                raise ValueError(f"param {pid!r}: step must be a number or a one-element Tensor, got {step!r}")
            for key in allowed - {"step"}:
                value = entry.get(key)
                if value is not None and (not isinstance(value, Tensor) or value.shape != param.shape):
                    got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                    raise ValueError(
                        f"param {pid!r}: {key} has shape {got}, the param has {tuple(param.shape)}"
                    )
        return by_id

    def _loaded_state(self, param: Tensor, group: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
        """One param's state from its saved entry, in this optimizer's layout (copies)."""
        step = saved["step"]
        step = step.detach().reshape(()) if isinstance(step, Tensor) else torch.tensor(float(step))
        state: dict[str, Any] = {
            "step": step.to(device=_step_device(param, group), dtype=torch.float32, copy=True)
        }
        if group["master_weights"] and param.dtype in _LOW_PRECISION:
            master = saved.get("master_param")
            master = param.detach() if master is None else master
            state["master_param"] = master.to(device=param.device, dtype=torch.float32, copy=True)
            math_dtype = torch.float32
        else:
            math_dtype = param.dtype
        for key in self._state_keys:
            state[key] = saved[key].to(device=param.device, dtype=math_dtype, copy=True)
        return state

    # ------------------------------------------------------------------ the step

    def _gather(self, group: dict[str, Any]) -> dict[str, list]:
        """The params of ``group`` that have grads, their state (created lazily), checked."""
        out: dict[str, list] = {"params": [], "grads": [], "masters": [], "steps": []}
        out.update({key: [] for key in self._state_keys})
        use_masters = group["master_weights"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            master = state.get("master_param")
            if not state:
                if use_masters and p.dtype in _LOW_PRECISION:
                    master = p.detach().float().clone(memory_format=torch.preserve_format)
                    state["master_param"] = master
                like = p if master is None else master
                state["step"] = torch.zeros((), dtype=torch.float32, device=_step_device(p, group))
                for key in self._state_keys:
                    state[key] = torch.zeros_like(like, memory_format=torch.preserve_format)
            out["params"].append(p)
            out["grads"].append(p.grad)
            out["masters"].append(master)
            out["steps"].append(state["step"])
            for key in self._state_keys:
                out[key].append(state[key])
        return out

    def _amp_inputs(self) -> tuple[Tensor | None, Tensor | None]:
        """``(grad_scale, found_inf)`` as ``torch.amp.GradScaler.step`` sets them, or Nones.

        After ``scaler.unscale_(opt)`` the scaler passes ``grad_scale=None`` (the grads are
        already unscaled) and still passes ``found_inf``."""
        return getattr(self, "grad_scale", None), getattr(self, "found_inf", None)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step. ``closure`` re-evaluates the model and returns the loss.

        Non-finite gradients are applied as torch.optim applies them (they reach the params
        and the state); a step is skipped only when a ``torch.amp.GradScaler`` found inf or
        NaN (``found_inf``), on every path."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_grads()
        grad_scale, found_inf = self._amp_inputs()
        fused = {group["fused"] for group in self.param_groups}
        if len(fused) > 1:
            raise ValueError("fused must be the same in every param group")
        if not fused.pop():
            # The single-tensor and foreach paths decide the skip on the host, before any
            # state is created or changed.
            if found_inf is not None and bool(found_inf.item()):
                return loss
            self._step_groups([self._gather(g) for g in self.param_groups], grad_scale=grad_scale)
            self._applied += 1
        else:
            # The fused kernels decide it on the device, from found_inf.
            gathered = [self._gather(g) for g in self.param_groups]
            self._fused_step(gathered, grad_scale=grad_scale, found_inf=found_inf)
        return loss

    def _check_grads(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} does not support sparse gradients")
                if p.grad is not None and p.grad.is_complex():
                    raise ValueError(
                        f"{type(self).__name__} does not support complex gradients "
                        f"(got {p.grad.dtype} for a param of shape {tuple(p.shape)})"
                    )

    def _step_groups(self, gathered: list[dict[str, list]], *, grad_scale: Tensor | None) -> None:
        raise NotImplementedError

    def _fused_step(self, gathered, *, grad_scale, found_inf) -> None:  # noqa: ANN001
        raise NotImplementedError


@functools.cache
def _compiled_body(body: Callable[..., None]) -> Callable[..., None]:
    """``body`` through ``torch.compile`` with dynamic sizes: one compiled kernel pair
    (norms, then the fused elementwise update) serves every tensor of a given dtype and
    set of flags, whatever its size.

    Every number the body uses (lr, the hyperparameters, bias corrections) reaches it as
    a 0-dim tensor, an input of the compiled graph, never as a Python float: Inductor's
    on-disk cache may serve a float baked in as a constant by another process with other
    values. Flags stay Python bools; they choose the graph's code and so its cache key.
    """
    return torch.compile(body, dynamic=True, fullgraph=True)


# The norms a compiled body is called with (each body keeps its own code object, and so
# its own compiled variants, because these go in as arguments).
_COMPILED_NORMS = dict(norm=_compiled_norm, plain_norm=_compiled_plain_norm)


def _as_tensors(*values: Any) -> tuple[Tensor, ...]:
    """Numbers for a compiled body: fp64 0-dim CPU tensors (see _compiled_body)."""
    return tuple(torch.as_tensor(v, dtype=torch.float64) for v in values)


def _lr_value(lr: float | Tensor) -> float | Tensor:
    """A group's lr for the math: a one-element Tensor (shape (), (1,) or (1, 1)) as 0-dim."""
    return lr.reshape(()) if isinstance(lr, Tensor) else lr


# Each compiled call costs a fixed ~0.2 ms of dispatch on the host: tensors below this
# size go through one foreach pass instead (in ResNet-50 they are 107 of 161 tensors
# and 0.3% of the elements).
COMPILE_MIN_TENSOR = 1 << 16


def _split_for_compile(lists: tuple[list, ...]) -> tuple[tuple[list, ...], tuple[list, ...]]:
    """``lists`` (params first) cut in two: the entries of contiguous params of
    COMPILE_MIN_TENSOR+ elements, for the compiled body, and the rest, for foreach."""
    large = [i for i, p in enumerate(lists[0]) if p.numel() >= COMPILE_MIN_TENSOR and p.is_contiguous()]
    chosen = set(large)
    small = [i for i in range(len(lists[0])) if i not in chosen]
    return tuple([xs[i] for i in large] for xs in lists), tuple([xs[i] for i in small] for xs in lists)


def _pick_body(body, compiled_body, tensors):  # noqa: ANN001, ANN202
    """The compiled body on flat views of contiguous tensors of 2+ elements, else the
    eager one (sizes 0 and 1 would each cost a compile of their own)."""
    present = [t for t in tensors if t is not None]
    if compiled_body is None or present[0].numel() < 2 or not all(t.is_contiguous() for t in present):
        return body, tensors
    return compiled_body, tuple(None if t is None else t.view(-1) for t in tensors)


def _use_foreach(foreach: bool | None) -> bool:
    return True if foreach is None else foreach


def _unscaled(grad: Tensor, like: Tensor, divisor: Tensor | None) -> Tensor:
    """``grad`` in ``like``'s dtype, divided by ``divisor``; a new tensor, or ``grad`` itself
    when nothing changes (the caller never writes to it)."""
    g = grad if grad.dtype == like.dtype else grad.to(like.dtype)
    return g if divisor is None else g / divisor


def _write_back(params: list[Tensor], masters: list[Tensor | None]) -> None:
    pairs = [(p, m) for p, m in zip(params, masters) if m is not None]
    if pairs:
        torch._foreach_copy_([p for p, _ in pairs], [m for _, m in pairs])


# --------------------------------------------------------------------------- LARS

# Each group's hyperparameters besides lr (LAMB: besides lr and betas).
_LARS_HYPER = ("momentum", "weight_decay", "trust_coefficient", "eps", "nesterov", "trust_clip", "trust_ratio")
_LAMB_HYPER = ("eps", "weight_decay", "bias_correction", "trust_ratio")



class LARS(_LayerwiseOptimizer):
    r"""LARS: SGD with momentum and a layer-wise trust ratio (You, Gitman, Ginsburg 2017).

    For each tensor ``w`` with gradient ``g`` (unscaled) and learning rate ``lr_t``::

        ratio = tc * ||w|| / (||g|| + wd * ||w|| + eps)   (ratio = 1 if ||w|| == 0 or ||g|| == 0)
        ratio = min(ratio / lr_t, 1)                       (trust_clip=True: LARC)
        d     = g + wd * w
        v     = momentum * v + lr_t * ratio * d            (v starts at 0)
        w     = w - v             nesterov: w = w - (momentum * v + lr_t * ratio * d)

    The variant, stated because peer libraries differ on each point:

    - **lr inside the momentum buffer**, as the MLPerf ResNet-50 reference and
      ``optax.lars`` keep it: when ``lr_t`` changes (warmup, decay) the buffer keeps the
      rates at which past gradients were taken. timm's ``Lars`` keeps lr outside
      (``w -= lr_t * v``); the two agree at constant lr.
    - **Denominator** ``||g|| + wd * ||w|| + eps``, as in the paper and timm; ``optax.lars``
      uses ``||g + wd * w||`` (equal when ``wd = 0``).
    - **Zero-norm rule**: ratio 1 when either norm is zero (fresh zero-initialized layers).
    - **trust_clip** gives LARC's clipping (apex ``LARC``, timm ``trust_clip``): the local
      rate ``lr_t * ratio`` never exceeds the global one.
    - **Exclusion**: a group with ``trust_ratio=False`` (biases, BatchNorm; see
      :func:`param_groups`) gets ratio 1 and no weight decay, plain momentum SGD.

    Args:
      params: params or param groups. Group keys: ``lr``, ``weight_decay``,
        ``trust_ratio`` and every keyword below but ``foreach``/``fused``.
      lr: the global learning rate: a float, or a one-element Tensor (the fused path reads
        an fp32 one on the params' device in place, without a copy).
      momentum: in [0, 1). trust_coefficient: tc > 0 (0.001 in the paper).
      eps: >= 0, added to the denominator. weight_decay: >= 0.
      nesterov: Nesterov momentum. trust_clip: LARC clipping.
      master_weights: keep fp32 master copies of fp16/bf16 params in the state.
      foreach: ``None`` or ``True``: ``torch._foreach_*`` ops; ``False``: a per-tensor loop.
      fused: ``None``: the Triton kernels when every param is on CUDA and triton imports;
        ``True``: always (CPU tensors need ``TRITON_INTERPRET=1``).
      compiled: the per-tensor update through ``torch.compile`` (a norm kernel and one
        fused elementwise kernel per tensor: the fast CPU path). ``None``: for CPU models
        of ``COMPILE_MIN_NUMEL`` (2**20) elements or more; the first step compiles.

    Example:
      >>> from largebatch.torch import LARS, param_groups
      >>> model = torch.nn.Linear(4, 2)
      >>> opt = LARS(param_groups(model, weight_decay=5e-5), lr=1.0)
      >>> model(torch.randn(8, 4)).square().mean().backward()
      >>> opt.step()

    References:
      You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks",
      https://arxiv.org/abs/1708.03888.
    """

    _state_keys = ("momentum_buffer",)
    _group_keys = ("lr", *_LARS_HYPER)
    _flags = ("nesterov", "trust_clip")

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1.0,
        *,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 0.0,
        nesterov: bool = False,
        trust_clip: bool = False,
        trust_ratio: bool = True,
        master_weights: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        compiled: bool | None = None,
    ) -> None:
        params = _param_list(params)
        _check_paths(foreach, fused, compiled)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            nesterov=nesterov,
            trust_clip=trust_clip,
            trust_ratio=trust_ratio,
            master_weights=master_weights,
            foreach=foreach,
            fused=(fused := _resolve_fused(fused, params)),
            compiled=_resolve_compiled(compiled, params, fused),
        )
        super().__init__(params, defaults)

    def _validate(self, group: dict[str, Any]) -> None:
        super()._validate(group)
        _check_range("momentum value", group["momentum"], 0.0, 1.0)
        _check_range("trust_coefficient value", group["trust_coefficient"], 0.0, math.inf, low_open=True)
        if group["nesterov"] and group["momentum"] == 0:
            raise ValueError("Nesterov momentum requires momentum > 0")

    def _step_groups(self, gathered, *, grad_scale):  # noqa: ANN001
        for group, g in zip(self.param_groups, gathered):
            lars(
                g["params"], g["grads"], g["momentum_buffer"], g["masters"], g["steps"],
                **_lars_kwargs(group), grad_scale=grad_scale, foreach=group["foreach"],
                compiled=group["compiled"],
            )

    def _fused_step(self, gathered, *, grad_scale, found_inf):  # noqa: ANN001
        from largebatch.lars.triton_kernels import fused_lars_step_

        _run_fused(self, gathered, self._state_keys, _lars_hyper, fused_lars_step_,
                    grad_scale=grad_scale, found_inf=found_inf)




def _lars_kwargs(group: dict[str, Any]) -> dict[str, Any]:
    return {"lr": _lr_value(group["lr"]), **{k: group[k] for k in _LARS_HYPER}}


def lars(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_buffers: list[Tensor],
    masters: list[Tensor | None],
    state_steps: list[Tensor],
    *,
    lr: float | Tensor,
    momentum: float,
    weight_decay: float,
    trust_coefficient: float,
    eps: float,
    nesterov: bool,
    trust_clip: bool,
    trust_ratio: bool,
    grad_scale: Tensor | None = None,
    foreach: bool | None = None,
    compiled: bool = False,
) -> None:
    """Functional LARS on one group (see :class:`LARS`); updates its arguments in place.

    ``masters[i]`` is the fp32 master of ``params[i]`` or None; ``grad_scale`` divides the
    grads (the GradScaler scale). The grads are never written.
    """
    hyper = dict(
        lr=lr, momentum=momentum, weight_decay=weight_decay,
        trust_coefficient=trust_coefficient, eps=eps, nesterov=nesterov,
        trust_clip=trust_clip, trust_ratio=trust_ratio, grad_scale=grad_scale,
    )
    lists = (params, grads, momentum_buffers, masters, state_steps)
    if compiled:
        large, small = _split_for_compile(lists)
        _single_tensor_lars(*large, compiled=True, **hyper)
        _foreach_lars(*small, **hyper)
    else:
        (_foreach_lars if _use_foreach(foreach) else _single_tensor_lars)(*lists, **hyper)


def _lars_ratio(w_norm, g_norm, *, lr, weight_decay, trust_coefficient, eps, trust_clip):  # noqa: ANN001, ANN202
    ratio = _safe_ratio(
        trust_coefficient * w_norm, g_norm + weight_decay * w_norm + eps, w_norm, g_norm
    )
    return torch.clamp(ratio / lr, max=1.0) if trust_clip else ratio


def _lars_one(
    p, grad, buf, master, grad_scale, lr, momentum, weight_decay, trust_coefficient, eps, *,  # noqa: ANN001
    nesterov, trust_clip, trust_ratio, norm=_norm, plain_norm=_norm,  # noqa: ANN001
) -> None:
    """LARS on one tensor (``weight_decay`` already 0 for excluded groups). The numbers
    are floats, or 0-dim tensors when this body runs compiled."""
    w = p if master is None else master
    g = _unscaled(grad, w, grad_scale)
    d = g + weight_decay * w if isinstance(weight_decay, Tensor) or weight_decay != 0 else g
    if trust_ratio:
        ratio = _lars_ratio(
            norm(w), norm(g), lr=lr, weight_decay=weight_decay,
            trust_coefficient=trust_coefficient, eps=eps, trust_clip=trust_clip,
        )
        scaled = d * (lr * ratio)
    else:
        scaled = d * lr
    buf.mul_(momentum).add_(scaled)
    if nesterov:
        w.sub_(scaled.add_(buf * momentum))
    else:
        w.sub_(buf)
    if master is not None:
        p.copy_(master)


def _single_tensor_lars(
    params, grads, momentum_buffers, masters, state_steps, *,  # noqa: ANN001
    lr, momentum, weight_decay, trust_coefficient, eps, nesterov, trust_clip, trust_ratio,  # noqa: ANN001
    grad_scale, compiled=False,  # noqa: ANN001
) -> None:
    numbers = (lr, momentum, weight_decay if trust_ratio else 0.0, trust_coefficient, eps)
    flags = dict(nesterov=nesterov, trust_clip=trust_clip, trust_ratio=trust_ratio)
    compiled_body = _compiled_body(_lars_one) if compiled else None
    compiled_numbers = _as_tensors(*numbers) if compiled else None
    for p, grad, buf, master, step in zip(params, grads, momentum_buffers, masters, state_steps):
        body, tensors = _pick_body(_lars_one, compiled_body, (p, grad, buf, master))
        if body is _lars_one:
            body(*tensors, grad_scale, *numbers, **flags)
        else:
            body(*tensors, grad_scale, *compiled_numbers, **flags, **_COMPILED_NORMS)
        step.add_(1)


def _foreach_lars(
    params, grads, momentum_buffers, masters, state_steps, *,  # noqa: ANN001
    lr, momentum, weight_decay, trust_coefficient, eps, nesterov, trust_clip, trust_ratio,  # noqa: ANN001
    grad_scale,  # noqa: ANN001
) -> None:
    if not params:
        return
    wd = weight_decay if trust_ratio else 0.0
    ws = [p if m is None else m for p, m in zip(params, masters)]
    gs = [_unscaled(g, w, None) for g, w in zip(grads, ws)]
    if grad_scale is not None:
        gs = torch._foreach_div(gs, grad_scale)
    ds = torch._foreach_add(gs, ws, alpha=wd) if wd != 0 else gs
    if trust_ratio:
        ratios = _lars_ratio(
            _stacked_norms(ws), _stacked_norms(gs), lr=lr, weight_decay=wd,
            trust_coefficient=trust_coefficient, eps=eps, trust_clip=trust_clip,
        )
        scaled = torch._foreach_mul(ds, (ratios * lr).unbind())
    else:
        scaled = torch._foreach_mul(ds, lr)
    torch._foreach_mul_(momentum_buffers, momentum)
    torch._foreach_add_(momentum_buffers, scaled)
    if nesterov:
        torch._foreach_add_(scaled, momentum_buffers, alpha=momentum)
        torch._foreach_sub_(ws, scaled)
    else:
        torch._foreach_sub_(ws, momentum_buffers)
    _write_back(params, masters)
    torch._foreach_add_(state_steps, 1)


# --------------------------------------------------------------------------- LAMB


class LAMB(_LayerwiseOptimizer):
    r"""LAMB: Adam moments with a layer-wise trust ratio (You et al. 2019, Algorithm 2).

    For each tensor ``w`` with gradient ``g`` (unscaled) at step ``t`` = 1, 2, ...::

        g = g / max(1, ||all grads|| / max_grad_norm)      (only when max_grad_norm is set)
        m = b1 * m + (1 - b1) * g          v = b2 * v + (1 - b2) * g^2
        r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)   (bias_correction=False: no 1 - b^t)
        u = r + wd * w
        ratio = ||w|| / ||u||              (ratio = 1 if ||w|| == 0 or ||u|| == 0)
        w = w - lr_t * ratio * u

    The variant: phi is the identity, no trust-ratio bounds, eps outside the square
    root, weight decay inside the trust-ratio numerator's update. With the defaults it
    equals ``optax.lamb``. timm's ``Lamb`` is the same rule but clips gradients by default
    (``max_grad_norm=1.0``) and adapts only groups with weight decay; NVIDIA apex's
    ``FusedLAMB`` also clips at a hidden ``max_grad_norm=1.0``. Here clipping is off unless
    asked for, and the global norm spans every group. A group with ``trust_ratio=False``
    gets ratio 1 and no weight decay (Adam with bias correction).

    Args:
      params: params or param groups. Group keys: ``lr``, ``weight_decay``, ``betas``,
        ``eps``, ``bias_correction``, ``trust_ratio``, ``master_weights``.
      lr: the global learning rate. betas: each in [0, 1). eps: >= 0. weight_decay: >= 0.
      bias_correction: divide the moments by 1 - b^t.
      max_grad_norm: optimizer-wide global gradient clipping (> 0) or None.
      master_weights, foreach, fused, compiled: as in :class:`LARS`.

    References:
      You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76
      minutes", https://arxiv.org/abs/1904.00962.
    """

    _state_keys = ("exp_avg", "exp_avg_sq")
    _group_keys = ("lr", "betas", *_LAMB_HYPER)
    _flags = ("bias_correction",)
    _extra_state = ("_applied", "max_grad_norm")

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        trust_ratio: bool = True,
        max_grad_norm: float | None = None,
        master_weights: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        compiled: bool | None = None,
    ) -> None:
        if max_grad_norm is not None:
            _check_range("max_grad_norm value", max_grad_norm, 0.0, math.inf, low_open=True)
        params = _param_list(params)
        _check_paths(foreach, fused, compiled)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            trust_ratio=trust_ratio,
            master_weights=master_weights,
            foreach=foreach,
            fused=(fused := _resolve_fused(fused, params)),
            compiled=_resolve_compiled(compiled, params, fused),
        )
        self.max_grad_norm = max_grad_norm
        super().__init__(params, defaults)

    def _validate(self, group: dict[str, Any]) -> None:
        super()._validate(group)
        betas = group["betas"]
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"Invalid betas: {betas!r} (must be a pair)")
        for i, beta in enumerate(betas):
            _check_range(f"beta parameter at index {i}", beta, 0.0, 1.0)

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["max_grad_norm"] = self.max_grad_norm
        return out

    def _grad_divisor(self, gathered, grad_scale):  # noqa: ANN001, ANN202
        """The global clipping divisor ``max(1, ||unscaled grads|| / max_grad_norm)``."""
        grads = [g for entry in gathered for g in entry["grads"]]
        if self.max_grad_norm is None or not grads:
            return None
        total = torch.linalg.vector_norm(_stacked_norms(grads))
        if grad_scale is not None:
            total = total / grad_scale.to(total.device)
        return torch.clamp(total / self.max_grad_norm, min=1.0)

    def _step_groups(self, gathered, *, grad_scale):  # noqa: ANN001
        divisor = self._grad_divisor(gathered, grad_scale)
        if grad_scale is not None:
            divisor = grad_scale if divisor is None else divisor * grad_scale
        for group, g in zip(self.param_groups, gathered):
            lamb(
                g["params"], g["grads"], g["exp_avg"], g["exp_avg_sq"], g["masters"], g["steps"],
                **_lamb_kwargs(group), grad_divisor=divisor, foreach=group["foreach"],
                compiled=group["compiled"],
            )

    def _fused_step(self, gathered, *, grad_scale, found_inf):  # noqa: ANN001
        from largebatch.lars.triton_kernels import fused_lamb_step_

        _run_fused(self, gathered, self._state_keys, _lamb_hyper, fused_lamb_step_,
                    max_grad_norm=self.max_grad_norm, grad_scale=grad_scale, found_inf=found_inf)




def _lamb_kwargs(group: dict[str, Any]) -> dict[str, Any]:
    return {"lr": _lr_value(group["lr"]), **{k: group[k] for k in ("betas", *_LAMB_HYPER)}}


def lamb(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    masters: list[Tensor | None],
    state_steps: list[Tensor],
    *,
    lr: float | Tensor,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    trust_ratio: bool,
    grad_divisor: Tensor | None = None,
    foreach: bool | None = None,
    compiled: bool = False,
) -> None:
    """Functional LAMB on one group (see :class:`LAMB`); updates its arguments in place.

    ``grad_divisor`` divides every grad first: the GradScaler scale times the global
    clipping divisor, or None. The grads are never written.
    """
    hyper = dict(
        lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
        bias_correction=bias_correction, trust_ratio=trust_ratio, grad_divisor=grad_divisor,
    )
    lists = (params, grads, exp_avgs, exp_avg_sqs, masters, state_steps)
    if compiled:
        large, small = _split_for_compile(lists)
        _single_tensor_lamb(*large, compiled=True, **hyper)
        _foreach_lamb(*small, **hyper)
    else:
        (_foreach_lamb if _use_foreach(foreach) else _single_tensor_lamb)(*lists, **hyper)


def _bias_corrections(step: Tensor, betas: tuple[float, float], bias_correction: bool) -> tuple[float, float]:
    if not bias_correction:
        return 1.0, 1.0
    t = float(step)
    return 1.0 - betas[0] ** t, 1.0 - betas[1] ** t


def _lamb_direction(w, m, v, eps, weight_decay, bc1, bc2) -> Tensor:  # noqa: ANN001
    """u = (m / bc1) / (sqrt(v / bc2) + eps) + wd * w, a new tensor."""
    u = (m / bc1).div_((v / bc2).sqrt_().add_(eps))
    if isinstance(weight_decay, Tensor) or weight_decay != 0:
        u.add_(w * weight_decay)
    return u


def _lamb_one(
    p, grad, m, v, master, grad_divisor, lr, b1, b2, eps, weight_decay, bc1, bc2, *,  # noqa: ANN001
    trust_ratio, norm=_norm, plain_norm=_norm,  # noqa: ANN001
) -> Tensor | None:
    """LAMB on one tensor at the bias corrections ``bc1``, ``bc2`` (``weight_decay``
    already 0 for excluded groups). The numbers are floats, or 0-dim tensors when this
    body runs compiled. Returns ``||u||`` (None without trust ratio).

    ``norm`` never overflows. ``plain_norm`` (for ``||u||``, which a compiled body then
    forms in the same pass as ``||w||``) may: an infinite ``||u||`` gives ratio 0 and
    leaves ``w`` as it was, for :func:`_lamb_after_overflow` to finish."""
    w = p if master is None else master
    g = _unscaled(grad, w, grad_divisor)
    m.mul_(b1).add_(g * (1.0 - b1))
    v.mul_(b2).add_(g * g * (1.0 - b2))
    u = _lamb_direction(w, m, v, eps, weight_decay, bc1, bc2)
    u_norm = None
    if trust_ratio:
        w_norm, u_norm = norm(w), plain_norm(u)
        ratio = _safe_ratio(w_norm, u_norm, w_norm, u_norm)
    else:
        ratio = 1.0
    w.sub_(u.mul_(lr * ratio))
    if master is not None:
        p.copy_(master)
    return u_norm


def _lamb_after_overflow(p, m, v, master, lr, eps, weight_decay, bc1, bc2) -> None:  # noqa: ANN001
    """The update of a tensor whose ``||u||`` overflowed an fp32 sum of squares (finite u,
    ``||u|| > ~1.8e19``: huge weights times weight decay) in the compiled body, which left
    ``w`` unchanged: u again from the new moments, its norm by :func:`_norm`."""
    w = p if master is None else master
    u = _lamb_direction(w, m, v, eps, weight_decay, bc1, bc2)
    w_norm, u_norm = _norm(w), _norm(u)
    w.sub_(u.mul_(lr * _safe_ratio(w_norm, u_norm, w_norm, u_norm)))
    if master is not None:
        p.copy_(master)


def _single_tensor_lamb(
    params, grads, exp_avgs, exp_avg_sqs, masters, state_steps, *,  # noqa: ANN001
    lr, betas, eps, weight_decay, bias_correction, trust_ratio, grad_divisor, compiled=False,  # noqa: ANN001
) -> None:
    numbers = (lr, *betas, eps, weight_decay if trust_ratio else 0.0)
    compiled_body = _compiled_body(_lamb_one) if compiled else None
    compiled_numbers = _as_tensors(*numbers) if compiled else None
    for p, grad, m, v, master, step in zip(params, grads, exp_avgs, exp_avg_sqs, masters, state_steps):
        step.add_(1)
        bcs = _bias_corrections(step, betas, bias_correction)
        body, tensors = _pick_body(_lamb_one, compiled_body, (p, grad, m, v, master))
        if body is _lamb_one:
            body(*tensors, grad_divisor, *numbers, *bcs, trust_ratio=trust_ratio)
            continue
        u_norm = body(*tensors, grad_divisor, *compiled_numbers, *_as_tensors(*bcs),
                      trust_ratio=trust_ratio, **_COMPILED_NORMS)
        if u_norm is not None and bool(torch.isinf(u_norm)):  # not NaN: non-finite grads
            _lamb_after_overflow(p, m, v, master, numbers[0], numbers[3], numbers[4], *bcs)


def _foreach_lamb(
    params, grads, exp_avgs, exp_avg_sqs, masters, state_steps, *,  # noqa: ANN001
    lr, betas, eps, weight_decay, bias_correction, trust_ratio, grad_divisor,  # noqa: ANN001
) -> None:
    if not params:
        return
    b1, b2 = betas
    wd = weight_decay if trust_ratio else 0.0
    ws = [p if m is None else m for p, m in zip(params, masters)]
    gs = [_unscaled(g, w, None) for g, w in zip(grads, ws)]
    if grad_divisor is not None:
        gs = torch._foreach_div(gs, grad_divisor)
    torch._foreach_add_(state_steps, 1)
    torch._foreach_mul_(exp_avgs, b1)
    torch._foreach_add_(exp_avgs, gs, alpha=1.0 - b1)
    torch._foreach_mul_(exp_avg_sqs, b2)
    torch._foreach_addcmul_(exp_avg_sqs, gs, gs, value=1.0 - b2)
    # Each param's own count: params that start late (frozen, then trained) have fewer.
    bc1s, bc2s = zip(*(_bias_corrections(s, betas, bias_correction) for s in state_steps))
    denom = torch._foreach_div(exp_avg_sqs, list(bc2s))
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    us = torch._foreach_div(exp_avgs, list(bc1s))
    torch._foreach_div_(us, denom)
    if wd != 0:
        torch._foreach_add_(us, ws, alpha=wd)
    if trust_ratio:
        w_norms, u_norms = _stacked_norms(ws), _stacked_norms(us)
        coefs = (_safe_ratio(w_norms, u_norms, w_norms, u_norms) * lr).unbind()
        torch._foreach_mul_(us, coefs)
    else:
        torch._foreach_mul_(us, lr)
    torch._foreach_sub_(ws, us)
    _write_back(params, masters)


# --------------------------------------------------------------------------- fused dispatch


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _resolve_fused(fused: bool | None, params: list[Any]) -> bool:
    """``fused=None``: fused when every param is on CUDA and triton imports."""
    tensors = _tensors(params)
    if fused is None:
        return bool(tensors) and all(t.is_cuda for t in tensors) and _triton_available()
    if fused:
        import os

        if not _triton_available():
            raise RuntimeError("fused=True needs triton: pip install triton")
        on_cpu = [t for t in tensors if not t.is_cuda]
        if on_cpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError(
                f"fused=True needs CUDA params ({len(on_cpu)} are on {on_cpu[0].device}); on the "
                "CPU the Triton kernels run only under TRITON_INTERPRET=1 (set before import)"
            )
    return bool(fused)


# The compiled CPU path pays a one-time compile (seconds, cached on disk by Inductor): by
# default it is chosen only for models large enough for the step's speed to matter.
COMPILE_MIN_NUMEL = 1 << 20


def _resolve_compiled(compiled: bool | None, params: list[Any], fused: bool) -> bool:
    """``compiled=None``: the compiled path for CPU models of COMPILE_MIN_NUMEL+ elements."""
    if fused and compiled:
        raise ValueError("compiled=True and fused=True cannot both be set")
    if compiled is not None:
        return compiled
    tensors = _tensors(params)
    return (not fused and bool(tensors) and all(t.device.type == "cpu" for t in tensors)
            and sum(t.numel() for t in tensors) >= COMPILE_MIN_NUMEL)


def _check_paths(foreach: Any, fused: Any, compiled: Any) -> None:
    for name, value in (("foreach", foreach), ("fused", fused), ("compiled", compiled)):
        _check_flag(name, value, allow_none=True)


def _tensors(params: list[Any]) -> list[Tensor]:
    entries = (entry["params"] if isinstance(entry, dict) else [entry] for entry in params)
    flat = (p for entry in entries for p in ([entry] if isinstance(entry, Tensor) else entry))
    return [t for t in flat if isinstance(t, Tensor)]


def _lars_hyper(group: dict[str, Any]) -> dict[str, Any]:
    """The fused kernels' hyperparameters of a LARS group."""
    return {k: group[k] for k in _LARS_HYPER}


def _lamb_hyper(group: dict[str, Any]) -> dict[str, Any]:
    b1, b2 = group["betas"]
    return {"beta1": b1, "beta2": b2, **{k: group[k] for k in _LAMB_HYPER}}


def _run_fused(opt, gathered, state_keys, hyper, kernel, **kwargs):  # noqa: ANN001, ANN202
    """Build the kernels' groups and take the step; the kernels advance each param's step
    count and the optimizer's count of applied steps on the device unless it is skipped."""
    from largebatch.lars import triton_kernels

    groups = [
        triton_kernels.FusedGroup(
            params=g["params"], grads=g["grads"], masters=g["masters"],
            state={k: g[k] for k in state_keys}, steps=g["steps"],
            lr=_device_lr(opt, group, g["params"][0].device), hyper=hyper(group),
        )
        for group, g in zip(opt.param_groups, gathered) if g["params"]
    ]
    if not groups:  # nothing to update: count the step unless GradScaler skips it
        found_inf = kwargs["found_inf"]
        if found_inf is None or not bool(found_inf.item()):
            opt._applied += 1
        return
    device = groups[0].params[0].device
    if opt._applied.device != device:
        opt._applied = opt._applied.to(device)
    kernel(groups, counter=opt._applied, **kwargs)


def _device_lr(opt, group, device) -> Tensor:  # noqa: ANN001
    """The group's lr as an fp32 0-dim tensor on ``device``: the group's own tensor when it
    holds one (the CUDA-graph-friendly way), else one kept per group and refilled, so the
    kernels' address tables stay valid from step to step."""
    lr = group["lr"]
    if isinstance(lr, Tensor) and lr.device == device and lr.dtype == torch.float32:
        return lr
    cache = opt.__dict__.setdefault("_fused_lr", {})
    buf = cache.get(id(group))
    if buf is None or buf.device != device:
        buf = cache[id(group)] = torch.zeros((), dtype=torch.float32, device=device)
    return buf.fill_(lr) if not isinstance(lr, Tensor) else buf.copy_(lr)
