"""JAX mixed precision: loss scales, all_finite, skip_if_nonfinite, Policy, a full step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from largebatch.mixed_precision.jax import (
    MAX_LOSS_SCALE,
    DynamicLossScale,
    NoOpLossScale,
    Policy,
    SkipIfNonfiniteState,
    StaticLossScale,
    all_finite,
    get_policy,
    select_tree,
    skip_if_nonfinite,
)


def _bits(tree):
    """Each leaf's raw bytes: equality here is bitwise (NaN == NaN, -0.0 != +0.0)."""
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


def _assert_same_bits(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for i, (x, y) in enumerate(zip(_bits(got), _bits(want))):
        assert x == y, f"leaf {i}: got {jax.tree.leaves(got)[i]}, want {jax.tree.leaves(want)[i]}"


def _optimizers():
    """Inner optimizers for the skip and train-step tests: optax's and, once it exists, ours."""
    opts = {"sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9)}
    try:
        from largebatch.lars.jax import lamb, lars
    except ImportError:  # before largebatch.lars.jax exists: optax's LAMB has the same state
        opts["optax_lamb"] = lambda: optax.lamb(1e-2, weight_decay=1e-2)
        return opts
    opts["lars"] = lambda: lars(0.1, weight_decay=1e-4)
    opts["lamb"] = lambda: lamb(1e-2, weight_decay=1e-2)
    return opts


OPTIMIZERS = _optimizers()


# ---------------------------------------------------------------------------------------
# DynamicLossScale.


def _gradscaler_rule(flags, scale, period, factor, floor):
    """torch.amp.GradScaler's update rule, written out in Python, with a floor."""
    counter, out = 0, []
    for finite in flags:
        if finite:
            counter += 1
            if counter == period:
                scale, counter = scale * factor, 0
        else:
            scale, counter = max(scale / factor, floor), 0
        out.append((scale, counter))
    return out


def test_defaults_match_gradscaler():
    ls = DynamicLossScale(2.0**16)
    assert (ls.period, ls.factor, ls.min_loss_scale) == (2000, 2.0, 1.0)
    assert ls.loss_scale.dtype == jnp.float32 and ls.counter.dtype == jnp.int32
    assert int(ls.counter) == 0


def test_adjust_follows_gradscaler_rule_under_jit():
    rng = np.random.default_rng(0)
    # Down to the floor, a long finite run, then random overflows (a mid-period reset).
    flags = np.concatenate([[False] * 6, [True] * 23, rng.random(250) < 0.85])
    ls = DynamicLossScale(2.0**4, period=5)
    adjust = jax.jit(lambda s, f: s.adjust(f))
    got = []
    for finite in flags:
        ls = adjust(ls, jnp.asarray(finite))
        got.append((float(ls.loss_scale), int(ls.counter)))
    want = _gradscaler_rule(flags, 2.0**4, 5, 2.0, 1.0)
    scales = [s for s, _ in want]
    assert scales.count(1.0) > 1 and max(scales) > 2.0**4  # the floor and growth both happen
    assert got == want
    assert adjust._cache_size() == 1


def test_adjust_matches_torch_amp_update_scale():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    flags = rng.random(200) < 0.8
    scale, tracker = torch.tensor([2.0**10]), torch.tensor([0], dtype=torch.int32)
    ls = DynamicLossScale(2.0**10, period=3, min_loss_scale=2.0**-40)  # GradScaler has no floor
    seen = set()
    for finite in flags:
        found_inf = torch.tensor([0.0 if finite else 1.0])
        torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 3)
        ls = ls.adjust(bool(finite))
        assert (float(ls.loss_scale), int(ls.counter)) == (scale.item(), tracker.item())
        seen.add(scale.item())
    assert min(seen) > 2.0**-40 and len(seen) > 5


def test_growth_after_period_and_reset_on_overflow():
    ls = DynamicLossScale(2.0**10, period=3)
    ls = ls.adjust(True).adjust(True)
    assert (float(ls.loss_scale), int(ls.counter)) == (2.0**10, 2)
    ls = ls.adjust(False)  # overflow mid-period: halve, restart the count
    assert (float(ls.loss_scale), int(ls.counter)) == (2.0**9, 0)
    ls = ls.adjust(True).adjust(True)
    assert float(ls.loss_scale) == 2.0**9
    ls = ls.adjust(True)
    assert (float(ls.loss_scale), int(ls.counter)) == (2.0**10, 0)


def test_min_loss_scale_survives_jit():
    ls = DynamicLossScale(16.0, period=10, factor=2, min_loss_scale=3.0)
    shrink = jax.jit(lambda s: s.adjust(jnp.array(False)))
    seen = []
    for _ in range(10):
        ls = shrink(ls)
        assert ls.min_loss_scale == 3.0 and ls.period == 10 and ls.factor == 2.0
        seen.append(float(ls.loss_scale))
    assert seen == [8.0, 4.0] + [3.0] * 8
    assert shrink._cache_size() == 1


def test_min_loss_scale_survives_scan():
    ls = DynamicLossScale(2.0**8, min_loss_scale=0.5)

    def body(carry, _):
        carry = carry.adjust(False)
        return carry, carry.loss_scale

    out, scales = jax.jit(lambda s: jax.lax.scan(body, s, None, length=20))(ls)
    assert out.min_loss_scale == 0.5 and float(out.loss_scale) == 0.5
    np.testing.assert_array_equal(np.asarray(scales), np.maximum(2.0 ** (7 - np.arange(20.0)), 0.5))


def test_pytree_round_trip_keeps_every_field():
    ls = DynamicLossScale(2.0**12, counter=5, period=7, factor=3, min_loss_scale=0.25)
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert len(leaves) == 2
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
    assert paths == [".loss_scale", ".counter"]

    def check(other):
        assert isinstance(other, DynamicLossScale)
        assert (other.period, other.factor, other.min_loss_scale) == (7, 3.0, 0.25)
        assert float(other.loss_scale) == 2.0**12 and int(other.counter) == 5

    check(jax.tree_util.tree_unflatten(treedef, leaves))
    check(jax.tree.map(lambda x: x, ls))
    check(jax.jit(lambda s: s)(ls))
    check(jax.device_put(ls))
    # Static fields are part of the structure: a different floor is a different tree.
    other = DynamicLossScale(2.0**12, counter=5, period=7, factor=3, min_loss_scale=0.5)
    assert jax.tree.structure(other) != treedef


def test_scale_stays_finite_at_the_float32_limit():
    ls = DynamicLossScale(2.0**124, period=1)
    for _ in range(5):
        ls = jax.jit(lambda s: s.adjust(True))(ls)
        assert np.isfinite(float(ls.loss_scale))
    assert float(ls.loss_scale) == MAX_LOSS_SCALE
    # Its reciprocal is a normal float32: unscaling does not flush to zero.
    assert float(ls.unscale(jnp.ones((), jnp.float32))) == 2.0**-126
    ls = DynamicLossScale(5e37, period=1, factor=3)  # not a power of two
    assert float(ls.adjust(True).loss_scale) == MAX_LOSS_SCALE


def test_scale_unscale():
    ls = DynamicLossScale(2.0**10)
    tree = {
        "f32": jnp.array([1.5, -3.0], jnp.float32),
        "bf16": jnp.array([0.25], jnp.bfloat16),
        "f16": jnp.array([2.0**-20], jnp.float16),  # a float16 subnormal: rescued by S
        "step": jnp.array(7, jnp.int32),
    }
    scaled = ls.scale(tree)
    assert jax.tree.map(lambda x: x.dtype, scaled) == jax.tree.map(lambda x: x.dtype, tree)
    np.testing.assert_array_equal(scaled["f32"], np.array([1536.0, -3072.0], np.float32))
    assert float(scaled["f16"][0]) == 2.0**-10
    assert int(scaled["step"]) == 7
    _assert_same_bits(ls.unscale(scaled), tree)
    # A float16 value pushed above 65504 overflows: that is what adjust reacts to.
    assert not bool(all_finite(DynamicLossScale(2.0**16).scale(jnp.ones((), jnp.float16))))


def test_static_and_noop():
    ls = StaticLossScale(128.0)
    assert ls.adjust(jnp.array(False)) is ls
    assert float(ls.scale(jnp.float32(2.0))) == 256.0
    assert float(ls.unscale(jnp.float32(256.0))) == 2.0
    out = jax.jit(lambda s: s.adjust(False))(ls)
    assert isinstance(out, StaticLossScale) and float(out.loss_scale) == 128.0
    noop = NoOpLossScale()
    x = {"a": jnp.ones(3, jnp.bfloat16)}
    assert noop.scale(x) is x and noop.unscale(x) is x and noop.adjust(False) is noop
    assert float(noop.loss_scale) == 1.0
    assert jax.tree.leaves(noop) == [] and isinstance(jax.jit(lambda s: s)(noop), NoOpLossScale)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: DynamicLossScale(0.0), "loss_scale: 0.0"),
        (lambda: DynamicLossScale(-2.0), "loss_scale: -2.0"),
        (lambda: DynamicLossScale(float("inf")), "loss_scale: inf"),
        (lambda: DynamicLossScale(float("nan")), "loss_scale: nan"),
        (lambda: DynamicLossScale(2.0**127), "loss_scale"),
        (lambda: DynamicLossScale(8.0, period=0), "period: 0"),
        (lambda: DynamicLossScale(8.0, period=2.5), "period: 2.5"),
        (lambda: DynamicLossScale(8.0, factor=1), "factor: 1"),
        (lambda: DynamicLossScale(8.0, factor=0.5), "factor: 0.5"),
        (lambda: DynamicLossScale(8.0, min_loss_scale=0.0), "min_loss_scale: 0.0"),
        (lambda: DynamicLossScale(8.0, min_loss_scale=16.0), "min_loss_scale: 16.0 > loss_scale"),
        (lambda: DynamicLossScale(8.0, counter=-1), "counter: -1"),
        (lambda: StaticLossScale(0.0), "loss_scale: 0.0"),
        (lambda: Policy(compute_dtype="float8"), "'float8'"),
        (lambda: Policy(param_dtype=jnp.int32), "int32"),
        (lambda: get_policy("params=float32,compute=fp12"), "'fp12'"),
        (lambda: get_policy("params=float32,weights=float16"), "'weights=float16'"),
        (lambda: get_policy("compute=float16,c=bfloat16"), "'c'"),
    ],
)
def test_bad_input_raises_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_dynamic_loss_scale_takes_numpy_and_jax_scalars():
    """0-dim NumPy and JAX numbers are numbers: stored as Python ones, the rule unchanged."""
    ls = DynamicLossScale(
        loss_scale=jnp.float32(2**15),
        min_loss_scale=jnp.float32(2**14),
        period=jnp.int32(2),
        factor=np.float32(2.0),
        counter=np.int64(1),
    )
    assert (ls.period, ls.factor, ls.min_loss_scale) == (2, 2.0, 2.0**14)
    assert all(type(v) in (int, float) for v in (ls.period, ls.factor, ls.min_loss_scale))
    same = DynamicLossScale(2.0**15, counter=1, period=2, factor=2.0, min_loss_scale=2.0**14)
    assert jax.tree.structure(ls) == jax.tree.structure(same)  # the same static fields
    backed_off = jax.jit(lambda s: s.adjust(False).adjust(False))(ls)
    assert float(backed_off.loss_scale) == 2.0**14  # floored at min_loss_scale
    grown = jax.jit(lambda s: s.adjust(True))(ls)
    assert float(grown.loss_scale) == 2.0**16 and int(grown.counter) == 0
    assert float(DynamicLossScale(np.float64(4.0), min_loss_scale=np.int32(4)).loss_scale) == 4.0


