"""largebatch.jax.lars / lamb against the float64 reference, optax, and the torch optimizers."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from cases import TOLERANCE, run_spec_tree  # noqa: E402
from helpers import MIXES, NON_FINITE, assert_float64_norms  # noqa: E402

from largebatch.jax import (  # noqa: E402
    as_optax_schedule,
    exclusion_mask,
    lamb,
    lars,
    make_schedule,
)
from largebatch.lars.jax.norms import leaf_norms  # noqa: E402
from largebatch.schedules import make_schedule as py_make_schedule  # noqa: E402

STEPS = 3
# Relative to each element, and to the tensor's largest element for elements that come
# out of a cancellation (w - v with both of order max|w|).
RTOL = {np.float64: TOLERANCE["float64"], np.float32: TOLERANCE["float32"]}

# Awkward leaves: a zero tensor, a zero gradient, odd sizes, an empty tensor, vectors
# (excluded by exclusion_mask) and a scalar; gradient scales far apart, so LARC's clip
# and LAMB's clipping bind on some leaves and not on others.
SHAPES = {
    "conv": (3, 3, 4, 8),
    "dense": (1025, 3),
    "one": (1, 1),
    "zero_w": (7, 5),
    "zero_g": (6, 2),
    "empty": (2, 0),
    "bias": (1025,),
    "scale": (1,),
    "scalar": (),
}
GRAD_SCALE = {"conv": 1e-3, "dense": 1.0, "one": 1e2, "bias": 10.0, "scale": 1e-2}


def make_tree_problem(dtype, seed=0, shapes=SHAPES):
    """Params and STEPS gradient trees (numpy, ``dtype``), fixed by ``seed``."""
    rng = np.random.default_rng(seed)
    params = {k: np.asarray(rng.standard_normal(s), dtype) for k, s in shapes.items()}
    if "zero_w" in params:
        params["zero_w"][...] = 0
    grads = []
    for _ in range(STEPS):
        g = {k: np.asarray(GRAD_SCALE.get(k, 0.1) * rng.standard_normal(s), dtype) for k, s in shapes.items()}
        if "zero_g" in g:
            g["zero_g"][...] = 0
        grads.append(g)
    return params, grads


def run_optax(opt, params, grads, jit=False):
    """Apply ``opt`` to each gradient tree in turn; returns the params.

    Eager by default: on the CPU, compiling each case's chain costs more than running it
    (the jitted paths have their own tests below).
    """
    params = jax.tree.map(jnp.asarray, params)
    state = opt.init(params)
    update = jax.jit(opt.update) if jit else opt.update
    for g in grads:
        updates, state = update(jax.tree.map(jnp.asarray, g), state, params)
        params = optax.apply_updates(params, updates)
    return params


def assert_trees_close(actual, expected, rtol, dtype=None):
    """Leaf by leaf, at ``rtol`` of the element or of the leaf's largest element."""
    for k in expected:
        a, e = np.asarray(actual[k]), np.asarray(expected[k], np.float64)
        assert dtype is None or a.dtype == dtype, (k, a.dtype)
        atol = rtol * np.max(np.abs(e), initial=0.0)
        np.testing.assert_allclose(a.astype(np.float64), e, rtol=rtol, atol=atol, err_msg=k)


SCHED = py_make_schedule("poly", peak_lr=0.4, total_steps=STEPS, warmup_steps=2, init_lr=0.05)
WD_MASK = {k: k not in ("dense",) for k in SHAPES}  # pytree mask: no decay on "dense"

