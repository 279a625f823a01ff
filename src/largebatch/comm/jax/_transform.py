"""AdaComp as an optax transformation for JAX (:func:`adacomp`), its state, and the
``shard_map`` specs and initialization of an optimizer state that holds it."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from largebatch import checks
from largebatch.checks import AxisName
from largebatch.comm.jax._compress import (
    DEFAULT_BIN_CAPACITY,
    chunk_length,
    compressible,
    compute_dtype,
    default_capacity,
    message_capacity,
)
from largebatch.comm.jax._exchange import all_gather, allgather_mean, axis_size, check_span, two_phase_mean
from largebatch.comm.jax._packed import Layout, Leaf, fusable
from largebatch.comm.jax._packed import allgather_mean as packed_allgather
from largebatch.comm.jax._packed import two_phase_mean as packed_two_phase
from largebatch.comm.reference import CONV_BIN, FC_BIN, check_options
from largebatch.lars.jax.common import check_fused
from largebatch.mixed_precision.jax.finite import select_tree


class AdaCompState(NamedTuple):
    """State of :func:`adacomp`, held inside ``shard_map``.

    ``count``: int32 scalar, the updates so far (warm-up included), replicated.
    ``residuals``: per leaf, this device's residual, shape ``(1, *leaf.shape)`` inside
    ``shard_map`` (``(n, *leaf.shape)`` outside, ``P(axis_name)``), float32 (float64 for
    float64 leaves); None for leaves sent uncompressed. ``chunk_residuals``: for
    ``form="two_phase"``, per leaf, the residual of the chunk this device owns, shape
    ``(1, chunk_length)`` (:func:`chunk_length`; the tail beyond the leaf stays 0);
    None otherwise. ``selected``: per leaf, int32 ``(1,)``, the elements this device
    selected at the last compressed update (0 until then; phase 1 for two-phase):
    ``leaf.size / selected`` is the compression rate, and ``selected`` above the
    leaf's capacity means elements were deferred.
    """

    count: jax.Array  # type: ignore[assignment]  # shadows tuple.count
    residuals: Any
    chunk_residuals: Any
    selected: Any


def _all_finite(leaves: Sequence[Any]) -> jax.Array:
    """Whether every element of every leaf is finite (True for no leaves)."""
    flags = [jnp.isfinite(x).all() for x in leaves if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    return jnp.stack(flags).all() if flags else jnp.asarray(True)


def adacomp(
    axis_name: AxisName,
    *,
    warmup_steps: int = 0,
    conv_bin: int = CONV_BIN,
    fc_bin: int = FC_BIN,
    bin_capacity: int | None = DEFAULT_BIN_CAPACITY,
    form: str = "allgather",
    select: str = "adacomp",
    values: str = "ternary",
    fused: bool | None = None,
) -> optax.GradientTransformationExtraArgs:
    """AdaComp's compressed average of the gradients over ``axis_name``, as an optax
    transformation for use inside ``jax.shard_map``.

    Chain it first, before the optimizer: ``optax.chain(adacomp("data"), lars(...))``.
    ``update`` takes this device's gradients and returns their average over the
    devices of ``axis_name``, the same on every device: weights of rank 3 or more
    compressed with bins of ``conv_bin``, rank 2 with ``fc_bin``, everything else
    (biases, normalization parameters, empty or non-real-floating leaves) averaged
    with ``lax.pmean``. During the first ``warmup_steps`` updates every leaf is
    ``pmean``-ed and the residuals stay zero (a ``lax.cond`` on the step count: one
    compiled step for both). A step where any device's gradients hold an inf or NaN is
    such a plain step too, on every device, and leaves every residual as it was (the
    inf reaches the result, so ``skip_if_nonfinite`` around the optimizer after it skips
    the step on every device); so does a step whose compressed average overflows the leaves' dtype (fp16):
    gradient is delayed, never dropped. The state (:class:`AdaCompState`) holds
    per-device residuals: create it inside ``shard_map`` (:func:`adacomp_init_state`) and pass it
    in and out with :func:`adacomp_state_specs`. See the docstring of
    :mod:`largebatch.comm.jax` for an example.

    ``optax.MultiSteps`` around a chain holding it works (its accumulated gradients are
    per device too; :func:`adacomp_state_specs` gives them ``P(axis_name)``), but
    ``MultiSteps`` runs the inner update at every mini-step and keeps it at the last
    one only, so the exchange runs, and costs, every mini-step. Its arguments are all
    static (shapes and branches depend on them): there is nothing to inject with
    ``optax.inject_hyperparams``; inject the optimizer after it instead.

    Args:
      axis_name: the data-parallel mesh axis (a name, or a tuple of names).
      warmup_steps: updates sent uncompressed first, an int >= 0.
      conv_bin: ``L_T`` for weights of rank 3 or more, an int >= 1.
      fc_bin: ``L_T`` for weights of rank 2, an int >= 1.
      bin_capacity: message entries per bin (an int >= 1; the message of a leaf of
        ``nbins`` bins has ``bin_capacity * nbins`` entries, at most its size; per chunk
        for two-phase); None: as many as elements (never exceeded, nothing saved). See
        "Static shapes" in the docstring of :mod:`largebatch.comm.jax`.
      form: ``"allgather"`` (:func:`allgather_mean`) or ``"two_phase"``
        (:func:`two_phase_mean`; the state holds a chunk residual per leaf).
      select: ``"adacomp"``, or ``"all"``: every element with ``G != 0``.
      values: ``"ternary"``, or ``"exact"``: the values as they are. With
        ``select="all"``, ``values="exact"`` and ``bin_capacity=None`` the result is the
        plain average.
      fused: ``True``: every leaf with bins of at most 2,048 elements in one packed
        exchange (Pallas kernels compiled on a GPU, their bodies as XLA on the CPU; "The
        packed exchange" in docs/communication.md): a fixed number of operations whatever
        the number of leaves, the same numbers and the same state. ``False``: leaf by
        leaf. ``None`` (the default): ``True`` where ``jax.default_backend()`` is
        ``"gpu"`` when ``adacomp`` is called, ``False`` elsewhere.

    Returns:
      An ``optax.GradientTransformation`` (``update`` ignores ``params``).

    Raises:
      ValueError: naming the value, for ``warmup_steps < 0``, a bin length or
        ``bin_capacity`` below 1 (or not an int), an unknown ``form``, ``select`` or
        ``values``, or a bad ``axis_name``; at construction.
      TypeError: for an ``axis_name`` that is not a str or a tuple of strs, or a
        ``fused`` that is not True, False or None.
    """
    if axis_name is None:
        raise ValueError("axis_name must name the data-parallel mesh axis, got None")
    axis_name = checks.axis_name("axis_name", axis_name)
    options = check_options(
        warmup_steps=warmup_steps, conv_bin=conv_bin, fc_bin=fc_bin, form=form, select=select, values=values
    )
    warmup_steps, conv_bin, fc_bin = (options[k] for k in ("warmup_steps", "conv_bin", "fc_bin"))
    if bin_capacity is not None:
        bin_capacity = checks.integer("bin_capacity", bin_capacity, 1)
    two_phase = form == "two_phase"
    use_kernels = check_fused(fused)

    def bins_of(leaves: Sequence[Any]) -> list[int | None]:
        return [compressible(x, conv_bin, fc_bin) for x in leaves]

    def capacity(numel: int, bin_len: int) -> int:
        return default_capacity(numel, bin_len, bin_capacity)

    def init_fn(params: optax.Params) -> AdaCompState:
        treedef: Any  # a PyTreeDef (no stubs)
        leaves, treedef = jax.tree.flatten(params)
        bins = bins_of(leaves)
        res = [
            None if b is None else jnp.zeros((1, *jnp.shape(p)), compute_dtype(p))
            for p, b in zip(leaves, bins)
        ]
        selected = [None if b is None else jnp.zeros((1,), jnp.int32) for b in bins]
        chunks = None
        if two_phase:
            try:
                n = axis_size(axis_name)
            except NameError as e:
                raise ValueError(
                    f"adacomp(form='two_phase').init must run inside shard_map over "
                    f"{axis_name!r} (the chunk length depends on the axis size): {e}"
                ) from None
            chunks = treedef.unflatten(
                [
                    None
                    if b is None
                    else jnp.zeros((1, chunk_length(math.prod(jnp.shape(p)), b, n)), compute_dtype(p))
                    for p, b in zip(leaves, bins)
                ]
            )
        return AdaCompState(
            count=jnp.zeros([], jnp.int32),
            residuals=treedef.unflatten(res),
            chunk_residuals=chunks,
            selected=treedef.unflatten(selected),
        )

    def exchange(
        grads: Sequence[jax.Array], bins: Sequence[Any], residuals: Sequence[Any], chunks: Sequence[Any]
    ) -> tuple[list[Any], ...]:
        out: tuple[list[Any], ...] = tuple([None] * len(grads) for _ in range(4))
        packed: dict[Any, list[int]] = {}
        for i, (g, b) in enumerate(zip(grads, bins)):
            if use_kernels and fusable(b):
                packed.setdefault(compute_dtype(g), []).append(i)
            else:
                for x, value in zip(out, exchange_leaf(g, b, residuals[i], chunks[i])):
                    x[i] = value
        for dtype, leaves in packed.items():
            results = exchange_packed(
                [grads[i] for i in leaves],
                [bins[i] for i in leaves],
                [residuals[i] for i in leaves],
                [chunks[i] for i in leaves],
                dtype,
            )
            for x, values_ in zip(out, results):
                for i, value in zip(leaves, values_):
                    x[i] = value
        return out

    def exchange_leaf(g: jax.Array, b: int, r: Any, c: Any) -> tuple[Any, ...]:
        numel = math.prod(jnp.shape(g))
        if two_phase:
            n = axis_size(axis_name)
            cap = capacity(chunk_length(numel, b, n), b)
            mean, r, c, message = two_phase_mean(
                r[0], c[0], g, b, axis_name, capacity=cap, select=select, values=values
            )
            c = c[None]
        else:
            mean, r, sent = allgather_mean(
                r[0], g, b, axis_name, capacity=capacity(numel, b), select=select, values=values
            )
            assert sent is not None  # a compressed leaf (b is not None) has a message
            message = sent
        return mean, r[None], c, message.selected[None]

    def exchange_packed(
        grads: Sequence[jax.Array],
        bins: Sequence[int],
        residuals: Sequence[Any],
        chunks: Sequence[Any],
        dtype: Any,
    ) -> tuple[list[Any], ...]:
        """Leaves of one compute dtype in one packed exchange (``_packed.py``)."""
        shapes = [jnp.shape(g) for g in grads]
        numels = [math.prod(s) for s in shapes]
        flat_r = [r[0].reshape(-1).astype(dtype) for r in residuals]
        flat_g = [g.reshape(-1).astype(dtype) for g in grads]

        def gather(x: jax.Array) -> jax.Array:
            return all_gather(x, axis_name)

        if two_phase:
            n = axis_size(axis_name)
            spans = [chunk_length(m, b, n) for m, b in zip(numels, bins)]
            caps = [message_capacity(capacity(s, b), s, b) for s, b in zip(spans, bins)]
            for s in spans:
                check_span(s, values)
            first = Layout(tuple(Leaf(m, b, n, s, c) for m, b, s, c in zip(numels, bins, spans, caps)), True)
            second = Layout(tuple(Leaf(s, b, 1, s, c) for b, s, c in zip(bins, spans, caps)))
            flat_c = [c[0].reshape(-1).astype(dtype) for c in chunks]
            means, new_r, new_c, selected = packed_two_phase(
                first, second, flat_r, flat_c, flat_g, axis_name, gather, select, values
            )
            new_chunks = [c[None] for c in new_c]
        else:
            for m in numels:
                check_span(m, values)
            spans = [-(-m // b) * b for m, b in zip(numels, bins)]
            layout = Layout(
                tuple(
                    Leaf(m, b, 1, s, message_capacity(capacity(m, b), m, b))
                    for m, b, s in zip(numels, bins, spans)
                )
            )
            means, new_r, selected = packed_allgather(layout, flat_r, flat_g, gather, select, values)
            new_chunks = list(chunks)
        return (
            [m.reshape(s).astype(jnp.result_type(g)) for m, s, g in zip(means, shapes, grads)],
            [r.reshape(s)[None] for r, s in zip(new_r, shapes)],
            new_chunks,
            [selected[k][None] for k in range(len(grads))],
        )

    def update_fn(
        updates: optax.Updates, state: AdaCompState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, AdaCompState]:  # as optax's aliases
        del params, extra_args
        treedef: Any  # a PyTreeDef (no stubs)
        leaves, treedef = jax.tree.flatten(updates)
        bins = bins_of(leaves)
        out = list(leaves)
        dense = [i for i, b in enumerate(bins) if b is None]
        if dense:
            for i, mean in zip(dense, lax.pmean([leaves[i] for i in dense], axis_name)):
                out[i] = mean
        packed = [i for i, b in enumerate(bins) if b is not None]
        residuals = treedef.flatten_up_to(state.residuals)
        selected = treedef.flatten_up_to(state.selected)
        chunks = treedef.flatten_up_to(state.chunk_residuals) if two_phase else [None] * len(leaves)
        if packed:
            operands = tuple([x[i] for i in packed] for x in (leaves, residuals, chunks, selected))
            pick = [bins[i] for i in packed]

            def compressed(ops: tuple[list[Any], ...]) -> tuple[list[Any], ...]:
                grads, res, chk, _ = ops
                return exchange(grads, pick, res, chk)

            def warm(ops: tuple[list[Any], ...]) -> tuple[list[Any], ...]:
                grads, res, chk, sel = ops
                return lax.pmean(grads, axis_name), res, chk, sel

            # A non-finite gradient on any device: every leaf plain-averaged (the inf or
            # NaN reaches every device, for a loss scaler or apply_if_finite to see) and
            # no residual changes, on every device alike.
            plain = lax.pmin(_all_finite(leaves).astype(jnp.int32), axis_name) == 0
            if warmup_steps:
                plain = plain | (state.count < warmup_steps)
            result = lax.cond(plain, warm, compressed, operands)
            # A finite exchange whose average overflows the leaves' dtype (fp16) is a
            # skipped step too: its residuals are not committed, so nothing is lost. The
            # average is the same on every device, and so is this choice.
            keep = ~_all_finite(result[0])
            result = (result[0], *select_tree(keep, tuple(operands[1:]), tuple(result[1:])))
            for k, i in enumerate(packed):
                out[i], residuals[i], chunks[i], selected[i] = (x[k] for x in result)
        new_state = AdaCompState(
            count=optax.safe_increment(state.count),
            residuals=treedef.unflatten(residuals),
            chunk_residuals=treedef.unflatten(chunks) if two_phase else None,
            selected=treedef.unflatten(selected),
        )
        return treedef.unflatten(out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adacomp_state_specs(state: Any, axis_name: AxisName) -> Any:
    """The ``shard_map`` specs of an optimizer state holding :class:`AdaCompState`\\ s.

    Per-device leaves get ``P(axis_name)``: every AdaComp residual, chunk residual and
    selection count (their leading axis is the device axis), and the accumulated
    gradients of an ``optax.MultiStepsState`` (each device accumulates its own; they
    are split along their first axis). Every other leaf (step counts, the optimizer's
    moments) gets ``P()``, replicated. ``state`` may be abstract (``jax.eval_shape``).

    Args:
      state: an optimizer state (any pytree), or its shapes.
      axis_name: the data-parallel mesh axis (a name, or a tuple of names).

    Returns:
      A pytree of ``PartitionSpec``\\ s with the structure of ``state``, for
      ``shard_map``'s ``in_specs``/``out_specs`` (and ``NamedSharding`` outside).

    Raises:
      ValueError: for a scalar among ``MultiSteps``' accumulated gradients (a per-device
        scalar has no axis to split).
    """
    axis_name = checks.axis_name("axis_name", axis_name)
    device = P(axis_name)

    def per_device(tree: Any) -> Any:
        return jax.tree.map(lambda _: device, tree)

    def accumulated(leaf: Any) -> P:
        if len(jnp.shape(leaf)) == 0:
            raise ValueError(
                "optax.MultiSteps accumulates a scalar gradient per device; "
                "adacomp_state_specs needs leaves of rank >= 1 to split"
            )
        return device

    def node(x: Any) -> Any:
        if isinstance(x, AdaCompState):
            # The specs of the state, in the state's own structure.
            return AdaCompState(
                count=P(),  # type: ignore[arg-type]
                residuals=per_device(x.residuals),
                chunk_residuals=per_device(x.chunk_residuals),
                selected=per_device(x.selected),
            )
        if isinstance(x, optax.MultiStepsState):
            return x._replace(
                mini_step=P(),
                gradient_step=P(),
                inner_opt_state=adacomp_state_specs(x.inner_opt_state, axis_name),
                acc_grads=jax.tree.map(accumulated, x.acc_grads),
                skip_state=jax.tree.map(lambda _: P(), x.skip_state),
            )
        return P()

    return jax.tree.map(node, state, is_leaf=lambda x: isinstance(x, (AdaCompState, optax.MultiStepsState)))


def _shard_map(
    f: Callable[..., Any], mesh: jax.sharding.Mesh, in_specs: Any, out_specs: Any, check: bool
) -> Callable[..., Any]:
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map  # pragma: no cover (older jax)

    return shard_map(
        f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check
    )  # pragma: no cover


def adacomp_init_state(
    optimizer: optax.GradientTransformation, params: Any, mesh: jax.sharding.Mesh, axis_name: AxisName
) -> tuple[Any, Any]:
    """``optimizer.init(params)`` run inside ``shard_map``, and the state's specs.

    For an optimizer holding :func:`adacomp` (chained, wrapped in ``optax.MultiSteps`` or
    ``optax.inject_hyperparams``), whose state has per-device leaves. ``params`` are the
    replicated params (``P()``).

    Example (data parallelism over the mesh axis ``"data"``; params replicated, each device
    differentiates its shard of the batch)::

        import jax, jax.numpy as jnp, numpy as np, optax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        from largebatch.jax import adacomp, adacomp_init_state, lars

        mesh = Mesh(np.array(jax.devices()), ("data",))
        opt = optax.chain(adacomp("data", warmup_steps=2), lars(0.1, weight_decay=1e-4))

        def loss_fn(params, x, y):
            h = jnp.tanh(x @ params["w1"] + params["b1"])
            return jnp.mean((h @ params["w2"] - y) ** 2)

        keys = jax.random.split(jax.random.key(0), 4)
        params = {"w1": jax.random.normal(keys[0], (16, 64)) / 4, "b1": jnp.zeros(64),
                  "w2": jax.random.normal(keys[1], (64, 4)) / 8}
        params = jax.device_put(params, NamedSharding(mesh, P()))  # replicated
        state, state_specs = adacomp_init_state(opt, params, mesh, "data")

        def train_step(params, state, x, y):  # runs on every device, on its shard of x, y
            grads = jax.grad(loss_fn)(params, x, y)
            updates, state = opt.update(grads, state, params)  # the AdaComp exchange
            return optax.apply_updates(params, updates), state

        train_step = jax.jit(jax.shard_map(
            train_step, mesh=mesh, in_specs=(P(), state_specs, P("data"), P("data")),
            out_specs=(P(), state_specs)))
        batch = jax.device_put(jax.random.normal(keys[2], (8 * len(jax.devices()), 16)),
                               NamedSharding(mesh, P("data")))
        target = jax.device_put(jax.random.normal(keys[3], (8 * len(jax.devices()), 4)),
                                NamedSharding(mesh, P("data")))
        for _ in range(5):  # compiled once
            params, state = train_step(params, state, batch, target)
        checkpoint = jax.device_get(state)  # numpy; every device's residuals
        state = jax.device_put(checkpoint, jax.tree.map(lambda s: NamedSharding(mesh, s),
                                                        state_specs))

    Args:
      optimizer: the ``optax.GradientTransformation``.
      params: the params, replicated over ``mesh``.
      mesh: the mesh of the ``shard_map``'d train step.
      axis_name: its data-parallel axis (a name, or a tuple of names).

    Returns:
      ``(state, specs)``: the state, placed as ``shard_map`` returns it (so a jitted
      step sees the same input shardings at every call), and
      :func:`adacomp_state_specs` of it.
    """
    axis_name = checks.axis_name("axis_name", axis_name)
    shapes = jax.eval_shape(_shard_map(optimizer.init, mesh, (P(),), P(), False), params)
    specs = adacomp_state_specs(shapes, axis_name)
    state = jax.jit(_shard_map(optimizer.init, mesh, (P(),), specs, False))(params)
    return state, specs
