"""The fused JAX path (``lars(..., fused=True)``, ``lamb(..., fused=True)``): its Pallas
kernels run interpreted on the CPU. Held to the float64 spec on every case of
tests/cases.py, to the unfused path on awkward trees, and to optax's conventions
(inject_hyperparams, MultiSteps, apply_if_finite, jit, donation, shard_map)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from cases import CASE_IDS, CASES, TOLERANCE, Result, assert_matches, make_problem, run_jax, run_reference  # noqa: E402
from helpers import assert_trees_equal, run_optax, shard_map  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from largebatch.jax import exclusion_mask, lamb, lars, make_schedule  # noqa: E402
from largebatch.lars.jax import packed as packed_mod  # noqa: E402
from largebatch.lars.jax import rows  # noqa: E402
from largebatch.lars.jax.fused import FusedLambState, FusedLarsState  # noqa: E402


@pytest.fixture(autouse=True)
def pallas_interpreter(monkeypatch):
    """The kernels in Pallas's interpreter, as a GPU compiles them (the CPU's default
    runs their bodies as XLA over all rows: ``test_the_cpu_route_is_the_interpreter``)."""
    monkeypatch.setattr(rows, "CPU_KERNELS", "interpret")


# Every case in float32 (a compile each, in the interpreter); bfloat16, float64 and
# float16 on a few (float16 LARS only: LAMB's (1 - b2) g^2 underflows a float16 state, as
# on the unfused path).
FEW = {
    "bfloat16": ("lars-nesterov", "lars-larc", "lars-decayed-norm", "lamb-max-grad-norm", "lamb-eps",
                 "lamb-l2-no-averaging", "lamb-frozen-variance"),
    "float64": ("lars-larc", "lars-decayed-norm", "lamb-max-grad-norm", "lamb-eps"),
    "float16": ("lars-lr-outside", "lars-trust-clip"),
}  # fmt: skip
GRID = [(case, "float32") for case in CASES]
GRID += [(c, p) for p, ids in FEW.items() for c in CASES if c.id in ids]
DTYPES = {"float64": np.float64, "float32": np.float32, "bfloat16": "bfloat16", "float16": np.float16}


@pytest.mark.parametrize("case, precision", GRID, ids=[f"{c.id}-{p}" for c, p in GRID])
def test_fused_matches_the_spec(case, precision):
    """The table's cases (zero norms, a size-0 and a one-element tensor, sizes off the
    row, masks, a second group) at the unfused path's tolerances."""
    import torch

    dtype = DTYPES[precision]
    params, grads = make_problem(torch.bfloat16 if dtype == "bfloat16" else dtype)
    expected = run_reference(case, params, grads)
    actual = run_jax(case, params, grads, dtype=dtype, fused=True)
    assert_matches(actual, Result(expected.params, {}), precision, start=params)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.id in ("lars-larc", "lamb-max-grad-norm", "lamb-eps")], ids=lambda c: c.id
)
def test_the_cpu_route_is_the_interpreter(case, monkeypatch):
    """The CPU's default, the bodies as XLA over all rows, gives the interpreted kernels'
    numbers."""
    params, grads = make_problem(np.float32)
    interpreted = run_jax(case, params, grads, dtype=np.float32, fused=True)
    monkeypatch.setattr(rows, "CPU_KERNELS", "xla")
    direct = run_jax(case, params, grads, dtype=np.float32, fused=True)
    for a, b in zip(direct.params, interpreted.params):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * np.max(np.abs(b), initial=0.0))


def test_every_case_is_in_the_grid():
    assert {c.id for c, p in GRID if p == "float32"} == set(CASE_IDS)


# ---------------------------------------------------------------- awkward trees

# Leaves past one row and past one run of pieces (CHUNK pieces: 32,768 elements), exact
# rows, a scalar, size-0 leaves, one element, and two dtypes (two packed buffers).
TREE = {
    "big": ((300, 130), jnp.float32),
    "row": ((4096,), jnp.float32),
    "row_plus": ((4097,), jnp.float32),
    "scalar": ((), jnp.float32),
    "empty": ((3, 0), jnp.float32),
    "one": ((1, 1), jnp.float32),
    "zero_w": ((5, 7), jnp.float32),
    "half": ((33, 9), jnp.bfloat16),
    "half_bias": ((9,), jnp.bfloat16),
}


