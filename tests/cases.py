"""The optimizer cases every backend and path is checked against, in one table.

A :class:`Case` is one LARS or LAMB setting in the reference's (the spec's) names: the
hyperparameters of the adapted group, the overrides of a second group, and LAMB's
``max_grad_norm``. :func:`run_reference` runs it on the float64 spec
(``largebatch.lars.reference``, through :func:`spec_step`, the one reference runner:
the JAX mask and kernel tests call it too); the adapters :func:`run_torch` (any path, any dtype,
with or without fp32 masters) and :func:`run_jax` run it on a backend. Every adapter
returns the same :class:`Result`, compared by :func:`assert_matches` at the tolerance of
the precision (:data:`TOLERANCE`, the one table of tolerances).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from largebatch.lars import reference
from largebatch.lars.spec import LAMB_SPEC, LARS_SPEC

# A zero param, a zero grad, a size-1 tensor, sizes off every block, a zero-size tensor.
SHAPES = [(7, 5), (1,), (1025,), (3, 4, 5), (17,), (0,), (64, 33)]
ZERO_PARAM = 4  # the all-zero param
ZERO_GRAD = 2  # the param whose grad is zero at every step
# Gradient scales far apart, so that LARC's clip and LAMB's clipping bind on some tensors
# and not on others; the last two tensors are the second group's.
GRAD_SCALES = [1e-3, 1e2, 1.0, 10.0, 1.0, 0.1, 0.1]
ADAPTED = 5  # the first group's size; the rest form the second group
LRS = [0.5, 1.0, 2.0, 0.25]  # the lr changes between steps (warmup, then decay)

# Relative tolerance per precision against the float64 spec: of each element, and of
# the tensor's largest element for elements that come out of a cancellation. Inputs
# are rounded to the precision first, so the spec starts where the backend starts.
TOLERANCE = {"float64": 1e-10, "float32": 2e-5, "bfloat16": 3e-2, "float16": 4e-3}
# On a CUDA GPU a torch path may round differently from the CPU. Its extra rounding per
# step and element, in float32 unit roundoffs (2**-24), is bounded from the CUDA C
# Programming Guide's error bounds (appendix "Mathematical Functions": sqrtf within
# 1 ulp and x / y within 2 ulp where compiled without -prec-sqrt / -prec-div; a fused
# multiply-add rounds once where the CPU rounds twice):
#   single_tensor, foreach: torch's CUDA kernels round sqrt and division correctly: 0.
#     Their reductions add in another order than on the CPU, as the CPU paths already
#     differ from each other: TOLERANCE covers that.
#   compiled: inductor's Triton code: division within 2 ulp, multiply-adds contracted.
#   fused: sqrt.approx (1 ulp), div.full (2 ulp), multiply-adds contracted; the norms'
#     fp64 sums and the trust ratio's fp64 division are correctly rounded.
# Both count one sqrt, two divisions and ten contracted multiply-adds per element and
# step (LAMB's u and update, LARS's ratio and momentum), 1 + 4 + 10 * 0.5 = 10 ulp,
# taken as 16. Every path is also bitwise the same from run to run on a GPU (the fused
# path sums its norms' partials in a fixed order): tests/test_gpu.py checks both.
GPU_ROUNDING = {"single_tensor": 0, "foreach": 0, "compiled": 16, "fused": 16}


def tolerance(precision: str, path: str | None = None, device: str = "cpu", steps: int = len(LRS)) -> float:
    """The relative tolerance of a run of ``steps`` steps on ``path`` and ``device`` in
    ``precision`` against the float64 spec: :data:`TOLERANCE`, plus on a CUDA GPU the
    path's :data:`GPU_ROUNDING` for each step."""
    extra = GPU_ROUNDING[path] * steps * 2.0**-24 if device == "cuda" and path else 0.0
    return TOLERANCE[precision] + extra


# The torch paths by name, as the optimizers' keywords: the one table every test takes its
# paths from (a test that needs fewer picks them by name; DTensor params refuse compiled).
TORCH_PATHS: dict[str, dict[str, bool]] = {
    "single_tensor": dict(foreach=False, compiled=False, fused=False),
    "foreach": dict(foreach=True, compiled=False, fused=False),
    "compiled": dict(compiled=True, fused=False),
    "fused": dict(fused=True),
}


def torch_paths(*names: str) -> dict[str, dict[str, bool]]:
    """The entries of :data:`TORCH_PATHS` named (all when none is)."""
    return {n: TORCH_PATHS[n] for n in names or TORCH_PATHS}