# JAX's own features against the spec: pytree and callable masks, schedules, and the
# norms' overflow and underflow safety (the settings' math on every backend and path is
# the one table of tests/cases.py, run by tests/test_reference_paths.py).
LARS_CASES = {
    "defaults": dict(lr=0.1),
    "wd_eps_tc": dict(lr=0.1, weight_decay=0.01, eps=1e-3, trust_coefficient=0.02),
    "nesterov": dict(lr=0.1, momentum=0.8, weight_decay=0.01, nesterov=True),
    "trust_clip": dict(lr=0.5, trust_coefficient=0.5, weight_decay=0.001, trust_clip=True),
    "no_momentum": dict(lr=0.1, momentum=0.0, weight_decay=0.01),
    "exclusion": dict(lr=0.1, weight_decay=0.01, trust_ratio_mask=exclusion_mask),
    "both_masks": dict(lr=0.1, weight_decay=0.01, trust_ratio_mask=exclusion_mask, weight_decay_mask=WD_MASK),
    "schedule_clip": dict(
        lr=SCHED, trust_coefficient=0.5, weight_decay=0.01, trust_clip=True, trust_ratio_mask=exclusion_mask
    ),
}
LAMB_CASES = {
    "defaults": dict(lr=0.01),
    "wd": dict(lr=0.01, weight_decay=0.01),
    "betas_eps": dict(lr=0.01, b1=0.5, b2=0.9, eps=1e-3, weight_decay=0.1),
    "no_bias_correction": dict(lr=0.01, weight_decay=0.01, bias_correction=False),
    "max_grad_norm": dict(lr=0.01, weight_decay=0.01, max_grad_norm=1.0),
    "max_grad_norm_unused": dict(lr=0.01, weight_decay=0.01, max_grad_norm=1e3),
    "exclusion": dict(lr=0.01, weight_decay=0.01, trust_ratio_mask=exclusion_mask),
    "both_masks": dict(
        lr=0.01, weight_decay=0.01, trust_ratio_mask=exclusion_mask, weight_decay_mask=WD_MASK
    ),
    "schedule": dict(lr=SCHED, weight_decay=0.01, max_grad_norm=5.0, trust_ratio_mask=exclusion_mask),
}


def jax_lr(lr, dtype):
    """A Python schedule as the JAX one of the test's precision."""
    return as_optax_schedule(lr, dtype) if callable(lr) else lr


def test_python_schedule_is_accepted():
    """A largebatch.schedules.Schedule works as learning_rate, also under jit."""
    params, grads = make_tree_problem(np.float32)
    kw = dict(peak_lr=0.4, total_steps=3)
    expected = run_optax(lars(make_schedule("cosine", **kw), trust_clip=True), params, grads)
    opt = lars(py_make_schedule("cosine", **kw), trust_clip=True)
    actual = run_optax(opt, params, grads, jit=True)
    assert_trees_close(actual, expected, RTOL[np.float32])


def test_trust_clip_at_a_zero_rate():
    """Warmup from 0: LARC's min(ratio / 0, 1) is 1, so the first step moves nothing."""
    params, grads = make_tree_problem(np.float32)
    sched = make_schedule("poly", peak_lr=0.4, total_steps=STEPS, warmup_steps=2)
    opt = lars(sched, trust_clip=True, weight_decay=0.01)
    assert_trees_close(run_optax(opt, params, grads[:1]), params, 0.0)
    expected = run_spec_tree(
        "lars", params, grads[1:], lr=lambda t: sched.schedule(t + 1), trust_clip=True, weight_decay=0.01
    )
    state = opt.init(jax.tree.map(jnp.asarray, params))
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
    assert_trees_close(params, expected, RTOL[np.float32])


