"""AdaComp for JAX: the compressor with static shapes, its exchanges inside ``jax.shard_map``,
and an optax transformation to chain before the optimizer.

The compression is :mod:`largebatch.comm.reference`'s (Chen et al. 2018, arXiv 1712.02679,
Algorithm 1): per leaf, ``G = r + g``, ``H = G + g``, bins of ``L_T`` elements, an element
selected where ``|H| >= max |G|`` of its bin (and ``G != 0``), sent as ``sign(G) * scale``
with ``scale`` the mean ``|G|`` of the leaf's sent elements, and ``r_new = G - sent``.
Weights of rank 3 or more take ``conv_bin`` (50), rank 2 ``fc_bin`` (500); rank 0 and 1
leaves (biases, normalization) are averaged uncompressed with ``lax.pmean``.

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

**Static shapes.** Under ``jit`` the message must have a fixed size, so the compressor
(:func:`compress`) returns the indices of the *first* ``capacity`` selected elements in
index order (int32, padded with a fill value out of range), one sign each (int8; or the
exact values for ``values="exact"``), the scale and the counts. An element selected
beyond the capacity is not sent and not dropped: it stays in the residual, so
``sent + r_new = r + g`` holds whatever the capacity, and it is sent at a later step. The
scale is the mean over the elements actually sent. When the capacity is not exceeded,
every output is the reference's. The capacity is the traffic: each device sends
``capacity`` 4-byte entries per leaf (index and sign packed into one int32) however few
are selected. :data:`DEFAULT_BIN_CAPACITY` (8) entries per bin are 16% of a
convolution's elements (a 6x smaller message than the dense leaf) and 1.6% of a fully
connected one's (62x); AdaComp selects about 2 to 5 elements per bin once the residuals
have built up (the paper; this package's study: about 4.5 per bin of 50 on
convolutions), more in the first steps after the warm-up. A smaller capacity sends less
but defers more; a leaf whose selections exceed its capacity step after step would
never send its last elements (they are last in index order), so watch
``AdaCompState.selected`` against the capacity (:func:`default_capacity`) and raise
``bin_capacity`` if it stays above. ``bin_capacity=None`` makes the message as long as
the leaf: never exceeded, no saving.

**Exchanges** (inside ``jax.shard_map`` over ``axis_name``):

- :func:`allgather_mean`: every device ``lax.all_gather``\\ s every device's message,
  decodes and sums them in device order (``lax.fori_loop``, one scatter-add per device,
  so every device adds the same numbers in the same order) and divides by the axis size.
  Each device receives ``n`` messages: it pays off against a dense all-reduce (about
  ``2 * size`` per device) while ``n * capacity < 2 * size``.
- :func:`two_phase_mean`: the leaf is cut into one chunk of whole bins per device
  (:func:`chunk_length`); each device's message is built per chunk (the first
  ``capacity`` selected of *each* chunk) and ``lax.all_to_all`` brings device ``j``
  everyone's chunk ``j``; the owner averages it in device order, compresses the average
  again with its own chunk residual (state), and an all-gather of the re-compressed
  chunks finishes. Each device sends and receives about ``2 * capacity`` entries per
  chunk whatever ``n``. ``lax.all_to_all`` works on the host (CPU) platform too, so it
  is used rather than an all-gather-and-slice, which would cost the all-gather's traffic.

Both collectives that produce the result gather with ``to="invarying"``, so under
``shard_map``'s ``check_vma`` the averaged gradient is typed as the same on every device
(as ``lax.pmean``'s is) and replicated params can be returned with ``P()``.

**The optax transformation** :func:`adacomp` keeps per leaf a residual (and for
``form="two_phase"`` a chunk residual), both per device, and a step count. Its state
lives inside ``shard_map``: ``init`` runs there (:func:`adacomp_init_state` does it for a
whole optimizer) and every per-device leaf has a leading axis of length 1 there, of
length ``n`` outside (``P(axis_name)``): ``state.residuals[...][k]`` is device ``k``'s
residual. :func:`adacomp_state_specs` gives the specs of a state holding AdaComp states
(in a chain, ``optax.MultiSteps``, ``optax.inject_hyperparams``). Scalars (the count)
are replicated (``P()``).

Arithmetic. Compression runs in float32 (float64 for float64 leaves); bf16 and fp16
gradients are compressed in float32 and the averaged result has the gradient's dtype.
The scale's sum of ``|G|`` is accumulated in double-word arithmetic (a pair of floats,
error-free additions) so it is the exactly rounded sum; the float32 scale is then the
exactly rounded mean (as the reference's float64 scale rounded to float32, and as the
torch compressor's float64 accumulation gives), the float64 scale the exactly rounded sum
divided by the count (the reference's own arithmetic). Counts above ``2**24`` in float32
round.
"""

from largebatch.comm.jax._compress import (
    DEFAULT_BIN_CAPACITY, AdaCompMessage, chunk_length, compress, decode, default_capacity,
)
from largebatch.comm.jax._exchange import allgather_mean, two_phase_mean
from largebatch.comm.jax._transform import (
    AdaCompState, adacomp, adacomp_init_state, adacomp_state_specs,
)
from largebatch.comm.reference import FORMS

# Importable from here too: the reference's settings and helpers the modules above use,
# and the scale's correctly rounded division (its rounding is tested on its own).
from largebatch.comm.jax._compress import _divide as _divide
from largebatch.comm.reference import (
    CONV_BIN as CONV_BIN, FC_BIN as FC_BIN, bin_length as bin_length,
    check_options as check_options, fit_bin as fit_bin,
)
from largebatch.lars.jax.norms import AxisName as AxisName

__all__ = [
    "DEFAULT_BIN_CAPACITY",
    "FORMS",
    "AdaCompMessage",
    "AdaCompState",
    "adacomp",
    "adacomp_init_state",
    "adacomp_state_specs",
    "allgather_mean",
    "chunk_length",
    "compress",
    "decode",
    "default_capacity",
    "two_phase_mean",
]