def tree_problem(steps=3, seed=0):
    rng = np.random.default_rng(seed)

    def tree(scale):
        return {k: jnp.asarray(scale * rng.standard_normal(s), d) for k, (s, d) in TREE.items()}

    params = tree(1.0)
    params["zero_w"] = jnp.zeros_like(params["zero_w"])
    return params, [tree(0.1) for _ in range(steps)]


def run(opt, params, grads):
    """``grads`` fed in turn through the jitted update; the final params and state."""
    return run_optax(opt, params, grads, jit=True)


SCHED = make_schedule("poly", peak_lr=0.4, total_steps=3, warmup_steps=2, init_lr=0.05)
TREE_CASES = {
    "lars_exclusion_clip": (
        lars,
        dict(learning_rate=SCHED, weight_decay=1e-3, trust_clip=True, trust_coefficient=0.5,
             trust_ratio_mask=exclusion_mask, nesterov=True),
    ),
    "lars_both_masks_decayed_norm": (
        lars,
        dict(learning_rate=0.1, weight_decay=1e-2, decayed_norm=True, trust_ratio_mask=exclusion_mask,
             weight_decay_mask=lambda p: {k: k != "big" for k in p}),
    ),
    "lars_larc": (
        lars,
        dict(learning_rate=0.5, weight_decay=1e-3, trust_clip=True, zero_norm_skip=True,
             lr_in_momentum=False, trust_coefficient=0.5),
    ),
    "lamb_clip_masks": (
        lamb,
        dict(learning_rate=0.01, weight_decay=1e-2, max_grad_norm=1.0, trust_ratio_mask=exclusion_mask),
    ),
    "lamb_apex": (
        lamb,
        dict(learning_rate=SCHED, weight_decay=1e-2, adam_w_mode=False, grad_averaging=False,
             adapt_without_decay=False, bias_correction=False, freeze_step=2),
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(TREE_CASES))
def test_fused_equals_unfused_on_awkward_trees(name):
    """Two dtypes, a scalar, size-0 leaves, leaves past a row and past a run of pieces:
    the fused step is the unfused one, leaf by leaf, and keeps each leaf's dtype."""
    factory, kw = TREE_CASES[name]
    params, grads = tree_problem()
    fused, state = run(factory(**kw, fused=True), params, grads)
    plain, _ = run(factory(**kw), params, grads)
    for k in params:
        assert fused[k].dtype == params[k].dtype and fused[k].shape == params[k].shape, k
        rtol = TOLERANCE["bfloat16" if params[k].dtype == jnp.bfloat16 else "float32"]
        a, b = np.asarray(fused[k], np.float64), np.asarray(plain[k], np.float64)
        scale = max(
            np.max(np.abs(b), initial=0.0), np.max(np.abs(np.asarray(params[k], np.float64)), initial=0.0)
        )
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale, err_msg=k)
    assert [b.dtype for b in jax.tree.leaves(state)[1:]] == [jnp.float32, jnp.bfloat16] * (
        2 if factory is lamb else 1
    )


@pytest.mark.parametrize("make", [lars, lamb])
def test_norms_do_not_overflow_or_underflow(make):
    """Weights of 1e19 and gradients of 1e21 square past float32's range, weights of 1e-25
    square to zero: the fused step follows the unfused one."""
    rng = np.random.default_rng(3)
    params = {
        "huge": jnp.asarray(1e19 * rng.standard_normal((300, 130)), jnp.float32),  # past a run
        "tiny": jnp.asarray(1e-25 * rng.standard_normal((3, 3)), jnp.float32),
        "plain": jnp.asarray(rng.standard_normal(6), jnp.float32),
    }
    grads = [jax.tree.map(lambda x: 0.1 * x / jnp.max(jnp.abs(x)), params) for _ in range(2)]
    if make is lars:
        grads = [{**g, "plain": g["plain"] * 1e21} for g in grads]
    kw = dict(weight_decay=1e-3, trust_coefficient=0.02) if make is lars else dict(max_grad_norm=1.0)
    fused, _ = run(make(0.1, **kw, fused=True), params, grads)
    plain, _ = run(make(0.1, **kw), params, grads)
    for k in params:
        assert np.isfinite(np.asarray(fused[k])).all(), k
        scale = float(np.max(np.abs(np.asarray(params[k]))))  # elements that cancel to near 0
        np.testing.assert_allclose(fused[k], plain[k], rtol=2e-5, atol=2e-5 * scale, err_msg=k)