@pytest.mark.parametrize("make", [lars, lamb])
def test_prefix_and_callable_masks_match_full_masks(make):
    """Masks as optax takes them: a prefix pytree or a callable give the full mask's numbers."""
    params, grads = make_tree_problem(np.float32, shapes={"a": (3, 4), "b": (4,), "c": (5, 2)})
    nest = lambda t: {"x": {"a": t["a"], "b": t["b"]}, "y": t["c"]}  # noqa: E731
    params, grads = nest(params), [nest(g) for g in grads]
    full = dict(
        trust_ratio_mask={"x": {"a": True, "b": False}, "y": True},
        weight_decay_mask={"x": {"a": False, "b": False}, "y": True},
    )
    prefix = dict(
        trust_ratio_mask=lambda p: {"x": {"a": True, "b": False}, "y": True},
        weight_decay_mask={"x": False, "y": True},
    )
    a = run_optax(make(0.1, weight_decay=0.1, **full), params, grads)
    b = run_optax(make(0.1, weight_decay=0.1, **prefix), params, grads)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    # "x/a" adapted but not decayed, "x/b" excluded, "y" adapted and decayed.
    flat = lambda t: {"a": t["x"]["a"], "b": t["x"]["b"], "c": t["y"]}  # noqa: E731
    expected = run_spec_tree(
        make.__name__,
        flat(params),
        [flat(g) for g in grads],
        lr=0.1,
        weight_decay=0.1,
        trust_ratio_mask={"a": True, "b": False, "c": True},
        weight_decay_mask={"a": False, "b": False, "c": True},
    )
    assert_trees_close(flat(a), expected, RTOL[np.float32])


@pytest.mark.parametrize("make", [lars, lamb])
def test_weight_decay_without_the_trust_ratio_where_the_masks_say_so(make):
    """Decay and adaptation are independent where ``weight_decay_mask`` is given (NVIDIA's
    MLPerf LARS decays the fc bias without adapting it); without it, excluded leaves are
    not decayed."""
    params, grads = make_tree_problem(np.float32, shapes={"w": (3, 4), "b": (4,)})
    trust = {"w": True, "b": False}
    got = run_optax(
        make(0.1, weight_decay=0.1, trust_ratio_mask=trust, weight_decay_mask={"w": True, "b": True}),
        params,
        grads,
    )
    expected = run_spec_tree(
        make.__name__,
        params,
        grads,
        lr=0.1,
        weight_decay=0.1,
        trust_ratio_mask=trust,
        weight_decay_mask={"w": True, "b": True},
    )
    assert_trees_close(got, expected, RTOL[np.float32])
    plain = run_optax(make(0.1, weight_decay=0.1, trust_ratio_mask=trust), params, grads)
    assert not np.allclose(plain["b"], got["b"])  # the decay moved the excluded leaf


HUGE_TINY_SHAPES = {"huge": (5, 4), "tiny": (3, 3), "huge_g": (4, 2), "plain": (6,)}


@pytest.mark.parametrize(
    "make, case",
    [
        ("lars", "wd_eps_tc"),
        ("lars", "trust_clip"),
        ("lars", "exclusion"),
        ("lamb", "wd"),
        ("lamb", "max_grad_norm"),
        ("lamb", "exclusion"),
    ],
)
def test_norms_do_not_overflow_or_underflow_in_float32(make, case):
    """Weights of 1e19 and gradients of 1e20 square past float32's range, weights of 1e-25
    square to zero; the trust ratios and the global gradient norm still follow the
    float64 reference."""
    params, grads = make_tree_problem(np.float32, seed=3, shapes=HUGE_TINY_SHAPES)
    params["huge"] *= np.float32(1e19)
    params["tiny"] *= np.float32(1e-25)
    for g in grads:  # Adam squares LAMB's gradients: huge ones only where they are clipped
        if make == "lars" or case == "max_grad_norm":
            g["huge_g"] *= np.float32(1e21)
    kw = dict((LARS_CASES if make == "lars" else LAMB_CASES)[case])
    expected = run_spec_tree(make, params, grads, **kw)
    lr = kw.pop("lr")
    actual = run_optax((lars if make == "lars" else lamb)(lr, **kw), params, grads, jit=True)
    for k, leaf in actual.items():
        assert np.isfinite(np.asarray(leaf)).all(), k
    assert_trees_close(actual, expected, RTOL[np.float32], np.float32)


# ------------------------------------------------------------------------------ optax


