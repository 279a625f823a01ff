"""The fused Triton LARS / LAMB steps against the float64 reference.

The kernels run on the CPU under TRITON_INTERPRET=1 (tests/conftest.py). Each step is
checked from the same starting point: the fused tensors before the step, in float64,
go through ``reference.py`` and the fused result must match it within the tolerance of
its dtype. Overflowing steps must change nothing, bit for bit. tests/test_kernel_compile.py
compiles the kernels for sm_80 and sm_90, without the interpreter and without a GPU.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from cases import group_hyper, spec_step

from largebatch.lars.kernels import (
    FusedGroup,
    fused_lamb_step_,
    fused_lars_step_,
)
from largebatch.lars.kernels import plan as kplan
from largebatch.lars.spec import LAMB_SPEC, LARS_SPEC

# (rtol, atol) of a result of this dtype against the float64 reference. Each new value is
# a sum of terms bounded by |old| + |new|, so rtol applies to that (cancellation-proof).
# fp16 / bf16: 2 ulp (LAMB forms u from m and v as rounded to the state dtype; the
# interpreter truncates to bf16); fp16 atol: its subnormal spacing.
TOL = {
    torch.float32: (5e-6, 1e-8),
    torch.float16: (2**-9, 2**-24),
    torch.bfloat16: (2**-6, 1e-30),
}
# A param rewritten from its fp32 master may differ from torch's cast by this (relative).
CAST_TOL = {torch.float16: 0.0, torch.bfloat16: 2**-7}

STATE = {"lars": ("momentum_buffer",), "lamb": ("exp_avg", "exp_avg_sq")}
STEP = {"lars": fused_lars_step_, "lamb": fused_lamb_step_}
SPEC = {"lars": LARS_SPEC, "lamb": LAMB_SPEC}

# Awkward sizes: one element, tails, an exact chunk, three chunks, an all-zero weight
# (index 3), a zero-size tensor, odd shapes, an all-zero grad (index 8).
SHAPES = [(1,), (1025,), (4096,), (7, 3), (0,), (3, 5, 7), (33, 65), (10_000,), (17,)]
ZERO_W, ZERO_G = 3, 8

# name: kind, hyperparameters of the two groups (the second excluded), step keywords.
CASES = {
    "lars": ("lars", dict(momentum=0.9, weight_decay=5e-2, trust_coefficient=0.02), {}),
    "lars_nesterov_clip_eps": (
        "lars",
        dict(
            momentum=0.8,
            weight_decay=1e-2,
            trust_coefficient=0.5,
            eps=1e-3,
            nesterov=True,
            trust_clip=True,
        ),
        {},
    ),
    "lamb": ("lamb", dict(betas=(0.9, 0.999), eps=1e-6, weight_decay=1e-2), {}),
    "lamb_no_bias_correction_clipped": (
        "lamb",
        dict(betas=(0.8, 0.99), eps=1e-4, weight_decay=1e-1, bias_correction=False),
        dict(max_grad_norm=1.0),
    ),
    "lamb_clip_inactive": ("lamb", dict(weight_decay=1e-2), dict(max_grad_norm=1e6)),
    "lamb_frozen_variance": ("lamb", dict(weight_decay=1e-2, freeze_step=1), {}),  # step 2 frozen
}
# name: param dtype, fp32 masters, grad_scale (None: no scaling)
PRECISIONS = {
    "fp32": (torch.float32, False, None),
    "fp32_scaled": (torch.float32, False, 3.0),
    "fp16_masters": (torch.float16, True, 1024.0),
    "bf16_masters": (torch.bfloat16, True, 256.0),
    "fp16": (torch.float16, False, 1024.0),
    "bf16": (torch.bfloat16, False, None),
}
LRS = [0.5, 0.2, 0.05]  # lr changes on the device between steps


def make_group(kind, shapes, dtype, masters, hyper, seed, zero=()):
    gen = torch.Generator().manual_seed(seed)
    w32 = [torch.randn(s, generator=gen) for s in shapes]
    for i in zero:
        w32[i].zero_()
    params = [w.to(dtype) for w in w32]
    state_dtype = torch.float32 if masters else dtype
    return FusedGroup(
        params=params,
        grads=[torch.zeros_like(p) for p in params],
        masters=[p.float() for p in params] if masters else None,
        state={k: [torch.zeros(p.shape, dtype=state_dtype) for p in params] for k in STATE[kind]},
        steps=[torch.zeros((), dtype=torch.float32) for _ in params],
        lr=torch.tensor(LRS[0], dtype=torch.float32),
        hyper=SPEC[kind].make(hyper),
    )


def set_grads(groups, gen, scale, zero_grads=()):
    """Fresh random grads, multiplied by the loss scale; returns the unscaled float64 ones.

    |g| >= 0.25, so that LAMB's 0.001 * g^2 stays a normal number in an fp16 exp_avg_sq
    (smaller grads underflow there: fp16 state without masters is not for LAMB).
    """
    unscaled = []
    for gi, g in enumerate(groups):
        for j, grad in enumerate(g.grads):
            x = torch.randn(grad.shape, generator=gen, dtype=torch.float64) * 0.5
            x += 0.25 * torch.sign(x)
            if (gi, j) in zero_grads:
                x.zero_()
            grad.copy_(x * (scale or 1.0))
        unscaled.append([grad.double().numpy() / (scale or 1.0) for grad in g.grads])
    return unscaled


def weights(g):
    """The tensors the math runs on: each param's master where it has one."""
    return [p if m is None else m for p, m in zip(g.params, g.masters or g.params)]


