"""LARS and LAMB as optax gradient transformations.

``lars()`` and ``lamb()`` are short ``optax.chain``\\ s of small public transformations,
each an ``(init, update)`` pair with NamedTuple state, built from optax's own pieces
wherever those give exactly the rule of DESIGN §2 (``scale_by_adam``, ``trace``,
``add_decayed_weights``, ``masked``, ``scale_by_learning_rate``) and from the
transformations of this module where they do not:

- :func:`scale_by_lars_trust_ratio`: ``ratio * (g + wd * w)`` with the LARS ratio
  ``tc * ||w|| / (||g|| + wd * ||w|| + eps)`` (and LARC's clip);
- :func:`scale_by_lamb_trust_ratio`: ``||w|| / ||u|| * u``;
- :func:`divide_by_global_norm`: NVIDIA's LAMB gradient clipping,
  ``g / max(1, ||all g|| / max_norm)``;
- :func:`scale_by_uncorrected_adam`: Adam's direction without bias correction.

Masks. ``trust_ratio_mask`` and ``weight_decay_mask`` are optax masks: ``None`` (every
leaf), a pytree of bools with the structure of the params (or a prefix of it), or a
callable returning one. A leaf where ``trust_ratio_mask`` is False is *excluded*: ratio 1
and no weight decay (biases and normalization parameters, as MLPerf does;
:func:`exclusion_mask` builds this split). ``weight_decay_mask`` can only remove weight
decay from leaves that keep their trust ratio: a leaf is decayed where both masks are
True. (``optax.lars`` applies its two masks independently, so an excluded leaf there is
still decayed.)

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

Complex params. Norms use ``|x|^2 = re^2 + im^2``, so the trust ratios are real and a
complex leaf steps as the pair of real leaves (re, im) would; LAMB's second moment is
``|g|^2``, as in ``optax.scale_by_adam``.

Traced hyperparameters. Every numeric hyperparameter may be a JAX array, traced or not,
so ``optax.inject_hyperparams(lars)(learning_rate=0.1, momentum=0.9, ...)`` works under
``jit`` (pass callable masks in ``static_args``). Concrete values are checked when the
optimizer is built; traced ones cannot be and are not.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from largebatch.schedules import Schedule
from largebatch.schedules.jax import as_optax_schedule

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

_NO_PARAMS = "this transformation needs the params: call update(updates, state, params)"
Mask = Any  # None, a pytree (or prefix) of bools, or a callable params -> such a pytree
ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]


# ---------------------------------------------------------------------------- helpers


def _compute_dtype(x: jax.Array) -> jnp.dtype:
    """float32, or the dtype of ``x`` where that is wider (float64)."""
    return jnp.promote_types(x.dtype, jnp.float32)


def _abs_sq(x: jax.Array) -> jax.Array:
    """``|x|^2``, real: ``re^2 + im^2`` for complex ``x``."""
    if jnp.iscomplexobj(x):
        return jnp.square(x.real) + jnp.square(x.imag)
    return jnp.square(x)


def _powers_of_two(magnitude: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(2**-k, 2**k)`` with ``2**k <= magnitude < 2**(k + 1)`` for a normal ``magnitude``.

    Read from the exponent bits, so both are exact; ``k`` is clipped so that both are
    normal numbers (zero and subnormal magnitudes give the smallest ``k``, inf and NaN
    the largest).
    """
    info = jnp.finfo(magnitude.dtype)
    bias = 2 ** (info.nexp - 1) - 1
    uint = {32: jnp.uint32, 64: jnp.uint64}[info.bits]
    biased = (jax.lax.bitcast_convert_type(magnitude, uint) >> info.nmant) & (2 * bias + 1)
    biased = jnp.clip(biased, 1, 2 * bias - 1)
    down = jax.lax.bitcast_convert_type((2 * bias - biased) << info.nmant, magnitude.dtype)
    up = jax.lax.bitcast_convert_type(biased << info.nmant, magnitude.dtype)
    return down, up