@pytest.mark.parametrize(
    "kw, error, match",
    [
        (dict(min_loss_scale=True), TypeError, r"min_loss_scale: True \(a bool"),
        (dict(min_loss_scale=jnp.bool_(True)), TypeError, "min_loss_scale: .*True"),
        (dict(min_loss_scale=None), TypeError, "min_loss_scale: None"),
        (dict(min_loss_scale=jnp.ones(2)), TypeError, "min_loss_scale"),
        (dict(min_loss_scale=jnp.float32(float("nan"))), ValueError, "min_loss_scale: nan"),
        (dict(min_loss_scale=np.float32(0.0)), ValueError, "min_loss_scale: 0.0"),
        (dict(min_loss_scale=jnp.float32(2.0**127)), ValueError, "min_loss_scale: 1.7"),
        (dict(min_loss_scale=jnp.float32(16.0)), ValueError, "min_loss_scale: 16.0 > loss_scale"),
        (dict(period=jnp.float32(2.5)), ValueError, "period: 2.5"),
        (dict(period=True), TypeError, "period: True"),
        (dict(factor=np.bool_(True)), TypeError, "factor: .*True"),
        (dict(factor=jnp.float32(1.0)), ValueError, "factor: 1.0"),
        (dict(loss_scale=True), TypeError, "loss_scale: True"),
        (dict(loss_scale="8"), TypeError, "loss_scale: '8'"),
        (dict(counter=True), TypeError, "counter: True"),
    ],
)
def test_dynamic_loss_scale_refuses_bools_nan_and_out_of_range(kw, error, match):
    with pytest.raises(error, match=match) as info:
        DynamicLossScale(**{"loss_scale": 8.0, **kw})
    assert " it " not in str(info.value)  # the message states the rule, not a pronoun