def test_lamb_equals_optax_lamb():
    params, grads = make_tree_problem(np.float32)
    for ours, theirs in [
        (lamb(0.01), optax.lamb(0.01)),
        (
            lamb(0.01, weight_decay=0.1, weight_decay_mask=exclusion_mask),
            optax.lamb(0.01, weight_decay=0.1, mask=exclusion_mask),
        ),
    ]:
        assert_trees_close(run_optax(ours, params, grads), run_optax(theirs, params, grads), 1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_equals_optax_lars_without_weight_decay(nesterov):
    """Both keep the rate inside the trace and divide by ||g|| + eps when wd = 0."""
    params, grads = make_tree_problem(np.float32)
    sched = make_schedule("poly", peak_lr=0.3, total_steps=STEPS, warmup_steps=1)
    for kw in (dict(eps=0.0), dict(eps=1e-2, trust_coefficient=0.1)):
        ours = lars(sched, momentum=0.8, nesterov=nesterov, trust_ratio_mask=exclusion_mask, **kw)
        theirs = optax.lars(sched, momentum=0.8, nesterov=nesterov, trust_ratio_mask=exclusion_mask, **kw)
        assert_trees_close(run_optax(ours, params, grads), run_optax(theirs, params, grads), 1e-6)


def test_lars_differs_from_optax_lars_with_weight_decay():
    """optax divides by ||g + wd * w|| and decays excluded leaves; docs/design.md §2 does neither."""
    params, grads = make_tree_problem(np.float32)
    kw = dict(weight_decay=0.5, trust_ratio_mask=exclusion_mask)
    ours = run_optax(lars(0.1, **kw), params, grads[:1])
    theirs = run_optax(optax.lars(0.1, **kw), params, grads[:1])
    for k in ("dense", "bias"):  # an adapted leaf and an excluded one
        assert not np.allclose(ours[k], theirs[k], rtol=1e-4), k


# -------------------------------------------------------------------- jit and dtypes


def _cached_update(opt, params):
    state = opt.init(params)
    update = jax.jit(opt.update)
    grads = jax.tree.map(jnp.ones_like, params)
    for i in range(3):
        updates, new_state = update(jax.tree.map(lambda g, k=i + 1: g * k, grads), state, params)
        assert jax.tree.structure(new_state) == jax.tree.structure(state)
        for old, new in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)):
            assert (old.dtype, old.shape, old.weak_type) == (new.dtype, new.shape, new.weak_type)
        state, params = new_state, optax.apply_updates(params, updates)
    return update


@pytest.mark.parametrize(
    "make",
    [
        lambda s: lars(
            s,
            weight_decay=1e-4,
            nesterov=True,
            trust_clip=True,
            trust_ratio_mask=exclusion_mask,
            weight_decay_mask={"w": True, "b": False, "s": False},
        ),
        lambda s: lamb(s, weight_decay=1e-2, max_grad_norm=1.0, trust_ratio_mask=exclusion_mask),
        lambda s: lamb(0.1, bias_correction=False),
        lambda s: lamb(s, weight_decay=1e-2, freeze_step=2),
    ],
    ids=["lars", "lamb", "lamb_uncorrected", "lamb_frozen_variance"],
)
def test_jit_does_not_recompile(make):
    params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3), "s": jnp.ones((2, 2))}
    sched = make_schedule("cosine", peak_lr=0.1, total_steps=10, warmup_steps=2)
    update = _cached_update(make(sched), params)
    assert update._cache_size() == 1


def test_a_traced_freeze_step_equals_a_fixed_one():
    """``optax.inject_hyperparams`` makes ``freeze_step`` an array in the state, traced
    under jit: the same steps as the Python int, and one compile whatever its value."""
    params, grads = make_tree_problem(np.float32)
    fixed = run_optax(lamb(0.01, weight_decay=1e-2, freeze_step=2), params, grads)
    opt = optax.inject_hyperparams(lamb)(learning_rate=0.01, weight_decay=1e-2, freeze_step=2)
    injected = run_optax(opt, params, grads, jit=True)
    assert_trees_close(injected, fixed, RTOL[np.float32], np.float32)
    moving = run_optax(lamb(0.01, weight_decay=1e-2), params, grads)
    assert not np.allclose(moving["dense"], fixed["dense"], rtol=1e-4)  # step 3 froze


