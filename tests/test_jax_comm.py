"""AdaComp for JAX (``largebatch.comm.jax``) against the float64 NumPy reference.

Every check has two sides: the *semantics* against ``largebatch.comm.reference`` (float64),
and the *arithmetic* bit for bit, against the same steps in float32 NumPy or in float64.

Tolerances. ``U = 2**-24`` is float32's unit roundoff.

- Hand-made bins hold small dyadic numbers: every sum, difference and mean is exact in
  float32, so the compressor equals the reference bit for bit there.
- Random float32 data: the reference runs on the float32 inputs cast to float64, so its
  ``G = r + g`` is exact where ours is rounded once (``U * |G|``). The selection compares
  ``|H|`` with ``max |G|`` and flips only if a comparison sits within that rounding, which
  these fixed seeds never hit: the masks are compared exactly. The scale (a mean of
  ``|G|``, rounded once more) is within ``2 U`` relative, a sent value too, and the new
  residual ``G - sent`` within ``U |G| + 2 U scale + U |r_new| <= 4 U (|G| + scale)``.
- Under ``jax.enable_x64`` (float64 leaves) both sides do the same float64 operations: bit
  for bit, the scale included (our double-word sum is the reference's ``math.fsum``).
- Exchanges over ``n`` devices: each device's sent values are within ``2 U`` of the
  reference's, the float32 sum of ``n`` of them adds ``(n - 1) U`` of their magnitudes
  (at most ``M``, the largest ``|r| + |g|``), and the two-phase owner's second compression
  two more roundings: the mean is within ``4 (n + 4) U M`` (a factor 4 to spare), the
  residuals within ``8 U M``. The bit-for-bit side replays the exchange with this
  module's own ``compress`` and float32 NumPy sums in device order.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from helpers import BAD_ADACOMP_OPTIONS, shard_map  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from largebatch.comm import reference as ref  # noqa: E402
from largebatch.comm.jax import (  # noqa: E402
    DEFAULT_BIN_CAPACITY,
    AdaCompState,
    adacomp,
    adacomp_init_state,
    adacomp_state_specs,
    allgather_mean,
    chunk_length,
    compress,
    decode,
    default_capacity,
    two_phase_mean,
)
from largebatch.comm.jax._compress import divide  # noqa: E402
from largebatch.jax import lars  # noqa: E402

U = 2.0**-24  # float32 unit roundoff
AXIS = "data"


def data_mesh(n):
    assert jax.device_count() == 8, "tests/conftest.py asks XLA for 8 host devices"
    return Mesh(np.array(jax.devices()[:n]), (AXIS,))


def put(mesh, tree, specs):
    """``tree`` placed as ``shard_map`` returns it, so a jitted step compiles once."""
    return jax.device_put(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))


_compress = jax.jit(compress, static_argnums=2, static_argnames=("capacity", "select", "values"))


def run(r, g, bin_len, **kw):
    """Our compressor as NumPy: ``(mask, scale, sent, new_residual, message)``; ``sent``
    decoded in NumPy (``decode`` is checked against it in
    ``test_capacity_overflow_keeps_the_leftover_in_the_residual``)."""
    new_r, msg = _compress(r, g, bin_len, **kw)
    numel = np.size(g)
    count = int(msg.count)
    indices, values, scale = np.asarray(msg.indices), np.asarray(msg.values), np.asarray(msg.scale)
    mask = np.zeros(numel, bool)
    mask[indices[:count]] = True
    sent = np.zeros(numel, scale.dtype)
    sent[indices[:count]] = values[:count] * scale if values.dtype == np.int8 else values[:count]
    return mask, scale, sent, np.asarray(new_r).ravel(), msg


def f32(x):
    return np.asarray(x, np.float32)


# ------------------------------------------------------------------------ compressor

# Hand-made leaves (G and g; r = G - g), bins of 4. Every number is a small dyadic one.
HAND = {
    # bin 1: ties |H| == max |G| (indices 1 and 2) are selected; G = 0 (index 3) is not.
    # bin 2: G = 0 everywhere while g is not: nothing is sent.
    # bin 3: the largest |G| (index 8) is not selected when g points the other way.
    # The mean |G| of the nonzero elements is dyadic too (select="all").
    # bin 4 (short): one element.
    "ties_zero_bin_short_bin": (
        [1, -2, 0.5, 0, 0, 0, 0, 0, 3, 0, -3, 2, -0.5, 0.25],
        [0, 0, 1.5, 0.25, 1, -1, 0.5, 0, -1, -0.5, 0.25, 1, -0.5, 0],
        [1, 2, 11, 12],
    ),
    "equal_magnitudes_all_sent": ([0.5, -0.5, 0.5, -0.5, 0.5], [0.5, -0.5, 0.25, 0, 0.5], [0, 1, 2, 3, 4]),
    "zero_leaf": ([0.0] * 9, [0.0] * 9, []),
}


@pytest.mark.parametrize("select", ["adacomp", "all"])
@pytest.mark.parametrize("values", ["ternary", "exact"])
@pytest.mark.parametrize("case", HAND)
def test_compress_hand_made_bins_equal_the_reference_bit_for_bit(case, select, values):
    big_g, g, expected = (np.array(v, np.float64) if v is not None else None for v in HAND[case])
    r = big_g - g
    want = ref.compress(r, g, 4, select=select, values=values)
    if select == "adacomp" and expected is not None:
        assert np.flatnonzero(want.mask).tolist() == expected.tolist()
    mask, scale, sent, new_r, msg = run(f32(r), f32(g), 4, capacity=big_g.size, select=select, values=values)
    np.testing.assert_array_equal(mask, want.mask)
    assert scale == np.float32(want.scale)
    np.testing.assert_array_equal(sent, f32(want.sent))
    np.testing.assert_array_equal(new_r, f32(want.residual))
    assert int(msg.count) == int(msg.selected) == int(want.mask.sum())


RANDOM = [(1, 50), (50, 50), (1234, 50), (1234, 500), (333, 7)]  # (numel, L_T)


def random_leaf(rng, numel):
    """A residual and a gradient of different magnitudes per element, in float32."""
    spread = 10.0 ** rng.uniform(-2, 1, numel)
    return f32(rng.standard_normal(numel) * spread), f32(rng.standard_normal(numel) * spread)


@pytest.mark.parametrize(("select", "values"), [("adacomp", "ternary"), ("adacomp", "exact")])
def test_compress_random_float32_equals_the_reference(select, values):
    rng = np.random.default_rng(0)
    for numel, bin_len in RANDOM:
        r, g = random_leaf(rng, numel)
        want = ref.compress(r, g, bin_len, select=select, values=values)
        mask, scale, sent, new_r, _ = run(r, g, bin_len, capacity=numel, select=select, values=values)
        np.testing.assert_array_equal(mask, want.mask, err_msg=f"{numel}, {bin_len}")
        np.testing.assert_allclose(scale, want.scale, rtol=2 * U, atol=0)
        np.testing.assert_allclose(sent, want.sent, rtol=2 * U, atol=0)
        big_g = r.astype(np.float64) + g
        bound = 4 * U * (np.abs(big_g) + want.scale)
        assert np.all(np.abs(new_r - want.residual) <= bound), np.max(np.abs(new_r - want.residual))
        if values == "ternary" and want.mask.any():
            # the scale: the float32 |G|'s exact mean, rounded once
            g32 = (r + g)[want.mask]
            assert scale == np.float32(math.fsum(np.abs(g32.astype(np.float64))) / g32.size)


def test_compress_float64_under_x64_equals_the_reference_bit_for_bit():
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        for numel, bin_len in [(1, 50), (1234, 50), (333, 7)]:
            spread = 10.0 ** rng.uniform(-2, 1, numel)
            r, g = (rng.standard_normal(numel) * spread for _ in range(2))
            for select, values in [("adacomp", "ternary"), ("all", "exact")]:
                want = ref.compress(r, g, bin_len, select=select, values=values)
                mask, scale, sent, new_r, msg = run(
                    r, g, bin_len, capacity=numel, select=select, values=values
                )
                assert new_r.dtype == np.float64 and msg.scale.dtype == jnp.float64
                np.testing.assert_array_equal(mask, want.mask)
                assert scale == want.scale
                np.testing.assert_array_equal(sent, want.sent)
                np.testing.assert_array_equal(new_r, want.residual)
    assert jnp.zeros(()).dtype == jnp.float32  # x64 stayed inside the context


@pytest.mark.parametrize("capacity", [None, 7, 10_000])
def test_error_feedback_identity(capacity):
    """Not sent: ``r_new = G`` bit for bit and nothing sent. Sent: ``r_new`` is float32's
    ``G - sent``, so ``sent + r_new`` is ``G`` up to that one rounding."""
    rng = np.random.default_rng(2)
    r, g = random_leaf(rng, 1234)
    mask, _, sent, new_r, _ = run(r, g, 50, capacity=capacity)
    big_g = r + g  # float32, as ours
    np.testing.assert_array_equal(new_r[~mask], big_g[~mask])
    assert not sent[~mask].any()
    np.testing.assert_array_equal(new_r[mask], big_g[mask] - sent[mask])
    total = sent.astype(np.float64) + new_r
    assert np.all(np.abs(total - big_g) <= U * np.abs(new_r.astype(np.float64)))
    assert mask.sum() > 0


def test_capacity_overflow_keeps_the_leftover_in_the_residual():
    rng = np.random.default_rng(3)
    numel, bin_len, capacity = 400, 50, 5
    g = f32(rng.standard_normal(numel))
    r = np.zeros(numel, np.float32)  # G = g exactly: the reference's mask is ours
    want = ref.compress(r, g, bin_len)
    chosen = np.flatnonzero(want.mask)
    assert chosen.size > capacity
    mask, scale, sent, new_r, msg = run(r, g, bin_len, capacity=capacity)
    assert msg.indices.shape == (capacity,) and msg.values.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(msg.indices), chosen[:capacity])
    assert int(msg.count) == capacity and int(msg.selected) == chosen.size
    assert scale == np.float32(math.fsum(np.abs(g[chosen[:capacity]].astype(np.float64))) / capacity)
    deferred = chosen[capacity:]
    np.testing.assert_array_equal(new_r[deferred], g[deferred])  # stays, whole
    assert not sent[deferred].any()
    np.testing.assert_array_equal(np.asarray(decode(msg, (20, 20))).ravel(), sent)
    np.testing.assert_array_equal(new_r[~mask], g[~mask])
    assert np.all(np.abs(sent.astype(np.float64) + new_r - g) <= U * np.abs(new_r))
    # the default: DEFAULT_BIN_CAPACITY entries per bin, padded with numel
    _, _, _, _, msg = run(f32(rng.standard_normal(12)), f32(rng.standard_normal(12)), 50)
    assert msg.indices.shape == (default_capacity(12, 50),) == (DEFAULT_BIN_CAPACITY,)
    _, _, _, _, msg = run(r, g, bin_len)
    assert msg.indices.shape == (DEFAULT_BIN_CAPACITY * 8,)
    count = int(msg.count)
    assert np.all(np.asarray(msg.indices)[count:] == numel)
    assert not np.asarray(msg.values)[count:].any()


@pytest.mark.parametrize("n", [3, 5, 6, 7, 1000, 4095])
def test_division_by_the_device_count_is_correctly_rounded(n):
    """The exchanges divide a sum by ``n``; XLA turns ``x / n`` into ``x * (1/n)``, an ulp
    off for about a third of the elements at ``n = 3``. Ours equals NumPy's division
    (IEEE, correctly rounded), in float32 and in float64."""
    quotient = jax.jit(lambda x, c: divide(x, jnp.zeros_like(x), c))
    rng = np.random.default_rng(n)
    x = rng.standard_normal(20_000) * 10.0 ** rng.uniform(-30, 30, 20_000)
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(quotient(x32, np.float32(n)), x32 / np.float32(n))
    with jax.enable_x64(True):
        np.testing.assert_array_equal(quotient(x, np.float64(n)), x / np.float64(n))


# --------------------------------------------------------------------------- exchanges

# A conv leaf (rank 4, 216 elements: 5 bins of 50, the last short), an all-zero conv
# leaf, a fully connected leaf (2,080 = 4 bins of 500 and one of 80) and a bias (sent
# uncompressed). Over 8 devices some two-phase chunks are empty.
LEAVES = {"conv": (3, 3, 4, 6), "zero": (2, 2, 3, 5), "fc": (40, 52), "bias": (6,)}
MAGNITUDES = {"conv": 1.0, "zero": 0.0, "fc": 1e-2, "bias": 1.0}


def device_grads(rng, n):
    """One step's gradients: per leaf ``(n, *shape)``, device ``k``'s at ``[k]``."""
    return {
        k: f32(MAGNITUDES[k] * 10.0 ** rng.uniform(-1, 1, (n, *s)) * rng.standard_normal((n, *s)))
        for k, s in LEAVES.items()
    }


def params_like():
    return {k: jnp.zeros(s, jnp.float32) for k, s in LEAVES.items()}


def exchange_step(tx, mesh, check=True):
    """``tx.update`` inside ``shard_map``, and ``lax.pmean`` of the same gradients; the
    state from :func:`adacomp_init_state`. Returns ``(step, state, state_specs)``."""
    state, specs = adacomp_init_state(tx, params_like(), mesh, AXIS)
    grad_specs = {k: P(AXIS) for k in LEAVES}

    def body(grads, state):
        g = jax.tree.map(lambda x: x[0], grads)
        updates, state = tx.update(g, state)
        return updates, state, jax.lax.pmean(g, AXIS)

    step = jax.jit(shard_map(body, mesh, (grad_specs, specs), (P(), specs, P()), check))
    return step, state, specs


@pytest.mark.parametrize("form", ["allgather", "two_phase"])
def test_a_bin_longer_than_the_leaf_costs_the_leafs_memory(form):
    """L_T = 1e6 over leaves of at most 2,080 elements is each leaf's one bin: the same
    compiled step, state and memory as bins of the leaves' own sizes (1e8 once took 4 GB)."""
    mesh = data_mesh(4)
    huge = exchange_step(adacomp(AXIS, form=form, conv_bin=10**6, fc_bin=10**6), mesh)
    fitted = exchange_step(adacomp(AXIS, form=form, conv_bin=216, fc_bin=2080), mesh)
    assert max(math.prod(s) for s in LEAVES.values()) == 2080
    grads = {
        k: jnp.asarray(np.random.default_rng(1).standard_normal((4, *s)), jnp.float32)
        for k, s in LEAVES.items()
    }
    (step, state, _), (step_fit, state_fit, _) = huge, fitted
    assert jax.tree.map(jnp.shape, state) == jax.tree.map(jnp.shape, state_fit)
    # Each step compiled once: its memory read, then the same executable run.
    compiled = [s.lower(grads, st).compile() for s, st in ((step, state), (step_fit, state_fit))]
    memory = [c.memory_analysis().temp_size_in_bytes for c in compiled]
    assert memory[0] == memory[1], memory
    for a, b in zip(
        jax.tree.leaves(compiled[0](grads, state)[:2]),
        jax.tree.leaves(compiled[1](grads, state_fit)[:2]),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _state_leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves((state.residuals, state.chunk_residuals, state.selected))]


