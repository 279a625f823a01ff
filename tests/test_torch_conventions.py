"""What a torch.optim user relies on, checked on every path of LARS and LAMB.

One table of optimizer cases (``CASES``) and one of implementations (``IMPLS``: the
per-tensor loop, ``torch._foreach_*``, the compiled per-tensor body and the fused Triton
kernels under ``TRITON_INTERPRET=1``) drive the generic checks that torch's own optimizer
tests run for every optimizer: generators in param groups, state-dict round trips,
copies and pickles, tensor learning rates, every ``lr_scheduler``, ``torch.compile`` of
``step``, step hooks, params that start late, load validation and bad arguments.
"""

from __future__ import annotations

import copy
import io
import math
import pickle

import numpy as np
import pytest
import torch
from cases import TORCH_PATHS, group_hyper, run_spec

from largebatch.lars.torch import _compiled
from largebatch.torch import LAMB, LARS, ScheduleLR, param_groups

# (id, class, constructor kwargs): each case has an adapted group and an excluded one.
CASES = [
    ("lars", LARS, dict(lr=0.5, weight_decay=1e-3, nesterov=True)),
    ("lars_clip", LARS, dict(lr=0.5, weight_decay=1e-4, trust_clip=True, eps=1e-8)),
    ("lamb", LAMB, dict(lr=0.05, weight_decay=1e-2)),
    ("lamb_clip", LAMB, dict(lr=0.05, weight_decay=1e-2, max_grad_norm=0.5, betas=(0.8, 0.99))),
]
IMPLS = TORCH_PATHS
SHAPES = [(6, 5), (7,), (3, 4, 2), (5,)]  # two adapted (ndim > 1), two excluded


@pytest.fixture(autouse=True)
def _compile_small_tensors(monkeypatch):
    """Send every tensor of 2+ elements through the compiled body on the compiled path.

    Each structural variant of a body (flags, dtype, master or not) is one compiled graph;
    this table runs more variants in one process than a training run does, so the
    recompile limit is raised for it."""
    monkeypatch.setattr(_compiled, "COMPILE_MIN_TENSOR", 2)
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


def make_params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype)) for s in SHAPES]


def groups_of(params) -> list[dict]:
    return [
        {"params": [p for p in params if p.ndim > 1]},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0, "trust_ratio": False},
    ]


def build(case, impl, params=None, **extra):
    _, cls, kwargs = case
    params = make_params() if params is None else params
    return params, cls(groups_of(params), **{**kwargs, **IMPLS[impl], **extra})


def twin(case, impl, params):
    """A second optimizer of ``case`` on copies of ``params``: (params, optimizer)."""
    return build(case, impl, params=[torch.nn.Parameter(p.detach().clone()) for p in params])


def grads_for(step: int, params, only=None) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1
        p.grad = g if only is None or i in only else None


def run(opt, params, steps: int, start: int = 0, only=None) -> None:
    for t in range(start, start + steps):
        grads_for(t, params, only)
        opt.step()


def assert_same(a, b, **tol):
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(
            x.detach(), y.detach(), equal_nan=True, msg=lambda m, i=i: f"tensor {i}: {m}", **tol
        )


def assert_state_dicts_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        assert sa.keys() == sb.keys(), k
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), (k, key)
            assert torch.as_tensor(sa[key]).dtype == torch.as_tensor(sb[key]).dtype, (k, key)
    for key in a.keys() - {"state", "param_groups"}:
        assert a[key] == b[key], key


cases = pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
impls = pytest.mark.parametrize("impl", IMPLS)


# --------------------------------------------------------------------------- param groups


@cases
@impls
def test_generators_in_param_groups_are_kept(case, impl):
    params = make_params()
    _, cls, kwargs = case
    before = [p.detach().clone() for p in params]
    opt = cls([{"params": (p for p in params[:2])}, {"params": iter(params[2:])}], **kwargs, **IMPLS[impl])
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]
    opt.add_param_group({"params": (p for p in [torch.nn.Parameter(torch.ones(3))])})
    assert len(opt.param_groups[2]["params"]) == 1
    run(opt, params, 1)
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


@cases
def test_a_generator_of_params_is_kept(case):
    params = make_params()
    _, cls, kwargs = case
    opt = cls((p for p in params), **kwargs)
    assert len(opt.param_groups[0]["params"]) == len(params)


