"""LARS and LAMB (torch): behaviour, errors, state dicts and peers (the match with the
float64 spec on every path is tests/test_reference_paths.py)."""

from __future__ import annotations

import copy
import io
import re

import numpy as np
import pytest
import torch
from cases import TOLERANCE, TORCH_PATHS, torch_paths

from largebatch.torch import LAMB, LARS, ScheduleLR, make_schedule, param_groups

# The fused Triton path runs on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py);
# its kernels take fp32/fp16/bf16 params.
PATHS = torch_paths("single_tensor", "foreach", "fused")


# --------------------------------------------------------------------------- behaviour


@pytest.mark.parametrize("cls", [LARS, LAMB])
@pytest.mark.parametrize("path", PATHS)
def test_params_without_grad_are_skipped(cls, path):
    a, b = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(4))
    a_before, before = a.detach().clone(), b.detach().clone()
    opt = cls([a, b], lr=0.1, **PATHS[path])
    a.grad = torch.randn(3, 3)
    opt.step()
    assert torch.equal(b, before) and b not in opt.state
    assert a in opt.state and not torch.equal(a, a_before)


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_the_path_is_resolved_once_per_group_not_at_each_step(cls, monkeypatch):
    """As torch's optimizers fix ``foreach``/``fused`` per group: a group's ``None`` is
    resolved when the group is added, and a step only reads the result."""
    from largebatch.lars.torch import _paths

    a, b = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(3))
    opt = cls([{"params": [a]}, {"params": [b], "compiled": None, "foreach": False}], lr=0.1)
    for group in opt.param_groups:
        assert {type(group[k]) for k in ("fused", "compiled")} == {bool}, group
    expected = cls([{"params": [p.detach().clone().requires_grad_()]} for p in (a, b)], lr=0.1, foreach=False)

    def refuse(*args, **kwargs):
        raise AssertionError("the path was resolved again during a step")

    monkeypatch.setattr(_paths, "resolve", refuse)
    for opt_, (x, y) in ((opt, (a, b)), (expected, [p for g in expected.param_groups for p in g["params"]])):
        x.grad, y.grad = torch.ones(3, 3), torch.ones(3)
        opt_.step()
    assert torch.equal(a, expected.param_groups[0]["params"][0])
    assert torch.equal(b, expected.param_groups[1]["params"][0])


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_closure_is_called_and_its_loss_returned(cls):
    w = torch.nn.Parameter(torch.ones(3))
    opt = cls([w], lr=0.1)
    calls = []

    def closure():
        opt.zero_grad()
        loss = (w * torch.arange(3.0)).sum()
        loss.backward()
        calls.append(1)
        return loss

    loss = opt.step(closure)
    assert calls == [1] and loss.item() == pytest.approx(3.0)
    assert w[0].item() == 1.0 and w[2].item() < 1.0


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_bfloat16_params_update_in_bfloat16(cls):
    w = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
    before = w.detach().clone()
    opt = cls([w], lr=0.5)
    w.grad = torch.randn(64, dtype=torch.bfloat16)
    opt.step()
    assert w.dtype == torch.bfloat16 and not torch.equal(w, before)
    key = "momentum_buffer" if cls is LARS else "exp_avg"
    assert opt.state[w][key].dtype == torch.bfloat16


@pytest.mark.parametrize("cls", [LARS, LAMB])
@pytest.mark.parametrize("path", PATHS)
def test_empty_group_is_fine(cls, path):
    model = torch.nn.Linear(4, 3, bias=False)  # no bias: the excluded group is empty
    groups = param_groups(model, weight_decay=1e-4)
    assert groups[1]["params"] == []
    opt = cls(groups, lr=0.1, **PATHS[path])
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert opt.num_steps == 1


@pytest.mark.parametrize("cls", [LARS, LAMB])
@pytest.mark.parametrize("path", PATHS)
# The fused LARS kernel forms ratio / lr and keeps it only under trust_clip (tl.where); at
# the warmup's first lr, 0, the Triton interpreter's NumPy warns of the discarded quotient.
@pytest.mark.filterwarnings("ignore:divide by zero encountered in divide:RuntimeWarning")
def test_resume_gives_the_identical_trajectory(cls, path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    data = [torch.randn(16, 6) for _ in range(6)]

    def train(model, opt, sched, batches):
        for x in batches:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            sched.step()

    def build(model):
        opt = cls(param_groups(model, 1e-4), lr=1.0, **PATHS[path])
        sched = ScheduleLR(opt, make_schedule("poly", peak_lr=1.0, total_steps=6, warmup_steps=2))
        return opt, sched

    straight = copy.deepcopy(model)
    opt, sched = build(straight)
    train(straight, opt, sched, data)

    opt, sched = build(model)
    train(model, opt, sched, data[:3])
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer)
    resumed = copy.deepcopy(model)
    resumed.load_state_dict(ckpt["model"])
    opt, sched = build(resumed)
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])
    train(resumed, opt, sched, data[3:])
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cls", [LARS, LAMB])
@pytest.mark.parametrize(
    "src,dst", [("single_tensor", "foreach"), ("foreach", "fused"), ("fused", "single_tensor")]
)
def test_state_dicts_are_interchangeable_between_paths(cls, src, dst):
    torch.manual_seed(0)
    w = [torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(3, 3))]
    first = cls(w, lr=0.1, weight_decay=0.01, **PATHS[src])
    for _ in range(2):
        for p in w:
            p.grad = torch.randn_like(p)
        first.step()
    w2 = [torch.nn.Parameter(p.detach().clone()) for p in w]
    second = cls(w2, lr=0.1, weight_decay=0.01, **PATHS[dst])
    second.load_state_dict(first.state_dict())
    for p, q in zip(w, w2):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    first.step()
    second.step()
    for p, q in zip(w, w2):
        torch.testing.assert_close(p, q)
    assert second.num_steps == first.num_steps == 3