@pytest.mark.parametrize("form", ["allgather", "two_phase"])
def test_a_nonfinite_gradient_on_one_device_is_a_plain_step_that_keeps_the_residuals(form):
    """As the torch hook: an inf or NaN on one device (in a compressed conv or fc leaf, or
    a plain-averaged bias) makes the step a plain average on every device (the value
    reaches the result) and no residual changes, so the next finite step is the one it
    would have been."""
    mesh = data_mesh(4)
    step, state, _ = exchange_step(adacomp(AXIS, form=form), mesh)
    rng = np.random.default_rng(2)
    first, later = device_grads(rng, 4), device_grads(rng, 4)
    _, state1, _ = step(first, state)
    expected_later = step(later, state1)[:2]
    for bad, leaf in [(np.inf, "fc"), (np.nan, "conv"), (-np.inf, "bias")]:
        poisoned = {k: np.array(v) for k, v in device_grads(rng, 4).items()}
        where = (2, *(0,) * len(LEAVES[leaf]))
        poisoned[leaf][where] = bad
        mean, state2, plain = step(poisoned, state1)
        for k in LEAVES:
            np.testing.assert_array_equal(np.asarray(mean[k]), np.asarray(plain[k]), err_msg=k)
        assert not np.isfinite(np.asarray(mean[leaf])[where[1:]]), (bad, leaf)
        for a, b in zip(_state_leaves(state1), _state_leaves(state2), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{bad} in {leaf}")
        for a, b in zip(
            jax.tree.leaves(step(later, state2)[:2]), jax.tree.leaves(expected_later), strict=True
        ):
            if a.ndim:  # all but the step count
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("form", ["allgather", "two_phase"])
def test_an_fp16_average_that_overflows_commits_no_residual(form):
    """Finite fp16 gradients whose compressed average exceeds 65504 (residuals of
    300,000, each device sending its own elements: 75,000 on average): the result holds
    the inf for a loss scaler to skip, and the residuals stay as they were: delayed, not
    dropped."""
    mesh = data_mesh(4)
    step, state, _ = exchange_step(adacomp(AXIS, form=form), mesh)
    state = state._replace(residuals={**state.residuals, "fc": jnp.full_like(state.residuals["fc"], 3e5)})
    grads = {k: jnp.asarray(v, jnp.float16) for k, v in device_grads(np.random.default_rng(3), 4).items()}
    mean, after, _ = step(grads, state)
    assert mean["fc"].dtype == jnp.float16 and np.isinf(np.asarray(mean["fc"])).any()
    for a, b in zip(_state_leaves(state), _state_leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)


def replay_allgather(residuals, grads, bin_len):
    """The all-gather exchange with our compressor and float32 NumPy sums in device
    order: ``(mean, new_residuals)``."""
    numel = grads[0].size
    parts = [run(r.ravel(), g.ravel(), bin_len, capacity=numel) for r, g in zip(residuals, grads)]
    total = parts[0][2].copy()
    for p in parts[1:]:
        total = total + p[2]
    return total / np.float32(len(grads)), [p[3] for p in parts]


def replay_two_phase(residuals, chunks, grads, bin_len):
    """The two-phase exchange, likewise: ``(mean, new_residuals, new_chunk_residuals)``."""
    n, numel = len(grads), grads[0].size
    span = chunk_length(numel, bin_len, n)
    parts = [run(r.ravel(), g.ravel(), bin_len, capacity=numel) for r, g in zip(residuals, grads)]
    sents = [np.pad(p[2], (0, n * span - numel)).reshape(n, span) for p in parts]
    out, new_chunks = [], []
    for j in range(n):
        total = sents[0][j].copy()
        for s in sents[1:]:
            total = total + s[j]
        _, _, sent, new_c, _ = run(chunks[j], total / np.float32(n), bin_len, capacity=span)
        out.append(sent)
        new_chunks.append(new_c)
    return np.concatenate(out)[:numel], [p[3] for p in parts], new_chunks


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.mark.parametrize(
    ("n", "form", "check"),
    [
        (2, "allgather", True),
        (4, "allgather", False),
        (8, "allgather", True),
        (2, "two_phase", True),
        (4, "two_phase", True),
        (8, "two_phase", False),
    ],
    ids=lambda v: {True: "check_vma", False: "no_check_vma"}.get(v, str(v)),
)
def test_exchange_in_shard_map_equals_the_reference(n, form, check):
    """One warm-up step (``pmean``, residuals untouched), then two compressed steps
    carrying the residuals: each step against the reference fed the same residuals."""
    tx = adacomp(AXIS, warmup_steps=1, form=form, bin_capacity=None)
    mesh = data_mesh(n)
    step, state, _ = exchange_step(tx, mesh, check)
    rng = np.random.default_rng(n)
    bins = {"conv": ref.CONV_BIN, "zero": ref.CONV_BIN, "fc": ref.FC_BIN}
    for t in range(3):
        before = host(state)
        grads = device_grads(rng, n)
        updates, state, pmean = step(grads, state)
        updates, after, pmean = host(updates), host(state), host(pmean)
        assert int(after.count) == t + 1
        np.testing.assert_array_equal(updates["bias"], pmean["bias"])
        assert after.residuals["bias"] is None
        if t == 0:  # warm-up
            for k in LEAVES:
                np.testing.assert_array_equal(updates[k], pmean[k])
            for tree in (after.residuals, after.chunk_residuals, after.selected):
                assert not any(np.any(x) for x in jax.tree.leaves(tree))
            continue
        for k, bin_len in bins.items():
            rs = list(before.residuals[k])
            gs = list(grads[k])
            numel, shape = gs[0].size, gs[0].shape
            magnitude = max(np.max(np.abs(rs)) + np.max(np.abs(gs)), 1e-30)
            if form == "allgather":
                want, want_rs = ref.allgather_exchange(rs, gs, bin_len)
                mean, new_rs = replay_allgather(rs, gs, bin_len)
            else:
                span = chunk_length(numel, bin_len, n)
                cs = list(before.chunk_residuals[k])
                bounds = ref.chunk_bounds(numel, bin_len, n)
                want, want_rs, want_cs = ref.two_phase_exchange(
                    rs, [c[: hi - lo] for c, (lo, hi) in zip(cs, bounds)], gs, bin_len
                )
                mean, new_rs, new_cs = replay_two_phase(rs, cs, gs, bin_len)
                magnitude = max(magnitude, max(np.max(np.abs(c)) for c in cs) + np.max(np.abs(want)))
                for j, (lo, hi) in enumerate(bounds):
                    got = after.chunk_residuals[k][j]
                    assert got.shape == (span,) and not got[hi - lo :].any()
                    np.testing.assert_allclose(got[: hi - lo], want_cs[j], rtol=0, atol=8 * U * magnitude)
                    np.testing.assert_array_equal(got, new_cs[j])
            np.testing.assert_allclose(
                updates[k].ravel(), want, rtol=0, atol=4 * (n + 4) * U * magnitude, err_msg=k
            )
            np.testing.assert_array_equal(updates[k], mean.reshape(shape), err_msg=k)
            for i in range(n):
                np.testing.assert_allclose(
                    after.residuals[k][i].ravel(), want_rs[i], rtol=0, atol=8 * U * magnitude
                )
                np.testing.assert_array_equal(after.residuals[k][i].ravel(), new_rs[i])
                want_mask = ref.compress(rs[i], gs[i], bin_len).mask
                assert int(after.selected[k][i]) == int(want_mask.sum())
            if k == "zero":
                assert not updates[k].any() and not after.residuals[k].any()
            else:
                assert updates[k].any() and after.residuals[k].any()


@pytest.mark.parametrize("form", ["allgather", "two_phase"])
def test_select_all_exact_values_equal_pmean(form):
    tx = adacomp(AXIS, form=form, select="all", values="exact", bin_capacity=None)
    step, state, _ = exchange_step(tx, data_mesh(8))
    rng = np.random.default_rng(5)
    for _ in range(2):
        updates, state, pmean = step(device_grads(rng, 8), state)
        for k in LEAVES:
            np.testing.assert_array_equal(np.asarray(updates[k]), np.asarray(pmean[k]))
        residuals = [state.residuals, state.chunk_residuals]
        assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(residuals))