@cases
def test_a_single_tensor_as_params_is_a_type_error(case):
    _, cls, kwargs = case
    # torch's own phrase, which torch's generic error inputs check for every optimizer
    with pytest.raises(
        TypeError,
        match="params argument given to the optimizer should be an "
        "iterable of Tensors or dicts, but got torch.FloatTensor",
    ):
        cls(torch.nn.Parameter(torch.randn(3, 3)), **kwargs)
    with pytest.raises(TypeError, match="set"):
        cls([{"params": {torch.nn.Parameter(torch.randn(3))}}], **kwargs)


# --------------------------------------------------------------------------- late params


@cases
@impls
def test_params_that_start_late_equal_the_loop(case, impl):
    """Param 0 (adapted) and param 3 (excluded) get grads only from step 4 on: their own
    step counts drive the bias correction, and the saved counts are their own."""
    late = {1, 2}
    params, opt = build(case, impl)
    ref_params, ref = build(case, "single_tensor")
    for o, ps in ((opt, params), (ref, ref_params)):
        run(o, ps, 4, only=late)
        run(o, ps, 3, start=4)
    assert_same(params, ref_params, rtol=2e-5, atol=2e-6)
    steps = [int(opt.state[p]["step"]) for p in params]
    assert steps == [3, 7, 7, 3]
    assert opt.num_steps == 7


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_late_param_in_an_excluded_lamb_group_is_bias_corrected_by_its_own_count(impl):
    """After many steps without a grad, the first update of a late param is Adam's first
    step: |u| = 1 per element (up to eps), not (1 - b1) / (1 - b1^t) * ..."""
    early = torch.nn.Parameter(torch.zeros(4))
    late = torch.nn.Parameter(torch.zeros(4))
    opt = LAMB([{"params": [early, late], "trust_ratio": False}], lr=1.0, eps=1e-12, **IMPLS[impl])
    for _ in range(30):
        early.grad, late.grad = torch.ones(4), None
        opt.step()
    early.grad, late.grad = torch.ones(4), torch.full((4,), 0.5)
    opt.step()
    torch.testing.assert_close(late.detach(), torch.full((4,), -1.0))
    assert int(opt.state[late]["step"]) == 1 and int(opt.state[early]["step"]) == 31


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_num_steps_counts_applied_steps_whoever_had_grads(impl):
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = LARS([a, b], lr=0.1, **IMPLS[impl])
    for t in range(5):
        a.grad = torch.ones(3) if t >= 3 else None  # the first param starts late
        b.grad = torch.ones(3) if t % 2 == 0 or t >= 3 else None
        opt.step()
    assert opt.num_steps == 5


# --------------------------------------------------------------------------- state dicts


@cases
@impls
def test_state_dict_is_deterministic_and_round_trips(case, impl):
    params, opt = build(case, impl)
    run(opt, params, 2)
    sd = opt.state_dict()
    assert_state_dicts_equal(sd, opt.state_dict())
    params2, opt2 = twin(case, impl, params)
    saved = copy.deepcopy(sd)
    opt2.load_state_dict(sd)
    assert_state_dicts_equal(saved, sd)  # the loaded dict is not changed
    assert_state_dicts_equal(opt2.state_dict(), sd)  # no new keys, same values
    run(opt, params, 2, start=2)
    run(opt2, params2, 2, start=2)
    assert_same(params, params2, rtol=0, atol=0)
    assert_state_dicts_equal(opt.state_dict(), opt2.state_dict())


@cases
@impls
def test_load_state_dict_with_plain_number_steps(case, impl):
    params, opt = build(case, impl)
    run(opt, params, 2)
    sd = opt.state_dict()
    plain = copy.deepcopy(sd)
    for entry in plain["state"].values():
        entry["step"] = int(entry["step"])
    params2, opt2 = twin(case, impl, params)
    opt2.load_state_dict(plain)
    run(opt, params, 1, start=2)
    run(opt2, params2, 1, start=2)
    assert_same(params, params2, rtol=0, atol=0)
    assert all(isinstance(opt2.state[p]["step"], torch.Tensor) for p in params2)