# ---------------------------------------------------------------------------------------
# all_finite and select_tree.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_all_finite(dtype, bad):
    tree = {"a": jnp.zeros((3, 5), dtype), "b": [jnp.ones(4, jnp.float32), jnp.arange(3)]}
    check = jax.jit(all_finite)
    assert check(tree).dtype == jnp.bool_ and check(tree).shape == ()
    assert bool(check(tree))
    for i in range(0, 15, 7):  # the first, a middle and the last element
        broken = {**tree, "a": tree["a"].reshape(-1).at[i].set(bad).reshape(3, 5)}
        assert not bool(check(broken)), (i, broken["a"])
    assert not bool(all_finite({**tree, "b": [jnp.array([bad], dtype), jnp.arange(3)]}))


def test_all_finite_edge_cases():
    assert bool(all_finite({})) and bool(all_finite([jnp.arange(4)]))  # nothing floating
    assert bool(all_finite(jnp.array(65504.0, jnp.float16)))
    assert not bool(all_finite(jnp.array(65504.0, jnp.float16) * jnp.float16(2)))
    assert bool(all_finite(jnp.array(3e38, jnp.bfloat16)))  # bf16 has float32's range


def test_select_tree():
    a, b = {"x": jnp.ones(2), "n": jnp.int32(1)}, {"x": jnp.zeros(2), "n": jnp.int32(2)}
    _assert_same_bits(jax.jit(select_tree)(jnp.array(True), a, b), a)
    _assert_same_bits(jax.jit(select_tree)(jnp.array(False), a, b), b)
    with pytest.raises(ValueError, match=r"\(2,\)"):
        select_tree(jnp.array([True, False]), a, b)


