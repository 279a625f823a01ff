"""LARS and LAMB as optax gradient transformations.

``lars()`` and ``lamb()`` are short ``optax.chain``\\ s of small public transformations,
each an ``(init, update)`` pair with NamedTuple state, built from optax's own pieces
wherever those give exactly the rule of docs/design.md §2 (``scale_by_adam``, ``trace``,
``add_decayed_weights``, ``masked``, ``scale_by_learning_rate``) and from the
transformations of this package where they do not:

- :func:`scale_by_lars_trust_ratio`: ``ratio * (g + wd * w)`` with the LARS ratio
  ``tc * ||w|| / (||g|| + wd * ||w|| + eps)`` (and LARC's clip);
- :func:`scale_by_lamb_trust_ratio`: ``||w|| / ||u|| * u``;
- :func:`divide_by_global_norm`: NVIDIA's LAMB gradient clipping,
  ``g / max(1, ||all g|| / max_norm)``;
- :func:`scale_by_uncorrected_adam`: Adam's direction without bias correction.

The package, one job a module: ``optimizers`` (``lars``, ``lamb``: checks and chains),
``transforms`` (the transformations above), ``masks`` (``exclusion_mask`` and how
masks combine) and ``norms`` (the overflow-safe L2 norms). Import from here, or from
``largebatch.jax``.

Masks. ``trust_ratio_mask`` and ``weight_decay_mask`` are optax masks: ``None`` (every
leaf), a pytree of bools with the structure of the params (or a prefix of it), or a
callable returning one. A leaf where ``trust_ratio_mask`` is False is *excluded*: ratio 1
(biases and normalization parameters, as MLPerf does; :func:`exclusion_mask` builds this
split by shape). Without ``weight_decay_mask`` a leaf is decayed where it is adapted; with
it, the two masks are independent, as ``optax.lars``'s are: a leaf is decayed where
``weight_decay_mask`` is True (NVIDIA's MLPerf LARS decays the fc bias without adapting
it).

Dtypes. Updates have the dtype of the incoming updates (bf16 gradients of bf16 params
get bf16 updates), and every state leaf keeps the dtype ``init`` gave it, whatever the
dtype of the hyperparameters: the LARS momentum and the LAMB moments have the dtype of
the params, as in optax; keep fp32 master params (``largebatch.mixed_precision``) to
train in bf16. Norms, trust ratios and the clipping divisor are computed in float32, or
float64 for float64 params.

Norms. Every L2 norm (per leaf, and LAMB's global gradient norm) is one pass in the
common case; a leaf whose plain sum of squares overflows (``||w||`` above about
``1.8e19`` in float32) or is tiny (elements below about ``1e-19`` square to zero) is
measured again after dividing it by a power of two taken from its largest magnitude
(exact), inside a ``lax.cond``.

Sharded params. Under ``jax.jit`` the norms of sharded arrays are global: nothing to
do. Inside ``jax.shard_map`` a device holds only a block of each leaf; ``axis_name``
(of ``lars``, ``lamb`` and the three transformations that take norms) names the mesh
axes over which the params are sharded, and every norm becomes the local sum of squares
``psum``-ed over them (the scaled pass with one power of two for all blocks, the
``pmax`` of their largest magnitudes; the ``lax.cond`` reads the ``psum``, so every
device takes the same branch). It applies to every leaf whose norm is taken: each must
be sharded over all of those axes, since a replicated leaf would be counted once per
device.

Complex params. Norms use ``|x|^2 = re^2 + im^2``, so the trust ratios are real and a
complex leaf steps as the pair of real leaves (re, im) would; LAMB's second moment is
``|g|^2``, as in ``optax.scale_by_adam``.

Hyperparameters. Defaults, valid values and messages are those of
:mod:`largebatch.lars.spec`, shared with the torch optimizers. Every numeric
hyperparameter may be a JAX array, traced or not, so
``optax.inject_hyperparams(lars)(learning_rate=0.1, momentum=0.9, ...)`` works under
``jit`` (pass callable masks in ``static_args``). Concrete values are checked when the
optimizer is built; traced ones cannot be and are not (they are checked as
``spec.UNKNOWN``). Flags must be ``True`` or ``False``.
"""

from largebatch.lars.jax.masks import exclusion_mask
from largebatch.lars.jax.optimizers import lamb, lars
from largebatch.lars.jax.transforms import (
    LarsTrustRatioState,
    divide_by_global_norm,
    scale_by_lamb_trust_ratio,
    scale_by_lars_trust_ratio,
    scale_by_uncorrected_adam,
)

__all__ = [
    "LarsTrustRatioState",
    "divide_by_global_norm",
    "exclusion_mask",
    "lamb",
    "lars",
    "scale_by_lamb_trust_ratio",
    "scale_by_lars_trust_ratio",
    "scale_by_uncorrected_adam",
]