@dataclass(frozen=True)
class Case:
    id: str
    optimizer: str  # "lars" or "lamb"
    hyper: dict[str, Any]  # both groups (the spec's names; lr comes from LRS)
    second: dict[str, Any] = field(default_factory=dict)  # the second group's overrides
    max_grad_norm: float | None = None

    @property
    def spec(self):
        return LARS_SPEC if self.optimizer == "lars" else LAMB_SPEC

    def groups(self) -> list[dict[str, Any]]:
        """The two groups' full hyperparameters, defaults filled in (lr left out)."""
        base = group_hyper(self.spec, self.hyper)
        base.pop("lr")
        return [base, {**base, **self.second}]


def group_hyper(spec: Any, *overrides: dict[str, Any]) -> dict[str, Any]:
    """A group's hyperparameters (``lr`` included; not the options, such as LAMB's
    ``max_grad_norm``, which span the groups): the spec's defaults, then ``overrides``."""
    values = {k: spec.defaults[k] for k in spec.group_keys}
    for override in overrides:
        unknown = set(override) - set(values)
        assert not unknown, f"{spec.name} groups have no {sorted(unknown)}"
        values.update(override)
    return values


EXCLUDED = {"trust_ratio": False, "weight_decay": 0.0}

CASES = [
    Case("lars-defaults", "lars", {}),
    Case("lars-wd-excluded", "lars", {"weight_decay": 1e-3}, EXCLUDED),
    Case("lars-nesterov", "lars", {"nesterov": True, "weight_decay": 1e-4}, {"trust_ratio": False}),
    Case(
        "lars-trust-clip",
        "lars",
        {"trust_clip": True, "trust_coefficient": 0.5, "weight_decay": 1e-3},
        {"trust_ratio": False},
    ),
    Case(
        "lars-eps-tc-momentum",
        "lars",
        {"eps": 1e-3, "trust_coefficient": 0.02, "momentum": 0.5},
        {"momentum": 0.0},
    ),
    # lr outside the buffer (torch SGD, NVIDIA's MXNet LARS) while lr changes, nesterov;
    # the excluded group keeps its weight decay (NVIDIA decays the fc bias without LARS).
    Case(
        "lars-lr-outside",
        "lars",
        {"lr_in_momentum": False, "nesterov": True, "weight_decay": 1e-3},
        {"trust_ratio": False},
    ),
    # apex LARC: clip, and a zero norm leaves the gradient as it is (lr 2 makes the
    # difference from the clipped fallback ratio min(1 / lr, 1) show).
    Case(
        "lars-larc",
        "lars",
        {
            "lr_in_momentum": False,
            "trust_clip": True,
            "zero_norm_skip": True,
            "trust_coefficient": 0.5,
            "eps": 1e-8,
            "weight_decay": 1e-3,
        },
        EXCLUDED,
    ),
    # optax's denominator ||g + wd * w|| (its zero-norm rule too: the zero grad's tensor is
    # adapted by tc / wd), beside a group with the default one (in one fused plan).
    Case("lars-decayed-norm", "lars", {"decayed_norm": True, "weight_decay": 1e-2}, {"decayed_norm": False}),
    Case("lamb-defaults", "lamb", {}),
    Case("lamb-wd-excluded", "lamb", {"weight_decay": 0.01}, EXCLUDED),
    Case(
        "lamb-no-bias-correction",
        "lamb",
        {"bias_correction": False, "weight_decay": 0.01},
        {"betas": (0.8, 0.99)},
    ),
    Case("lamb-max-grad-norm", "lamb", {"weight_decay": 0.01}, {"trust_ratio": False}, max_grad_norm=5.0),
    Case("lamb-max-grad-norm-unused", "lamb", {"weight_decay": 0.01}, max_grad_norm=1e6),
    Case("lamb-eps", "lamb", {"eps": 1e-3}, {"eps": 0.0}),
    # apex FusedLAMB's L2 mode without gradient averaging; the group without decay adapts.
    # (Decay well above the small grads: where g + wd * w nearly cancels, the sign of a
    # bf16 m is noise, and so is that element's step.)
    Case(
        "lamb-l2-no-averaging",
        "lamb",
        {"adam_w_mode": False, "grad_averaging": False, "weight_decay": 0.1},
        {"weight_decay": 0.0},
    ),
    # apex FusedLAMB's and timm's default: the group without decay takes no trust ratio.
    Case(
        "lamb-adapt-only-decayed",
        "lamb",
        {"adapt_without_decay": False, "weight_decay": 0.01},
        {"weight_decay": 0.0},
    ),
    # 1-bit LAMB's frozen variance: v and its bias correction kept after step 2 of 4 (the
    # grads change every step, so a v that moved would show), beside a group that never
    # freezes; a zero grad's tensor and a zero param among the frozen.
    Case("lamb-frozen-variance", "lamb", {"freeze_step": 2, "weight_decay": 0.01}, {"freeze_step": None}),
]
CASE_IDS = [c.id for c in CASES]