def test_grads_are_never_written():
    w = torch.nn.Parameter(torch.randn(5, 5))
    g = torch.randn(5, 5)
    for cls in (LARS, LAMB):
        for path in PATHS.values():
            w.grad = g.clone()
            cls([w], lr=0.1, weight_decay=0.1, **path).step()
            assert torch.equal(w.grad, g)


def test_param_groups_split():
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(), torch.nn.Linear(4, 2)
    )
    adapted, excluded = param_groups(model, weight_decay=5e-5)
    assert adapted["weight_decay"] == 5e-5 and "trust_ratio" not in adapted
    assert excluded["weight_decay"] == 0.0 and excluded["trust_ratio"] is False
    assert [p.ndim for p in adapted["params"]] == [4, 2]
    assert len(excluded["params"]) == 4  # conv bias, bn weight and bias, linear bias
    only_linear = param_groups(model, 0.0, exclude=lambda name, p: not name.startswith("3."))
    assert len(only_linear[0]["params"]) == 2


def test_changing_lr_stays_inside_momentum():
    """lr inside the buffer: halving lr does not rescale what the buffer already holds."""
    w = torch.nn.Parameter(torch.ones(1))
    opt = LARS([w], lr=1.0, momentum=0.5, trust_ratio=False)
    w.grad = torch.ones(1)
    opt.step()  # v = 1
    opt.param_groups[0]["lr"] = 0.5
    opt.step()  # v = 0.5 * 1 + 0.5 * 1 = 1.0 (lr outside momentum would give 0.5 * 1.5 = 0.75)
    assert opt.state[w]["momentum_buffer"].item() == pytest.approx(1.0)
    assert w.item() == pytest.approx(1.0 - 1.0 - 1.0)


# --------------------------------------------------------------------------- errors

ERROR_CASES = [
    (LARS, dict(lr=-0.1), "lr: -0.1"),
    (LARS, dict(momentum=1.0), "momentum: 1.0"),
    (LARS, dict(momentum=-0.1), "momentum: -0.1"),
    (LARS, dict(trust_coefficient=0.0), "trust_coefficient: 0.0"),
    (LARS, dict(eps=-1e-8), "eps: -1e-08"),
    (LARS, dict(weight_decay=-1e-4), "weight_decay: -0.0001"),
    (LARS, dict(nesterov=True, momentum=0.0), "nesterov=True with momentum=0.0"),
    (LARS, dict(foreach=True, fused=True), "cannot both"),
    (LAMB, dict(lr=-1.0), "lr: -1.0"),
    (LAMB, dict(betas=(1.0, 0.999)), "betas[0]: 1.0"),
    (LAMB, dict(betas=(0.9, -0.1)), "betas[1]: -0.1"),
    (LAMB, dict(eps=-1.0), "eps: -1.0"),
    (LAMB, dict(weight_decay=-0.01), "weight_decay: -0.01"),
    (LAMB, dict(max_grad_norm=0.0), "max_grad_norm: 0.0"),
    (LAMB, dict(max_grad_norm=-1.0), "max_grad_norm: -1.0"),
]