def test_kernel_launches_per_step():
    """Per dtype: LARS two kernels (norms, update), LAMB two, three with max_grad_norm."""
    params, grads = tree_problem(1)

    def launches(opt):
        jaxpr = jax.make_jaxpr(opt.update)(grads[0], opt.init(params), params)
        return str(jaxpr).count("pallas_call")

    assert launches(lars(0.1, fused=True)) == 2 * 2
    assert launches(lamb(0.1, fused=True)) == 2 * 2
    assert launches(lamb(0.1, max_grad_norm=1.0, fused=True)) == 3 * 2


def test_the_kernels_lower_for_a_gpu_with_triton(monkeypatch):
    """Lowered for CUDA on this CPU (``jax.export``), every kernel of a step, two dtypes,
    every pass, becomes one Triton call: Pallas's Triton backend takes each operation
    the bodies use (newer jax picks Mosaic GPU unless told, which refuses the blocks)."""
    from jax import export

    monkeypatch.setattr(rows, "interpret", lambda what="fused=True": False)
    params, _ = tree_problem(0)
    triton = "__gpu$xla.gpu.triton"
    for opt, kernels in [
        (lars(0.1, weight_decay=1e-3, trust_clip=True, nesterov=True, decayed_norm=True, fused=True), 2),
        (lamb(0.01, weight_decay=1e-2, max_grad_norm=1.0, eps=0.0, fused=True), 3),
    ]:
        lowered = export.export(
            jax.jit(opt.update),
            platforms=["cuda"],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)],
        )(params, opt.init(params), params)
        assert lowered.mlir_module().count(f"custom_call @{triton}") == kernels * 2


# ---------------------------------------------------------------------- the state