def make_problem(dtype: Any = np.float64, shapes=SHAPES, steps: int = len(LRS), seed: int = 0):
    """Params and a gradient per step (NumPy, rounded to ``dtype``, as float64 arrays)."""
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s) for s in shapes]
    scales = GRAD_SCALES if len(shapes) == len(GRAD_SCALES) else [0.1] * len(shapes)
    grads = [[rng.standard_normal(s) * c for s, c in zip(shapes, scales)] for _ in range(steps)]
    if len(shapes) > ZERO_PARAM:
        params[ZERO_PARAM] = np.zeros(shapes[ZERO_PARAM])
    if len(shapes) > ZERO_GRAD:
        for g in grads:
            g[ZERO_GRAD] = np.zeros(shapes[ZERO_GRAD])
    return _rounded(params, dtype), [_rounded(g, dtype) for g in grads]


def _rounded(arrays: list[np.ndarray], dtype: Any) -> list[np.ndarray]:
    """Each array rounded to ``dtype`` (a NumPy dtype, or a torch one for bf16), in float64."""
    if isinstance(dtype, type) and issubclass(dtype, np.floating):
        return [a.astype(dtype).astype(np.float64) for a in arrays]
    import torch

    return [torch.tensor(a).to(dtype).double().numpy() for a in arrays]


@dataclass
class Result:
    params: list[np.ndarray]
    state: dict[str, list[np.ndarray]]  # the spec's state names (empty where not read)


def spec_step(
    optimizer: str,
    weights: list[np.ndarray],
    grads: list[np.ndarray],
    state: dict[str, list[np.ndarray]],
    hypers: list[dict[str, Any]],
    steps: list[int],
    max_grad_norm: float | None = None,
) -> tuple[list[np.ndarray], dict[str, list[np.ndarray]]]:
    """One step of the float64 spec: the reference runner every test uses.

    Each tensor has its own hyperparameters (``hypers[j]``: the spec's names, ``lr``
    included) and, for LAMB, its own step count ``steps[j]`` (from 1: params that start
    late); LAMB's clipping divisor spans all of them. Returns the new weights and state."""
    divisor = reference.clip_divisor(grads, max_grad_norm)
    names = LARS_SPEC.state if optimizer == "lars" else LAMB_SPEC.state
    new_w, new_state = [], {k: [] for k in names}
    for j, (w, g, hyper) in enumerate(zip(weights, grads, hypers)):
        lists = [[w], [g], *([state[k][j]] for k in names)]
        if optimizer == "lars":
            out = reference.lars_step(*lists, **hyper)
        else:
            out = reference.lamb_step(*lists, step=steps[j], grad_scale=divisor, **hyper)
        new_w.append(out[0][0])
        for k, x in zip(names, out[1:]):
            new_state[k].append(x[0])
    return new_w, new_state


def run_spec(
    optimizer: str,
    params: list[np.ndarray],
    grads: list[list[np.ndarray]],
    hypers: list[dict[str, Any]],
    lrs: list[float],
    max_grad_norm: float | None = None,
) -> Result:
    """:func:`spec_step` from zero state, one step per ``lrs[t]`` and ``grads[t]``."""
    names = LARS_SPEC.state if optimizer == "lars" else LAMB_SPEC.state
    state = {k: [np.zeros_like(p, dtype=np.float64) for p in params] for k in names}
    weights = [np.asarray(p, np.float64) for p in params]
    for t, (lr, step_grads) in enumerate(zip(lrs, grads), start=1):
        step_hypers = [{**h, "lr": lr} for h in hypers]
        weights, state = spec_step(
            optimizer,
            weights,
            [np.asarray(g, np.float64) for g in step_grads],
            state,
            step_hypers,
            [t] * len(params),
            max_grad_norm,
        )
    return Result(weights, state)


