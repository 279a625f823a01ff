"""largebatch.jax.make_schedule: the numbers of largebatch.schedules, jitted."""

from __future__ import annotations

import inspect
import math
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

from largebatch import jax as lbjax  # noqa: E402
from largebatch import schedules  # noqa: E402

CASES = {
    "constant": dict(name="constant", peak_lr=0.8, total_steps=50, warmup_steps=7, end_lr=0.01),
    "poly": dict(name="poly", peak_lr=3.2, total_steps=100, warmup_steps=10, init_lr=0.1, end_lr=1e-4),
    "poly_power1": dict(name="poly", peak_lr=1.0, total_steps=37, power=1.0),
    "cosine": dict(name="cosine", peak_lr=2.0, total_steps=64, warmup_steps=5, end_lr=0.02),
    "step": dict(
        name="step", peak_lr=0.4, total_steps=90, warmup_steps=5, milestones=(30, 60, 80), gamma=0.1
    ),
    "all_warmup": dict(name="cosine", peak_lr=0.5, total_steps=20, warmup_steps=20),
    "offset_decay_steps": dict(
        name="poly", peak_lr=2.0, total_steps=40, warmup_steps=6, end_lr=1e-4, offset=1, decay_steps=35
    ),
}


def steps_for(kw):
    """Every step from 0 to T + 3: all boundaries (W - 1, W, milestones, T - 1, T) included."""
    return np.arange(kw["total_steps"] + 4, dtype=np.int32)


@pytest.mark.parametrize("case", CASES)
def test_jitted_schedule_matches_python(case):
    kw = dict(CASES[case])
    name = kw.pop("name")
    py = schedules.make_schedule(name, **kw)
    sched = lbjax.make_schedule(name, **kw)
    steps = steps_for(CASES[case])
    expected = np.array([py(int(t)) for t in steps])
    one = jax.jit(sched)
    got = np.array([one(jnp.int32(t)) for t in steps])
    assert one._cache_size() == 1  # a traced count: one compilation for every step
    assert np.asarray(one(jnp.int32(0))).dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7 * kw["peak_lr"])
    np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(sched))(steps)), got, rtol=1e-6, atol=0)


@pytest.mark.parametrize("case", CASES)
def test_float64_schedule_matches_python_exactly(case):
    kw = dict(CASES[case])
    name = kw.pop("name")
    py = schedules.make_schedule(name, **kw)
    steps = steps_for(CASES[case])
    with jax.enable_x64(True):
        sched = lbjax.as_optax_schedule(py, jnp.float64)
        got = np.asarray(jax.jit(jax.vmap(sched))(steps))
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, [py(int(t)) for t in steps], rtol=1e-12, atol=0)


def test_drives_optax_by_its_count():
    """Inside an optax chain the schedule reads the optimizer's int32 count."""
    sched = lbjax.make_schedule("poly", peak_lr=1.0, total_steps=8, warmup_steps=3)
    opt = optax.scale_by_learning_rate(sched, flip_sign=False)
    params = jnp.ones(())
    state = opt.init(params)
    update = jax.jit(opt.update)
    seen = []
    for _ in range(10):
        u, state = update(jnp.ones(()), state)
        seen.append(float(u))
    np.testing.assert_allclose(seen, [sched.schedule(t) for t in range(10)], rtol=1e-6)
    assert update._cache_size() == 1


def test_same_signature_and_errors_as_python_factory():
    py_params = inspect.signature(schedules.make_schedule).parameters
    assert list(inspect.signature(lbjax.make_schedule).parameters) == list(py_params)
    with pytest.raises(ValueError, match="-1.0"):
        lbjax.make_schedule("poly", peak_lr=-1.0, total_steps=10)
    with pytest.raises(ValueError, match="'linear'"):
        lbjax.make_schedule("linear", peak_lr=1.0, total_steps=10)
    with pytest.raises(ValueError, match="0.1"):
        lbjax.as_optax_schedule(0.1)


def test_linear_scaling_is_the_goyal_rule():
    assert lbjax.linear_scaling(0.1, 8192) == pytest.approx(3.2)
    assert lbjax.linear_scaling(0.1, 1536, base_batch_size=256) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="-0.1"):
        lbjax.linear_scaling(-0.1, 256)


def test_invalid_traced_steps_give_nan_not_a_rate():
    """Traced steps cannot raise: a negative, NaN or infinite one gives NaN."""
    sched = lbjax.make_schedule("poly", peak_lr=1.0, total_steps=10, warmup_steps=2, init_lr=0.1)
    one = jax.jit(sched)
    assert np.isnan(one(jnp.int32(-1)))
    assert np.isnan(one(jnp.int32(np.iinfo(np.int32).min)))
    for bad in (-0.5, -math.inf, math.inf, math.nan):
        assert np.isnan(one(jnp.float32(bad))), bad
    steps = jnp.array([-3, -1, 0, 1, 2, 9, 10, 11], dtype=jnp.int32)
    got = np.asarray(jax.jit(jax.vmap(sched))(steps))
    assert np.isnan(got[:2]).all()
    np.testing.assert_allclose(got[2:], [sched.schedule(int(t)) for t in steps[2:]], rtol=1e-6)
    assert one(jnp.float32(-0.0)) == one(jnp.int32(0)) == np.float32(0.1)
    with jax.enable_x64(True):
        sched64 = lbjax.as_optax_schedule(sched.schedule, jnp.float64)
        assert np.isnan(jax.jit(sched64)(jnp.int64(-1)))


def test_traced_bool_step_is_refused():
    sched = lbjax.make_schedule("cosine", peak_lr=1.0, total_steps=10)
    with pytest.raises(ValueError, match="Invalid step: .*bool"):
        jax.jit(sched)(jnp.bool_(True))
    with pytest.raises(ValueError, match="Invalid step: True"):
        sched(True)


def test_python_schedule_takes_concrete_jax_steps_and_refuses_traced_ones():
    py = schedules.make_schedule("cosine", peak_lr=1.0, total_steps=10, warmup_steps=2)
    assert py(jnp.int32(3)) == py(np.int64(3)) == py(3)
    assert py(jnp.float32(3.0)) == py(3)
    with pytest.raises(ValueError, match=re.escape("Invalid step: Array(-1")):
        py(jnp.int32(-1))
    with pytest.raises(ValueError, match=re.escape("Invalid step: Array(nan")):
        py(jnp.float32(math.nan))
    with pytest.raises(ValueError, match="as_optax_schedule"):
        jax.jit(py)(jnp.int32(3))


def test_schedule_is_hashable_for_static_args():
    a = lbjax.make_schedule("cosine", peak_lr=1.0, total_steps=10)
    b = lbjax.make_schedule("cosine", peak_lr=1.0, total_steps=10)
    assert a == b and hash(a) == hash(b)