def _exact_norm(x: jax.Array) -> jax.Array:
    """The norm of ``x`` (real, at least float32) after an exact power-of-two scaling:
    ``x`` is multiplied by ``2**-k``, with ``2**k`` the power of two at or below
    ``max |x|`` (``max(|re|, |im|)`` for complex ``x``), before squaring, so the scaled
    squares are below 8 and their sum cannot overflow. Two passes over ``x``."""
    x = x.astype(_compute_dtype(x))
    if jnp.iscomplexobj(x):
        magnitude = jnp.maximum(jnp.abs(x.real), jnp.abs(x.imag))
    else:
        magnitude = jnp.abs(x)
    down, up = _powers_of_two(jnp.max(magnitude, initial=0.0))
    return jnp.sqrt(jnp.sum(_abs_sq(x * down))) * up


def _norm_of(x: jax.Array) -> jax.Array:
    x = x.astype(_compute_dtype(x))
    squares = jnp.sum(_abs_sq(x))
    # One pass in the common case. The scaled pass runs only where the plain sum of
    # squares may be wrong: past the float range (||x|| > ~1.8e19 in float32), or so
    # small that squares of its elements may have rounded to zero (zero tensors too).
    fast = jnp.isfinite(squares) & (squares >= jnp.finfo(squares.dtype).tiny * 2.0**30)
    return jax.lax.cond(fast, lambda: jnp.sqrt(squares), lambda: _exact_norm(x))


_norm_of_jit = jax.jit(_norm_of)


def _norm(x: jax.Array) -> jax.Array:
    """The L2 norm of ``x`` (real, at least float32), safe from overflow and underflow.

    The sum of squares is formed in one pass; where it overflows (``||x|| > ~1.8e19`` in
    float32) or is tiny (below ~1e-29: elements' squares may have rounded to zero), the
    norm is taken again from ``x`` scaled by a power of two (:func:`_exact_norm`), inside
    a ``lax.cond``, so the common case pays nothing more. Non-finite elements give a
    non-finite norm.
    """
    x = jnp.asarray(x)
    # Outside jit one compiled call per norm instead of an op-by-op dispatch; inside
    # jit the operations are traced in place.
    return _norm_of(x) if isinstance(x, jax.core.Tracer) else _norm_of_jit(x)


def _global_norm(leaves: list[jax.Array]) -> jax.Array:
    """The L2 norm of all ``leaves`` together: the norm of their norms, each overflow-safe."""
    norms = [_norm(x) for x in leaves]
    dtype = jnp.result_type(*norms)
    return _norm(jnp.stack([n.astype(dtype) for n in norms]))


def _safe_ratio(numerator, denominator, w_norm, other_norm):
    """``numerator / denominator``, or 1 where ``w_norm`` or ``other_norm`` is zero."""
    zero = jnp.logical_or(w_norm == 0.0, other_norm == 0.0)
    return jnp.where(zero, jnp.ones_like(numerator), numerator / jnp.where(zero, 1.0, denominator))


def _rate(learning_rate: ScalarOrSchedule, count: jax.Array):
    return learning_rate(count) if callable(learning_rate) else learning_rate


def _as_optax_schedule(learning_rate: Any) -> ScalarOrSchedule:
    """A :class:`largebatch.schedules.Schedule` becomes its jit-traceable JAX twin."""
    if isinstance(learning_rate, Schedule):
        return as_optax_schedule(learning_rate)
    return learning_rate


def exclusion_mask(params: Any) -> Any:
    """True for leaves that get the trust ratio and weight decay, False for ``ndim <= 1``.

    The same split as ``largebatch.torch.param_groups``: biases and normalization scales
    (vectors) and scalars are excluded. Pass it as ``trust_ratio_mask``.
    """
    return jax.tree.map(lambda p: jnp.ndim(p) > 1, params)