def run_spec_tree(
    optimizer: str,
    params: dict[str, Any],
    grads: list[dict[str, Any]],
    *,
    lr: Any,
    trust_ratio_mask: Any = None,
    weight_decay_mask: Any = None,
    max_grad_norm: float | None = None,
    b1: float | None = None,
    b2: float | None = None,
    **hyper: Any,
) -> dict[str, np.ndarray]:
    """The JAX factories' keywords on the float64 spec, leaf by leaf (flat dicts of
    leaves): a mask (a dict, a callable or None) becomes each leaf's ``trust_ratio``
    and weight decay (``weight_decay_mask`` None: decayed where adapted), a schedule
    ``lr(t)`` the lr of step ``t`` (from 0)."""

    def flags(mask: Any) -> dict[str, bool]:
        if mask is None:
            return {k: True for k in params}
        return dict(mask(params) if callable(mask) else mask)

    spec = LARS_SPEC if optimizer == "lars" else LAMB_SPEC
    adapt = flags(trust_ratio_mask)
    # Without weight_decay_mask the factories decay where they adapt; with it, apart.
    decay = adapt if weight_decay_mask is None else flags(weight_decay_mask)
    base = group_hyper(spec, hyper)
    if b1 is not None or b2 is not None:
        base["betas"] = (base["betas"][0] if b1 is None else b1, base["betas"][1] if b2 is None else b2)
    keys = list(params)
    hypers = [
        {**base, "trust_ratio": adapt[k], "weight_decay": base["weight_decay"] if decay[k] else 0.0}
        for k in keys
    ]
    lrs = [lr(t) if callable(lr) else lr for t in range(len(grads))]
    result = run_spec(
        optimizer,
        [params[k] for k in keys],
        [[g[k] for k in keys] for g in grads],
        hypers,
        lrs,
        max_grad_norm,
    )
    return dict(zip(keys, result.params))


def run_reference(
    case: Case, params: list[np.ndarray], grads: list[list[np.ndarray]], lrs=LRS, split: int = ADAPTED
) -> Result:
    """``case`` on the float64 spec."""
    first, second = case.groups()
    hypers = [first] * split + [second] * (len(params) - split)
    return run_spec(case.optimizer, params, grads, hypers, lrs, case.max_grad_norm)


def run_torch(
    case: Case,
    params: list[np.ndarray],
    grads: list[list[np.ndarray]],
    *,
    dtype: Any,
    masters: bool = False,
    lrs=LRS,
    split: int = ADAPTED,
    device: str = "cpu",
    **paths: Any,
) -> Result:
    """``case`` on ``largebatch.torch`` with params of ``dtype`` on ``device``; ``paths``:
    the constructor's ``foreach``/``fused``/``compiled``. With ``masters`` the result is
    the fp32 masters (the params are their casts)."""
    import torch

    from largebatch.torch import LAMB, LARS

    ps = [torch.tensor(p, dtype=dtype, device=device, requires_grad=True) for p in params]
    group_list = [{"params": ps[:split], **case.groups()[0]}, {"params": ps[split:], **case.groups()[1]}]
    cls = LARS if case.optimizer == "lars" else LAMB
    extra = {} if case.optimizer == "lars" else {"max_grad_norm": case.max_grad_norm}
    opt = cls(group_list, lr=lrs[0], master_weights=masters, **extra, **paths)
    drive(opt, ps, grads, lrs)
    assert opt.num_steps == len(lrs)
    if masters and dtype in (torch.float16, torch.bfloat16):
        for p in ps:  # the params are their masters' casts, exactly
            assert torch.equal(p, cast_like_the_path(opt.state[p]["master_param"], dtype, paths))
        weights = [opt.state[p]["master_param"] for p in ps]
    else:
        weights = ps
    state = {k: [opt.state[p][k].double().cpu().numpy() for p in ps] for k in case.spec.state}
    return Result([w.detach().double().cpu().numpy() for w in weights], state)


def cast_like_the_path(master: Any, dtype: Any, paths: dict[str, Any]) -> Any:
    """The param a path writes from its fp32 master. Triton's CPU interpreter rounds fp32
    to bf16 by truncation (the GPU rounds to nearest), so under it the fused path truncates."""
    import torch

    if dtype == torch.bfloat16 and paths.get("fused") and not master.is_cuda:
        return (master.view(torch.int32) & ~0xFFFF).view(torch.float32).to(dtype)
    return master.to(dtype)