# ---------------------------------------------------------------------------------------
# skip_if_nonfinite.


def _params():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((4, 3)), jnp.float32),
        "b": jnp.array([0.5, -0.0, 0.0], jnp.float32),  # -0.0 must keep its sign
        "h": jnp.asarray(rng.standard_normal(3), jnp.float16),
    }


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_skip_if_nonfinite_leaves_params_and_state_bitwise(name):
    inner = OPTIMIZERS[name]()
    opt = skip_if_nonfinite(inner)
    params = _params()
    good = jax.tree.map(lambda p: np.full(p.shape, 0.25, p.dtype), params)

    @jax.jit
    def step(p, s, g):
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    state = opt.init(params)
    for i, bad in enumerate((float("nan"), float("inf"))):
        if i == 1:  # a finite step between the bad ones: momentum and counts move
            params, state = step(params, state, good)
        grads = {**good, "w": good["w"].copy()}
        grads["w"][1, 2] = bad
        new_params, new_state = step(params, state, grads)
        _assert_same_bits(new_params, params)
        _assert_same_bits(new_state.inner_state, state.inner_state)
        assert not bool(new_state.last_finite)
        assert int(new_state.skipped) == int(state.skipped) + 1
        params, state = new_params, new_state
    assert int(state.skipped) == 2
    # A finite step after the skips is exactly the inner optimizer's step.
    want_u, want_s = jax.jit(inner.update)(good, state.inner_state, params)
    new_params, new_state = step(params, state, good)
    _assert_same_bits(new_params, jax.jit(optax.apply_updates)(params, want_u))
    _assert_same_bits(new_state.inner_state, want_s)
    assert bool(new_state.last_finite) and isinstance(new_state, SkipIfNonfiniteState)
    assert step._cache_size() == 1