def snapshot(groups):
    """Every tensor the step may write, cloned (for bitwise comparisons)."""
    out = []
    for g in groups:
        tensors = [*g.params, *weights(g), *(x for k in g.state for x in g.state[k]), *g.steps]
        out.append([t.clone() for t in tensors])
    return out


def reference_step(kind, groups, grads, max_grad_norm=None, **override):
    """The float64 spec (tests/cases.py) applied to the fused tensors as they are now, each
    tensor at its group's lr and its own step count: (inputs, outputs), per group."""
    before, hypers, steps = [], [], []
    for g in groups:
        h = group_hyper(SPEC[kind], dataclasses.asdict(g.hyper), override, {"lr": float(g.lr)})
        before.append(
            [
                [x.double().numpy() for x in weights(g)],
                *([x.double().numpy() for x in g.state[k]] for k in STATE[kind]),
            ]
        )
        hypers += [h] * len(g.params)
        steps += [int(s) + 1 for s in g.steps]
    flat = lambda lists: [x for xs in lists for x in xs]  # noqa: E731
    state = {k: flat(b[1 + i] for b in before) for i, k in enumerate(STATE[kind])}
    w, state = spec_step(kind, flat(b[0] for b in before), flat(grads), state, hypers, steps, max_grad_norm)
    out, at = [], 0
    for g in groups:
        n = len(g.params)
        out.append((w[at : at + n], *(state[k][at : at + n] for k in STATE[kind])))
        at += n
    return before, out


def assert_close(name, actual, expected, before, dtype):
    rtol, atol = TOL[dtype]
    a = actual.double().numpy()
    bad = ~(np.abs(a - expected) <= atol + rtol * (np.abs(expected) + np.abs(before)))
    if bad.any():
        rows = "\n".join(
            f"  {i}: fused {a[i]!r} reference {expected[i]!r} before {before[i]!r}"
            for i in map(tuple, np.argwhere(bad)[:5])
        )
        raise AssertionError(
            f"{name}: {bad.sum()} of {bad.size} differ beyond rtol={rtol} atol={atol}:\n{rows}"
        )


def check_step(kind, groups, before, expected):
    """The fused tensors after a step against the reference from ``before`` (float64 arrays)."""
    for gi, (g, old, exp) in enumerate(zip(groups, before, expected)):
        for j, w in enumerate(weights(g)):
            assert_close(f"group {gi} weight {j}", w, exp[0][j], old[0][j], w.dtype)
            for k, (name, s) in enumerate(zip(STATE[kind], exp[1:])):
                x = g.state[name][j]
                assert_close(f"group {gi} {name} {j}", x, s[j], old[1 + k][j], x.dtype)
        for j, (p, m) in enumerate(zip(g.params, weights(g))):
            if m is p:
                continue
            diff = (p.double() - m.to(p.dtype).double()).abs()
            ok = (diff <= CAST_TOL[p.dtype] * m.double().abs()).all()
            assert ok, f"group {gi} param {j} is not its master cast to {p.dtype}"


