"""The conventions every optax optimizer keeps, checked on one table of lars/lamb cases.

Each check runs over every row of ``CASES``: hyperparameters injected as traced state
(``optax.inject_hyperparams``), gradient accumulation (``optax.MultiSteps``), skipped
non-finite steps (``optax.apply_if_finite``), one compilation for many steps, stable
dtypes, complex parameters, and a state that survives flattening and the host.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from cases import run_spec_tree  # noqa: E402
from helpers import assert_trees_equal, run_optax  # noqa: E402

from largebatch.jax import exclusion_mask, lamb, lars  # noqa: E402

SHAPES = {"w": (4, 3), "v": (3, 2), "b": (3,)}
ADAPT = {"w": True, "v": True, "b": False}  # a static pytree mask
NO_DECAY_W = {"w": False, "v": True, "b": True}

CASES = {
    "lars": (lars, dict(learning_rate=0.1)),
    "lars_wd_nesterov_clip": (
        lars,
        dict(
            learning_rate=0.3,
            momentum=0.8,
            weight_decay=1e-2,
            trust_coefficient=0.5,
            nesterov=True,
            trust_clip=True,
        ),
    ),
    "lars_eps_no_momentum": (
        lars,
        dict(
            learning_rate=0.2,
            momentum=0.0,
            eps=1e-3,
            weight_decay=1e-3,
            trust_coefficient=0.1,
        ),
    ),
    "lars_exclusion": (
        lars,
        dict(
            learning_rate=0.1,
            weight_decay=1e-2,
            trust_coefficient=0.02,
            trust_ratio_mask=exclusion_mask,
        ),
    ),
    "lars_both_masks": (
        lars,
        dict(
            learning_rate=0.1,
            weight_decay=1e-2,
            trust_ratio_mask=ADAPT,
            weight_decay_mask=NO_DECAY_W,
        ),
    ),
    "lamb": (lamb, dict(learning_rate=0.01)),
    "lamb_wd_max_grad_norm": (lamb, dict(learning_rate=0.01, weight_decay=1e-2, max_grad_norm=1.0)),
    "lamb_uncorrected": (
        lamb,
        dict(
            learning_rate=0.01,
            b1=0.8,
            b2=0.99,
            eps=1e-3,
            weight_decay=1e-2,
            bias_correction=False,
        ),
    ),
    "lamb_masks": (
        lamb,
        dict(
            learning_rate=0.01,
            weight_decay=1e-2,
            trust_ratio_mask=exclusion_mask,
            weight_decay_mask=NO_DECAY_W,
        ),
    ),
}
NAMES = list(CASES)


def build(name, **override):
    factory, kw = CASES[name]
    return factory(**{**kw, **override})


def injected(name):
    """``optax.inject_hyperparams`` over the case; callable masks are not schedules."""
    factory, kw = CASES[name]
    static = [k for k, v in kw.items() if k.endswith("_mask") and callable(v)]
    return optax.inject_hyperparams(factory, static_args=static)(**kw)


def make_tree(rng, scale=1.0, dtype=jnp.float32):
    return {k: jnp.asarray(scale * rng.standard_normal(s), dtype) for k, s in SHAPES.items()}


def problem(n_grads, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    params = make_tree(rng, 1.0, dtype)
    return params, [make_tree(rng, 0.3, dtype) for _ in range(n_grads)]


def run(opt, params, grads, jit=False):
    """Feed ``grads`` in turn; returns the final params and state."""
    return run_optax(opt, params, grads, jit=jit)


def assert_close(a, b, rtol=1e-5):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol * np.max(np.abs(y), initial=0.0))


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def avals(tree):
    return [(jnp.result_type(x), jnp.shape(x), getattr(x, "weak_type", False)) for x in jax.tree.leaves(tree)]


# ------------------------------------------------------------------ inject_hyperparams


@pytest.mark.parametrize("name", NAMES)
def test_inject_hyperparams_jits_once_and_equals_plain(name):
    """Every numeric hyperparameter becomes traced state and the numbers do not change:
    the jitted injected update gives the plain optimizer's params. A new rate in the
    state is a new value, not a new trace."""
    params, grads = problem(3)
    opt = injected(name)
    traces = []

    def update(g, s, p):
        traces.append(None)
        return opt.update(g, s, p)

    jitted = jax.jit(update)
    state = opt.init(params)
    numeric = {k for k, v in CASES[name][1].items() if isinstance(v, float)}
    assert numeric <= set(state.hyperparams), state.hyperparams.keys()
    rates = [CASES[name][1]["learning_rate"], 0.02, 0.3]
    p = params
    for i, g in enumerate(grads):
        if i:  # the first step runs on the values inject_hyperparams stored
            state.hyperparams["learning_rate"] = jnp.asarray(rates[i], jnp.float32)
        updates, state = jitted(g, state, p)
        p = optax.apply_updates(p, updates)
    assert len(traces) == 1 and jitted._cache_size() == 1
    schedule = lambda count: jnp.asarray(rates, jnp.float32)[count]  # noqa: E731
    expected, _ = run(build(name, learning_rate=schedule), params, grads)
    assert_close(p, expected)


@pytest.mark.parametrize("factory", [lars, lamb])
@pytest.mark.parametrize("mask", ["trust_ratio_mask", "weight_decay_mask"])
def test_inject_hyperparams_without_static_args_refuses_a_mask(factory, mask):
    """Without ``static_args``, inject_hyperparams takes a callable mask for a schedule
    (``exclusion_mask`` of the step count is False: no leaf adapted) and an array mask
    for a traced hyperparameter: both are refused, naming static_args."""
    params, grads = problem(1)
    with pytest.raises(TypeError, match="called on a step count .* static_args"):
        optax.inject_hyperparams(factory)(
            learning_rate=0.1, weight_decay=1e-2, **{mask: exclusion_mask}
        ).init(params)
    opt = optax.inject_hyperparams(factory)(learning_rate=0.1, **{mask: jnp.asarray(True)})
    with pytest.raises(TypeError, match=f"Invalid {mask}: an array .* static_args"):
        opt.init(params)
    with pytest.raises(TypeError, match=f"Invalid {mask}: an array"):
        factory(0.1, **{mask: np.array([True, False, True])})
    # Named in static_args, the mask is the mask.
    opt = optax.inject_hyperparams(factory, static_args=mask)(
        learning_rate=0.1, weight_decay=1e-2, **{mask: exclusion_mask}
    )
    expected, _ = run(factory(0.1, weight_decay=1e-2, **{mask: exclusion_mask}), params, grads)
    assert_close(run(opt, params, grads, jit=True)[0], expected)


# ------------------------------------------------------------------- optax wrappers


@pytest.mark.parametrize("name", NAMES)
def test_multi_steps_equals_the_averaged_gradient(name):
    k = 2
    params, grads = problem(2 * k)
    actual, _ = run(optax.MultiSteps(build(name), every_k_schedule=k), params, grads, jit=True)
    means = [jax.tree.map(lambda *g: sum(g) / k, *grads[i : i + k]) for i in (0, k)]
    expected, _ = run(build(name), params, means)
    assert_close(actual, expected)


@pytest.mark.parametrize("name", NAMES)
def test_apply_if_finite_skips_a_nan_step(name):
    start, (g0, g1) = problem(2)
    bad = {**g1, "w": g1["w"].at[1, 2].set(jnp.nan)}
    opt = optax.apply_if_finite(build(name), max_consecutive_errors=2)
    update = jax.jit(opt.update)
    state = opt.init(start)
    updates, state = update(g0, state, start)
    params = optax.apply_updates(start, updates)
    updates, skipped = update(bad, state, params)
    assert_same(optax.apply_updates(params, updates), params)
    assert_same(skipped.inner_state, state.inner_state)
    assert int(skipped.notfinite_count) == 1 and not bool(skipped.last_finite)
    # The next finite step continues as if the bad one had never come.
    updates, _ = update(g1, skipped, params)
    expected, _ = run(build(name), start, [g0, g1])
    assert_close(optax.apply_updates(params, updates), expected)


# --------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize(
    "dtype, hyper",
    [(jnp.float32, "python"), (jnp.bfloat16, "python"), (jnp.bfloat16, "float32_arrays")],
)
@pytest.mark.parametrize("name", NAMES)
def test_updates_and_state_keep_the_params_dtype(name, dtype, hyper):
    """Updates and moments in the params' dtype, int32 counts, the same avals every step,
    whether the hyperparameters are Python floats or float32 arrays."""
    factory, kw = CASES[name]
    if hyper == "float32_arrays":
        kw = {k: jnp.float32(v) if isinstance(v, float) else v for k, v in kw.items()}
    opt = factory(**kw)
    params, grads = problem(3, dtype)
    state = opt.init(params)
    first = avals(state)
    for g in grads:
        updates, state = opt.update(g, state, params)
        assert avals(updates) == avals(params)
        assert avals(state) == first
        params = optax.apply_updates(params, updates)
    assert {d for d, _, _ in first} <= {jnp.dtype(dtype), jnp.dtype(jnp.int32)}


# -------------------------------------------------------------------------- complex


def crandn(rng, shape):
    return rng.standard_normal(shape) + 1j * rng.standard_normal(shape)


_rng = np.random.default_rng(1)
X, Y = crandn(_rng, (6, 4)), crandn(_rng, (6, 3))
TARGET_V = crandn(_rng, SHAPES["v"])


def complex_loss(p):
    """A least-squares problem in complex parameters (a real loss)."""
    fit = jnp.asarray(X, jnp.complex64) @ p["w"] + p["b"] - jnp.asarray(Y, jnp.complex64)
    rest = p["v"] - jnp.asarray(TARGET_V, jnp.complex64)
    return jnp.sum(jnp.abs(fit) ** 2) + jnp.sum(jnp.abs(rest) ** 2)


@jax.jit
def complex_grad(p):
    """The descent direction: JAX's gradient of a real loss in complex inputs, conjugated."""
    return jax.tree.map(jnp.conj, jax.grad(complex_loss)(p))