@pytest.mark.parametrize(
    "cls,kwargs,message", ERROR_CASES, ids=[f"{c.__name__}-{k}" for c, k, _ in ERROR_CASES]
)
def test_bad_arguments_raise_naming_the_value(cls, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        cls([torch.nn.Parameter(torch.randn(2))], **kwargs)


# A bad default with groups that all override it: (class, key, the groups' value, the bad
# default, the error, its message).
DEFAULT_CASES = [
    (LARS, "weight_decay", 1e-4, -1, ValueError, "Invalid weight_decay: -1 (must be >= 0)"),
    (LARS, "lr", 0.1, -0.1, ValueError, "Invalid lr: -0.1 (must be >= 0)"),
    (LARS, "lr", 0.1, torch.ones(2), ValueError, "Invalid lr: Tensor lr must be 1-element"),
    (LARS, "momentum", 0.9, 1.0, ValueError, "Invalid momentum: 1.0 (must be in [0, 1))"),
    (LARS, "trust_coefficient", 1e-3, 0.0, ValueError, "Invalid trust_coefficient: 0.0 (must be > 0)"),
    (LARS, "nesterov", False, "yes", TypeError, "Invalid nesterov: 'yes' (must be True or False)"),
    (LARS, "master_weights", False, 1, TypeError, "Invalid master_weights: 1 (must be True or False)"),
    (LAMB, "weight_decay", 0.01, -0.01, ValueError, "Invalid weight_decay: -0.01 (must be >= 0)"),
    (LAMB, "betas", (0.9, 0.999), (1.0, 0.999), ValueError, "Invalid betas[0]: 1.0 (must be in [0, 1))"),
    (LAMB, "eps", 1e-6, float("nan"), ValueError, "Invalid eps: nan (must be >= 0)"),
    (LAMB, "bias_correction", True, 1, TypeError, "Invalid bias_correction: 1 (must be True or False)"),
    (LAMB, "master_weights", True, "no", TypeError, "Invalid master_weights: 'no' (must be True or False)"),
    (
        LAMB,
        "freeze_step",
        5,
        0,
        ValueError,
        "Invalid freeze_step: 0 (must be >= 1 and < 2147483647, a whole number, or None)",
    ),
    (LAMB, "freeze_step", None, 2.5, ValueError, "Invalid freeze_step: 2.5"),
]


@pytest.mark.parametrize(
    "cls,key,good,bad,error,message",
    DEFAULT_CASES,
    ids=[f"{c.__name__}-{k}-{b!r}" for c, k, _, b, *_ in DEFAULT_CASES],
)
def test_every_default_is_checked_even_where_every_group_overrides_it(cls, key, good, bad, error, message):
    """As torch's optimizers check their defaults: the constructor refuses a bad keyword
    whatever the groups hold, before any group is added."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    groups = [{**group, key: good} for group in param_groups(model, 1e-4)]
    cls(groups)  # the groups are valid
    with pytest.raises(error, match=re.escape(message)):
        cls(groups, **{key: bad})


def test_the_defaults_are_checked_before_the_groups():
    """The first error named is the constructor's, as in torch: here the default's, not
    the first group's."""
    groups = [
        {"params": [torch.nn.Parameter(torch.randn(2))], "momentum": 2.0},
        {"params": [torch.nn.Parameter(torch.randn(2))]},
    ]
    with pytest.raises(ValueError, match=re.escape("Invalid weight_decay: -1.0 (must be >= 0)")):
        LARS(groups, weight_decay=-1.0)


DECAYED_AND_SKIP = (
    "Invalid decayed_norm=True with zero_norm_skip=True: apex LARC's zero-norm rule "
    "(zero_norm_skip) and optax's denominator"
)


def test_decayed_norm_with_zero_norm_skip_is_refused():
    """optax's denominator (decayed_norm) with apex LARC's zero-norm rule is no one source's
    update: the constructor and a new group refuse it, naming both."""
    w = torch.nn.Parameter(torch.randn(2))
    with pytest.raises(ValueError, match=re.escape(DECAYED_AND_SKIP)):
        LARS([w], decayed_norm=True, zero_norm_skip=True)
    opt = LARS([w], lr=0.1, decayed_norm=True)
    with pytest.raises(ValueError, match=re.escape(DECAYED_AND_SKIP)):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "zero_norm_skip": True})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_bad_group_value_raises_before_the_group_is_added(cls):
    opt = cls([torch.nn.Parameter(torch.randn(2))], lr=0.1)
    with pytest.raises(ValueError, match="weight_decay: -1"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "weight_decay": -1})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_sparse_and_complex_grads_raise_before_any_change(cls):
    w = torch.nn.Parameter(torch.randn(4))
    v = torch.nn.Parameter(torch.randn(4))
    before = (w.detach().clone(), v.detach().clone())
    opt = cls([v, w], lr=0.1)
    v.grad = torch.randn(4)
    w.grad = torch.randn(4).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    assert torch.equal(v, before[1]) and not opt.state
    w.grad = None
    with pytest.raises(ValueError, match="complex"):
        cls([torch.nn.Parameter(torch.randn(2, dtype=torch.complex64))], lr=0.1)
    assert torch.equal(w, before[0])


def test_integer_params_are_rejected():
    with pytest.raises(ValueError, match="torch.int64"):
        LARS([torch.zeros(3, dtype=torch.int64)], lr=0.1)


def test_fused_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        LARS([torch.nn.Parameter(torch.randn(2))], lr=0.1, fused=True)