@pytest.mark.parametrize("form", ["allgather", "two_phase"])
def test_exchange_capacity_overflow_conserves_the_gradient(form):
    """One entry per bin: most selections are deferred, none is lost. All-gather:
    ``n * mean = sum_i (r_i + g_i - r_new_i)``; two-phase, per chunk ``j`` of the owner
    ``j``: ``n * (mean + s_new_j - s_j) = sum_i (r_i + g_i - r_new_i)``."""
    n = 4
    tx = adacomp(AXIS, form=form, bin_capacity=1)
    step, state, _ = exchange_step(tx, data_mesh(n))
    rng = np.random.default_rng(6)
    for _ in range(2):
        before = host(state)
        grads = device_grads(rng, n)
        updates, state, _ = step(grads, state)
        updates, after = host(updates), host(state)
        for k, bin_len in [("conv", ref.CONV_BIN), ("fc", ref.FC_BIN)]:
            numel = grads[k][0].size
            nbins = -(-numel // bin_len)
            sent = sum(
                before.residuals[k][i].astype(np.float64) + grads[k][i] - after.residuals[k][i]
                for i in range(n)
            ).ravel()
            got = n * updates[k].astype(np.float64).ravel()
            if form == "allgather":
                assert np.all(after.selected[k] > nbins)  # overflowed on every device
            else:
                span = chunk_length(numel, bin_len, n)
                pad = n * span - numel
                change = np.concatenate(
                    [
                        after.chunk_residuals[k][j].astype(np.float64) - before.chunk_residuals[k][j]
                        for j in range(n)
                    ]
                )
                got = got + n * change[: n * span - pad]
                per_chunk = [
                    np.pad(ref.compress(before.residuals[k][i], grads[k][i], bin_len).mask, (0, pad))
                    .reshape(n, span)
                    .sum(1)
                    for i in range(n)
                ]
                assert np.max(per_chunk) > span // bin_len  # some chunk overflowed
            magnitude = np.max(np.abs(sent)) + np.max(np.abs(got))
            np.testing.assert_allclose(got, sent, rtol=0, atol=4 * n * (n + 4) * U * magnitude)


@pytest.mark.parametrize(
    ("n", "form"), [(3, "allgather"), (8, "allgather"), (6, "two_phase"), (8, "two_phase")]
)
def test_same_gradients_same_result_as_the_torch_exchange(n, form):
    """The JAX transformation and the torch hook's exchange (``SimulatedWorkers``, the
    hook's arithmetic for ``n`` workers in one process) fed the same per-device
    gradients: one warm-up step, then three compressed steps carrying the residuals.
    Compressed leaves and residuals agree bit for bit: both compress in float32 with a
    correctly rounded scale and sum the decoded messages in device order before dividing
    by ``n``. What is averaged uncompressed (the bias; everything in the warm-up) is a
    ``lax.pmean`` (sum, then divide) here and a sum of ``g / n`` there (as DDP's
    all-reduce): within ``n`` roundings."""
    torch = pytest.importorskip("torch")
    from largebatch.comm.torch import SimulatedWorkers

    names = list(LEAVES)
    sim = SimulatedWorkers(names, [torch.Size(LEAVES[k]) for k in names], n, warmup_steps=1, form=form)
    tx = adacomp(AXIS, warmup_steps=1, form=form, bin_capacity=None)
    step, state, _ = exchange_step(tx, data_mesh(n))
    rng = np.random.default_rng(100 + n)
    for t in range(4):
        grads = device_grads(rng, n)
        updates, state, _ = step(grads, state)
        updates, after = host(updates), host(state)
        theirs = sim.exchange([[torch.from_numpy(grads[k][i].copy()) for k in names] for i in range(n)])
        for k, got in zip(names, theirs):
            got = got.numpy()
            if k == "bias" or t == 0:  # averaged uncompressed
                bound = n * U * np.max(np.abs(grads[k]))
                np.testing.assert_allclose(updates[k], got, rtol=0, atol=bound, err_msg=k)
                continue
            np.testing.assert_array_equal(updates[k], got, err_msg=f"step {t}, {k}")
            for i, worker in enumerate(sim.workers):
                np.testing.assert_array_equal(
                    after.residuals[k][i].ravel(), worker.residuals[k].numpy(), err_msg=k
                )
        assert t == 0 or updates["conv"].any() and updates["fc"].any()


# ------------------------------------------------------------------------------ optax

MODEL = {"conv": (3, 3, 2, 4), "fc": (12, 40), "b": (40,)}


def train(opt, mesh, grads, params, resumes=(None,)):
    """``opt.update`` in a jitted, ``shard_map``'d step fed ``grads[t]`` (per device), once
    per entry of ``resumes``: at step ``resume_at`` the params and the state go through
    the host (``jax.device_get``) and back. One compiled step for all the runs; returns
    each run's ``(params, state)`` on the host."""
    state0, specs = adacomp_init_state(opt, params, mesh, AXIS)
    param_specs = jax.tree.map(lambda _: P(), params)
    params0 = put(mesh, params, param_specs)
    grad_specs = jax.tree.map(lambda _: P(AXIS), params)

    def body(params, state, grads):
        updates, state = opt.update(jax.tree.map(lambda x: x[0], grads), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(shard_map(body, mesh, (P(), specs, grad_specs), (P(), specs)))
    runs = []
    for resume_at in resumes:
        params, state = params0, state0
        for t, g in enumerate(grads):
            if t == resume_at:
                saved = jax.device_get((params, state))
                params, state = put(mesh, saved, (param_specs, specs))
            params, state = step(params, state, put(mesh, g, grad_specs))
        runs.append((host(params), host(state)))
    assert step._cache_size() == 1
    return runs


def model_problem(n, steps, seed=7):
    rng = np.random.default_rng(seed)
    params = {k: f32(rng.standard_normal(s)) for k, s in MODEL.items()}
    grads = [{k: f32(rng.standard_normal((n, *s))) for k, s in MODEL.items()} for _ in range(steps)]
    return params, grads


def test_chained_with_lars_compiles_once_and_resumes_bit_for_bit():
    n, steps = 4, 5
    params, grads = model_problem(n, steps)
    opt = optax.chain(
        adacomp(AXIS, warmup_steps=2, form="two_phase"), lars(0.1, weight_decay=1e-4, trust_coefficient=0.01)
    )
    mesh = data_mesh(n)
    whole, resumed = train(opt, mesh, grads, params, resumes=(None, 3))
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(resumed)):
        np.testing.assert_array_equal(a, b)
    ada = whole[1][0]
    assert isinstance(ada, AdaCompState) and int(ada.count) == steps
    assert ada.residuals["conv"].shape == (n, *MODEL["conv"]) and ada.residuals["b"] is None
    assert ada.chunk_residuals["fc"].shape == (n, chunk_length(480, ref.FC_BIN, n))
    assert np.all(ada.selected["conv"] > 0) and ada.residuals["conv"].any()
    moved = [not np.allclose(a, params[k]) for k, a in whole[0].items()]
    assert all(moved)


def test_multi_steps_around_the_chain_equals_the_chain_on_the_averaged_gradient():
    """``optax.MultiSteps(chain(adacomp, inject_hyperparams(lars)), 2)``: every second
    mini-step applies the chain to the mean of two gradients (MultiSteps' running mean),
    which the plain chain fed that mean reproduces."""
    n, k = 4, 2
    params, grads = model_problem(n, 2 * k, seed=8)

    def inner():
        return optax.chain(
            adacomp(AXIS, warmup_steps=1),
            optax.inject_hyperparams(lars)(learning_rate=0.1, weight_decay=1e-4),
        )

    mesh = data_mesh(n)
    [multi] = train(optax.MultiSteps(inner(), every_k_schedule=k), mesh, grads, params)
    means = []
    for t in range(0, len(grads), k):
        acc = jax.tree.map(np.zeros_like, grads[t])
        for i, g in enumerate(grads[t : t + k]):  # MultiSteps' update: acc + (g - acc) / (i + 1)
            acc = jax.tree.map(lambda a, x, i=i: a + (x - a) / np.float32(i + 1), acc, g)
        means.append(acc)
    [plain] = train(inner(), mesh, means, params)
    for a, b in zip(jax.tree.leaves(multi[0]), jax.tree.leaves(plain[0])):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    inner_state = multi[1].inner_opt_state[0]
    np.testing.assert_array_equal(inner_state.residuals["fc"], plain[1][0].residuals["fc"])
    assert int(inner_state.count) == 2


def test_docstring_example_runs():
    """``adacomp_init_state``'s example, as written: it compiles its step once."""
    import textwrap

    doc = adacomp_init_state.__doc__
    block = doc.split("shard of the batch)::\n", 1)[1].split("\n    Args:", 1)[0]
    namespace: dict = {}
    exec(textwrap.dedent(block), namespace)  # noqa: S102
    assert namespace["train_step"]._cache_size() == 1
    state = namespace["state"]
    assert int(state[0].count) == 5
    assert state[0].residuals["w1"].shape == (jax.device_count(), 16, 64)


def test_docs_example_runs():
    """docs/communication.md's JAX block, as written, given params, a loss and batches:
    past its warm-up of 100 steps it compresses, and it compiles its step once."""
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "communication.md").read_text()
    block = page.split("## JAX:", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    setup = (
        "import jax, jax.numpy as jnp, numpy as np, optax\n"
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
        "from largebatch.jax import adacomp, adacomp_init_state, lars\n"
        "k1, k2 = jax.random.split(jax.random.key(0))\n"
        "params = {'w': jax.random.normal(k1, (3, 3, 2, 4)) / 4, 'b': jnp.zeros(4),\n"
        "          'fc': jax.random.normal(k2, (36, 2)) / 8}\n"
        "def loss_fn(p, x, y):\n"
        "    h = jax.lax.conv_general_dilated(x, p['w'], (1, 1), 'SAME',\n"
        "                                     dimension_numbers=('NHWC', 'HWIO', 'NHWC'))\n"
        "    h = jnp.tanh(h + p['b']).reshape(x.shape[0], -1)[:, :36]\n"
        "    return jnp.mean((h @ p['fc'] - y) ** 2)\n"
    )
    namespace: dict = {}
    exec(setup + block, namespace)  # noqa: S102
    mesh, step = namespace["mesh"], namespace["train_step"]
    params, state = namespace["params"], namespace["state"]
    rng = np.random.default_rng(0)
    data = NamedSharding(mesh, P("data"))
    for _ in range(102):
        x = jax.device_put(f32(rng.standard_normal((16, 6, 6, 2))), data)
        y = jax.device_put(f32(rng.standard_normal((16, 2))), data)
        # One step at a time: overlapping steps on forced host devices can deadlock
        # XLA:CPU's all-reduce (docs/communication.md says why).
        params, state = jax.block_until_ready(step(params, state, x, y))
    assert step._cache_size() == 1
    assert int(state[0].count) == 102
    assert np.asarray(state[0].residuals["w"]).any()  # compressed steps ran
    assert np.asarray(state[0].residuals["fc"]).any()


# ------------------------------------------------------------------------------ checks

BAD_ADACOMP = [
    *BAD_ADACOMP_OPTIONS,
    ({"bin_capacity": 0}, "Invalid bin_capacity: 0 (must be an integer >= 1)"),
]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    BAD_ADACOMP,
    ids=[next(iter(k)) + "=" + repr(next(iter(k.values()))) for k, _ in BAD_ADACOMP],
)
def test_bad_arguments_raise_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        adacomp(AXIS, **kwargs)