def _full_mask(mask: Mask, tree: Any) -> Any:
    """``mask`` resolved against ``tree``: a pytree of bools with its full structure."""
    if mask is None:
        return jax.tree.map(lambda _: True, tree)
    if callable(mask):
        mask = mask(tree)
    return jax.tree.map(lambda flag, sub: jax.tree.map(lambda _: flag, sub), mask, tree)


def _mask_and(a: Mask, b: Mask, negate_b: bool = False) -> Mask:
    """The leaf-wise ``a and b`` (or ``a and not b``) of two optax masks, as a callable."""
    if b is None and not negate_b:
        return a

    def mask_fn(tree):
        return jax.tree.map(
            lambda x, y: bool(x) and (bool(y) != negate_b),
            _full_mask(a, tree),
            _full_mask(b, tree),
        )

    return mask_fn


def _masked(inner: optax.GradientTransformation, mask: Mask) -> optax.GradientTransformation:
    return inner if mask is None else optax.masked(inner, mask)


def _as_real(name: str, value: Any, rule: str) -> float | None:
    """``value`` as a Python float, or None when it is traced (its value is unknown).

    A real number is a Python or NumPy int or float, or a 0-dim NumPy or JAX array of an
    integer or floating dtype. Anything else, bools included, raises a TypeError naming
    ``value``.
    """
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"Invalid {name}: {value!r} (a bool; must be a number {rule})")
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0:
        if jnp.issubdtype(value.dtype, jnp.integer) or jnp.issubdtype(value.dtype, jnp.floating):
            return float(value)
    raise TypeError(f"Invalid {name}: {value!r} (must be a number {rule})")


def _check(name: str, value: Any, ok: Callable[[float], bool], rule: str) -> None:
    """Check a numeric hyperparameter before anything is built.

    A TypeError names ``value`` unless it is a real number (see :func:`_as_real`), a
    ValueError unless it is finite and passes ``ok``. Traced values pass unchecked.
    """
    number = _as_real(name, value, rule)
    if number is not None and not (math.isfinite(number) and ok(number)):
        raise ValueError(f"Invalid {name}: {value!r} (must be {rule})")