# --------------------------------------------------------------------------- peers


def _twin_params(seed=0):
    torch.manual_seed(seed)
    shapes = [(16, 8), (8,), (32, 16), (16,), (10, 32)]
    base = [torch.randn(s, dtype=torch.float64) for s in shapes]
    base[2].zero_()  # a zero-norm layer
    return [[torch.nn.Parameter(b.clone()) for b in base] for _ in range(2)]


def _step_both(ours, theirs, p_ours, p_theirs, steps=5):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for a, b in zip(p_ours, p_theirs):
            g = torch.randn(a.shape, generator=gen, dtype=torch.float64)
            a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    for a, b in zip(p_ours, p_theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("nesterov,trust_clip", [(False, False), (True, False), (False, True)])
def test_lars_equals_timm_at_constant_lr(nesterov, trust_clip):
    """timm's Lars keeps lr outside momentum, so the two agree only at constant lr; timm
    adapts a group only when its weight decay is nonzero (our trust_ratio flag), and its
    eps defaults to 1e-8 (ours: 0), so eps is passed to both."""
    from timm.optim import Lars

    p_ours, p_timm = _twin_params()
    kw = dict(momentum=0.9, nesterov=nesterov, trust_clip=trust_clip, eps=1e-8)
    ours = LARS(
        [
            {"params": p_ours[::2], "weight_decay": 1e-3},
            {"params": p_ours[1::2], "weight_decay": 0.0, "trust_ratio": False},
        ],
        lr=0.5,
        trust_coefficient=0.01,
        **kw,
    )
    theirs = Lars(
        [{"params": p_timm[::2], "weight_decay": 1e-3}, {"params": p_timm[1::2], "weight_decay": 0.0}],
        lr=0.5,
        trust_coeff=0.01,
        **kw,
    )
    _step_both(ours, theirs, p_ours, p_timm)


@pytest.mark.parametrize("max_grad_norm", [None, 1.0])
def test_lamb_equals_timm(max_grad_norm):
    """timm's Lamb clips at max_grad_norm=1.0 by default (pass it explicitly) and adapts a
    group only when its weight decay is nonzero; sqrt(v)/sqrt(bc2) vs sqrt(v/bc2) differ
    only in rounding."""
    from timm.optim import Lamb

    p_ours, p_timm = _twin_params()
    ours = LAMB(
        [
            {"params": p_ours[::2], "weight_decay": 0.01},
            {"params": p_ours[1::2], "weight_decay": 0.0, "trust_ratio": False},
        ],
        lr=0.01,
        max_grad_norm=max_grad_norm,
    )
    theirs = Lamb(
        [{"params": p_timm[::2], "weight_decay": 0.01}, {"params": p_timm[1::2], "weight_decay": 0.0}],
        lr=0.01,
        max_grad_norm=max_grad_norm,
    )
    _step_both(ours, theirs, p_ours, p_timm)


@pytest.mark.parametrize("path", TORCH_PATHS)
def test_each_param_freezes_its_variance_at_its_own_step(path):
    """``freeze_step`` counts each param's own steps: a param that gets its first grad at
    step 3 keeps updating its v (and bias correction) for two of its steps after the
    other param's v froze. Checked against the float64 spec, one tensor at a time."""
    from largebatch.lars import reference

    gen = torch.Generator().manual_seed(7)
    start = [torch.randn(6, 5, generator=gen), torch.randn(40, generator=gen)]
    params = [torch.nn.Parameter(x.clone()) for x in start]
    opt = LAMB(params, lr=0.05, weight_decay=1e-2, freeze_step=2, **TORCH_PATHS[path])
    expected = [x.double().numpy() for x in start]
    moments = [[np.zeros(x.shape), np.zeros(x.shape)] for x in start]
    counts = [0, 0]
    for k in range(5):
        for i, p in enumerate(params):
            if i == 1 and k < 2:  # the second param starts late
                p.grad = None
                continue
            p.grad = torch.randn(p.shape, generator=gen)
            counts[i] += 1
            (w,), (m,), (v,) = reference.lamb_step(
                [expected[i]],
                [p.grad.double().numpy()],
                [moments[i][0]],
                [moments[i][1]],
                step=counts[i],
                lr=0.05,
                weight_decay=1e-2,
                freeze_step=2,
            )
            expected[i], moments[i] = w, [m, v]
        opt.step()
    for i, p in enumerate(params):
        rtol = TOLERANCE["float32"]
        np.testing.assert_allclose(p.detach().double().numpy(), expected[i], rtol=rtol, atol=1e-6)
        np.testing.assert_allclose(
            opt.state[p]["exp_avg_sq"].double().numpy(), moments[i][1], rtol=rtol, atol=1e-12
        )
    assert [int(opt.state[p]["step"]) for p in params] == [5, 3]