@cases
@impls
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_of_the_optimizer_step_like_it(case, impl, how):
    params, opt = build(case, impl)
    run(opt, params, 2)
    if how == "deepcopy":
        params2, opt2 = copy.deepcopy((params, opt))
    elif how == "pickle":
        params2, opt2 = pickle.loads(pickle.dumps((params, opt)))
    else:
        buffer = io.BytesIO()
        torch.save((params, opt), buffer)
        buffer.seek(0)
        params2, opt2 = torch.load(buffer, weights_only=False)
    assert getattr(opt2, "max_grad_norm", None) == getattr(opt, "max_grad_norm", None)
    run(opt, params, 2, start=2)
    run(opt2, params2, 2, start=2)
    assert_same(params, params2, rtol=0, atol=0)
    assert opt2.num_steps == opt.num_steps == 4


# --------------------------------------------------------------------------- learning rates


@cases
@impls
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=str)
def test_tensor_lr_of_one_element_equals_the_float(case, impl, shape):
    lr = case[2]["lr"]
    params, opt = build(case, impl, lr=torch.full(shape, lr))
    ref_params, ref = build(case, impl)
    run(opt, params, 3)
    run(ref, ref_params, 3)
    assert_same(params, ref_params, rtol=1e-6, atol=1e-7)


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[1, 3], gamma=0.3),
    "ConstantLR": lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=2),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=3),
    "ExponentialLR": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
    "PolynomialLR": lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=4, power=2.0),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=4),
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0 / (t + 1)),
    "MultiplicativeLR": lambda o: torch.optim.lr_scheduler.MultiplicativeLR(o, lambda t: 0.8),
    "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=2),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.ConstantLR(o, factor=0.1, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
        ],
        milestones=[2],
    ),
    "ChainedScheduler": lambda o: torch.optim.lr_scheduler.ChainedScheduler(
        [
            torch.optim.lr_scheduler.ConstantLR(o, factor=0.1, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
        ]
    ),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
}


@cases
@pytest.mark.parametrize("name", SCHEDULERS)
def test_every_torch_lr_scheduler_drives_our_groups(case, name):
    """The lrs a torch scheduler sets on our groups are those it sets on torch's SGD, and
    the steps use them."""
    _, cls, kwargs = case
    params, sgd_params = make_params(), make_params()
    ours = cls(groups_of(params), **kwargs)
    sgd = torch.optim.SGD(groups_of(sgd_params), lr=kwargs["lr"], momentum=0.9)
    scheds = [SCHEDULERS[name](o) for o in (ours, sgd)]
    for t in range(5):
        grads_for(t, params)
        grads_for(t, sgd_params)
        lr = ours.param_groups[0]["lr"]
        before = [p.detach().clone() for p in params]
        ours.step()
        sgd.step()
        if t == 0 and lr > 0:
            assert all(not torch.equal(p, b) for p, b in zip(params, before))
        for s in scheds:
            s.step(1.0) if name == "ReduceLROnPlateau" else s.step()
        assert [g["lr"] for g in ours.param_groups] == [g["lr"] for g in sgd.param_groups]
    if name == "ReduceLROnPlateau":
        assert ours.param_groups[0]["lr"] < kwargs["lr"]


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_schedule_lr_keeps_its_count_when_the_first_param_starts_late(cls):
    """ScheduleLR(follow_optimizer=True) reads num_steps: a late first param does not
    restart the warmup."""
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = cls([a, b], lr=0.0)
    sched = ScheduleLR(opt, lambda t: float(t), follow_optimizer=True)
    for t in range(6):
        a.grad = torch.ones(3) if t >= 3 else None
        b.grad = torch.ones(3)
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 6.0


# --------------------------------------------------------------------------- compile, hooks


@pytest.mark.parametrize("case", [CASES[0], CASES[3]], ids=["lars", "lamb_clip"])
@pytest.mark.parametrize("impl", ["single_tensor", "foreach"])
def test_torch_compile_of_step_equals_eager(case, impl):
    """``torch.compile(opt.step)`` traces the whole step as one graph (fullgraph=True
    refuses a graph break): eager mode's host read (whether a norm overflowed fp32) is
    taken on the device while compiling."""
    torch._dynamo.reset()
    params, opt = build(case, impl)
    ref_params, ref = build(case, impl)
    step = torch.compile(opt.step, fullgraph=True)
    for t in range(3):
        grads_for(t, params)
        step()
        grads_for(t, ref_params)
        ref.step()
    assert_same(params, ref_params, rtol=1e-6, atol=1e-7)
    assert opt.num_steps == 3