def complex_params():
    rng = np.random.default_rng(3)
    return {k: jnp.asarray(crandn(rng, s), jnp.complex64) for k, s in SHAPES.items()}


def real_view(z):
    return np.stack([np.real(z), np.imag(z)], axis=-1).astype(np.float64)


@pytest.mark.parametrize("name", NAMES)
def test_complex_least_squares_descends(name):
    """Complex leaves train: the loss goes down and the params stay complex64."""
    opt = build(name)
    params = complex_params()
    state = opt.init(params)
    losses = [float(complex_loss(params))]
    for _ in range(5):
        updates, state = opt.update(complex_grad(params), state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(complex_loss(params)))
    assert all(x.dtype == jnp.complex64 for x in jax.tree.leaves(params))
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("lars")])
def test_complex_lars_is_lars_on_the_real_view(name):
    """|z|^2 = re^2 + im^2 and the LARS step is linear in (g, w): on complex leaves it is
    the reference step on (re, im) pairs."""
    factory, kw = CASES[name]
    params = complex_params()
    grads = [complex_grad(params), jax.tree.map(lambda g: 0.5j * g, complex_grad(params))]
    actual, _ = run(factory(**kw), params, grads)
    ref_kw = {k: v for k, v in kw.items() if k != "learning_rate"}
    if callable(ref_kw.get("trust_ratio_mask")):  # of the complex leaves, not of their real views
        ref_kw["trust_ratio_mask"] = ref_kw["trust_ratio_mask"](params)
    views = lambda tree: {k: real_view(x) for k, x in tree.items()}  # noqa: E731
    expected = run_spec_tree(
        "lars", views(params), [views(g) for g in grads], lr=kw["learning_rate"], **ref_kw
    )
    for k, w in expected.items():
        np.testing.assert_allclose(real_view(actual[k]), w, rtol=2e-5, atol=2e-5 * np.abs(w).max())