@pytest.mark.parametrize(
    "opt",
    [lars(0.1, weight_decay=1e-3), lamb(0.01, weight_decay=1e-2, max_grad_norm=1.0)],
    ids=["lars", "lamb"],
)
def test_bfloat16_params_stay_bfloat16(opt):
    """bf16 params give bf16 updates and state, within bf16 rounding of the float32 updates."""
    params32 = {"w": jnp.ones((64, 64)), "v": jnp.linspace(-1.0, 1.0, 4096).reshape(64, 64)}
    grads32 = {"w": jnp.full((64, 64), 0.5), "v": jnp.ones((64, 64))}
    to_bf16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16), t)  # noqa: E731
    params16, grads16 = to_bf16(params32), to_bf16(grads32)
    state = opt.init(params16)
    updates, state = jax.jit(opt.update)(grads16, state, params16)
    for leaf in jax.tree.leaves((updates, state)):
        assert leaf.dtype in (jnp.bfloat16, jnp.int32), leaf.dtype
    expected, _ = opt.update(grads32, opt.init(params32), params32)
    for k in expected:
        np.testing.assert_allclose(
            np.asarray(updates[k], np.float32), expected[k], rtol=2e-2, atol=1e-6, err_msg=k
        )


# ---------------------------------------------------------------------------- errors


@pytest.mark.slow
@pytest.mark.parametrize(
    "build, value",
    [
        (lambda: lars(-0.1), "-0.1"),
        (lambda: lars(0.1, momentum=1.0), "1.0"),
        (lambda: lars(0.1, momentum=-0.5), "-0.5"),
        (lambda: lars(0.1, trust_coefficient=0.0), "0.0"),
        (lambda: lars(0.1, eps=-1e-8), "-1e-08"),
        (lambda: lars(0.1, weight_decay=-1e-4), "-0.0001"),
        (lambda: lars(float("nan")), "nan"),
        (lambda: lamb(-1.0), "-1.0"),
        (lambda: lamb(0.1, b1=1.0), "1.0"),
        (lambda: lamb(0.1, b2=-0.1), "-0.1"),
        (lambda: lamb(0.1, eps=-1.0), "-1.0"),
        (lambda: lamb(0.1, weight_decay=-0.01), "-0.01"),
        (lambda: lamb(0.1, max_grad_norm=0.0), "0.0"),
        (lambda: lamb(0.1, freeze_step=0), "freeze_step: 0"),
        (lambda: lamb(0.1, freeze_step=1.5), "freeze_step: 1.5"),
    ],
)
def test_bad_hyperparameters_raise_on_build(build, value):
    with pytest.raises(ValueError, match=value.replace(".", r"\.").replace("+", r"\+")):
        build()