@cases
@impls
def test_step_hooks_run_around_each_step(case, impl):
    params, opt = build(case, impl)
    calls = []
    pre = opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o.num_steps)))
    post = opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o.num_steps)))
    run(opt, params, 2)
    pre.remove()
    run(opt, params, 1, start=2)
    post.remove()
    run(opt, params, 1, start=3)
    assert calls == [("pre", 0), ("post", 1), ("pre", 1), ("post", 2), ("post", 3)]


# --------------------------------------------------------------------------- loading checks


def _refused(opt, sd, match):
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert_state_dicts_equal(opt.state_dict(), before)


@cases
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_load_refuses_bad_state_dicts_before_any_change(case, impl):
    params, opt = build(case, impl)
    run(opt, params, 1)
    good = opt.state_dict()

    wrong_shape = copy.deepcopy(good)
    key = "momentum_buffer" if case[1] is LARS else "exp_avg"
    wrong_shape["state"][0][key] = torch.zeros(2, 2)
    _refused(opt, wrong_shape, "shape")

    for lr in (float("nan"), -5.0):
        bad_lr = copy.deepcopy(good)
        bad_lr["param_groups"][1]["lr"] = lr
        _refused(opt, bad_lr, f"lr: {lr}")

    fewer = copy.deepcopy(good)
    fewer["param_groups"][0]["params"] = fewer["param_groups"][0]["params"][:1]
    with pytest.raises(ValueError):
        opt.load_state_dict(fewer)


def test_foreign_optimizer_state_is_refused():
    params = make_params()
    adam = torch.optim.Adam(params, lr=0.1)
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    grads_for(0, params)
    adam.step()
    sgd.step()
    _refused(LAMB(params, lr=0.1), adam.state_dict(), "LAMB")
    _refused(LARS(params, lr=0.1), sgd.state_dict(), "LARS")
    lars = LARS(params, lr=0.1)
    lars.step()
    _refused(LAMB(params, lr=0.1), lars.state_dict(), "LAMB")


