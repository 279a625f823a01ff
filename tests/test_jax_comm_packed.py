"""AdaComp's packed JAX exchange (``adacomp(..., fused=True)``) against the leaf-by-leaf one,
bit for bit: every output of ``update`` (the averages, residuals, chunk residuals, counts)
over several steps, both forms, capacity overflow, exact values, bins of several widths and
leaves left to the per-leaf path, dtypes, a non-finite step; and a fixed number of heavy
operations whatever the number of leaves. The leaf-by-leaf path is held to the reference in
``test_jax_comm.py``. On the CPU the kernels run in Pallas's interpreter in one case and as
XLA bodies in the others; the CUDA mode (``make gpu-check``) compiles them."""

from __future__ import annotations

import collections

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from largebatch.comm.jax import _packed as packed  # noqa: E402
from largebatch.comm.jax import adacomp, adacomp_init_state  # noqa: E402
from largebatch.lars.jax import rows  # noqa: E402

AXIS = "data"
SHAPES = {
    "conv": (8, 3, 3, 3),  # 216: bins of 50, the last one short
    "fc": (30, 17),  # bins of 500 (width 512): another group
    "tiny": (2, 3),  # 6 elements: one bin of 6 (width 8)
    "bias": (7,),  # sent uncompressed
    "long": (3, 700),  # 2,100 elements: with fc_bin=4096, a bin past MAX_BIN (per leaf)
    "half": (4, 5, 3),  # float16: compressed in float32, averaged in float16
}
DTYPES = {"half": jnp.float16}


def mesh_of(n):
    devices = jax.devices()[: min(n, len(jax.devices()))]
    return Mesh(np.array(devices), (AXIS,))


def steps(tx, mesh, grads_list, check_vma=False):
    """``update`` under ``shard_map`` on each step's per-device gradients: every output."""
    params = {k: jnp.zeros(s, DTYPES.get(k, jnp.float32)) for k, s in SHAPES.items()}
    state, specs = adacomp_init_state(tx, params, mesh, AXIS)

    def step(grads, state):
        return tx.update(jax.tree.map(lambda g: g[0], grads), state)

    fn = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(AXIS), specs), out_specs=(P(), specs), check_vma=False)
    )
    out = []
    for grads in grads_list:
        updates, state = fn(grads, state)
        out.append(jax.device_get((updates, state)))
    return out


def gradients(n, count, seed, nonfinite_at=None):
    rng = np.random.default_rng(seed)
    out = []
    for t in range(count):
        grads = {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in SHAPES.items()}
        grads["conv"][0, :2] = 0.0  # a zero bin's worth on one device
        if t == nonfinite_at:
            grads["fc"][n - 1, 3, 4] = np.inf
        out.append({k: jnp.asarray(g, DTYPES.get(k, jnp.float32)) for k, g in grads.items()})
    return out


# (form, options, whether the kernels run in Pallas's interpreter)
CONFIGS = [
    ("allgather", {}, False),
    ("two_phase", {}, False),
    ("allgather", {"bin_capacity": 1, "conv_bin": 7, "fc_bin": 4096}, True),
    ("two_phase", {"bin_capacity": 1, "select": "all", "values": "exact", "conv_bin": 7, "fc_bin": 4096,
                   "warmup_steps": 1}, False),
]  # fmt: skip


@pytest.mark.parametrize(("form", "options", "interpreted"), CONFIGS, ids=lambda v: str(v) if v else "")
def test_packed_equals_leaf_by_leaf_bit_for_bit(monkeypatch, form, options, interpreted):
    monkeypatch.setattr(rows, "CPU_KERNELS", "interpret" if interpreted else "xla")
    mesh = mesh_of(4)
    n = mesh.devices.size
    grads = gradients(n, 3, seed=len(options), nonfinite_at=1)
    check_vma = form == "two_phase" and not options  # shard_map's type check on one case
    plain = steps(adacomp(AXIS, form=form, fused=False, **options), mesh, grads, check_vma)
    fused = steps(adacomp(AXIS, form=form, fused=True, **options), mesh, grads, check_vma)
    for t, (a, b) in enumerate(zip(plain, fused)):
        leaves_a, tree_a = jax.tree.flatten(a)
        leaves_b, tree_b = jax.tree.flatten(b)
        assert tree_a == tree_b
        for x, y in zip(leaves_a, leaves_b):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y, err_msg=f"step {t}")
    state = fused[-1][1]
    assert state.residuals["conv"].any() and state.residuals["half"].any()  # compressed, and kept
    if options.get("bin_capacity") == 1 and n > 1:  # every leaf deferred elements
        assert all(np.all(state.selected[k] > 0) for k in ("conv", "fc"))


# ------------------------------------------------------------------ operation counts

HEAVY = ("scatter", "scatter-add", "cumsum", "all_gather", "all_gather_invariant", "all_to_all",
         "pallas_call", "reduce_max", "while", "sort", "gather")  # fmt: skip


def _count(jaxpr, counter):
    for eqn in jaxpr.eqns:
        counter[eqn.primitive.name] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _count(inner, counter)
    return counter