# ---------------------------------------------------------------------------------------
# Real float16 overflow in a forward/backward pass.


def _fp16_loss(params, x, policy):
    p = policy.cast_to_compute(params)
    out = policy.cast_to_output((x @ p["w1"] + p["b1"]) @ p["w2"])
    return jnp.mean(out**2)


def _float64_grads(params, x):
    """The gradients of ``_fp16_loss``, by hand, in float64."""
    w1, b1, w2 = (np.asarray(params[k], np.float64) for k in ("w1", "b1", "w2"))
    x = np.asarray(x, np.float64)
    h = x @ w1 + b1
    d_out = 2 * (h @ w2) / (h.shape[0] * w2.shape[1])
    d_h = d_out @ w2.T
    return {"w1": x.T @ d_h, "b1": d_h.sum(0), "w2": h.T @ d_out}


def test_fp16_overflow_skips_step_and_halves_scale():
    policy = get_policy("params=float32,compute=float16,output=float32")
    rng = np.random.default_rng(1)
    b1 = np.zeros(16, np.float32)
    b1[3] = -0.0
    params = {
        "w1": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
        "b1": jnp.asarray(b1),
        "w2": jnp.asarray(rng.standard_normal((16, 4)) * 0.5, jnp.float32),
    }
    x = jnp.asarray(rng.standard_normal((32, 8)), jnp.float16)
    opt = skip_if_nonfinite(optax.sgd(1e-3, momentum=0.9))

    @jax.jit
    def train_step(params, opt_state, ls, x):
        scaled_loss_fn = lambda p: ls.scale(_fp16_loss(p, x, policy))  # noqa: E731
        scaled_loss, scaled_grads = jax.value_and_grad(scaled_loss_fn)(params)
        grads = ls.unscale(scaled_grads)
        finite = all_finite(grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, ls.adjust(finite), finite, grads, scaled_loss

    ls, opt_state = DynamicLossScale(2.0**16), opt.init(params)
    skipped = 0
    while True:
        new_params, new_state, new_ls, finite, grads, scaled_loss = train_step(params, opt_state, ls, x)
        assert np.isfinite(scaled_loss)  # the float32 loss is fine: the float16 backward overflows
        if bool(finite):
            break
        skipped += 1
        assert not all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
        _assert_same_bits(new_params, params)
        _assert_same_bits(new_state.inner_state, opt_state.inner_state)
        assert float(new_ls.loss_scale) == float(ls.loss_scale) / 2 and int(new_ls.counter) == 0
        params, opt_state, ls = new_params, new_state, new_ls
        assert skipped < 16, "the scale never got low enough"
    # Params never moved, so only the scale differs between the skipped steps and this one.
    assert skipped >= 2, f"expected float16 overflow at scale 2**16, got {skipped} skips"
    assert int(new_state.skipped) == skipped and int(new_ls.counter) == 1
    # The first finite step: float16 gradients, unscaled, agree with float64 ones.
    want = _float64_grads(params, x)
    for k in params:
        atol = 2e-2 * np.abs(want[k]).max()
        np.testing.assert_allclose(grads[k], want[k], rtol=2e-2, atol=atol, err_msg=k)
    assert not np.array_equal(new_params["w1"], params["w1"])
    assert train_step._cache_size() == 1


# ---------------------------------------------------------------------------------------
# A full data-parallel train step inside one jit.


def test_policy():
    p = get_policy(" Params = float32 , compute=bf16,OUTPUT=fp32 ")
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == (
        jnp.float32,
        jnp.bfloat16,
        jnp.float32,
    )
    assert get_policy(str(p)) == p and get_policy("c=half") == Policy(compute_dtype=jnp.float16)
    assert get_policy("") == Policy()
    tree = {"w": jnp.ones(2, jnp.float32), "i": jnp.arange(2), "k": jax.random.key(0), "lr": 0.5}
    out = p.cast_to_compute(tree)
    assert out["w"].dtype == jnp.bfloat16 and out["i"].dtype == tree["i"].dtype
    assert out["k"] is tree["k"] and out["lr"] == 0.5
    assert p.cast_to_param(out)["w"].dtype == jnp.float32
    assert p.cast_to_output(out)["w"].dtype == jnp.float32
    h = Policy("float32", "float16", "float16")
    assert jax.jit(h.cast_to_output)(tree)["w"].dtype == jnp.float16


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_jitted_data_parallel_train_step(name):
    policy = get_policy("params=float32,compute=float16,output=float32")
    opt = skip_if_nonfinite(OPTIMIZERS[name]())
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    replicated = jax.NamedSharding(mesh, jax.P())
    sharded = jax.NamedSharding(mesh, jax.P("data"))
    rng = np.random.default_rng(2)
    params = {
        "w": (rng.standard_normal((6, 3)) * 0.5).astype(np.float32),
        "b": np.zeros(3, np.float32),
    }
    x = rng.standard_normal((64, 6)).astype(np.float32)
    y = rng.standard_normal((64, 3)).astype(np.float32)

    def loss_fn(p, x, y):
        p, x = policy.cast_to_compute((p, x))
        out = policy.cast_to_output(x @ p["w"] + p["b"])
        return jnp.mean((out - y) ** 2)

    traces = []

    @jax.jit
    def step(params, opt_state, ls, x, y, poison):
        traces.append(1)  # runs once per trace: counts recompiles
        scaled_grads = jax.grad(lambda p: ls.scale(loss_fn(p, x, y)))(params)
        grads = ls.unscale(scaled_grads)
        grads = jax.tree.map(lambda g: g * poison, grads)  # poison = NaN makes a bad step
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, ls.adjust(all_finite(grads))

    params, ls = jax.device_put((params, DynamicLossScale(2.0**8, period=2)), replicated)
    opt_state = jax.device_put(opt.init(params), replicated)
    x, y = jax.device_put((x, y), sharded)
    one, nan = jax.device_put((np.float32(1), np.float32(np.nan)), replicated)
    loss_at = jax.jit(loss_fn)
    loss0 = float(loss_at(params, x, y))
    with jax.transfer_guard("disallow"):  # no host round trip anywhere in the loop
        history = []
        for i in range(12):
            poisoned = i == 5
            before = (params, opt_state)
            params, opt_state, ls = step(params, opt_state, ls, x, y, nan if poisoned else one)
            if poisoned:
                history.append(before)
                history.append((params, opt_state))
    _assert_same_bits(history[1][0], history[0][0])
    _assert_same_bits(history[1][1].inner_state, history[0][1].inner_state)
    # 11 finite steps, one NaN after 5 of them: 2**8 -> 2**10 -> 2**9 -> 2**12.
    assert float(ls.loss_scale) == 2.0**12 and ls.min_loss_scale == 1.0
    assert int(opt_state.skipped) == 1
    assert float(loss_at(params, x, y)) < loss0
    assert len(traces) == 1


def test_public_names_in_facade():
    import largebatch.jax as facade
    import largebatch.mixed_precision.jax as mp

    for name in mp.__all__:
        assert name in facade.__all__ and getattr(facade, name) is getattr(mp, name), name