@pytest.mark.parametrize("cls", [LARS, LAMB])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_masters_are_created_for_a_checkpoint_without_them(cls, dtype):
    """A state dict of an fp32 model loaded into a half model with master_weights=True:
    the constructor's choice holds and every half param gets an fp32 master."""
    params32 = make_params()
    first = cls(params32, lr=0.1)
    run(first, params32, 2)
    half = [torch.nn.Parameter(p.detach().to(dtype)) for p in params32]
    opt = cls(half, lr=0.1, master_weights=True)
    opt.load_state_dict(first.state_dict())
    assert opt.param_groups[0]["master_weights"] is True
    for p in half:
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and torch.equal(master, p.detach().float())
    tiny = [torch.full(p.shape, 1e-4, dtype=dtype) for p in half]
    for p, g in zip(half, tiny):
        p.grad = g
    opt.step()
    assert all(opt.state[p]["master_param"].dtype == torch.float32 for p in half)


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_load_keeps_the_constructors_paths_and_master_choice(cls):
    params = make_params()
    fused = cls(params, lr=0.1, fused=True, master_weights=True)
    run(fused, params, 1)
    cpu = cls(params, lr=0.1, foreach=False, compiled=False)
    cpu.load_state_dict(fused.state_dict())
    group = cpu.param_groups[0]
    flags = (group["fused"], group["foreach"], group["compiled"], group["master_weights"])
    assert flags == (False, False, False, False)
    assert all(cpu.state[p]["step"].device.type == "cpu" for p in params)


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_masters_of_a_checkpoint_are_dropped_when_not_wanted(cls):
    half = [torch.nn.Parameter(p.detach().bfloat16()) for p in make_params()]
    first = cls(half, lr=0.1, master_weights=True)
    run(first, half, 1)
    second = cls(half, lr=0.1)
    second.load_state_dict(first.state_dict())
    key = "momentum_buffer" if cls is LARS else "exp_avg"
    for p in half:
        assert "master_param" not in second.state[p]
        assert second.state[p][key].dtype == torch.bfloat16
    run(second, half, 1, start=1)


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "cls,kwargs,error,match",
    [
        (LAMB, dict(max_grad_norm=True), TypeError, "max_grad_norm: True"),
        (LARS, dict(master_weights="False"), TypeError, "master_weights"),
        (LAMB, dict(bias_correction="no"), TypeError, "bias_correction"),
        (LARS, dict(nesterov=1), TypeError, "nesterov"),
        (LARS, dict(trust_clip="True"), TypeError, "trust_clip"),
        (LARS, dict(trust_ratio=None), TypeError, "trust_ratio"),
        (LARS, dict(foreach="True"), TypeError, "foreach"),
        (LAMB, dict(fused=0), TypeError, "fused"),
        (LAMB, dict(compiled="yes"), TypeError, "compiled"),
        (LARS, dict(maximize="yes"), TypeError, "maximize: 'yes'"),
        (LAMB, dict(differentiable=1), TypeError, "differentiable: 1"),
        (LAMB, dict(capturable=None), TypeError, "capturable: None"),
        (
            LARS,
            dict(lr=torch.tensor([0.1, 0.2])),
            ValueError,
            r"Invalid lr: Tensor lr must be 1-element, got shape \(2,\)",
        ),  # torch's phrase too
        (LARS, dict(lr=True), TypeError, "lr: True"),
        (LARS, dict(lr=None), TypeError, "lr: None"),
        (LAMB, dict(betas=(0.9, True)), TypeError, r"betas\[1\]: True"),
        (LARS, dict(momentum=math.nan), ValueError, "momentum"),
    ],
)
def test_bad_arguments_name_the_value(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(make_params(), **{"lr": 0.1, **kwargs})


@pytest.mark.parametrize("wd", [math.inf, math.nan, None, True, -1.0])
def test_param_groups_refuses_bad_weight_decay(wd):
    with pytest.raises((ValueError, TypeError), match="weight_decay"):
        param_groups(torch.nn.Linear(2, 2), wd)


# --------------------------------------------------------------------------- numerics


@cases
@impls
@pytest.mark.parametrize("size", [1e19, 1e22])
# Under TRITON_INTERPRET=1 the fused kernels' arithmetic is NumPy's, which warns where a
# GPU overflows to inf silently; the kernels then sum the tile again, scaled (checked here).
@pytest.mark.filterwarnings("ignore:overflow encountered in (multiply|reduce):RuntimeWarning")
def test_huge_weights_do_not_overflow_the_norms(case, impl, size):
    """||w|| of 1e19-sized weights overflows an fp32 sum of squares (at 1e22, so does
    LAMB's ||u|| through weight decay); the step must stay finite and equal the float64
    spec."""
    _huge_weights_step(case, impl, size, lambda opt: opt.step())


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["lars", "lamb"])
@pytest.mark.parametrize("impl", ["single_tensor", "foreach"])
def test_huge_weights_under_torch_compile_take_the_wide_norms(case, impl):
    """Under ``torch.compile(opt.step, fullgraph=True)`` the overflowed norms are replaced
    on the device, not after a host read: the same step as the float64 spec."""
    torch._dynamo.reset()
    _huge_weights_step(case, impl, 1e22, lambda opt: torch.compile(opt.step, fullgraph=True)())


def _huge_weights_step(case, impl, size, step) -> None:
    _, cls, kwargs = case
    w = torch.nn.Parameter(torch.full((8,), size) * torch.linspace(1, 2, 8))
    opt = cls([w], **{**kwargs, "max_grad_norm": None} if cls is LAMB else kwargs, **IMPLS[impl])
    w0 = w.detach().double().numpy().copy()
    g = torch.linspace(-1, 1, 8) * 1e18
    w.grad = g.clone()
    step(opt)
    assert torch.isfinite(w).all()
    hyper = group_hyper(cls.spec, {k: v for k, v in kwargs.items() if k in cls.spec.group_keys})
    expected = run_spec(
        "lars" if cls is LARS else "lamb", [w0], [[g.double().numpy()]], [hyper], [hyper["lr"]]
    )
    np.testing.assert_allclose(w.detach().double().numpy(), expected.params[0], rtol=1e-5)


@cases
@impls
# The NaN and inf fed here reach LAMB's division: NumPy (the Triton interpreter) warns of it.
@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_non_finite_grads_without_a_scaler_are_applied_as_torch_optim_does(case, impl):
    """Without a GradScaler every path applies the step: an inf/NaN gradient reaches the
    params and the state, as in torch.optim; skipping is GradScaler's job."""
    params, opt = build(case, impl)
    ref_params, ref = build(case, "single_tensor")
    for o, ps in ((opt, params), (ref, ref_params)):
        run(o, ps, 1)
        grads_for(1, ps)
        ps[0].grad[1, 2] = float("nan")
        ps[3].grad[0] = float("inf")
        o.step()
    assert not torch.isfinite(params[0]).all() and not torch.isfinite(params[3]).all()
    assert_same(params, ref_params, rtol=2e-5, atol=2e-6)
    assert opt.num_steps == 2