def heavy_operations(leaves, form, fused, tx=None):
    """The heavy primitives of one ``update`` over ``leaves`` conv-like leaves (traced),
    of ``tx`` where given, else of ``adacomp(AXIS, form=form, fused=fused)``."""
    mesh = mesh_of(4)
    tx = tx or adacomp(AXIS, form=form, fused=fused)
    params = {f"w{i:02d}": jnp.zeros((4, 3, 3, 3 + i % 5)) for i in range(leaves)}
    params["fc"] = jnp.zeros((40, 30))
    state, specs = adacomp_init_state(tx, params, mesh, AXIS)
    grads = {k: jnp.zeros((mesh.devices.size, *v.shape)) for k, v in params.items()}
    fn = jax.shard_map(
        lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s),
        mesh=mesh,
        in_specs=(P(AXIS), specs),
        out_specs=(P(), specs),
        check_vma=False,
    )
    counts = _count(jax.make_jaxpr(fn)(grads, state).jaxpr, collections.Counter())
    return {k: counts[k] for k in HEAVY if counts[k]}


@pytest.mark.parametrize("form", ["allgather", "two_phase"])
def test_the_packed_exchange_runs_the_same_operations_for_4_leaves_as_for_40(form):
    few, many = heavy_operations(4, form, True), heavy_operations(40, form, True)
    assert few == many and few["scatter"] > 0
    # Leaf by leaf, the same count grows with the leaves (what the test tells apart).
    assert heavy_operations(12, form, False)["scatter"] > 2 * heavy_operations(4, form, False)["scatter"]


def test_fused_none_is_the_packed_exchange_on_a_gpu_and_leaf_by_leaf_elsewhere(monkeypatch):
    """``fused=None`` follows JAX's default backend when ``adacomp`` is called: on a GPU
    the packed exchange (the faster there: docs/benchmarks.md, H200 2026-11-28), elsewhere
    leaf by leaf."""
    packed, by_leaf = heavy_operations(12, "allgather", True), heavy_operations(12, "allgather", False)
    assert packed != by_leaf
    for backend, want in (("gpu", packed), ("cpu", by_leaf), ("tpu", by_leaf)):
        with monkeypatch.context() as m:
            m.setattr(jax, "default_backend", lambda: backend)  # noqa: B023 (used at once)
            tx = adacomp(AXIS, form="allgather", fused=None)
        assert heavy_operations(12, "allgather", None, tx=tx) == want, backend


def test_a_bad_fused_value_raises_at_construction():
    with pytest.raises(TypeError, match=r"Invalid fused: 'yes' \(must be True, False or None\)"):
        adacomp(AXIS, fused="yes")


def test_layout_places_messages_by_owner_for_the_two_phase_exchange():
    """Chunk ``j`` of every leaf is sent to device ``j``: the first phase's messages lie
    owner by owner; each leaf's rows, its parts' first rows and capacities as given."""
    leaves = (packed.Leaf(10, 4, 3, 4, 2), packed.Leaf(7, 7, 3, 7, 3))
    layout = packed.Layout(leaves, owner_major=True)
    assert layout.bases == [[0, 5, 10], [2, 7, 12]] and layout.slots == 15
    plain = packed.Layout(leaves)
    assert plain.bases == [[0, 2, 4], [6, 9, 12]]
    [narrow, wide] = layout.groups
    assert (narrow.width, wide.width) == (4, 8)
    first, capacity, base, bin_len, row_in_part, leaf = narrow.table
    assert list(first[:3]) == [0, 1, 2] and list(capacity[:3]) == [2, 2, 2] and list(base[:3]) == [0, 5, 10]
    assert narrow.rows % narrow.block_rows == 0 and set(leaf[3:]) == {-1}


@pytest.mark.parametrize(("select", "values"), [("adacomp", "ternary"), ("all", "exact")])
def test_the_kernels_lower_for_a_gpu_with_triton(monkeypatch, select, values):
    """Lowered for CUDA on this CPU (``jax.export``), each pass over each group of bin
    widths becomes one Triton call (Pallas's Triton backend takes every operation the
    bodies use: the rows' maxima, cumulative counts, selects)."""
    from jax import export

    monkeypatch.setattr(rows, "interpret", lambda what="fused=True": False)
    layout = packed.Layout((packed.Leaf(216, 50, 1, 250, 40), packed.Leaf(510, 500, 1, 1000, 16)))
    flats = [jnp.ones(leaf.numel) for leaf in layout.leaves]
    triton = "__gpu$xla.gpu.triton"
    lowered = export.export(
        jax.jit(lambda r, g: packed.compress(layout, r, g, select, values)),
        platforms=["cuda"],
        disabled_checks=[export.DisabledSafetyCheck.custom_call(triton)],
    )(flats, flats)
    assert lowered.mlir_module().count(f"custom_call @{triton}") == 3 * len(layout.groups) == 6


def test_an_exchange_too_large_for_int32_places_is_refused():
    layout = packed.Layout((packed.Leaf(2**31 - 50, 50, 1, 2**31 - 50, 8),))
    with pytest.raises(ValueError, match=r"too large for int32 places .*use fused=False"):
        jax.eval_shape(lambda: packed.compress(layout, [jnp.zeros(8)], [jnp.zeros(8)], "adacomp", "ternary"))