def _check_flag(name: str, value: Any) -> bool:
    """``value`` as a bool: only ``True`` and ``False`` (or NumPy's) are flags."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise TypeError(f"Invalid {name}: {value!r} (must be True or False)")


def _check_learning_rate(learning_rate: Any) -> None:
    if not callable(learning_rate):
        _check("learning_rate", learning_rate, lambda x: x >= 0.0, ">= 0, or a schedule")


def _is_zero(value: Any) -> bool:
    """True for a Python number equal to 0 (a static zero: the term can be left out)."""
    return isinstance(value, (int, float)) and value == 0


def _keep_dtypes(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """``inner`` with its updates in the incoming updates' dtypes and its state in the
    dtypes ``init`` gave it, so that float32 hyperparameters (injected, or passed as
    arrays) never promote bf16 updates or state, and ``jit`` sees the same state types
    at every step."""

    def update_fn(updates, state, params=None):
        new_updates, new_state = inner.update(updates, state, params)
        new_updates = jax.tree.map(lambda u, g: u.astype(jnp.result_type(g)), new_updates, updates)
        new_state = jax.tree.map(lambda n, o: n.astype(jnp.result_type(o)), new_state, state)
        return new_updates, new_state

    return optax.GradientTransformation(inner.init, update_fn)


# ------------------------------------------------------------------- transformations


class LarsTrustRatioState(NamedTuple):
    """State of :func:`scale_by_lars_trust_ratio`: the step count (for a clip schedule)."""

    count: jax.Array  # int32 scalar


def scale_by_lars_trust_ratio(
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    clip_learning_rate: ScalarOrSchedule | None = None,
) -> optax.GradientTransformation:
    """Scale each leaf by the LARS trust ratio, with weight decay folded in.

    Per leaf with gradient ``g`` and parameter ``w``::

        ratio = tc * ||w|| / (||g|| + wd * ||w|| + eps)   (1 if ||w|| == 0 or ||g|| == 0)
        ratio = min(ratio / lr_t, 1)                      (only with clip_learning_rate)
        update = ratio * (g + wd * w)

    The denominator holds ``||g||`` and ``wd * ||w||`` apart (MLPerf's LARS), so weight
    decay is part of this transformation rather than an ``add_decayed_weights`` before
    it. ``clip_learning_rate`` (a float or a schedule of the step count) turns on LARC's
    clipping: the local rate ``lr_t * ratio`` never exceeds ``lr_t``. Norms and the
    ratio are real and computed in float32 (float64 for float64 leaves), safe from
    overflow; the update keeps the leaf's dtype. The hyperparameters may be traced.
    """
    _check("weight_decay", weight_decay, lambda x: x >= 0.0, ">= 0")
    _check("trust_coefficient", trust_coefficient, lambda x: x > 0.0, "> 0")
    _check("eps", eps, lambda x: x >= 0.0, ">= 0")
    wd, tc = weight_decay, trust_coefficient

    def init_fn(params):
        del params
        return LarsTrustRatioState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(_NO_PARAMS)
        lr = None if clip_learning_rate is None else _rate(clip_learning_rate, state.count)

        def leaf(g, w):
            dtype = _compute_dtype(g)
            g32, w32 = g.astype(dtype), w.astype(dtype)
            w_norm, g_norm = _norm(w32), _norm(g32)
            ratio = _safe_ratio(tc * w_norm, g_norm + wd * w_norm + eps, w_norm, g_norm)
            if lr is not None:
                ratio = jnp.minimum(ratio / jnp.asarray(lr, ratio.dtype), 1.0)
            d = g32 if _is_zero(wd) else g32 + wd * w32
            return (ratio * d).astype(g.dtype)

        updates = jax.tree.map(leaf, updates, params)
        return updates, LarsTrustRatioState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init_fn, update_fn)


def scale_by_lamb_trust_ratio() -> optax.GradientTransformation:
    """Scale each leaf ``u`` by the LAMB trust ratio ``||w|| / ||u||``.

    The ratio is 1 where ``||w|| == 0`` or ``||u|| == 0``; no bounds, no coefficient
    (``optax.scale_by_trust_ratio()`` at its defaults, with overflow-safe real norms in
    float32 or wider and the update in the leaf's dtype).
    """

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(_NO_PARAMS)

        def leaf(u, w):
            dtype = _compute_dtype(u)
            u32 = u.astype(dtype)
            w_norm, u_norm = _norm(w.astype(dtype)), _norm(u32)
            return (_safe_ratio(w_norm, u_norm, w_norm, u_norm) * u32).astype(u.dtype)

        return jax.tree.map(leaf, updates, params), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def divide_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Divide all updates by ``max(1, ||all updates|| / max_norm)`` (NVIDIA's LAMB clip).

    The same rule as ``optax.clip_by_global_norm`` (which multiplies by
    ``max_norm / norm`` above the threshold), written as NVIDIA's LAMB and the torch
    optimizers write it; the global norm is the norm of the per-leaf norms, each
    computed in float32 or wider and safe from overflow.
    """
    _check("max_norm", max_norm, lambda x: x > 0.0, "> 0")

    def update_fn(updates, state, params=None):
        del params
        leaves = jax.tree.leaves(updates)
        if not leaves:
            return updates, state
        divisor = jnp.maximum(1.0, _global_norm(leaves) / max_norm)
        updates = jax.tree.map(lambda g: (g / divisor).astype(g.dtype), updates)
        return updates, state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def scale_by_uncorrected_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6
) -> optax.GradientTransformation:
    """Adam's scaling without bias correction: ``m / (sqrt(v) + eps)``.

    ``m = b1 * m + (1 - b1) * g`` and ``v = b2 * v + (1 - b2) * g^2``, as
    ``optax.scale_by_adam`` but without dividing by ``1 - b^t`` (``g^2`` is ``|g|^2``
    for complex ``g``); the state is an ``optax.ScaleByAdamState``, so a checkpoint
    fits either setting.
    """

    def init_fn(params):
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=optax.tree.zeros_like(params),
            nu=optax.tree.zeros_like(params),
        )

    def update_fn(updates, state, params=None):
        del params
        mu = jax.tree.map(lambda g, m: (1 - b1) * g + b1 * m, updates, state.mu)
        nu = jax.tree.map(lambda g, v: (1 - b2) * _abs_sq(g) + b2 * v, updates, state.nu)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        count = optax.safe_increment(state.count)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