@pytest.mark.slow
@pytest.mark.parametrize(
    "build, error, value",
    [
        (lambda: lars(0.1, nesterov=True, momentum=0.0), ValueError, "momentum=0.0"),
        (lambda: lars(0.1, nesterov=True, momentum=0), ValueError, "momentum=0"),
        (lambda: lars(0.1, nesterov=True, momentum=jnp.float32(0)), ValueError, "momentum="),
        (lambda: lars(0.1, weight_decay=True), TypeError, "weight_decay: True"),
        (lambda: lars(True), TypeError, "learning_rate: True"),
        (lambda: lars(0.1, momentum=np.bool_(False)), TypeError, "momentum: np.False_"),
        (lambda: lars(0.1, eps=jnp.array(True)), TypeError, "eps: Array\\(True"),
        (lambda: lamb(0.1, max_grad_norm=True), TypeError, "max_grad_norm: True"),
        (lambda: lamb(0.1, b1=False), TypeError, "b1: False"),
        (lambda: lars(0.1, nesterov="False"), TypeError, "nesterov: 'False'"),
        (lambda: lars(0.1, trust_clip="yes"), TypeError, "trust_clip: 'yes'"),
        (lambda: lars(0.1, nesterov=1), TypeError, "nesterov: 1"),
        (lambda: lamb(0.1, bias_correction="False"), TypeError, "bias_correction: 'False'"),
        (lambda: lamb(0.1, bias_correction=None), TypeError, "bias_correction: None"),
        (lambda: lars(None), TypeError, "learning_rate: None"),
        (lambda: lars(0.1, momentum=None), TypeError, "momentum: None"),
        (lambda: lars(0.1, trust_coefficient=None), TypeError, "trust_coefficient: None"),
        (lambda: lamb(0.1, eps=None), TypeError, "eps: None"),
        (lambda: lamb(0.1, weight_decay="0.01"), TypeError, "weight_decay: '0.01'"),
        (lambda: lamb(0.1, b2=jnp.ones(2)), TypeError, "b2: Array"),
        (lambda: lamb(0.1, b1=1 + 0j), TypeError, "b1: \\(1\\+0j\\)"),
        (lambda: lars(0.1, momentum=jnp.float32(1.5)), ValueError, "momentum: Array\\(1.5"),
    ],
)
def test_wrong_types_and_nesterov_without_momentum_raise(build, error, value):
    """Bools are not numbers, only True/False are flags, None is no number, and Nesterov
    needs momentum (as in largebatch.torch.LARS)."""
    with pytest.raises(error, match=value):
        build()


def test_decayed_norm_with_zero_norm_skip_is_refused():
    """optax's denominator with apex LARC's zero-norm rule is no one source's update: the
    factory and the transformation refuse it, naming both (as largebatch.torch.LARS)."""
    import re

    from largebatch.jax import scale_by_lars_trust_ratio

    message = (
        "Invalid decayed_norm=True with zero_norm_skip=True: apex LARC's zero-norm rule "
        "(zero_norm_skip) and optax's denominator"
    )
    for build in (
        lambda: lars(0.1, weight_decay=0.1, decayed_norm=True, zero_norm_skip=True),
        lambda: scale_by_lars_trust_ratio(0.1, decayed_norm=True, zero_norm_skip=True),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            build()


def test_numpy_and_jax_scalars_are_numbers_and_flags():
    opts = [
        lars(np.float32(0.1), momentum=jnp.float32(0.9), nesterov=np.bool_(True), eps=np.int64(0)),
        lamb(
            jnp.float32(0.01), b1=np.float64(0.9), max_grad_norm=jnp.int32(1), bias_correction=np.bool_(False)
        ),
    ]
    params = {"w": jnp.ones((2, 2))}
    for opt in opts:
        updates, _ = opt.update(params, opt.init(params), params)
        assert np.isfinite(np.asarray(updates["w"])).all()


def test_update_needs_params():
    params = {"w": jnp.ones((2, 2))}
    for opt in (lars(0.1), lamb(0.1)):
        with pytest.raises(ValueError, match="(?i)params"):
            opt.update(params, opt.init(params))


@pytest.mark.parametrize("make", [lars, lamb])
@pytest.mark.parametrize("rate", [np.float32(0.1), jnp.float32(0.1), jnp.array(0.1)])
def test_array_scalar_rates_step_as_floats(make, rate):
    """A 0-dim NumPy or JAX learning rate is a rate: the same step as the Python float."""
    params = {"w": jnp.arange(1.0, 7.0).reshape(3, 2)}
    grads = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)}
    steps = []
    for lr in (rate, 0.1):
        opt = make(lr, weight_decay=1e-2)
        updates, _ = opt.update(grads, opt.init(params), params)
        steps.append(np.asarray(updates["w"]))
    assert np.any(steps[1] != 0)
    np.testing.assert_allclose(steps[0], steps[1], rtol=1e-6)