def drive(opt: Any, params: list, grads: list[list[np.ndarray]], lrs: list[float]) -> None:
    """One ``opt.step()`` per ``lrs[t]`` (every group's lr) and ``grads[t]`` (as ``.grad``
    of ``params``, in their dtype)."""
    import torch

    for lr, step_grads in zip(lrs, grads):
        for group in opt.param_groups:
            group["lr"] = lr
        for p, g in zip(params, step_grads):
            p.grad = torch.tensor(g, dtype=p.dtype, device=p.device)
        opt.step()


def run_jax(
    case: Case,
    params: list[np.ndarray],
    grads: list[list[np.ndarray]],
    *,
    dtype: Any,
    lrs=LRS,
    split: int = ADAPTED,
    fused: bool | None = None,
) -> Result:
    """``case`` on ``largebatch.jax`` with leaves of ``dtype`` (a NumPy dtype or "bfloat16");
    ``fused``: the factories' argument (the fused path's steps are jitted).

    The second group is a ``trust_ratio_mask`` where it only excludes tensors, else an
    ``optax.multi_transform`` of two optimizers (not with ``max_grad_norm``, whose global
    norm spans both groups)."""
    import jax
    import jax.numpy as jnp
    import optax

    from largebatch.jax import lamb, lars

    labels = ["a"] * split + ["b"] * (len(params) - split)
    lr = optax.piecewise_constant_schedule(lrs[0], {i: lrs[i] / lrs[i - 1] for i in range(1, len(lrs))})

    def build(hyper: dict[str, Any], **masks: Any):
        if case.optimizer == "lars":
            hyper = {k: v for k, v in hyper.items() if k != "trust_ratio"}
            return lars(lr, **hyper, **masks, fused=fused)
        hyper = dict(hyper)
        b1, b2 = hyper.pop("betas")
        hyper.pop("trust_ratio")
        return lamb(lr, b1=b1, b2=b2, max_grad_norm=case.max_grad_norm, **hyper, **masks, fused=fused)

    first, second = case.groups()
    differs = {k for k in second if second[k] != first[k]}
    only_excludes = not differs or (
        second["trust_ratio"] is False
        and differs <= {"trust_ratio", "weight_decay"}
        and second["weight_decay"] in (0.0, first["weight_decay"])
    )
    if only_excludes:
        mask = [label == "a" or second["trust_ratio"] for label in labels]
        decayed = [label == "a" or second["weight_decay"] != 0 for label in labels]
        opt = build(first, trust_ratio_mask=mask, weight_decay_mask=decayed)
    else:
        assert case.max_grad_norm is None, case.id
        opt = optax.multi_transform({"a": build(first), "b": build(second)}, labels)
    jdtype = jnp.bfloat16 if dtype == "bfloat16" else dtype
    with jax.enable_x64(dtype == np.float64):
        ws = [jnp.asarray(p, jdtype) for p in params]
        state = opt.init(ws)
        # Eager for a few leaves; jitted for many, where one compile beats eager dispatch.
        update = jax.jit(opt.update) if len(params) > 20 or fused else opt.update
        for step_grads in grads:
            updates, state = update([jnp.asarray(g, jdtype) for g in step_grads], state, ws)
            ws = optax.apply_updates(ws, updates)
            assert all(w.dtype == jdtype for w in ws)
        return Result(
            [
                np.asarray(w.astype(jnp.float64 if dtype == np.float64 else jnp.float32), np.float64)
                for w in ws
            ],
            {},
        )


def assert_matches(
    actual: Result,
    expected: Result,
    precision: str,
    start: list[np.ndarray] | None = None,
    rtol: float | None = None,
) -> None:
    """Every param and state tensor at :data:`TOLERANCE` ``[precision]`` (or ``rtol``,
    from :func:`tolerance`): of each element, and of the tensor's largest element (for a
    param, the largest of its start values too: an update may cancel it to rounding
    noise)."""
    rtol = TOLERANCE[precision] if rtol is None else rtol
    pairs = [("param", actual.params, expected.params, start)]
    pairs += [(k, actual.state[k], expected.state[k], None) for k in actual.state]
    for what, xs, es, starts in pairs:
        for i, (a, e) in enumerate(zip(xs, es)):
            start = 0.0 if starts is None else np.max(np.abs(starts[i]), initial=0.0)
            scale = max(np.max(np.abs(e), initial=0.0), start)
            np.testing.assert_allclose(
                a, e, rtol=rtol, atol=rtol * scale, err_msg=f"{what} {i} of shape {e.shape}"
            )