# --------------------------------------------------------------------------- torch.optim's keywords

# One group of every param (each path's graphs once per flag set): LARS with optax's
# denominator ||g + wd * w||, where the sign of g changes the ratio; LAMB in L2 mode (the
# decay enters the moments beside g) with global clipping.
ASCENT_CASES = [
    ("lars_decayed", LARS, dict(lr=0.5, weight_decay=1e-2, nesterov=True, decayed_norm=True)),
    ("lamb_l2_clip", LAMB, dict(lr=0.05, weight_decay=1e-2, adam_w_mode=False, max_grad_norm=0.5)),
]


def _ascent(case, impl, maximize: bool, sign: float):
    """Three steps of ``case`` on ``impl`` with ``maximize`` and the grads times ``sign``."""
    _, cls, kwargs = case
    params = make_params()
    opt = cls(params, **kwargs, **IMPLS[impl], maximize=maximize)
    for t in range(3):
        grads_for(t, params)
        for p in params:
            p.grad.mul_(sign)
        opt.step()
    return params, opt


# The compiled path runs the single-tensor body, compiled (two compiles a case): one case.
ASCENT_RUNS = [(c, i) for c in ASCENT_CASES for i in IMPLS if i != "compiled" or c[1] is LARS]


@pytest.mark.parametrize("case,impl", ASCENT_RUNS, ids=[f"{i}-{c[0]}" for c, i in ASCENT_RUNS])
def test_maximize_equals_minimizing_the_negated_grads_bit_for_bit(case, impl):
    """torch's ``maximize``: each path takes ``-grad`` where it took ``grad`` (the fused
    kernels through a sign in their table), so ascending on f is descending on -f, to
    the bit, params and state; ``trust_ratios()`` reports the ratios of that step."""
    params, opt = _ascent(case, impl, True, 1.0)
    ref_params, ref = _ascent(case, impl, False, -1.0)
    assert_same(params, ref_params, rtol=0, atol=0)
    assert_state_dicts_equal(
        {**opt.state_dict(), "param_groups": []}, {**ref.state_dict(), "param_groups": []}
    )
    assert opt.param_groups[0]["maximize"] is True
    assert opt.trust_ratios() == ref.trust_ratios()  # the ratios the next step would apply


@pytest.mark.parametrize("cls", [LARS, LAMB])
@pytest.mark.parametrize("impl", ["single_tensor", "foreach", "fused"])
@pytest.mark.parametrize("maximize", [False, True])
def test_the_loss_goes_the_way_maximize_says(cls, impl, maximize):
    """torch's test_forloop_goes_right_direction: a least-squares loss falls, or with
    ``maximize`` rises, over a few steps."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(10, 5, generator=gen))
    bias = torch.nn.Parameter(torch.randn(10, generator=gen))
    x = torch.randn(5, generator=gen)
    opt = cls([weight, bias], lr=0.5 if cls is LARS else 0.05, **IMPLS[impl], maximize=maximize)

    def closure():
        opt.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        return loss

    start = closure().item()
    for _ in range(5):
        opt.step(closure)
    end = closure().item()
    assert end > start if maximize else end < start


@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_maximize_changed_between_steps_is_seen(impl):
    """A group's maximize written between steps takes effect at the next step, also on
    the fused path, whose memory replays its last plan when the grads are written in
    place (as ``zero_grad(set_to_none=False)`` leaves them)."""
    runs = []
    for flip in (True, False):
        params = make_params()
        opt = LARS(params, **ASCENT_CASES[0][2], **IMPLS[impl])
        held = [torch.zeros_like(p) for p in params]
        for t in range(3):
            grads_for(t, params)
            for p, g in zip(params, held):
                p.grad = g.copy_(p.grad if flip or t < 2 else -p.grad)
            if flip and t == 2:
                opt.param_groups[0]["maximize"] = True
            opt.step()
        runs.append(params)
    assert_same(*runs, rtol=0, atol=0)


def test_the_functionals_take_maximize():
    from largebatch.lars.torch import lamb, lars

    gen = torch.Generator().manual_seed(4)
    w, g = torch.randn(6, generator=gen), torch.randn(6, generator=gen)
    for fn, cls in ((lars, LARS), (lamb, LAMB)):
        out = []
        for sign, maximize in ((1.0, True), (-1.0, False)):
            x = w.clone()
            state = [[torch.zeros(6)] for _ in cls.spec.state]
            hyper = group_hyper(cls.spec, {"lr": 0.1, "weight_decay": 0.1})
            fn([x], [g * sign], *state, [None], [torch.zeros(())], **hyper, maximize=maximize)
            out.append(x)
        assert torch.equal(*out) and not torch.equal(out[0], w)


def _diff_fn(p, grad, opt_differentiable_state, opt_class, kwargs, *ignored):
    """torch's test/optim/test_optim.py helper: one step from the given state, on a copy
    of ``p``; returns the new param and every state tensor that requires grad (``ignored``:
    the state's tensors again, so that gradcheck sees them as inputs)."""
    p = p.clone()
    p.grad = grad
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt_differentiable_state.items()}
    opt = opt_class([p], **kwargs)
    opt.state[p].update(state)
    opt.step()
    return (p,) + tuple(v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.requires_grad)