# ------------------------------------------------------------------------ optimizers


def lars(
    learning_rate: ScalarOrSchedule,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    nesterov: bool = False,
    trust_clip: bool = False,
    weight_decay_mask: Mask = None,
    trust_ratio_mask: Mask = None,
) -> optax.GradientTransformation:
    r"""LARS: SGD with momentum and a layer-wise trust ratio (MLPerf's form).

    Per leaf ``w`` with gradient ``g``, at step ``t``::

        ratio = tc * ||w|| / (||g|| + wd * ||w|| + eps)   (1 if ||w|| == 0 or ||g|| == 0)
        ratio = min(ratio / lr_t, 1)                      (trust_clip: LARC)
        d = g + wd * w
        v = momentum * v + lr_t * ratio * d               (v starts at 0)
        w = w - v            nesterov: w = w - (momentum * v + lr_t * ratio * d)

    The variant: the learning rate sits *inside* the momentum buffer (a change of rate
    affects only new contributions), the trust-ratio denominator is
    ``||g|| + wd * ||w|| + eps`` (not ``||g + wd * w||``), a zero norm gives ratio 1, and
    ``trust_clip`` is LARC's clip (apex, timm), which keeps the local rate at or below
    ``lr_t``. Leaves where ``trust_ratio_mask`` is False get ratio 1 and no weight decay
    (plain momentum SGD); see the module docstring for how the two masks combine.

    The chain: ``scale_by_lars_trust_ratio`` (masked) -> ``optax.scale_by_learning_rate``
    -> ``optax.trace``. Differences from ``optax.lars``: optax divides by
    ``||g + wd * w|| + eps``, decays leaves whose trust ratio is masked out, and has no
    trust clip. At ``weight_decay=0`` the two give the same numbers. timm's ``Lars`` keeps
    the rate outside its buffer (``w -= lr_t * v``) and adapts only with weight decay or
    ``always_adapt=True``; where it adapts, it gives the same numbers at a constant rate.

    Args:
      learning_rate: ``lr_t``: a float >= 0 or a schedule (a callable of the step
        count, e.g. ``largebatch.jax.make_schedule(...)``).
      momentum: the momentum coefficient, in [0, 1).
      weight_decay: ``wd`` >= 0, applied as ``g + wd * w`` inside the trust ratio.
      trust_coefficient: ``tc`` > 0 (eta in the paper).
      eps: >= 0, added to the trust-ratio denominator.
      nesterov: Nesterov momentum.
      trust_clip: LARC's clipping ``min(ratio / lr_t, 1)``.
      weight_decay_mask: optax mask; False removes weight decay from a leaf.
      trust_ratio_mask: optax mask; False excludes a leaf (ratio 1, no weight decay).
        ``exclusion_mask`` gives the usual choice.

    Returns:
      An ``optax.GradientTransformation``; ``update`` needs ``params``.

    Every numeric argument may be a JAX array, traced included (``optax.inject_hyperparams``).

    Raises:
      ValueError: naming the value, for a negative rate or weight decay, momentum
        outside [0, 1), ``trust_coefficient <= 0``, ``eps < 0``, a non-finite number,
        or ``nesterov=True`` with ``momentum=0``.
      TypeError: naming the value, for a non-number (a bool, a string, None) where a
        number belongs, or anything but ``True``/``False`` for a flag.

    Example::

        >>> import jax, jax.numpy as jnp, optax
        >>> from largebatch.jax import lars, exclusion_mask
        >>> params = {"w": jnp.ones((3, 2)), "b": jnp.zeros(2)}
        >>> opt = lars(0.1, weight_decay=1e-4, trust_ratio_mask=exclusion_mask)
        >>> state = opt.init(params)
        >>> grads = jax.tree.map(jnp.ones_like, params)
        >>> updates, state = opt.update(grads, state, params)
        >>> params = optax.apply_updates(params, updates)
        >>> round(float(params["b"][0]), 4)  # excluded: plain SGD step, -0.1 * 1
        -0.1

    References:
      You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks",
      https://arxiv.org/abs/1708.03888.
      Goyal et al. 2017 (linear scaling, warmup), https://arxiv.org/abs/1706.02677.
      LARC (the trust clip): NVIDIA apex, ``apex/parallel/LARC.py``.
    """
    _check_learning_rate(learning_rate)
    _check("momentum", momentum, lambda x: 0.0 <= x < 1.0, "in [0, 1)")
    _check("weight_decay", weight_decay, lambda x: x >= 0.0, ">= 0")
    _check("trust_coefficient", trust_coefficient, lambda x: x > 0.0, "> 0")
    _check("eps", eps, lambda x: x >= 0.0, ">= 0")
    nesterov = _check_flag("nesterov", nesterov)
    trust_clip = _check_flag("trust_clip", trust_clip)
    if nesterov and _as_real("momentum", momentum, "") == 0.0:
        raise ValueError(f"Invalid nesterov=True with momentum={momentum!r} (needs momentum > 0)")
    learning_rate = _as_optax_schedule(learning_rate)
    clip = learning_rate if trust_clip else None

    def adapt(wd):
        return scale_by_lars_trust_ratio(wd, trust_coefficient, eps, clip)

    # The structure of the chain depends on the masks only, never on a value.
    if weight_decay_mask is None:
        adapted = [_masked(adapt(weight_decay), trust_ratio_mask)]
    else:  # decayed where both masks hold; adapted but not decayed where only the first does
        adapted = [
            optax.masked(adapt(weight_decay), _mask_and(trust_ratio_mask, weight_decay_mask)),
            optax.masked(adapt(0.0), _mask_and(trust_ratio_mask, weight_decay_mask, True)),
        ]
    return _keep_dtypes(
        optax.chain(
            *adapted,
            optax.scale_by_learning_rate(learning_rate),
            optax.trace(decay=momentum, nesterov=nesterov),
        )
    )