def run_steps(kind, groups, *, scale=None, max_grad_norm=None, steps=3, seed=0, zero_grads=(), **ref_hyper):
    """Fused steps, each checked against the reference (``ref_hyper`` overrides its values)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [float(s) for g in groups for s in g.steps]
    for k in range(steps):
        grads = set_grads(groups, gen, scale, zero_grads)
        for g in groups:
            g.lr.fill_(LRS[k % len(LRS)])
        before, expected = reference_step(kind, groups, grads, max_grad_norm, **ref_hyper)
        extra = {} if kind == "lars" else dict(max_grad_norm=max_grad_norm)
        grad_scale = None if scale is None else torch.tensor(scale)
        STEP[kind](groups, grad_scale=grad_scale, found_inf=None, **extra)
        check_step(kind, groups, before, expected)
        assert [float(s) for g in groups for s in g.steps] == [c + k + 1 for c in counts]


def two_groups(kind, hyper, dtype=torch.float32, masters=False, shapes=SHAPES):
    return [
        make_group(kind, shapes, dtype, masters, hyper, seed=1, zero=(ZERO_W,)),
        make_group(kind, shapes[:4], dtype, masters, {**hyper, "trust_ratio": False}, seed=2),
    ]


# Every case in fp32; every precision with one LARS and one LAMB case.
MATRIX = [(c, "fp32") for c in CASES]
MATRIX += [(c, p) for c in ("lars", "lamb") for p in PRECISIONS if p != "fp32"]


@pytest.mark.parametrize("case, precision", MATRIX)
def test_matches_reference(case, precision):
    kind, hyper, kw = CASES[case]
    dtype, masters, scale = PRECISIONS[precision]
    groups = two_groups(kind, hyper, dtype, masters)
    steps = 2 if dtype == torch.float32 else 3  # fp32 runs most cases: fewer steps there
    run_steps(kind, groups, scale=scale, zero_grads={(0, ZERO_G)}, steps=steps, **kw)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_resnet50_tensor_count(kind):
    """161 tensors, as in ResNet-50: 54 adapted weights, 107 excluded biases and norms."""
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(1, 300, (161,), generator=gen).tolist()
    shapes = [(s // 4 + 1, 4) if i % 3 == 0 else (s,) for i, s in enumerate(sizes)]
    hyper = dict(weight_decay=1e-2)
    if kind == "lars":
        hyper = dict(weight_decay=1e-4, trust_coefficient=0.01)
    excluded = {**hyper, "trust_ratio": False}
    groups = [
        make_group(kind, shapes[:54], torch.float32, False, hyper, seed=4),
        make_group(kind, shapes[54:], torch.float32, False, excluded, seed=5),
    ]
    run_steps(kind, groups, steps=1)


@pytest.mark.parametrize("kind, wrong", [("lars", dict(momentum=0.85)), ("lamb", dict(betas=(0.85, 0.999)))])
def test_wrong_hyperparameter_is_caught(kind, wrong):
    """The comparison can fail: a reference with another momentum / b1 must not match."""
    groups = two_groups(kind, CASES[kind][1])
    with pytest.raises(AssertionError, match="differ beyond"):
        run_steps(kind, groups, steps=2, **wrong)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_overflow_step_changes_nothing(kind):
    hyper = dict(weight_decay=1e-2)
    groups = [
        make_group(kind, SHAPES[:4], torch.float16, True, hyper, seed=6),
        make_group(kind, SHAPES[4:], torch.float32, False, hyper, seed=7),
    ]
    extra = {} if kind == "lars" else dict(max_grad_norm=1.0)
    scale = torch.tensor(1024.0)
    run_steps(kind, groups, scale=1024.0, steps=1, **extra)  # nonzero state first

    gen = torch.Generator().manual_seed(8)
    set_grads(groups, gen, 1024.0)
    found_inf = torch.ones(1)
    groups[0].grads[1][7] = float("inf")  # what GradScaler found
    counter = torch.zeros(())
    before = snapshot(groups)
    STEP[kind](groups, grad_scale=scale, found_inf=found_inf, counter=counter, **extra)
    for gi, (b, a) in enumerate(zip(before, snapshot(groups))):
        for j, (x, y) in enumerate(zip(b, a)):
            assert torch.equal(x, y), f"group {gi} tensor {j} changed on an overflowing step"
    assert all(float(s) == 1 for g in groups for s in g.steps) and float(counter) == 0

    # The next finite step is taken as usual.
    grads = set_grads(groups, gen, 1024.0)
    before, expected = reference_step(kind, groups, grads, extra.get("max_grad_norm"))
    STEP[kind](groups, grad_scale=scale, found_inf=torch.zeros(1), counter=counter, **extra)
    check_step(kind, groups, before, expected)
    assert all(float(s) == 2 for g in groups for s in g.steps) and float(counter) == 1


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_non_finite_grad_without_found_inf_is_applied(kind):
    """Without GradScaler's found_inf nothing is skipped (as in torch.optim): the bad
    element reaches its weight, every other tensor takes its usual step."""
    groups = [make_group(kind, SHAPES[:4], torch.float32, False, dict(weight_decay=1e-2), seed=6)]
    gen = torch.Generator().manual_seed(8)
    grads = set_grads(groups, gen, None)
    before, expected = reference_step(kind, groups, grads)
    groups[0].grads[1][7] = float("nan")
    STEP[kind](groups, grad_scale=None, found_inf=None)
    assert torch.isnan(groups[0].params[1][7])
    for j in (0, 2, 3):
        assert_close(f"weight {j}", groups[0].params[j], expected[0][0][j], before[0][0][j], torch.float32)
    assert all(float(s) == 1 for s in groups[0].steps)


def test_each_tensor_is_bias_corrected_at_its_own_step():
    """LAMB tensors of one group at different step counts (params that started late)."""
    group = make_group("lamb", SHAPES[:5], torch.float32, False, dict(weight_decay=1e-2), seed=4)
    for j, s in enumerate(group.steps):
        s.fill_(1000.0 * (j % 2))
    run_steps("lamb", [group], steps=2)
    assert [float(s) for s in group.steps] == [2.0, 1002.0, 2.0, 1002.0, 2.0]


@pytest.mark.parametrize("kind, max_grad_norm", [("lars", None), ("lamb", None), ("lamb", 1.0)])
# The overflow this test provokes: under TRITON_INTERPRET=1, NumPy warns of it as it happens.
@pytest.mark.filterwarnings("ignore:overflow encountered in (multiply|reduce):RuntimeWarning")
def test_sums_of_squares_beyond_fp32(kind, max_grad_norm):
    """A tile's sum of squares is formed in fp32: where it overflows (weights of 1e19 and,
    through LAMB's weight decay, 1e22; grads of 1e18 in LAMB's global norm) or its squares
    underflow (weights of 1e-25), the tile is summed again, scaled, and every norm is still
    the float64 reference's. One tensor has one such tile among ordinary ones."""
    shapes = [(300,), (3000,), (10_000,), (50,)]
    group = make_group(kind, shapes, torch.float32, False, dict(weight_decay=1e-2), seed=13)
    with torch.no_grad():
        group.params[0].mul_(1e19)
        group.params[1].mul_(1e-25)
        group.params[2][5000:6000].mul_(1e19)
        group.params[3].mul_(1e22)
    gen = torch.Generator().manual_seed(14)
    for k in range(2):
        grads = set_grads([group], gen, None)
        group.grads[0].mul_(1e18)
        grads[0][0] = group.grads[0].double().numpy()
        group.lr.fill_(LRS[k])
        before, expected = reference_step(kind, [group], grads, max_grad_norm)
        extra = {} if kind == "lars" else dict(max_grad_norm=max_grad_norm)
        STEP[kind]([group], grad_scale=None, found_inf=None, **extra)
        assert all(torch.isfinite(p).all() for p in group.params)
        check_step(kind, [group], before, expected)
        # The weights of 1e-25 lie below fp32's atol: held to its rtol alone.
        tiny, exp, old = group.params[1].double().numpy(), expected[0][0][1], before[0][0][1]
        assert (np.abs(tiny - exp) <= TOL[torch.float32][0] * (np.abs(exp) + np.abs(old))).all()


