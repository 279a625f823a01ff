"""Sharded params: LARS and LAMB take the norms of whole params, not of a device's block.

Under ``jax.jit`` (GSPMD) sharded arrays give global norms by themselves. Inside
``jax.shard_map`` each device sees only its block, and ``axis_name`` makes every norm a
``psum`` over the mesh axes that shard the params. Every run here is compared with the
same optimizer on one device.

Tolerance. The sharded and the single-device runs differ only in the order of float32
sums: the norms (blocks summed, then the block sums) and, under GSPMD, the matmuls of
the loss. Each such sum is off by a few units in the last place (float32 eps is 1.2e-7),
a trust ratio by about as much, and each step moves a param by a small fraction of its
value, so after ``STEPS`` steps params agree to a few 1e-7 relative: ``RTOL = 2e-6``.
``ATOL``, relative to a leaf's largest element, covers elements that come out of a
cancellation near zero: there a few ulps of the leaf's scale are a large relative error.
A per-block norm instead of the whole one is off by tens of percent.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from helpers import shard_map  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from largebatch.jax import (  # noqa: E402
    divide_by_global_norm,
    exclusion_mask,
    lamb,
    lars,
    make_schedule,
    scale_by_lamb_trust_ratio,
    scale_by_lars_trust_ratio,
)

STEPS = 3
RTOL, ATOL = 2e-6, 1e-7
SCHEDULE = make_schedule("poly", peak_lr=0.5, total_steps=STEPS, warmup_steps=1, init_lr=0.1)
LAMB_SCHEDULE = make_schedule("poly", peak_lr=0.02, total_steps=STEPS, warmup_steps=1, init_lr=0.01)
MAX_GRAD_NORM = 0.05  # below every gradient norm here: the clipping binds
# shard_map with and without its typing of values as varying or replicated over the axes
CHECKS = pytest.mark.parametrize("check", [True, False], ids=["check_vma", "no_check_vma"])

OPTIMIZERS = {
    "lars_wd_exclusion": lambda **kw: lars(
        SCHEDULE,
        weight_decay=1e-3,
        trust_coefficient=0.02,
        trust_ratio_mask=exclusion_mask,
        **kw,
    ),
    # tc such that LARC's clip binds on some leaves at some steps, not on all
    "lars_every_leaf_nesterov_clip": lambda **kw: lars(
        SCHEDULE,
        weight_decay=1e-3,
        trust_coefficient=0.02,
        nesterov=True,
        trust_clip=True,
        **kw,
    ),
    "lamb_wd_exclusion_clip": lambda **kw: lamb(
        LAMB_SCHEDULE,
        weight_decay=1e-2,
        max_grad_norm=MAX_GRAD_NORM,
        trust_ratio_mask=exclusion_mask,
        **kw,
    ),
    "lamb_every_leaf_uncorrected_clip": lambda **kw: lamb(
        LAMB_SCHEDULE,
        weight_decay=1e-2,
        bias_correction=False,
        max_grad_norm=MAX_GRAD_NORM,
        **kw,
    ),
}


def assert_close(actual, expected):
    """Leaf by leaf: ``RTOL`` of each element, ``ATOL`` of the leaf's largest element."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL * np.max(np.abs(b)))


def max_relative_difference(actual, expected):
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)) / (np.abs(np.asarray(b)) + 1e-30)))
        for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected))
    )


def moved(params, start):
    """Every leaf has left its start (the steps are not no-ops), at any magnitude."""
    return all(
        not np.allclose(a, b, rtol=1e-4, atol=0.0)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(start))
    )


def f32(tree):
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), tree)


def single_device(opt, params, grads):
    """The reference: ``grads`` fed in turn to one jitted update on one device."""

    @jax.jit
    def step(params, state, g):
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    state = opt.init(params)
    for g in grads:
        params, state = step(params, state, g)
    return params