def _rand(*shape, requires_grad=True):
    return torch.rand(*shape, requires_grad=requires_grad, dtype=torch.float64)


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (LARS, dict(lr=0.9, weight_decay=0.1, trust_coefficient=0.5)),
        (LARS, dict(lr=0.9, weight_decay=0.1, nesterov=True, trust_clip=True, maximize=True)),
        (LARS, dict(lr=0.9, weight_decay=0.1, decayed_norm=True, lr_in_momentum=False)),
        (LAMB, dict(lr=0.9, weight_decay=0.1)),
        (LAMB, dict(lr=0.9, weight_decay=0.1, adam_w_mode=False, maximize=True, max_grad_norm=0.5)),
    ],
    ids=["lars", "lars-nesterov-clip-maximize", "lars-decayed-lr-outside", "lamb", "lamb-l2-maximize-clip"],
)
def test_differentiable_step_passes_gradcheck(cls, kwargs):
    """torch's TestDifferentiableOptimizer: with ``differentiable=True`` autograd runs
    through a step, from the param, its grad and the state to the new param and state,
    checked against finite differences in float64."""
    torch.manual_seed(5)
    state = {"step": torch.tensor(10.0, dtype=torch.float64)}
    for key in cls.spec.state:
        state[key] = _rand(10)
    assert torch.autograd.gradcheck(
        _diff_fn, (_rand(10), _rand(10), state, cls, {**kwargs, "differentiable": True}, *state.values())
    )


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_differentiable_lr_gets_its_meta_gradient(cls):
    """torch's test_adam_differentiable_lr: two steps with the grads' graph kept, then the
    loss's gradient with respect to a tensor lr, against finite differences."""

    def meta_loss(params, lr):
        params = params.clone()
        opt = cls([params], lr=lr, weight_decay=0.1, differentiable=True)
        x, y = torch.tensor([1.0], dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64)
        for _ in range(2):
            loss = torch.nn.functional.mse_loss(x * params.sum(), y)
            (params.grad,) = torch.autograd.grad(loss, params, create_graph=True)
            opt.step()
        return loss

    lr = torch.tensor(0.01, requires_grad=True, dtype=torch.float64)
    assert torch.autograd.gradcheck(meta_loss, (_rand(10), lr))


def test_without_differentiable_the_step_builds_no_graph():
    p = torch.nn.Parameter(torch.randn(4))
    opt = LARS([p], lr=0.1)
    p.grad = torch.randn(4, requires_grad=True)
    with torch.enable_grad():
        opt.step()
    assert p.grad_fn is None and all(t.grad_fn is None for t in opt.state[p].values())
    with pytest.raises(ValueError, match="can't optimize a non-leaf Tensor"):
        LARS([p.clone()], lr=0.1)