@pytest.mark.parametrize("make", [lars, lamb])
def test_state_is_the_unfused_state_plus_less_than_a_row_a_leaf(make):
    params, _ = tree_problem(0)
    fused = make(0.1, fused=True).init(params)
    plain = make(0.1).init(params)

    def size(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    rows = sum(packed_mod.ROW * jnp.dtype(p.dtype).itemsize for p in jax.tree.leaves(params))
    per_buffer = 2 if make is lamb else 1
    assert size(plain) < size(fused) <= size(plain) + per_buffer * rows
    assert isinstance(fused, FusedLambState if make is lamb else FusedLarsState)


# ------------------------------------------------------------------ optax habits


@pytest.mark.parametrize("make", [lars, lamb])
def test_inject_hyperparams_jits_once_and_equals_plain(make):
    """Rate, weight decay and the rest traced: one trace for every value."""
    params, grads = tree_problem(3)
    kw = dict(learning_rate=0.1, weight_decay=1e-2, trust_ratio_mask=exclusion_mask)
    # A flag stays static by itself; a callable mask is named in static_args.
    opt = optax.inject_hyperparams(make, static_args="trust_ratio_mask")(**kw, fused=True)
    traces = []

    def update(g, s, p):
        traces.append(None)
        return opt.update(g, s, p)

    jitted = jax.jit(update)
    state, p = opt.init(params), params
    rates, decays = [0.1, 0.02, 0.3], [1e-2, 1e-3, 0.0]
    for i, g in enumerate(grads):
        state.hyperparams["learning_rate"] = jnp.asarray(rates[i], jnp.float32)
        state.hyperparams["weight_decay"] = jnp.asarray(decays[i], jnp.float32)
        updates, state = jitted(g, state, p)
        p = optax.apply_updates(p, updates)
    assert len(traces) == 1 and jitted._cache_size() == 1
    expected, plain_state = params, make(0.1, trust_ratio_mask=exclusion_mask).init(params)
    for i, g in enumerate(grads):  # the plain optimizer, one value of each at a time
        plain = make(rates[i], weight_decay=decays[i], trust_ratio_mask=exclusion_mask)
        updates, plain_state = plain.update(g, plain_state, expected)
        expected = optax.apply_updates(expected, updates)
    for k in params:
        rtol = TOLERANCE["bfloat16" if params[k].dtype == jnp.bfloat16 else "float32"]
        np.testing.assert_allclose(
            np.asarray(p[k], np.float64), np.asarray(expected[k], np.float64), rtol=rtol,
            atol=rtol * float(np.max(np.abs(np.asarray(expected[k], np.float64)), initial=1.0)), err_msg=k,
        )  # fmt: skip


@pytest.mark.parametrize("make", [lars, lamb])
def test_multi_steps_equals_the_averaged_gradient(make):
    params, grads = tree_problem(4)
    params, grads = jax.tree.map(lambda x: x.astype(jnp.float32), (params, grads))
    actual, _ = run(
        optax.MultiSteps(make(0.1, weight_decay=1e-2, fused=True), every_k_schedule=2), params, grads
    )
    means = [jax.tree.map(lambda a, b: (a + b) / 2, grads[i], grads[i + 1]) for i in (0, 2)]
    expected, _ = run(make(0.1, weight_decay=1e-2, fused=True), params, means)
    for k in params:
        scale = float(np.max(np.abs(np.asarray(expected[k])), initial=0.0))
        np.testing.assert_allclose(actual[k], expected[k], rtol=1e-5, atol=1e-5 * scale, err_msg=k)


@pytest.mark.parametrize("make", [lars, lamb])
def test_apply_if_finite_skips_a_nan_step_and_nan_propagates(make):
    params, (g0, g1) = tree_problem(2)
    bad = {**g1, "big": g1["big"].at[1, 2].set(jnp.nan)}
    opt = optax.apply_if_finite(make(0.1, weight_decay=1e-2, fused=True), max_consecutive_errors=2)
    update = jax.jit(opt.update)
    state = opt.init(params)
    updates, state = update(g0, state, params)
    params = optax.apply_updates(params, updates)
    updates, skipped = update(bad, state, params)
    assert_trees_equal(optax.apply_updates(params, updates), params)
    assert_trees_equal(skipped.inner_state, state.inner_state)
    assert int(skipped.notfinite_count) == 1
    # Without the wrapper a NaN gradient gives a NaN step where the unfused path does.
    fused_opt, plain_opt = make(0.1, weight_decay=1e-2, fused=True), make(0.1, weight_decay=1e-2)
    fused, _ = jax.jit(fused_opt.update)(bad, fused_opt.init(params), params)
    plain, _ = jax.jit(plain_opt.update)(bad, plain_opt.init(params), params)
    for k in params:
        np.testing.assert_array_equal(np.isfinite(np.asarray(fused[k])), np.isfinite(np.asarray(plain[k])), k)


@pytest.mark.parametrize("make", [lars, lamb])
def test_skip_if_nonfinite_skips_a_nan_step(make):
    """largebatch's own skip (the inner step inside a ``lax.cond``): params and the
    packed state as they were."""
    from largebatch.jax import skip_if_nonfinite

    params, (g0,) = tree_problem(1)
    opt = skip_if_nonfinite(make(0.1, weight_decay=1e-2, fused=True))
    update = jax.jit(opt.update)
    state = opt.init(params)
    bad = {**g0, "half": g0["half"].at[0, 0].set(jnp.inf)}
    updates, skipped = update(bad, state, params)
    assert_trees_equal(optax.apply_updates(params, updates), params)
    assert_trees_equal(skipped.inner_state, state.inner_state)
    assert int(skipped.skipped) == 1
    updates, moved = update(g0, state, params)
    assert int(jax.tree.leaves(moved.inner_state)[0]) == 1


@pytest.mark.parametrize("make", [lars, lamb])
def test_jit_with_donated_state_does_not_recompile_or_copy(make):
    """The state donated to the jitted update: its buffers reused (no warning about
    unusable donations), one compile over steps whose values change."""
    params, grads = tree_problem(3)
    sched = make_schedule("cosine", peak_lr=0.1, total_steps=10, warmup_steps=2)
    opt = (
        make(sched, weight_decay=1e-2, max_grad_norm=1.0, fused=True)
        if make is lamb
        else make(sched, weight_decay=1e-2, trust_clip=True, fused=True)
    )
    update = jax.jit(opt.update, donate_argnums=(1,))
    state = opt.init(params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for g in grads:
            old = jax.tree.leaves(state)
            updates, state = update(g, state, params)
            assert all(x.is_deleted() for x in old)  # donated
            params = optax.apply_updates(params, updates)
    assert update._cache_size() == 1


# ------------------------------------------------------------------------ errors


@pytest.mark.parametrize("make", [lars, lamb])
@pytest.mark.parametrize("value", ["True", 1, 0, "yes", jnp.asarray(True)])
def test_bad_fused_values_are_refused(make, value):
    with pytest.raises(TypeError, match=r"Invalid fused: .* \(must be True, False or None\)"):
        make(0.1, fused=value)


@pytest.mark.parametrize("make", [lars, lamb])
def test_fused_none_is_the_fused_path_on_a_gpu_and_the_chain_elsewhere(make, monkeypatch):
    """``fused=None`` follows JAX's default backend when the optimizer is made: on a GPU
    the fused path (the faster there: docs/benchmarks.md, H200 2026-11-28), elsewhere the
    unfused chain; ``False`` is the chain everywhere, ``True`` the fused path."""
    params, grads = tree_problem(1)
    fused_state = (FusedLarsState, FusedLambState)
    for backend, none_is_fused in (("cpu", False), ("gpu", True), ("tpu", False)):
        with monkeypatch.context() as m:
            m.setattr(jax, "default_backend", lambda: backend)  # noqa: B023 (used at once)
            made = {f: make(0.1, fused=f) for f in (None, False, np.bool_(False), True)}
        assert isinstance(made[None].init(params), fused_state) == none_is_fused, backend
        assert isinstance(made[True].init(params), fused_state)
        assert not any(isinstance(made[f].init(params), fused_state) for f in (False, np.bool_(False)))


@pytest.mark.parametrize("make", [lars, lamb])
def test_complex_leaves_and_other_platforms_are_refused(make, monkeypatch):
    z = {"w": jnp.ones((2, 2), jnp.complex64)}
    with pytest.raises(TypeError, match="Invalid fused=True for a leaf of dtype complex64 .* fused=False"):
        make(0.1, fused=True).init(z)
    params = {"w": jnp.ones((2, 2))}
    opt = make(0.1, fused=True)
    state = opt.init(params)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="Invalid fused=True on tpu: .* fused=False"):
        opt.update(params, state, params)


# -------------------------------------------------------------------- shard_map


def row_sharded_problem(seed=0):
    rng = np.random.default_rng(seed)

    def tree(scale):
        return {
            "kernel": jnp.asarray(scale * rng.standard_normal((16, 6)), jnp.float32),
            "proj": jnp.asarray(0.2 * scale * rng.standard_normal((24, 4, 2)), jnp.float32),
            "bias": jnp.asarray(scale * rng.standard_normal(32), jnp.float32),
        }

    return tree(1.0), [tree(0.3) for _ in range(3)]


SHARDED = {
    "lars": lambda **kw: lars(0.5, weight_decay=1e-3, trust_coefficient=0.02, trust_clip=True, **kw),
    "lamb": lambda **kw: lamb(0.02, weight_decay=1e-2, max_grad_norm=0.05, **kw),
}


@pytest.mark.parametrize("check", [True, False], ids=["check_vma", "no_check_vma"])
@pytest.mark.parametrize("name", list(SHARDED))
def test_shard_map_with_axis_name_equals_one_device(name, check):
    """Each device packs its blocks and keeps its packed state; the norms are those of
    the whole leaves (one psum of every leaf's sums), so the steps are one device's."""
    params, grads = row_sharded_problem()
    mesh = Mesh(np.array(jax.devices()), ("x",))
    single, _ = run(SHARDED[name](fused=True), params, grads)
    plain, _ = run(SHARDED[name](), params, grads)
    for k in params:
        np.testing.assert_allclose(single[k], plain[k], rtol=TOLERANCE["float32"], atol=1e-6, err_msg=k)
    opt = SHARDED[name](fused=True, axis_name="x")
    specs = jax.tree.map(lambda _: P("x"), params)
    state_shape = jax.eval_shape(shard_map(opt.init, mesh, (specs,), P(), check=False), params)
    state_specs = jax.tree.map(lambda s: P("x") if s.ndim else P(), state_shape)
    init = jax.jit(shard_map(opt.init, mesh, (specs,), state_specs, check))

    def body(params, state, g):
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(shard_map(body, mesh, (specs, state_specs, specs), (specs, state_specs), check))
    put = lambda t: jax.device_put(t, jax.tree.map(lambda _: NamedSharding(mesh, P("x")), t))  # noqa: E731
    p, state = put(params), init(put(params))
    for g in grads:
        p, state = step(p, state, put(g))
    assert step._cache_size() == 1
    for k in params:
        np.testing.assert_allclose(
            p[k], single[k], rtol=2e-6, atol=1e-7 * float(np.max(np.abs(single[k]))), err_msg=k
        )
    # One psum of all the leaves' sums a norm pass (LAMB: the grads' pass, then w and u);
    # the rescue branch's psum and pmax run only where a sum overflowed or underflowed.
    jaxpr = jax.make_jaxpr(shard_map(body, mesh, (specs, state_specs, specs), (specs, state_specs), check))(
        params, state, grads[0]
    )
    top = [e for e in jaxpr.jaxpr.eqns[0].params["jaxpr"].eqns if e.primitive.name.startswith("psum")]
    assert len(top) == (1 if name == "lars" else 2)
    assert math.isfinite(float(np.asarray(p["kernel"]).sum()))


# ------------------------------------------------------------ params kept packed


@pytest.mark.parametrize("make", [lars, lamb])
def test_params_kept_packed_step_as_the_pytree(make):
    """``PackedParams``: grads taken of the packed buffers, the step on them without
    packing, the same params as the pytree's fused step; the padding stays zero (LAMB at
    eps = 0 too, where the padding's direction is 0 / 0)."""
    from largebatch.jax import PackedParams

    rng = np.random.default_rng(0)
    params = {
        "w": jnp.asarray(rng.standard_normal((30, 20)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal(20), jnp.float32),
        "h": jnp.asarray(rng.standard_normal((5, 9)), jnp.bfloat16),
    }
    x = jnp.asarray(rng.standard_normal((8, 30)), jnp.float32)

    def loss(p):
        return jnp.sum(jnp.tanh(x @ p["w"] + p["b"]) ** 2) + jnp.sum(p["h"].astype(jnp.float32) ** 2)

    kw = dict(weight_decay=1e-2, trust_ratio_mask=exclusion_mask, fused=True)
    opt = lars(0.1, **kw) if make is lars else lamb(0.01, eps=0.0, **kw)
    packed = PackedParams.pack(params)
    assert jax.tree.structure(packed.unpack()) == jax.tree.structure(params)

    @jax.jit
    def packed_step(packed, state):
        grads = jax.grad(lambda q: loss(q.unpack()))(packed)
        assert isinstance(grads, PackedParams)
        updates, state = opt.update(grads, state, packed)
        return optax.apply_updates(packed, updates), state

    @jax.jit
    def tree_step(params, state):
        updates, state = opt.update(jax.grad(loss)(params), state, params)
        return optax.apply_updates(params, updates), state

    state, packed_state = opt.init(params), opt.init(packed)
    for _ in range(3):
        params, state = tree_step(params, state)
        packed, packed_state = packed_step(packed, packed_state)
    for k, leaf in packed.unpack().items():
        np.testing.assert_allclose(
            np.asarray(leaf, np.float32), np.asarray(params[k], np.float32), rtol=1e-6, atol=1e-6
        )
    for buffer, again in zip(packed.buffers, PackedParams.pack(packed.unpack()).buffers):
        np.testing.assert_array_equal(buffer, again)  # the padding is still zero
    with pytest.raises(ValueError, match="the params must be PackedParams"):
        opt.update(packed, packed_state, packed.unpack())
