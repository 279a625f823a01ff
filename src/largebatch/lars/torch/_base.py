"""What LARS and LAMB share as ``torch.optim.Optimizer``\\ s: groups checked once into
typed hyperparameters, master weights, the GradScaler contract, state dicts, the count of
applied steps, and the step itself."""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from largebatch.lars.spec import Hyperparams, OptimizerSpec, as_flag
from largebatch.lars.torch import _fused, _paths, _sharded, _step
from largebatch.lars.torch._common import (
    LOW_PRECISION,
    SUPPORTED_DTYPES,
    ParamNames,
    check_paths,
    group_params,
    lr_number,
    lr_value,
    param_list,
    param_names,
    skipped,
    tensor_of,
    tensors_of,
)
from largebatch.lars.torch._group import Bodies, GroupStep

# Chosen by the constructor, kept by load_state_dict: which path runs (and so whether a
# step is differentiable or capturable) and whether fp16/bf16 params get fp32 masters are
# settings of this optimizer, not of the checkpoint.
CONSTRUCTOR_KEYS = ("master_weights", "foreach", "fused", "compiled", "differentiable", "capturable")
# torch.optim's keywords beside the spec's hyperparameters, stored in every param group,
# with the value a group saved before they existed loads with (torch's __setstate__ too).
TORCH_KEYS = {"maximize": False, "differentiable": False, "capturable": False}