@pytest.mark.parametrize("kind, max_grad_norm", [("lars", None), ("lamb", 1.0)])
def test_sums_do_not_depend_on_the_order_programs_run(kind, max_grad_norm):
    """On a GPU the programs of a pass run in any order. The step must come out the same,
    bit for bit, whatever the order: here the programs run in chunk order, then in the
    reverse order (the chunk table flipped). The data make fp64 addition order visible:
    one chunk sums to 2**38 and two to 2**-15 each, half an ulp of 2**38, so added one
    by one to 2**38 they vanish, and added to each other first they count. Weights and
    grads have this shape, so every norm, LAMB's global one too, depends on the order in
    which the chunks' sums are added."""
    shape = (3 * kplan.BLOCK * kplan.TILES,)  # three full chunks

    def run(flip):
        group = make_group(kind, [shape, (5,)], torch.float32, False, dict(weight_decay=1e-2), 0)
        with torch.no_grad():
            for x in (group.params[0], group.grads[0]):
                x.zero_()
                x[: kplan.BLOCK * kplan.TILES] = 2.0**13
                x[kplan.BLOCK * kplan.TILES :: kplan.BLOCK * kplan.TILES // 2] = 2.0**-8
            group.grads[1].fill_(0.5)
        extra = {} if kind == "lars" else dict(max_grad_norm=max_grad_norm)
        plan = kplan.plan_for(SPEC[kind], [group], None)
        assert plan.buckets[0].grid == (4,)
        if flip:  # on the CPU the plan's tables are host memory
            for b in plan.buckets:
                b.chunks.copy_(b.chunks.flip(0).clone())
        STEP[kind]([group], grad_scale=None, found_inf=None, **extra)
        kplan._PLANS.clear()
        return plan.ws.clone(), snapshot([group])[0]

    (ws, after), (ws_flipped, after_flipped) = run(False), run(True)
    assert ws[kplan.WS_HEAD] >= 2.0**38  # the chunks' sums were formed
    assert torch.equal(ws, ws_flipped)
    for x, y in zip(after, after_flipped):
        assert torch.equal(x, y)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_empty_is_a_no_op(kind):
    STEP[kind]([], grad_scale=None, found_inf=None)
    empty = make_group(kind, [], torch.float32, False, {}, seed=0)
    STEP[kind]([empty], grad_scale=None, found_inf=None)
    assert empty.steps == []


def test_shared_step_counter_counts_once():
    groups = two_groups("lamb", {})
    shared = groups[0].steps[0]
    groups[0].steps = [shared] * len(groups[0].params)
    groups[1].steps = [shared] * len(groups[1].params)
    run_steps("lamb", groups, steps=2)


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_masters_for_some_params_of_a_group(kind):
    """fp16 weights with fp32 masters and fp32 params without, in one group."""
    group = make_group(kind, [(300,), (7, 3), (1025,)], torch.float16, True, {}, seed=11)
    fp32 = make_group(kind, [(40,), (5,)], torch.float32, False, {}, seed=12)
    group.params += fp32.params
    group.grads += fp32.grads
    group.masters += [None, None]
    group.steps += fp32.steps
    for k in STATE[kind]:
        group.state[k] += fp32.state[k]
    run_steps(kind, [group], scale=512.0, steps=2)
    assert len(last_plan().buckets) == 2


def last_plan():
    return next(reversed(kplan._PLANS.values()))


def test_new_grad_tensors_and_cached_plans():
    """A plan is reused while addresses stay; new grad tensors (set_to_none) build a new one."""
    groups = two_groups("lars", CASES["lars"][1], shapes=SHAPES[:5])
    run_steps("lars", groups, steps=1)
    plan = last_plan()
    fused_lars_step_(groups, grad_scale=None, found_inf=None)
    assert last_plan() is plan
    for g in groups:
        g.grads = [torch.empty_like(x) for x in g.grads]
        for s in g.steps:
            s.zero_()
    run_steps("lars", groups, steps=1, seed=9)
    assert last_plan() is not plan
    plan = last_plan()
    old_lrs = [g.lr for g in groups]  # kept alive: the new ones get new addresses
    for g in groups:  # new lr tensors: the same plan, with its address table refreshed
        g.lr = g.lr.clone()
        for s in g.steps:
            s.zero_()
    run_steps("lars", groups, steps=2, seed=10)
    assert last_plan() is plan and len(old_lrs) == 2


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_views_at_unaligned_offsets(kind):
    """Params, grads and state as views into flat buffers, at odd element offsets."""
    shapes = [(5,), (300,), (0,), (4, 33)]
    group = make_group(kind, shapes, torch.float32, False, dict(weight_decay=1e-2), seed=10)

    def as_views(xs):
        flat = torch.zeros(1 + sum(x.numel() + 1 for x in xs))
        views, at = [], 1
        for x in xs:
            views.append(flat[at : at + x.numel()].view(x.shape).copy_(x))
            at += x.numel() + 1
        return views

    group.params, group.grads = as_views(group.params), as_views(group.grads)
    group.state = {k: as_views(v) for k, v in group.state.items()}
    run_steps(kind, [group], steps=2)
    assert not last_plan().buckets[0].consts["ALIGNED"]


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_strides_of_one_element_dims_are_free(kind):
    """channels_last weights with dims of one element, as a conv on one input channel
    (8, 1, 3, 3) has: autograd's contiguous grad (strides (9, 9, 3, 1) against the
    weight's (9, 1, 3, 1)) orders its elements the same way, and the step takes it; a grad
    whose order does differ is refused, named."""

    def channels_last(x):  # its strides, also where .contiguous(memory_format=) would keep x's
        return torch.empty(x.shape, dtype=x.dtype, memory_format=torch.channels_last).copy_(x)

    group = make_group(kind, [(8, 1, 3, 3), (4, 2, 1, 1), (1, 1, 1, 1)], torch.float32, False, {}, seed=11)
    group.params = [channels_last(p) for p in group.params]
    group.state = {k: [channels_last(s) for s in v] for k, v in group.state.items()}
    assert all(g.stride() != p.stride() for g, p in zip(group.grads[:2], group.params))
    run_steps(kind, [group], steps=2)

    other = make_group(kind, [(6, 3, 2, 2)], torch.float32, False, {}, seed=12)
    other.params = [channels_last(p) for p in other.params]
    other.state = {k: [channels_last(s) for s in v] for k, v in other.state.items()}
    before = snapshot([other])
    with pytest.raises(ValueError, match=r"group 0 grads\[0\]: expected torch.float32 like param"):
        STEP[kind]([other], grad_scale=None, found_inf=None)
    assert all(torch.equal(a, b) for a, b in zip(before[0], snapshot([other])[0]))


def test_invalid_inputs_are_named():
    g = two_groups("lars", {})[0]
    lamb = two_groups("lamb", {})[0]
    with pytest.raises(TypeError, match="group 0: hyper must be a LarsHyperparams"):
        fused_lars_step_([FusedGroup(**{**vars(g), "hyper": lamb.hyper})])
    with pytest.raises(TypeError, match="group 0: hyper must be a LambHyperparams .* got dict"):
        fused_lamb_step_([FusedGroup(**{**vars(lamb), "hyper": {"betas": (0.9, 0.99)}})])
    with pytest.raises(TypeError, match=r"LAMB group hyperparameters are .*, not \['beta1', 'beta2'\]"):
        LAMB_SPEC.make({"beta1": 0.9, "beta2": 0.99})
    with pytest.raises(ValueError, match=r"Invalid group 0 betas\[1\]: 1\.0"):
        LAMB_SPEC.make({"betas": (0.9, 1.0)}, group=0)
    with pytest.raises(ValueError, match="Invalid group 0 momentum: 1.0"):
        LARS_SPEC.make({"momentum": 1.0}, group=0)
    with pytest.raises(ValueError, match=r"Invalid momentum: 1.0 \(must be in \[0, 1\)\)"):
        dataclasses.replace(g.hyper, momentum=1.0)  # made directly: checked as well
    g.grads[2] = g.grads[2].half()
    with pytest.raises(ValueError, match=r"grads\[2\]"):
        fused_lars_step_([g], grad_scale=None, found_inf=None)


def test_lamb_eps_zero_is_refused_before_anything_changes():
    """On a GPU, fp32 sqrt and division flush denormals: a v_hat below 2**-126 would give
    u = m / 0. The fused LAMB path refuses eps=0 and leaves params and state as they were."""
    from largebatch.torch import LAMB

    p = torch.nn.Parameter(torch.ones(5))
    refused = r"Invalid group 0 eps: 0 \(the fused LAMB kernels need eps > 0"
    with pytest.raises(ValueError, match=refused):
        LAMB([p], lr=0.1, eps=0.0, fused=True)
    opt = LAMB([p], lr=0.1, fused=True)
    opt.param_groups[0]["eps"] = 0.0  # changed after the group was added: refused at the step
    p.grad = torch.full((5,), 1e-3)
    with pytest.raises(ValueError, match=refused):
        opt.step()
    assert torch.equal(p.detach(), torch.ones(5)) and not opt.state[p]