def lamb(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    max_grad_norm: float | None = None,
    weight_decay_mask: Mask = None,
    trust_ratio_mask: Mask = None,
) -> optax.GradientTransformation:
    r"""LAMB: Adam with decoupled weight decay and a layer-wise trust ratio.

    Per leaf ``w`` with gradient ``g``, at step ``t`` = 1, 2, ...::

        g = g / max(1, ||all grads|| / max_grad_norm)        (only with max_grad_norm)
        m = b1 * m + (1 - b1) * g ;  v = b2 * v + (1 - b2) * g^2
        r = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)  (no 1 - b^t without bias_correction)
        u = r + wd * w
        ratio = ||w|| / ||u||                                (1 if ||w|| == 0 or ||u|| == 0)
        w = w - lr_t * ratio * u

    The variant: Algorithm 2 of the paper with phi = identity (no trust-ratio bounds),
    eps outside the square root, weight decay inside the trust ratio, and the global
    gradient clipping of NVIDIA's LAMB when ``max_grad_norm`` is set. Leaves where
    ``trust_ratio_mask`` is False get ratio 1 and no weight decay (plain Adam steps).

    The chain: [``divide_by_global_norm``] -> ``optax.scale_by_adam`` (or
    ``scale_by_uncorrected_adam``) -> ``optax.add_decayed_weights`` (masked) ->
    ``scale_by_lamb_trust_ratio`` (masked) -> ``optax.scale_by_learning_rate``. At its
    defaults this is ``optax.lamb``; the differences: ``optax.lamb`` has ``eps_root``
    and a single ``mask`` for weight decay only (its trust ratio covers every leaf), and
    neither ``bias_correction=False`` nor gradient clipping. ``optax.lamb(lr,
    weight_decay=wd, mask=m)`` equals ``lamb(lr, weight_decay=wd, weight_decay_mask=m)``.

    Args:
      learning_rate: ``lr_t``: a float >= 0 or a schedule of the step count.
      b1, b2: the moment decay rates, in [0, 1).
      eps: >= 0, added to ``sqrt(v_hat)``.
      weight_decay: ``wd`` >= 0, decoupled (added to the Adam direction).
      bias_correction: divide the moments by ``1 - b^t``.
      max_grad_norm: > 0 or None; clip the gradients by their global norm first.
      weight_decay_mask: optax mask; False removes weight decay from a leaf.
      trust_ratio_mask: optax mask; False excludes a leaf (ratio 1, no weight decay).

    Returns:
      An ``optax.GradientTransformation``; ``update`` needs ``params``.

    Every numeric argument may be a JAX array, traced included (``optax.inject_hyperparams``).

    Raises:
      ValueError: naming the value, for a negative rate, eps or weight decay, betas
        outside [0, 1), ``max_grad_norm <= 0`` or a non-finite number.
      TypeError: naming the value, for a non-number (a bool, a string) where a number
        belongs, or anything but ``True``/``False`` for ``bias_correction``.

    Example::

        >>> import jax, jax.numpy as jnp, optax
        >>> from largebatch.jax import lamb, exclusion_mask, make_schedule
        >>> sched = make_schedule("poly", peak_lr=0.01, total_steps=100, warmup_steps=10)
        >>> opt = lamb(sched, weight_decay=0.01, trust_ratio_mask=exclusion_mask)
        >>> params = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
        >>> state = opt.init(params)
        >>> loss = lambda p: jnp.sum((p["w"].sum(0) + p["b"] - 1.0) ** 2)
        >>> for _ in range(3):
        ...     updates, state = opt.update(jax.grad(loss)(params), state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> bool(loss(params) < 36.0)
        True

    References:
      You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in
      76 minutes", https://arxiv.org/abs/1904.00962.
      NVIDIA apex ``FusedLAMB`` (global gradient clipping).
    """
    _check_learning_rate(learning_rate)
    _check("b1", b1, lambda x: 0.0 <= x < 1.0, "in [0, 1)")
    _check("b2", b2, lambda x: 0.0 <= x < 1.0, "in [0, 1)")
    _check("eps", eps, lambda x: x >= 0.0, ">= 0")
    _check("weight_decay", weight_decay, lambda x: x >= 0.0, ">= 0")
    bias_correction = _check_flag("bias_correction", bias_correction)
    if max_grad_norm is not None:
        _check("max_grad_norm", max_grad_norm, lambda x: x > 0.0, "> 0 or None")
    learning_rate = _as_optax_schedule(learning_rate)
    clip = [] if max_grad_norm is None else [divide_by_global_norm(max_grad_norm)]
    moments = (optax.scale_by_adam if bias_correction else scale_by_uncorrected_adam)(b1, b2, eps)
    return _keep_dtypes(
        optax.chain(
            *clip,
            moments,
            optax.add_decayed_weights(weight_decay, _mask_and(trust_ratio_mask, weight_decay_mask)),
            _masked(scale_by_lamb_trust_ratio(), trust_ratio_mask),
            optax.scale_by_learning_rate(learning_rate),
        )
    )