def _decayed(p):  # weight_decay_mask given: decay apart from the trust ratio
    return {k: bool(NO_DECAY_W[k]) for k in p}


COMPLEX_TWINS = {  # optax's LAMB pieces are complex-aware; these rows have an optax twin
    "lamb": lambda: optax.lamb(0.01),
    "lamb_wd_max_grad_norm": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.lamb(0.01, weight_decay=1e-2)
    ),
    "lamb_masks": lambda: optax.chain(
        optax.scale_by_adam(eps=1e-6),
        optax.add_decayed_weights(1e-2, _decayed),
        optax.masked(optax.scale_by_trust_ratio(), exclusion_mask),
        optax.scale_by_learning_rate(0.01),
    ),
}


@pytest.mark.parametrize("name", list(COMPLEX_TWINS))
def test_complex_lamb_equals_optax(name):
    params = complex_params()
    grads = [complex_grad(params), jax.tree.map(lambda g: (0.3 - 2j) * g, complex_grad(params))]
    actual, _ = run(build(name), params, grads)
    expected, _ = run(COMPLEX_TWINS[name](), params, grads)
    assert_close(actual, expected)


# ------------------------------------------------------------------------ the state


@pytest.mark.parametrize("name", NAMES)
def test_state_is_deterministic_flattens_and_survives_the_host(name):
    opt = build(name)
    params, (g0, g1) = problem(2)
    assert_same(opt.init(params), opt.init(params))
    u0, state = opt.update(g0, opt.init(params), params)
    u0_again, state_again = opt.update(g0, opt.init(params), params)
    assert_same((u0, state), (u0_again, state_again))
    leaves, treedef = jax.tree.flatten(state)
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert type(rebuilt) is type(state) and avals(rebuilt) == avals(state)
    host = jax.device_get(state)
    assert jax.tree.structure(host) == treedef
    params = optax.apply_updates(params, u0)
    expected = opt.update(g1, state, params)
    assert_same(opt.update(g1, rebuilt, params), expected)
    assert_same(opt.update(g1, host, params), expected)
    assert_close(jax.jit(opt.update)(g1, host, params), expected)


@pytest.mark.parametrize("name", NAMES)
def test_update_accepts_extra_args_as_optax_aliases_do(name):
    """optax's aliases are GradientTransformationExtraArgs: update takes keyword
    arguments it does not use (optax.contrib's test_optimizers_accept_extra_args)."""
    opt = build(name)
    assert isinstance(opt, optax.GradientTransformationExtraArgs)
    params = {"w": jnp.ones((3, 2)), "v": jnp.ones(4), "b": jnp.zeros(2)}
    state = opt.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    with_extra, _ = opt.update(grads, state, params, value=jnp.array(1.0), unused="x")
    plain, _ = opt.update(grads, state, params)
    assert_trees_equal(with_extra, plain)