def in_shard_map(opt, params, grads, mesh, spec, check=True):
    """The same steps inside ``shard_map``: every leaf (params, grads, and the state's
    per-param leaves) split by ``spec``; the step is compiled once."""
    specs = jax.tree.map(lambda _: spec, params)
    state = opt.init(params)
    state_specs = jax.tree.map(lambda s: spec if jnp.ndim(s) else P(), state)
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    rows = [p.shape[0] // math.prod(mesh.shape[a] for a in axes) for p in jax.tree.leaves(params)]

    def body(params, state, g):
        assert [p.shape[0] for p in jax.tree.leaves(params)] == rows  # each device: a block
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(shard_map(body, mesh, (specs, state_specs, specs), (specs, state_specs), check))
    params, state = put(mesh, (params, state), (specs, state_specs))
    for g in grads:
        params, state = step(params, state, put(mesh, g, specs))
    assert step._cache_size() == 1
    return params


def put(mesh, tree, specs):
    """``tree`` placed as ``shard_map`` gives its outputs back, so every step sees the
    same input shardings (one compilation)."""
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


# ------------------------------------------------------------ jit with sharded params


def init_mlp(rng):
    return {
        "dense1": {"kernel": rng.standard_normal((16, 32)) / 4, "bias": rng.standard_normal(32) / 8},
        "dense2": {"kernel": rng.standard_normal((32, 8)) / 4, "bias": np.zeros(8)},
    }


# Over a (data: 2, model: 4) mesh: three leaves split over all 8 devices, one 4 ways.
MLP_SPECS = {
    "dense1": {"kernel": P("data", "model"), "bias": P(("data", "model"))},
    "dense2": {"kernel": P("model", "data"), "bias": P("model")},
}


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    logits = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train(opt, params, batches, mesh=None):
    """``STEPS`` jitted steps; with ``mesh`` the params and the state are sharded by
    ``MLP_SPECS`` (and stay so) and the batch is split over ``data``."""
    state = opt.init(params)
    if mesh is not None:
        by_shape = {
            p.shape: NamedSharding(mesh, s)
            for p, s in zip(jax.tree.leaves(params), jax.tree.leaves(MLP_SPECS))
        }
        replicated = NamedSharding(mesh, P())
        param_sh = jax.tree.map(lambda p: by_shape[p.shape], params)
        state_sh = jax.tree.map(lambda s: by_shape.get(jnp.shape(s), replicated), state)
        params, state = jax.device_put((params, state), (param_sh, state_sh))
        batches = jax.device_put(batches, NamedSharding(mesh, P("data")))

    def step(params, state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(step) if mesh is None else jax.jit(step, out_shardings=(param_sh, state_sh))
    for x, y in batches:
        params, state = jitted(params, state, x, y)
    assert jitted._cache_size() == 1
    if mesh is not None:
        kernel = params["dense1"]["kernel"]
        assert {s.data.shape for s in kernel.addressable_shards} == {(8, 8)}
        for leaf, sharding in zip(jax.tree.leaves(params), jax.tree.leaves(param_sh)):
            assert leaf.sharding == sharding and not leaf.sharding.is_fully_replicated
        sharded_state = [s for s in jax.tree.leaves(state) if jnp.ndim(s)]
        assert sharded_state and not any(s.sharding.is_fully_replicated for s in sharded_state)
    return params


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_jit_with_sharded_params_equals_single_device(name):
    assert jax.device_count() == 8, "tests/conftest.py asks XLA for 8 host devices"
    rng = np.random.default_rng(0)
    params = f32(init_mlp(rng))
    batches = [
        (jnp.asarray(rng.standard_normal((64, 16)), jnp.float32), jnp.asarray(rng.integers(0, 8, 64)))
        for _ in range(STEPS)
    ]
    assert float(optax.tree.norm(jax.grad(loss_fn)(params, *batches[0]))) > MAX_GRAD_NORM
    opt = OPTIMIZERS[name]()
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    single = train(opt, params, batches)
    sharded = train(opt, params, batches, mesh)
    assert moved(single, params)
    assert_close(sharded, single)


# ------------------------------------------------------- shard_map with axis_name


def row_sharded_problem(seed=0):
    """Params and ``STEPS`` gradients whose leaves split by rows over 8 devices: two
    kernels and a bias-like vector of length 8 * 4 (its blocks of 4)."""
    rng = np.random.default_rng(seed)

    def tree(kernel, proj, bias):
        return f32(
            {
                "kernel": kernel * rng.standard_normal((16, 6)),
                "proj": proj * rng.standard_normal((24, 4, 2)),
                "bias": bias * rng.standard_normal(32),
            }
        )

    # ||w|| / ||g|| of about 2, 10 and 2: LARC's clip binds on "proj" at the first step
    return tree(1.0, 1.0, 0.5), [tree(0.5, 0.1, 0.25) for _ in range(STEPS)]


def row_mesh():
    return Mesh(np.array(jax.devices()), ("x",))


@CHECKS
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_shard_map_with_axis_name_equals_single_device(name, check):
    params, grads = row_sharded_problem()
    assert float(optax.tree.norm(grads[0])) > MAX_GRAD_NORM
    expected = single_device(OPTIMIZERS[name](), params, grads)
    assert moved(expected, params)
    opt = OPTIMIZERS[name](axis_name="x")
    assert_close(in_shard_map(opt, params, grads, row_mesh(), P("x"), check), expected)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_shard_map_without_axis_name_takes_block_norms(name):
    """The failure ``axis_name`` fixes: each device's ratio from its block's norms."""
    params, grads = row_sharded_problem()
    expected = single_device(OPTIMIZERS[name](), params, grads)
    per_block = in_shard_map(OPTIMIZERS[name](), params, grads, row_mesh(), P("x"))
    assert max_relative_difference(per_block, expected) > 1e-2


@pytest.mark.parametrize(
    ("spec", "axis_name"),
    [(P(("a", "b")), ("a", "b")), (P(("b", "a")), ("b", "a")), (P("b"), "b")],
    ids=["over_both", "over_both_reversed", "over_b_replicated_over_a"],
)
@pytest.mark.parametrize("name", ["lars_every_leaf_nesterov_clip", "lamb_wd_exclusion_clip"])
def test_shard_map_on_a_2d_mesh(name, spec, axis_name):
    """A tuple of axes; and params split over ``b`` only (replicated over ``a``, as in
    data parallelism along ``a``): ``axis_name`` names the axes that split them."""
    params, grads = row_sharded_problem(seed=1)
    expected = single_device(OPTIMIZERS[name](), params, grads)
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    sharded = in_shard_map(OPTIMIZERS[name](axis_name=axis_name), params, grads, mesh, spec)
    assert_close(sharded, expected)


# ------------------------------------------- zero and extreme leaves (the scaled pass)


def block_scaled(rng, shape, scale):
    """Normal entries times ``scale``, the rows of block ``i`` (of 8) times ``4**i``:
    the blocks differ in magnitude, so a per-block power of two would be wrong."""
    rows = np.repeat(4.0 ** np.arange(8), shape[0] // 8).reshape(-1, *[1] * (len(shape) - 1))
    return scale * rows * rng.standard_normal(shape)


def extreme_problem():
    """Leaves whose plain sum of squares is zero, overflows or underflows in float32:
    ``zero`` (ratio 1), ``half_zero`` (zero on the first four devices only), ``huge``
    (entries up to ~1e35, squares past 3.4e38) and ``tiny`` (entries ~1e-25, squares
    below the smallest float32)."""
    rng = np.random.default_rng(2)
    params = {
        "zero": np.zeros((16, 4)),
        "half_zero": np.concatenate([np.zeros((8, 4)), rng.standard_normal((8, 4))]),
        "huge": block_scaled(rng, (16, 4), 1e30),
        "tiny": block_scaled(rng, (16,), 1e-25),
        "bias": rng.standard_normal(16),
    }

    def grads():
        return f32(
            {
                "zero": rng.standard_normal((16, 4)),
                "half_zero": rng.standard_normal((16, 4)),
                "huge": block_scaled(rng, (16, 4), 1e20),
                "tiny": block_scaled(rng, (16,), 1e-25),
                "bias": rng.standard_normal(16),
            }
        )

    return f32(params), [grads() for _ in range(STEPS)]


EXTREME_OPTIMIZERS = {
    "lars_no_wd": lambda **kw: lars(0.1, trust_coefficient=0.01, **kw),
    "lars_wd": lambda **kw: lars(0.1, weight_decay=1e-3, trust_coefficient=0.01, **kw),
    "lamb_no_wd": lambda **kw: lamb(0.01, **kw),
    "lamb_wd_clip": lambda **kw: lamb(0.01, weight_decay=1e-2, max_grad_norm=1.0, **kw),
}


@CHECKS
@pytest.mark.parametrize("name", EXTREME_OPTIMIZERS)
def test_shard_map_zero_and_extreme_leaves_equal_single_device(name, check):
    params, grads = extreme_problem()
    sq = {k: float(jnp.sum(jnp.square(v))) for k, v in params.items()}
    assert sq["zero"] == 0 and sq["tiny"] == 0 and sq["huge"] == np.inf
    assert float(jnp.sum(jnp.square(grads[0]["huge"]))) == np.inf
    expected = single_device(EXTREME_OPTIMIZERS[name](), params, grads)
    opt = EXTREME_OPTIMIZERS[name](axis_name="x")
    sharded = in_shard_map(opt, params, grads, row_mesh(), P("x"), check)
    for leaf in jax.tree.leaves(sharded):
        assert np.all(np.isfinite(leaf))
    assert moved(expected, params)
    assert_close(sharded, expected)
    per_block = in_shard_map(EXTREME_OPTIMIZERS[name](), params, grads, row_mesh(), P("x"), check)
    assert max_relative_difference(per_block, expected) > 1e-2


@CHECKS
@pytest.mark.parametrize("scale", [1e30, 1e-25, 1.0, 0.0])
def test_shard_map_global_norm_is_the_whole_norm(scale, check):
    """``divide_by_global_norm`` inside ``shard_map``: the divisor is the norm of all the
    blocks of all the leaves (float64 on the host), on every device."""
    rng = np.random.default_rng(3)
    updates = f32({"a": block_scaled(rng, (16, 3), scale), "b": block_scaled(rng, (8,), scale)})
    max_norm = np.float32(1e-3 * max(scale, 1e-30))  # divisors of ~1e3-1e6 (1 at scale 0)
    tx = divide_by_global_norm(max_norm, axis_name="x")
    specs = jax.tree.map(lambda _: P("x"), updates)

    def body(u):
        out, _ = tx.update(u, tx.init(u))
        return out

    out = jax.jit(shard_map(body, row_mesh(), (specs,), specs, check))(updates)
    flat = np.concatenate([np.asarray(u, np.float64).ravel() for u in jax.tree.leaves(updates)])
    norm = np.sqrt(np.sum(np.square(flat / max(scale, 1e-300)))) * scale
    divisor = max(1.0, norm / np.float64(max_norm))
    assert divisor > 100 or scale == 0
    for a, u in zip(jax.tree.leaves(out), jax.tree.leaves(updates)):
        np.testing.assert_allclose(
            np.asarray(a, np.float64), np.asarray(u, np.float64) / divisor, rtol=1e-6, atol=0.0
        )


@pytest.mark.parametrize("form", ["largebatch", "one pass"])
@pytest.mark.parametrize("scale", [1e30, 1e-25, 1.0, 0.0])
def test_shard_map_leaf_norms_in_each_form_are_the_whole_norms(scale, form):
    """The norms inside ``shard_map``, ours and the one-pass form of
    ``benchmarks/jax_norms.py``: each leaf's norm is its whole array's (float64 on the
    host), the blocks differing in magnitude (one element a block for ``b``)."""
    import sys
    from pathlib import Path

    from largebatch.lars.jax.norms import leaf_norms

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from jax_norms import one_pass_norms

    norms = leaf_norms if form == "largebatch" else one_pass_norms
    rng = np.random.default_rng(5)
    leaves = f32({"a": block_scaled(rng, (16, 3), scale), "b": block_scaled(rng, (8,), scale)})
    specs = jax.tree.map(lambda _: P("x"), leaves)

    def body(t):
        return jnp.stack(norms(list(t.values()), axis_name="x"))

    got = np.asarray(jax.jit(shard_map(body, row_mesh(), (specs,), P(), True))(leaves))
    for value, leaf in zip(got, leaves.values()):
        wide = np.abs(np.asarray(leaf, np.float64))
        top = max(wide.max(), 1e-300)
        np.testing.assert_allclose(value, np.sqrt(np.sum(np.square(wide / top))) * top, rtol=1e-6)


# ------------------------------------------------------------------------- checks


GOOD = ["x", ("x",), ("x", "y")]
BAD = [
    ("", ValueError),
    ((), ValueError),
    (("x", ""), ValueError),
    (("x", "x"), ValueError),
    (["x"], TypeError),
    (1, TypeError),
    (("x", 1), TypeError),
    (b"x", TypeError),
    (True, TypeError),
]
FACTORIES = {
    "lars": lambda a: lars(0.1, axis_name=a),
    "lamb": lambda a: lamb(0.1, axis_name=a),
    "lamb_clip": lambda a: lamb(0.1, max_grad_norm=1.0, axis_name=a),
    "scale_by_lars_trust_ratio": lambda a: scale_by_lars_trust_ratio(axis_name=a),
    "scale_by_lamb_trust_ratio": lambda a: scale_by_lamb_trust_ratio(axis_name=a),
    "divide_by_global_norm": lambda a: divide_by_global_norm(1.0, axis_name=a),
}


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize(("value", "error"), BAD, ids=[repr(v) for v, _ in BAD])
def test_bad_axis_name_raises_when_built(factory, value, error):
    with pytest.raises(error, match=re.escape(f"Invalid axis_name: {value!r} (must be")):
        FACTORIES[factory](value)


@pytest.mark.parametrize("factory", FACTORIES)
@pytest.mark.parametrize("value", [None, *GOOD])
def test_good_axis_name_is_accepted(factory, value):
    assert isinstance(FACTORIES[factory](value), optax.GradientTransformation)


def test_axis_name_is_static_under_inject_hyperparams():
    """A str is no number: ``inject_hyperparams`` keeps it static, and the injected
    optimizer inside ``shard_map`` equals the plain one on one device."""
    params, grads = row_sharded_problem()
    injected = optax.inject_hyperparams(lars)(learning_rate=0.1, weight_decay=1e-3, axis_name="x")
    expected = single_device(lars(0.1, weight_decay=1e-3), params, grads)
    assert_close(in_shard_map(injected, params, grads, row_mesh(), P("x")), expected)