def test_bad_arguments_of_the_compressor_and_the_axis():
    r = g = np.zeros(10, np.float32)
    for kwargs, message in [
        ({"capacity": 0}, "Invalid capacity: 0 (must be an integer >= 1)"),
        ({"select": "x"}, "Invalid select"),
        ({"values": "x"}, "Invalid values"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            compress(r, g, 5, **kwargs)
    with pytest.raises(ValueError, match=re.escape("Invalid bin length L_T: 0 (must be an integer >= 1)")):
        compress(r, g, 0)
    with pytest.raises(ValueError, match="residual has 9 elements, gradient 10"):
        compress(r[:9], g, 5)
    with pytest.raises(TypeError, match="real floating"):
        compress(r, np.zeros(10, np.int32), 5)
    with pytest.raises(ValueError, match="axis_name must name"):
        adacomp(None)
    with pytest.raises(ValueError, match=re.escape("Invalid axis_name: ''")):
        adacomp("")
    with pytest.raises(ValueError, match="must run inside shard_map over 'data'"):
        adacomp(AXIS, form="two_phase").init(params_like())
    multi = optax.MultiSteps(adacomp(AXIS), 2).init({"w": jnp.zeros((4, 4)), "s": jnp.zeros(())})
    with pytest.raises(ValueError, match="scalar gradient per device"):
        adacomp_state_specs(multi, AXIS)


def test_per_leaf_functions_outside_the_transformation():
    """``allgather_mean`` and ``two_phase_mean`` called directly (a leaf's residuals by
    hand), with a bias (``bin_len=None``) through ``allgather_mean``."""
    n, numel = 2, 130
    mesh = data_mesh(n)
    span = chunk_length(numel, 50, n)
    rng = np.random.default_rng(9)
    g = f32(rng.standard_normal((n, numel)))
    zeros, chunk0 = np.zeros((n, numel), np.float32), np.zeros((n, span), np.float32)

    def body(r, c, g, b):
        a, ar, _ = allgather_mean(r[0], g[0], 50, AXIS, capacity=numel)
        t, tr, tc, _ = two_phase_mean(r[0], c[0], g[0], 50, AXIS, capacity=span)
        b = b[0]
        bias, same, none = allgather_mean(b, b, None, AXIS)
        assert none is None and same is b
        return a, ar[None], t, tr[None], tc[None], bias

    specs = (P(AXIS),) * 4
    outs = jax.jit(shard_map(body, mesh, specs, (P(), P(AXIS), P(), P(AXIS), P(AXIS), P())))(
        zeros, chunk0, g, g
    )
    a, ar, t, tr, tc, bias = map(np.asarray, outs)
    want, want_rs = ref.allgather_exchange(list(zeros), list(g), 50)
    np.testing.assert_allclose(a, want, rtol=0, atol=4 * (n + 4) * U * np.abs(g).max())
    want2, _, want_cs = ref.two_phase_exchange(
        list(zeros), [np.zeros(hi - lo) for lo, hi in ref.chunk_bounds(numel, 50, n)], list(g), 50
    )
    np.testing.assert_allclose(t, want2, rtol=0, atol=4 * (n + 4) * U * np.abs(g).max())
    np.testing.assert_allclose(tc[0][:span], want_cs[0], rtol=0, atol=8 * U * np.abs(g).max())
    np.testing.assert_allclose(bias, g.mean(0), rtol=2 * U)
    np.testing.assert_array_equal(ar, tr)  # the same phase-1 residual: no overflow


def test_update_accepts_extra_args_as_optax_aliases_do():
    """A GradientTransformationExtraArgs, as optax's aliases: update takes (and ignores)
    keyword arguments meant for other members of a chain."""
    tx = adacomp(AXIS, bin_capacity=None)
    assert isinstance(tx, optax.GradientTransformationExtraArgs)
    passing = optax.GradientTransformation(tx.init, lambda u, s, p=None: tx.update(u, s, p, loss=1.0))
    mesh = data_mesh(2)
    plain, state, _ = exchange_step(tx, mesh)
    extra, _, _ = exchange_step(passing, mesh)
    grads = device_grads(np.random.default_rng(0), 2)
    for a, b in zip(jax.tree.leaves(host(plain(grads, state))), jax.tree.leaves(host(extra(grads, state)))):
        np.testing.assert_array_equal(a, b)


def test_the_jax_facade_exports_the_transforms_state():
    """``largebatch.jax.AdaCompState`` is the state ``adacomp``'s ``init`` gives."""
    import largebatch.jax as lj

    assert "AdaCompState" in lj.__all__
    assert lj.AdaCompState is AdaCompState
    _, state, _ = exchange_step(lj.adacomp(AXIS), data_mesh(2))
    assert isinstance(state, lj.AdaCompState)
    chained, _ = adacomp_init_state(
        optax.chain(lj.adacomp(AXIS), lars(0.1)), params_like(), data_mesh(2), AXIS
    )
    assert isinstance(chained[0], lj.AdaCompState)