# ----------------------------------------------------------------------------- torch


def _torch_groups(torch, params, adapt):
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    groups = [
        {"params": [tensors[k] for k in params if adapt[k]], "trust_ratio": True},
        # Excluded and not decayed, as param_groups and trust_ratio_mask alone have it.
        {"params": [tensors[k] for k in params if not adapt[k]], "trust_ratio": False, "weight_decay": 0.0},
    ]
    return tensors, groups


@pytest.mark.parametrize(
    "name, jax_kw, torch_kw",
    [
        (
            "LARS",
            dict(momentum=0.9, weight_decay=1e-3, trust_coefficient=0.01),
            dict(momentum=0.9, weight_decay=1e-3, trust_coefficient=0.01),
        ),
        (
            "LARS",
            dict(nesterov=True, trust_clip=True, trust_coefficient=0.5, weight_decay=1e-3),
            dict(nesterov=True, trust_clip=True, trust_coefficient=0.5, weight_decay=1e-3),
        ),
        (
            "LAMB",
            dict(b1=0.8, b2=0.99, weight_decay=1e-2, max_grad_norm=1.0),
            dict(betas=(0.8, 0.99), weight_decay=1e-2, max_grad_norm=1.0),
        ),
        (
            "LAMB",
            dict(weight_decay=1e-2, bias_correction=False),
            dict(weight_decay=1e-2, bias_correction=False),
        ),
        ("LAMB", dict(weight_decay=1e-2, freeze_step=2), dict(weight_decay=1e-2, freeze_step=2)),
    ],
)
def test_torch_and_jax_agree(name, jax_kw, torch_kw):
    """Same float32 inputs, same param split: the same params after several steps."""
    torch = pytest.importorskip("torch")
    from largebatch.torch import LAMB, LARS

    params, grads = make_tree_problem(np.float32)
    adapt = exclusion_mask(params)
    tensors, groups = _torch_groups(torch, params, adapt)
    lr = 0.1 if name == "LARS" else 0.01
    opt = (LARS if name == "LARS" else LAMB)(groups, lr, **torch_kw)
    for g in grads:
        for k, t in tensors.items():
            t.grad = torch.tensor(g[k])
        opt.step()
    make = lars if name == "LARS" else lamb
    actual = run_optax(make(lr, trust_ratio_mask=exclusion_mask, **jax_kw), params, grads)
    expected = {k: t.detach().numpy() for k, t in tensors.items()}
    assert_trees_close(actual, expected, RTOL[np.float32], np.float32)


# ---------------------------------------------------------------------------- facade


@pytest.mark.slow
def test_facade_exports_and_imports_no_torch():
    """Every name in largebatch.jax.__all__ exists, and importing it loads no torch."""
    import subprocess
    import sys

    code = (
        "import sys, largebatch.jax as m\n"
        "missing = [n for n in m.__all__ if not hasattr(m, n)]\n"
        "assert not missing, missing\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------ norms


@pytest.mark.parametrize("size", [1, 7, 4099])
@pytest.mark.parametrize("mix", MIXES, ids="+".join)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_norm_is_the_float64_norm_for_every_mix_of_magnitudes(size, mix, jit):
    """A tensor of one element or of many, holding elements of each magnitude class, is
    measured as float64 measures it, compiled or not; complex leaves too."""
    assert_float64_norms(leaf_norms, size, mix, jit)


@pytest.mark.parametrize("values, expected", NON_FINITE)
def test_norm_of_non_finite_elements(values, expected):
    """NaN wherever one element is NaN, else inf wherever one is infinite; zeros give 0."""
    np.testing.assert_equal(float(leaf_norms([jnp.asarray(values, jnp.float32)])[0]), expected)