@pytest.mark.parametrize("cls", [LARS, LAMB])
@pytest.mark.parametrize("path", ["fused", "foreach", "compiled"])
def test_differentiable_refuses_the_other_paths_by_name(cls, path):
    params = make_params()
    with pytest.raises(
        ValueError, match=f"differentiable=True does not apply to the {path} path \\({path}=True\\)"
    ):
        cls(params, lr=0.1, differentiable=True, **{path: True})
    opt = cls(params[:2], lr=0.1)
    before = copy.deepcopy(opt.param_groups)
    with pytest.raises(ValueError, match=f"the {path} path"):
        opt.add_param_group({"params": params[2:], "differentiable": True, path: True})
    assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in before]
    opt = cls(params, lr=0.1, differentiable=True)
    assert [(g["foreach"], g["fused"], g["compiled"]) for g in opt.param_groups] == [(False, False, False)]


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_capturable_fused_steps_read_nothing_on_the_host(cls):
    """``capturable=True`` on the fused path: the same bits as without it, step counts on
    the params' device, and no step after the first reads a device value on the host."""
    from devices import HostSyncs

    extra = {} if cls is LARS else {"max_grad_norm": 1.0}
    runs = []
    for capturable in (True, False):
        params = make_params()
        opt = cls(groups_of(params), lr=0.1, weight_decay=1e-2, fused=True, capturable=capturable, **extra)
        opt.found_inf = torch.zeros(1)  # what torch.amp.GradScaler.step sets
        syncs = []
        for t in range(3):
            grads_for(t, params)
            with HostSyncs() as record:
                opt.step()
            syncs.append(record.record)
        assert syncs[1:] == [[], []], syncs
        assert all(opt.state[p]["step"].device == p.device for p in params)
        runs.append(params)
    assert opt.param_groups[0]["capturable"] is False
    assert_same(*runs, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [LARS, LAMB])
@pytest.mark.parametrize("impl", ["single_tensor", "foreach", "compiled"])
def test_capturable_refuses_the_other_paths_by_name(cls, impl):
    with pytest.raises(ValueError, match=f"capturable=True applies only to the fused path.* the {impl} path"):
        cls(make_params(), lr=0.1, capturable=True, **IMPLS[impl])
    if impl == "foreach":  # CPU params by default: the foreach path
        with pytest.raises(ValueError, match="the foreach path"):
            cls(make_params(), lr=0.1, capturable=True)


@pytest.mark.parametrize("cls", [LARS, LAMB])
@pytest.mark.parametrize("impl", ["single_tensor", "foreach"])
def test_capturing_a_step_off_the_fused_path_says_why_before_any_change(cls, impl, monkeypatch):
    """torch's optimizers refuse a CUDA graph capture of a step that is not capturable with
    a RuntimeError; so do ours, naming the path, before anything is written (the capture
    is simulated: the CPU has no CUDA stream)."""
    params = make_params()
    opt = cls(params, lr=0.1, **IMPLS[impl])
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=f"CUDA graph capture of step.* {cls.__name__} on the {impl} path"):
        opt.step()
    assert not opt.state and all(torch.equal(p, b) for p, b in zip(params, before))


@cases
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_the_keywords_round_trip_and_older_state_dicts_load(case, impl):
    """The keywords are param-group keys: saved and loaded with the rest (maximize is
    the checkpoint's; differentiable and capturable, like the paths, the constructor's).
    A state dict saved before they existed (torch's test_can_load_older_state_dict
    deletes them and the paths) loads with maximize off; a pickled optimizer of that
    time too."""
    params, opt = build(case, impl, maximize=True)
    run(opt, params, 2)
    sd = opt.state_dict()
    assert [(g["maximize"], g["differentiable"], g["capturable"]) for g in sd["param_groups"]] == [
        (True, False, False)
    ] * 2
    _, opt2 = twin(case, impl, params)
    opt2.load_state_dict(sd)
    assert_state_dicts_equal(opt2.state_dict(), sd)

    old = copy.deepcopy(sd)
    for group in old["param_groups"]:
        for key in (
            "maximize",
            "differentiable",
            "capturable",
            "foreach",
            "fused",
            "compiled",
            "master_weights",
        ):
            del group[key]
    params3, opt3 = twin(case, impl, params)
    opt3.load_state_dict(old)
    assert [g["maximize"] for g in opt3.param_groups] == [False, False]
    assert [g["fused"] for g in opt3.param_groups] == [impl == "fused"] * 2
    run(opt3, params3, 1, start=2)

    pickled = opt.__getstate__()
    for key in ("maximize", "differentiable", "capturable"):
        del pickled["defaults"][key]
        for group in pickled["param_groups"]:
            del group[key]
    opt4 = type(opt).__new__(type(opt))
    opt4.__setstate__(copy.deepcopy(pickled))
    assert [g["maximize"] for g in opt4.param_groups] == [False, False]
    assert opt4.defaults["differentiable"] is False
