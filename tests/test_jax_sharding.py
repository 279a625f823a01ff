"""Data parallelism with jax.sharding: 8 host devices give the single-device numbers."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from largebatch.jax import exclusion_mask, lamb, lars, make_schedule  # noqa: E402

STEPS = 3


def init_mlp(rng):
    return {
        "dense1": {"kernel": rng.standard_normal((12, 16)) / 4, "bias": np.zeros(16)},
        "dense2": {"kernel": rng.standard_normal((16, 3)) / 4, "bias": np.zeros(3)},
    }


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    logits = h @ params["dense2"]["kernel"] + params["dense2"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train(opt, params, batches, shard):
    """``STEPS`` jitted steps; with ``shard`` the batch is split over all devices."""
    if shard:
        mesh = Mesh(np.array(jax.devices()), ("data",))
        replicated, by_batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
        params = jax.device_put(params, replicated)
        batches = [jax.device_put(b, by_batch) for b in batches]
        x = batches[0][0]
        assert {s.data.shape[0] for s in x.addressable_shards} == {len(x) // jax.device_count()}
    state = opt.init(params)

    @jax.jit
    def step(params, state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for x, y in batches:
        params, state = step(params, state, x, y)
    if shard:
        for leaf in jax.tree.leaves((params, state)):
            assert leaf.sharding.is_fully_replicated
    return params


@pytest.mark.parametrize(
    "make",
    [
        lambda s: lars(s, weight_decay=1e-3, trust_coefficient=0.02, trust_ratio_mask=exclusion_mask),
        lambda s: lamb(s, weight_decay=1e-2, max_grad_norm=1.0, trust_ratio_mask=exclusion_mask),
    ],
    ids=["lars", "lamb"],
)
def test_data_parallel_equals_single_device(make):
    assert jax.device_count() == 8, "tests/conftest.py asks XLA for 8 host devices"
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), init_mlp(rng))
    batches = [
        (
            jnp.asarray(rng.standard_normal((64, 12)), jnp.float32),
            jnp.asarray(rng.integers(0, 3, 64)),
        )
        for _ in range(STEPS)
    ]
    opt = make(make_schedule("poly", peak_lr=0.5, total_steps=STEPS, warmup_steps=1, init_lr=0.1))
    single = train(opt, params, batches, shard=False)
    sharded = train(opt, params, batches, shard=True)
    for a, b, p in zip(jax.tree.leaves(sharded), jax.tree.leaves(single), jax.tree.leaves(params)):
        assert not np.allclose(b, p), "the steps must move the params"
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
