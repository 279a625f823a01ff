"""The schedule factory (docs/design.md §4) and its torch adapter ScheduleLR."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from largebatch.schedules import SCHEDULES, linear_scaling, make_schedule, sqrt_scaling
from largebatch.torch import LARS, ScheduleLR

RULES = [linear_scaling, sqrt_scaling]


def formula(name, t, *, peak, total, warmup, init=0.0, end=0.0, power=2.0, milestones=(), gamma=0.1):
    """docs/design.md §4 written out independently, branch by branch."""
    if t < warmup:
        return init + (peak - init) * t / warmup
    if t >= total:
        return peak * gamma ** len(milestones) if name == "step" else end
    s = (t - warmup) / (total - warmup)
    if name == "constant":
        return peak
    if name == "poly":
        return end + (peak - end) * (1 - s) ** power
    if name == "cosine":
        return end + (peak - end) * (1 + math.cos(math.pi * s)) / 2
    return peak * gamma ** sum(m <= t for m in milestones)


CASES = [
    ("constant", dict(peak=1.0, total=50, warmup=10, init=0.1)),
    ("poly", dict(peak=3.2, total=100, warmup=5, end=1e-4, power=2.0)),
    ("poly", dict(peak=2.0, total=40, warmup=0, power=1.0)),
    ("cosine", dict(peak=0.4, total=60, warmup=6, end=0.01)),
    ("step", dict(peak=3.2, total=90, warmup=5, milestones=(30, 60, 80), gamma=0.1)),
    ("cosine", dict(peak=1.0, total=10, warmup=10, init=0.5)),  # warmup fills the run
]


@pytest.mark.parametrize("name,kw", CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
def test_schedule_matches_formula_at_every_step(name, kw):
    sched = make_schedule(
        name,
        peak_lr=kw["peak"],
        total_steps=kw["total"],
        warmup_steps=kw["warmup"],
        init_lr=kw.get("init", 0.0),
        end_lr=kw.get("end", 0.0),
        power=kw.get("power", 2.0),
        milestones=kw.get("milestones", ()),
        gamma=kw.get("gamma", 0.1),
    )
    for t in range(kw["total"] + 5):
        assert sched(t) == pytest.approx(formula(name, t, **kw), rel=1e-12, abs=1e-15), t


def test_goyal_warmup_and_step_example():
    # Goyal et al. 2017 at 8K: lr = 0.1 * 8192 / 256 = 3.2, 5-epoch warmup from 0.1.
    peak = linear_scaling(0.1, 8192)
    assert peak == pytest.approx(3.2)
    epoch = 156
    sched = make_schedule(
        "step",
        peak_lr=peak,
        total_steps=90 * epoch,
        warmup_steps=5 * epoch,
        init_lr=0.1,
        milestones=(30 * epoch, 60 * epoch, 80 * epoch),
    )
    assert sched(0) == pytest.approx(0.1)
    assert sched(5 * epoch) == pytest.approx(3.2)
    assert sched(30 * epoch) == pytest.approx(0.32)
    assert sched(90 * epoch + 7) == pytest.approx(0.0032)


@given(
    name=st.sampled_from(SCHEDULES),
    total=st.integers(1, 500),
    frac=st.floats(0, 1),
    peak=st.floats(0, 10),
    t=st.integers(0, 600),
)
def test_schedule_is_bounded_and_continuous_at_warmup_end(name, total, frac, peak, t):
    warmup = int(frac * total)
    sched = make_schedule(name, peak_lr=peak, total_steps=total, warmup_steps=warmup)
    assert 0.0 <= sched(t) <= peak * (1 + 1e-12)
    if 0 < warmup < total:
        assert sched(warmup) == pytest.approx(peak)


ERRORS = [
    (dict(name="linear"), "known schedules: constant, poly, cosine, step"),
    (dict(total_steps=0), "total_steps: 0"),
    (dict(total_steps=-5), "total_steps: -5"),
    (dict(warmup_steps=11), "warmup_steps: 11"),
    (dict(warmup_steps=-1), "warmup_steps: -1"),
    (dict(peak_lr=-0.1), "peak_lr: -0.1"),
    (dict(end_lr=-1.0), "end_lr: -1.0"),
    (dict(init_lr=float("nan")), "init_lr: nan"),
    (dict(power=0.0), "power: 0.0"),
    (dict(name="poly", milestones=(3,)), "only apply to the 'step' schedule"),
    (dict(name="step", milestones=(5, 3)), "milestone 3"),
    (dict(name="step", milestones=(10,)), "milestone 10"),
    (dict(name="step", gamma=0.0), "gamma: 0.0"),
    (dict(offset=-1), "offset: -1"),
    (dict(offset=True), "offset: True"),
    (dict(decay_steps=0), "decay_steps: 0"),
]


@pytest.mark.parametrize("kwargs,message", ERRORS, ids=[m for _, m in ERRORS])
def test_bad_schedule_raises_naming_the_value(kwargs, message):
    args = dict(name="poly", peak_lr=1.0, total_steps=10, warmup_steps=2)
    args.update(kwargs)
    name = args.pop("name")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_schedule(name, **args)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("args", [(-0.1, 256), (0.1, 0), (0.1, 256, 0), (0.1, 2.5)])
def test_scaling_rules_errors(rule, args):
    with pytest.raises(ValueError):
        rule(*args)


def test_sqrt_scaling_is_the_square_root_rule():
    assert sqrt_scaling(0.064, 3072, 1536) == pytest.approx(0.064 * math.sqrt(2), rel=1e-15)
    assert sqrt_scaling(1e-3, 256) == 1e-3
    assert sqrt_scaling(0.01, 4 * 256) == pytest.approx(0.02, rel=1e-15)


def test_negative_step_raises():
    with pytest.raises(ValueError, match="step: -1"):
        make_schedule("constant", peak_lr=1.0, total_steps=3)(-1)


def _raises_naming(message):
    """pytest.raises(ValueError) matching ``message`` literally."""
    return pytest.raises(ValueError, match=re.escape(message))


BOOLS = [
    ("poly", dict(total_steps=True, warmup_steps=0), "Invalid total_steps: True"),
    ("poly", dict(warmup_steps=True), "Invalid warmup_steps: True"),
    ("poly", dict(peak_lr=True), "Invalid peak_lr: True"),
    ("poly", dict(init_lr=False), "Invalid init_lr: False"),
    ("poly", dict(end_lr=True), "Invalid end_lr: True"),
    ("poly", dict(power=True), "Invalid power: True"),
    ("step", dict(gamma=True), "Invalid gamma: True"),
    ("poly", dict(gamma=True), "Invalid gamma: True"),
    ("step", dict(warmup_steps=0, milestones=(True, 5)), "Invalid milestone True"),
]


@pytest.mark.parametrize(
    "args,message",
    [
        ((True, 256), "Invalid base_lr: True"),
        ((0.1, True), "Invalid batch_size: True"),
        ((0.1, 256, True), "Invalid base_batch_size: True"),
    ],
)
@pytest.mark.parametrize("rule", RULES)
def test_scaling_rules_refuse_bools_naming_the_argument(rule, args, message):
    with _raises_naming(message):
        rule(*args)


@pytest.mark.parametrize(
    "args,message",
    [
        ((math.inf, 256), "Invalid base_lr: inf (must be a finite number >= 0)"),
        ((math.nan, 256), "Invalid base_lr: nan (must be a finite number >= 0)"),
        ((-math.inf, 256), "Invalid base_lr: -inf (must be a finite number >= 0)"),
        ((None, 256), "Invalid base_lr: None"),
        (("0.1", 256), "Invalid base_lr: '0.1'"),
        ((0.1, None), "Invalid batch_size: None"),
        ((0.1, 256, None), "Invalid base_batch_size: None"),
        ((1e308, 4096), "{rule}(1e+308, 4096, 256) = inf"),
    ],
)
@pytest.mark.parametrize("rule", RULES)
def test_scaling_rules_refuse_non_finite_and_none(rule, args, message):
    with _raises_naming(message.format(rule=rule.__name__)):
        rule(*args)


NON_NUMBERS = [
    ("poly", dict(peak_lr=None), "Invalid peak_lr: None"),
    ("poly", dict(peak_lr=math.inf), "Invalid peak_lr: inf"),
    ("poly", dict(peak_lr=-math.inf), "Invalid peak_lr: -inf"),
    ("poly", dict(peak_lr=10**400), "Invalid peak_lr: 1000"),
    ("poly", dict(init_lr=-0.5), "Invalid init_lr: -0.5"),
    ("poly", dict(end_lr=math.nan), "Invalid end_lr: nan"),
    ("poly", dict(power=None), "Invalid power: None"),
    ("poly", dict(power=math.inf), "Invalid power: inf (must be a finite number > 0)"),
    ("poly", dict(gamma=None), "Invalid gamma: None"),
    ("cosine", dict(gamma=-0.5), "Invalid gamma: -0.5"),
    ("step", dict(gamma=math.nan), "Invalid gamma: nan"),
    ("step", dict(milestones=None), "Invalid milestones: None"),
    ("step", dict(milestones=5), "Invalid milestones: 5"),
    ("step", dict(milestones="5"), "Invalid milestones: '5'"),
    ("step", dict(milestones=(4.0,)), "Invalid milestone 4.0"),
    ("poly", dict(total_steps=None), "Invalid total_steps: None"),
    ("poly", dict(warmup_steps=None), "Invalid warmup_steps: None"),
]


@pytest.mark.parametrize(
    "name,kwargs,message", BOOLS + NON_NUMBERS, ids=[m for _, _, m in BOOLS + NON_NUMBERS]
)
def test_make_schedule_refuses_bools_none_non_finite_and_negative(name, kwargs, message):
    args = dict(peak_lr=1.0, total_steps=10, warmup_steps=2)
    args.update(kwargs)
    with _raises_naming(message):
        make_schedule(name, **args)


def test_numpy_numbers_are_still_accepted():
    sched = make_schedule(
        "step",
        peak_lr=np.float32(0.5),
        total_steps=np.int64(10),
        warmup_steps=np.int32(2),
        init_lr=np.float64(0.1),
        milestones=np.array([4, 8]),
        gamma=np.float32(0.5),
    )
    assert sched == make_schedule(
        "step", peak_lr=0.5, total_steps=10, warmup_steps=2, init_lr=0.1, milestones=(4, 8), gamma=0.5
    )
    assert linear_scaling(np.float64(0.1), np.int64(512), np.int32(256)) == pytest.approx(0.2)


BAD_STEPS = [
    (math.nan, "Invalid step: nan"),
    (math.inf, "Invalid step: inf"),
    (-math.inf, "Invalid step: -inf"),
    (-0.5, "Invalid step: -0.5"),
    (np.float64("nan"), "Invalid step: np.float64(nan)"),
    (np.int64(-3), "Invalid step: np.int64(-3)"),
    (np.array(-2), "Invalid step: array(-2)"),
    (True, "Invalid step: True"),
    (np.True_, "Invalid step: np.True_"),
    (None, "Invalid step: None"),
    ("3", "Invalid step: '3'"),
    (np.array([1, 2]), "Invalid step: array([1, 2])"),
]


@pytest.mark.parametrize("step,message", BAD_STEPS, ids=[m for _, m in BAD_STEPS])
def test_non_finite_negative_or_non_numeric_step_raises(step, message):
    sched = make_schedule("poly", peak_lr=1.0, total_steps=10, warmup_steps=2, init_lr=0.1)
    with _raises_naming(message):
        sched(step)


@pytest.mark.parametrize(
    "step",
    [3, np.int64(3), np.int32(3), np.uint8(3), np.array(3), 3.0, np.float32(3.0), torch.tensor(3)],
    ids=repr,
)
def test_integer_like_steps_are_accepted(step):
    sched = make_schedule("cosine", peak_lr=1.0, total_steps=10, warmup_steps=2)
    assert sched(step) == sched(3)
    assert sched(0.0) == sched(-0.0) == sched(0) == 0.0


# --------------------------------------------------------------------------- ScheduleLR


def _opt(n_groups=2):
    return LARS([{"params": [torch.nn.Parameter(torch.randn(3))]} for _ in range(n_groups)], lr=9.0)


def test_schedule_lr_applies_step_zero_then_advances():
    opt = _opt()
    sched_fn = make_schedule("poly", peak_lr=1.0, total_steps=10, warmup_steps=4, init_lr=0.2)
    sched = ScheduleLR(opt, sched_fn)
    seen = []
    for _ in range(12):
        seen.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    assert seen == [[sched_fn(t)] * 2 for t in range(12)]


def test_schedule_lr_one_schedule_per_group_and_mismatch():
    opt = _opt(2)
    a = make_schedule("constant", peak_lr=1.0, total_steps=5)
    b = make_schedule("constant", peak_lr=0.1, total_steps=5)
    ScheduleLR(opt, [a, b])
    assert [g["lr"] for g in opt.param_groups] == [1.0, 0.1]
    with pytest.raises(ValueError, match="one schedule per param group \\(2\\), got 3"):
        ScheduleLR(_opt(2), [a, b, a])
    with pytest.raises(ValueError, match="not callable"):
        ScheduleLR(_opt(1), [3.0])


def test_schedule_lr_state_dict_round_trip():
    fn = make_schedule("cosine", peak_lr=1.0, total_steps=20, warmup_steps=5)
    opt = _opt(1)
    sched = ScheduleLR(opt, fn)
    for _ in range(7):
        opt.step()
        sched.step()
    state = sched.state_dict()
    assert "schedules" not in state
    opt2 = _opt(1)
    sched2 = ScheduleLR(opt2, fn)
    sched2.load_state_dict(state)
    opt.step(), opt2.step()
    sched.step(), sched2.step()
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"] == fn(8)


def test_tensor_lr_is_updated_in_place():
    p = torch.nn.Parameter(torch.randn(3))
    lr = torch.tensor(0.5)
    opt = LARS([p], lr=lr)
    ScheduleLR(opt, make_schedule("constant", peak_lr=0.25, total_steps=3))
    assert opt.param_groups[0]["lr"] is lr and lr.item() == 0.25


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf, None], ids=repr)
def test_schedule_lr_refuses_a_negative_or_nan_lr_before_writing_it(bad):
    opt = _opt(2)
    ok = make_schedule("constant", peak_lr=0.5, total_steps=5)

    def broken(step):
        return bad if step >= 2 else 0.25

    sched = ScheduleLR(opt, [ok, broken])
    opt.step()
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.25]
    opt.step()
    with _raises_naming(f"param group 1 at step 2: {bad!r}"):
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.25]  # nothing was written
    with _raises_naming(f"param group 0 at step 0: {bad!r}"):
        ScheduleLR(_opt(1), lambda step: bad)


def test_follow_optimizer_needs_a_step_count():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)
    with pytest.raises(ValueError, match="num_steps"):
        ScheduleLR(opt, make_schedule("constant", peak_lr=1.0, total_steps=3), follow_optimizer=True)


def _mxnet_poly(t: int, *, base: float, warmup: int, total: int, end: float, power: float) -> float:
    """mlcommons/training_results_v0.7, NVIDIA's resnet/implementations/mxnet/common/fit.py,
    PolySchedule.__call__ at MXNet's update count ``t`` (1 at the first step): linear
    warmup ``base * t / W``, then ``end + (base - end) * (1 - (t - W) / (T - W))^power``."""
    if t <= warmup:
        return base * t / warmup
    return end + (base - end) * (1 - (t - warmup) / (total - warmup)) ** power


def _tf_reference_poly(t: int, *, init: float, warmup: int, total: int, end: float) -> float:
    """mlcommons/training, image_classification/tensorflow2/lars_util.py,
    PolynomialDecayWithWarmup at the optimizer's iteration count ``t`` (0 at the first
    step): ``init * t / W`` while ``t < W``, else Keras's polynomial decay over ``T - W + 1``
    steps, power 2."""
    if t < warmup:
        return init * t / warmup
    decay = total - warmup + 1
    return (init - end) * (1 - min(t - warmup, decay) / decay) ** 2 + end


def test_offset_reproduces_mxnets_counter_from_one():
    # NVIDIA's 34K run: 38 steps an epoch, 17 warmup and 59 epochs.
    w, total = 38 * 17, 38 * 59
    sched = make_schedule("poly", peak_lr=21.6, total_steps=total, warmup_steps=w, end_lr=1e-4, offset=1)
    plain = make_schedule("poly", peak_lr=21.6, total_steps=total, warmup_steps=w, end_lr=1e-4)
    for step in range(total):  # step 0 is MXNet's update 1
        expected = _mxnet_poly(step + 1, base=21.6, warmup=w, total=total, end=1e-4, power=2.0)
        assert sched(step) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert plain(0) == 0.0 and sched(0) == pytest.approx(21.6 / w)  # without it: lr 0 first


def test_decay_steps_reproduces_the_tf_references_decay_length():
    w, total = 5 * 39, 90 * 39
    sched = make_schedule(
        "poly", peak_lr=2.9, total_steps=total, warmup_steps=w, end_lr=1e-4, decay_steps=total - w + 1
    )
    plain = make_schedule("poly", peak_lr=2.9, total_steps=total, warmup_steps=w, end_lr=1e-4)
    for step in range(total):
        expected = _tf_reference_poly(step, init=2.9, warmup=w, total=total, end=1e-4)
        assert sched(step) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert plain(total - 1) != pytest.approx(sched(total - 1), rel=1e-3)