def _autograd_if_differentiable(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step`` under ``torch.no_grad()``, or with autograd on for an optimizer made with
    ``differentiable=True`` (torch's optimizers do the same)."""

    @functools.wraps(step)
    def run(self: LayerwiseOptimizer, closure: Callable[[], Any] | None = None) -> Any:
        with torch.set_grad_enabled(self.defaults["differentiable"]):
            return step(self, closure)

    return run


def _step_device(param: Tensor, group: dict[str, Any]) -> torch.device:
    """Where a param's step count lives: on its device for the fused kernels (which count
    on the device), on the CPU otherwise (read on the host for bias corrections)."""
    return param.device if group["fused"] else torch.device("cpu")


class LayerwiseOptimizer(Optimizer):
    """The base of :class:`LARS` and :class:`LAMB`. A subclass names its ``spec`` and the
    bodies of its unfused paths. When a group is added its settings are checked and its
    path resolved (:meth:`add_param_group`); a step turns each group into a
    :class:`GroupStep` (its hyperparameters made again only where a value changed) and
    hands them all to ``_step.run``, which the functionals share."""

    _step_supports_amp_scaling = True
    spec: OptimizerSpec
    bodies: Bodies  # the unfused paths
    _extra_state: tuple[str, ...] = ("_applied",)  # pickled with the optimizer

    def __init__(
        self,
        params: Any,
        lr: float | Tensor,
        hyper: Hyperparams,
        *,
        master_weights: bool,
        foreach: Any,
        fused: Any,
        compiled: Any,
        maximize: Any = False,
        differentiable: Any = False,
        capturable: Any = False,
    ) -> None:
        # Every default is checked here (``hyper`` when it was made), as torch's optimizers
        # check theirs, whether or not a group uses it, and before any group is.
        defaults = {
            "lr": lr,
            **hyper.values(),
            "master_weights": master_weights,
            "maximize": maximize,
            "differentiable": differentiable,
            "capturable": capturable,
        }
        self._check_settings({**defaults, "foreach": foreach, "fused": fused, "compiled": compiled})
        params = param_list(params)
        _sharded.check_not_flat(tensors_of(params))
        paths = _paths.resolve(
            foreach,
            fused,
            compiled,
            tensors_of(params),
            differentiable=differentiable,
            capturable=capturable,
        )
        self._applied = torch.zeros((), dtype=torch.float32)
        self._hyperparams: dict[int, tuple[tuple, Hyperparams]] = {}
        self._replay = _fused.Replay()  # the last fused step, for the next (never pickled)
        super().__init__(params, {**defaults, **paths})

    # Validation runs on every group, including those added later, before it is stored
    # (the defaults were checked by the constructor).
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {torch.typename(param_group)}")
        param_group = {**param_group, "params": group_params(param_group["params"])}
        merged = {**self.defaults, **{k: v for k, v in param_group.items() if k != "params"}}
        hyper = self._validate(merged)
        # The group's path, resolved once: the step reads it back with _paths.pick.
        param_group.update(
            _paths.resolve(
                merged["foreach"],
                merged["fused"],
                merged["compiled"],
                tensors_of([param_group]),
                differentiable=merged["differentiable"],
                capturable=merged["capturable"],
            )
        )
        if param_group["fused"]:
            _fused.check(hyper, len(self.param_groups))
        for p in map(tensor_of, param_group["params"]):
            if isinstance(p, Tensor) and p.dtype not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"{type(self).__name__} supports float64/32/16 and bfloat16 params, "
                    f"got a {p.dtype} param of shape {tuple(p.shape)}"
                )
        super().add_param_group(param_group)
        stored = self.param_groups[-1]  # its missing keys filled from the defaults
        values = self._hyper_values(stored)
        self._hyperparams[len(self.param_groups) - 1] = (values, hyper)

    def _validate(self, group: dict[str, Any]) -> Hyperparams:
        """Every check of a group; returns its typed hyperparameters."""
        hyper = self.spec.make({k: group[k] for k in self.spec.group_keys[1:]})
        self._check_settings(group)
        return hyper

    def _check_settings(self, group: dict[str, Any]) -> None:
        """A group's settings beside its hyperparameters: lr, master_weights, torch.optim's
        maximize, differentiable and capturable, the paths."""
        self.spec.check({"lr": lr_number(group["lr"])})
        for name in ("master_weights", *TORCH_KEYS):
            as_flag(name, group[name])
        check_paths(group["foreach"], group["fused"], group["compiled"])
        if group["fused"] and group["foreach"]:
            raise ValueError("foreach=True and fused=True cannot both be set")

    def _hyper_values(self, group: dict[str, Any]) -> tuple:
        """A group's hyperparameters but lr, as stored (what its typed object is made
        from), then its maximize: a new typed object when either changed, so that the
        fused step's memory, which compares them by identity, plans again."""
        return (*(group[k] for k in self.spec.group_keys[1:]), group["maximize"])

    def _group_hyperparams(self, i: int, group: dict[str, Any]) -> Hyperparams:
        """Group ``i``'s typed hyperparameters: made when the group is first stepped and
        again only when one of its values changed since (a user or a scheduler may write
        any group key, as with torch's optimizers), checked then."""
        values = self._hyper_values(group)
        cached = self._hyperparams.get(i)
        if cached is None or cached[0] != values:
            as_flag("maximize", values[-1])
            hyper = self.spec.make(dict(zip(self.spec.group_keys[1:], values[:-1])))
            if group["fused"]:
                _fused.check(hyper, i)
            cached = self._hyperparams[i] = (values, hyper)
        return cached[1]

    def __getstate__(self) -> dict[str, Any]:
        # torch.optim pickles defaults, state and groups only: keep the count of applied
        # steps (and LAMB's max_grad_norm) through copy.deepcopy, pickle and torch.save.
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in self._extra_state}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_applied", torch.zeros((), dtype=torch.float32))
        self.__dict__.setdefault("_hyperparams", {})
        self.__dict__.setdefault("_replay", _fused.Replay())
        for key, value in TORCH_KEYS.items():
            self.defaults.setdefault(key, value)
        for group in self.param_groups:
            for key, value in TORCH_KEYS.items():  # a group saved before they existed
                group.setdefault(key, value)
            for key in (*self.spec.group_keys, *CONSTRUCTOR_KEYS):
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
        for option in self.spec.options:
            out[option.name] = getattr(self, option.name)
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
        options = [o.name for o in self.spec.options]
        extra = {k: state_dict.pop(k) for k in ("num_steps", *options) if k in state_dict}
        if "num_steps" in extra:
            n = extra["num_steps"]
            if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 0:
                raise ValueError(f"Invalid num_steps: {n!r} (must be an integer >= 0)")
        self.spec.check({k: extra[k] for k in options if k in extra})
        by_id = self._check_loadable(state_dict)
        kept = [{k: g[k] for k in CONSTRUCTOR_KEYS} for g in self.param_groups]
        self._replay.forget()  # new state tensors: the next step plans again
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
        for name in options:
            if name in extra:
                setattr(self, name, extra[name])

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
        by_id: dict[Any, Tensor] = {}
        for i, (saved, group) in enumerate(zip(saved_groups, self.param_groups)):
            missing = [k for k in self.spec.group_keys if k not in saved]
            if missing:
                raise ValueError(
                    f"not a {name} state dict: its param group {i} lacks {missing} (it has {sorted(saved)})"
                )
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(
                    f"loaded param group {i} has {len(saved['params'])} params, {name}'s has "
                    f"{len(group['params'])}"
                )
            merged = {**group, **{k: v for k, v in saved.items() if k not in CONSTRUCTOR_KEYS}}
            self._validate(merged)
            by_id.update(zip(saved["params"], group["params"]))
        allowed = {"step", "master_param", *self.spec.state}
        for pid, entry in state_dict["state"].items():
            if pid not in by_id:
                raise ValueError(f"loaded state refers to param {pid!r}, which no param group holds")
            param = by_id[pid]
            if not set(entry) <= allowed or not {"step", *self.spec.state} <= set(entry):
                raise ValueError(
                    f"not a {name} state dict: param {pid!r} holds {sorted(entry)}, expected "
                    f"{sorted(allowed)} (master_param optional)"
                )
            step = entry["step"]
            if not (isinstance(step, numbers.Real) or (isinstance(step, Tensor) and step.numel() == 1)):
                raise ValueError(
                    f"param {pid!r}: step must be a number or a one-element Tensor, got {step!r}"
                )
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
        if group["master_weights"] and param.dtype in LOW_PRECISION:
            master = saved.get("master_param")
            master = param.detach() if master is None else master
            state["master_param"] = master.to(device=param.device, dtype=torch.float32, copy=True)
            math_dtype = torch.float32
        else:
            math_dtype = param.dtype
        for key in self.spec.state:
            state[key] = saved[key].to(device=param.device, dtype=math_dtype, copy=True)
        return _sharded.laid_out_as(param, state)

    # ------------------------------------------------------------------ the step

    def _group_step(self, group: dict[str, Any], hyper: Hyperparams, path: str) -> GroupStep:
        """A group's params that have grads, with their state (created here, when a
        param first has a grad), its lr and its hyperparameters."""
        out = GroupStep(
            params=[],
            grads=[],
            state={key: [] for key in self.spec.state},
            masters=[],
            steps=[],
            lr=lr_value(group["lr"]),
            hyper=hyper,
            path=path,
            key=id(group),
            maximize=group["maximize"],
            differentiable=group["differentiable"],
        )
        use_masters = group["master_weights"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            master = state.get("master_param")
            if not state:
                if use_masters and p.dtype in LOW_PRECISION:
                    master = p.detach().float().clone(memory_format=torch.preserve_format)
                    state["master_param"] = master
                like = p if master is None else master
                state["step"] = torch.zeros((), dtype=torch.float32, device=_step_device(p, group))
                for key in self.spec.state:
                    state[key] = torch.zeros_like(like, memory_format=torch.preserve_format)
            out.params.append(p)
            out.grads.append(p.grad)
            out.masters.append(master)
            out.steps.append(state["step"])
            for key, values in out.state.items():
                values.append(state[key])
        return out

    def _amp_inputs(self) -> tuple[Tensor | None, Tensor | None]:
        """``(grad_scale, found_inf)`` as ``torch.amp.GradScaler.step`` sets them, or Nones.

        After ``scaler.unscale_(opt)`` the scaler passes ``grad_scale=None`` (the grads are
        already unscaled) and still passes ``found_inf``."""
        return getattr(self, "grad_scale", None), getattr(self, "found_inf", None)

    @_autograd_if_differentiable
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step. ``closure`` re-evaluates the model and returns the loss.

        Runs without autograd unless the optimizer was made with ``differentiable=True``.
        Non-finite gradients are applied as torch.optim applies them (they reach the params
        and the state); a step is skipped only when a ``torch.amp.GradScaler`` found inf or
        NaN (``found_inf``), on every path."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale, found_inf = self._amp_inputs()
        paths = [_paths.pick(g["foreach"], g["fused"], g["compiled"]) for g in self.param_groups]
        fused = "fused" in paths
        if fused and set(paths) != {"fused"}:
            raise ValueError("fused must be the same in every param group")
        if (
            not fused
            and not torch.compiler.is_compiling()
            and torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing()
        ):
            raise RuntimeError(
                f"Attempting CUDA graph capture of step() for an instance of "
                f"{type(self).__name__} on the {paths[0]} path, which reads device values on "
                "the host (a graph cannot capture that): only the fused path is capturable "
                "(fused=True, or the default for CUDA params with triton)"
            )
        # Every group's hyperparameters, checked where they changed, before any state is made.
        hypers = [self._group_hyperparams(i, group) for i, group in enumerate(self.param_groups)]
        reuse = (
            self._replay.check(self.param_groups, hypers, self._applied, self.state) if fused else _fused.FULL
        )
        if reuse == _fused.NEW_GRADS and self._replay.unusual(self._replay.new_grads()):
            reuse = _fused.FULL  # a sparse or complex grad: the full step's checks say so
        if reuse != _fused.FULL:
            reducer = self._replay.reducer
            if reducer is not None:  # sharded grads: every rank checked only its own shard
                found_inf = reducer.found_inf(found_inf)
            options = self._fused_options(True, reducer)
            if reuse == _fused.REPLAY:  # nothing moved since the last step: its plan serves
                self._applied = self._replay.run(grad_scale=grad_scale, found_inf=found_inf, options=options)
            else:  # only the grads are new tensors: the last step's groups take them
                self._applied = _step.run(
                    self.bodies,
                    self._replay.with_new_grads(),
                    grad_scale=grad_scale,
                    found_inf=found_inf,
                    counter=self._applied,
                    fused_options=options,
                    memo=self._replay,
                )
            return loss
        self._check_grads()
        reducer = _sharded.reducer_for(self._params_with_grads())
        if reducer is not None:  # sharded grads: every rank checked only its own shard
            found_inf = reducer.found_inf(found_inf)
        if not fused and skipped(found_inf):  # the kernels decide the skip on the device
            return loss
        groups = [self._group_step(g, h, path) for g, h, path in zip(self.param_groups, hypers, paths)]
        if fused:
            self._applied = _step.run(
                self.bodies,
                groups,
                grad_scale=grad_scale,
                found_inf=found_inf,
                counter=self._applied,
                fused_options=self._fused_options(any(g.params for g in groups), reducer),
                memo=self._replay,
            )
            self._replay.record(self.param_groups, hypers, groups, self._applied, self.state, reducer)
        else:  # found_inf was read above
            grads = [g for group in groups for g in group.grads]
            _step.run(
                self.bodies,
                groups,
                grad_scale=self._grad_scale(grads, grad_scale),
                found_inf=None,
                counter=self._applied,
            )
        return loss

    def trust_ratios(self, grad_scale: float | Tensor | None = None) -> list[float]:
        """The trust ratio the next step would apply to each adapted tensor with a grad,
        in group order, nothing changed: each tensor's update runs on copies of its weight
        and state, through the same single-tensor code as a step (``grad_scale``: what the
        grads carry, e.g. the GradScaler scale). The ratios are gathered on the device and
        read on the host once, whatever their number; :meth:`named_trust_ratios` names them."""
        _, ratios = self.trust_ratio_tensor(grad_scale)
        return ratios.tolist() if ratios.numel() else []

    def named_trust_ratios(
        self, names: ParamNames = None, grad_scale: float | Tensor | None = None
    ) -> dict[str, float]:
        """:meth:`trust_ratios` by parameter name, in group order (one host read).

        ``names``: a module (``model``, its ``named_parameters()``) or a mapping of names
        to params; None takes the names the param groups carry, as ``torch.optim`` keeps
        them when given ``model.named_parameters()`` or groups with ``"param_names"``. A
        ValueError says which param has no name."""
        params, ratios = self.trust_ratio_tensor(grad_scale)
        name_of = param_names(self.param_groups, names)
        keys = [name_of(p) for p in params]
        return dict(zip(keys, ratios.tolist() if ratios.numel() else []))

    @torch.no_grad()
    def trust_ratio_tensor(self, grad_scale: float | Tensor | None = None) -> tuple[list[Tensor], Tensor]:
        """The adapted params with a grad, in group order, and the trust ratios the next
        step would apply to them as one tensor on their device (nothing read on the host;
        what :meth:`trust_ratios` reads)."""
        device = self._device()
        if grad_scale is None:
            scale = None
        elif isinstance(grad_scale, Tensor):
            scale = grad_scale.float()
        else:  # made on the device, where the grads and their clipping norm are
            scale = torch.full((), float(grad_scale), dtype=torch.float32, device=device)
        grads = [p.grad for p in self._params_with_grads() if p.grad is not None]
        divisor = self._grad_scale(grads, scale, on_device=True)
        params: list[Tensor] = []
        ratios: list[Tensor] = []
        for i, group in enumerate(self.param_groups):
            hyper = self._group_hyperparams(i, group)
            if not hyper.adapts:
                continue
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state.get(p, {})
                saved = [state.get("master_param", p), p.grad, *(state.get(k) for k in self.spec.state)]
                (w, grad, *moments), _ = _sharded.local(tuple([x] for x in saved))  # local blocks
                trial = GroupStep(
                    params=[w[0].clone()],
                    grads=grad,
                    masters=[None],
                    state={
                        k: [torch.zeros_like(w[0]) if x[0] is None else x[0].clone()]
                        for k, x in zip(self.spec.state, moments)
                    },
                    steps=[state["step"].clone() if state else torch.zeros(())],
                    lr=lr_value(group["lr"]),
                    hyper=hyper,
                    maximize=group["maximize"],
                )
                norm = functools.partial(_sharded.whole_norm, p, on_device=True)
                ratio = self.bodies.one_tensor(trial, divisor, norm)
                params.append(p)
                ratios.append(ratio if ratio.device == device else ratio.to(device))
        return params, torch.stack(ratios) if ratios else torch.zeros(0, device=device)

    def _device(self) -> torch.device:
        """Where this optimizer's params live (the first one's device)."""
        return next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))

    def _params_with_grads(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"] if p.grad is not None]

    def _grad_scale(
        self, grads: list[Tensor], grad_scale: Tensor | None, on_device: bool = False
    ) -> Tensor | None:
        """What divides every grad on the unfused paths (LAMB adds its clipping divisor;
        ``on_device``: its norms read nothing on the host)."""
        return grad_scale

    def _fused_reductions(self, reducer: _sharded.Reducer | None) -> dict[str, Any]:
        """The kernels' reduction hooks (none unless params are sharded)."""
        return {} if reducer is None else reducer.fused_kwargs(self.spec)

    def _fused_options(self, has_grads: bool, reducer: _sharded.Reducer | None) -> dict[str, Any]:
        """The kernels' keywords beyond the groups: this optimizer's options and, for
        sharded params, the reductions of their norms (``has_grads``: whether any param
        of this rank has a grad)."""
        options = {o.name: getattr(self, o.name) for o in self.spec.options}
        reductions = self._fused_reductions(reducer)
        if not has_grads and options.get("max_grad_norm") is not None and "reduce_global" in reductions:
            # No grads here, but the other ranks' global norm waits for this rank's share.
            reductions["reduce_global"](torch.zeros(1, dtype=torch.float64, device=self._device()))
        return {**options, **reductions}

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
