"""Loss scales as pytrees: dynamic (``torch.amp.GradScaler``'s rule), static and none."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from largebatch.mixed_precision.jax.finite import is_float

#: The largest loss scale :class:`DynamicLossScale` grows to. ``1 / MAX_LOSS_SCALE``
#: is float32's smallest normal number, so unscaling never multiplies by a reciprocal
#: that XLA flushes to zero, and the scale never overflows to inf (``2.0**128`` does).
MAX_LOSS_SCALE = 2.0**126


def _concrete(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array, or None when it is traced (its value is not known)."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _scale_tree(tree: Any, factor: jax.Array) -> Any:
    """Multiply every floating leaf by ``factor`` in float32; keep each leaf's dtype."""

    def one(x: Any) -> Any:
        if not is_float(x):
            return x
        return (x.astype(jnp.float32) * factor).astype(x.dtype)

    return jax.tree.map(one, tree)


class _LossScaleMethods:
    """``scale`` / ``unscale`` shared by the loss scales that hold a ``loss_scale``."""

    loss_scale: jax.Array

    def scale(self, tree: Any) -> Any:
        """``tree * S`` for every floating leaf, computed in float32, cast back.

        Scale a float32 loss: the scaled value must be representable in the leaf's
        dtype (a float16 leaf above 65504 becomes inf).
        """
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: Any) -> Any:
        """``tree * (1 / S)`` for every floating leaf, computed in float32, cast back."""
        return _scale_tree(tree, 1.0 / self.loss_scale)


def _is_bool(x: Any) -> bool:
    return isinstance(x, (bool, np.bool_)) or np.dtype(getattr(x, "dtype", object)) == np.bool_


def _is_real_dtype(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)


def _check_number(
    name: str, value: Any, ok: Callable[[float], bool], rule: str, integral: bool = False
) -> float | int:
    """``value`` as a Python number, checked; raises naming ``value`` otherwise.

    A number is a Python or NumPy int or float, or a 0-dim NumPy or JAX array of an
    integer or floating dtype (an integer one where ``integral``). Bools, strings, None
    and traced values raise a TypeError; a number that fails ``ok`` a ValueError.
    """
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"Invalid {name}: a traced value (need a concrete number, {rule})")
    if _is_bool(value):
        raise TypeError(f"Invalid {name}: {value!r} (a bool; need {rule})")
    shown: object
    if isinstance(value, numbers.Real):
        number, shown = cast(float, value), value  # a Python or NumPy int or float
    elif isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0:
        if not _is_real_dtype(value.dtype):
            raise TypeError(f"Invalid {name}: {value!r} (need {rule})")
        number = value.item()
        shown = f"{number} ({value.dtype})"
    else:
        raise TypeError(f"Invalid {name}: {value!r} (need {rule})")
    if integral and not isinstance(number, numbers.Integral):
        raise ValueError(f"Invalid {name}: {shown} (need {rule})")
    if isinstance(number, numbers.Real) and (np.isnan(number) or not ok(number)):
        raise ValueError(f"Invalid {name}: {shown} (need {rule})")
    return number


def _check_loss_scale(loss_scale: Any) -> None:
    rule = "need a number, 0 < loss_scale <= 2**126"
    if isinstance(loss_scale, jax.core.Tracer):
        return
    value = np.asarray(loss_scale)
    if _is_bool(loss_scale) or not _is_real_dtype(value.dtype):
        raise TypeError(f"Invalid loss_scale: {loss_scale!r} ({rule})")
    if not (np.all(np.isfinite(value)) and np.all(value > 0) and np.all(value <= MAX_LOSS_SCALE)):
        raise ValueError(f"Invalid loss_scale: {loss_scale} ({rule})")


@dataclasses.dataclass(frozen=True, eq=False)
class DynamicLossScale(_LossScaleMethods):
    r"""A loss scale that adapts to overflow, as a pytree (``jit``/``pmap``/shard it).

    With scale :math:`S`, step counter :math:`c`, period :math:`P`, factor :math:`f`
    and floor :math:`S_{min}`, :meth:`adjust` applies

    .. math::

        \text{finite grads:}\quad & c \leftarrow c + 1;\ \text{if } c = P:\
            S \leftarrow \min(f S, 2^{126}),\ c \leftarrow 0 \\
        \text{inf or NaN:}\quad & S \leftarrow \max(S / f, S_{min}),\ c \leftarrow 0

    the rule of ``torch.amp.GradScaler`` (``growth_interval=P``, ``growth_factor=f``,
    ``backoff_factor=1/f``) with a floor, and with growth capped at
    :data:`MAX_LOSS_SCALE` so that the scale stays finite and its float32 reciprocal
    normal (GradScaler instead skips a growth that would give inf).

    ``loss_scale`` (float32) and ``counter`` (int32) are the pytree's leaves;
    ``period``, ``factor`` and ``min_loss_scale`` are static: they survive
    flattening, ``jit`` and ``tree_util`` round trips, and changing them recompiles.

    Args:
      loss_scale: initial scale :math:`S`; ``2**16`` matches GradScaler.
      counter: finite steps since the last change of scale.
      period: finite steps between two growths (:math:`P \ge 1`).
      factor: growth and backoff factor (:math:`f > 1`).
      min_loss_scale: the scale never drops below this (:math:`0 < S_{min} \le S`).

    Example::

      ls = DynamicLossScale(jnp.float32(2**16))
      grads = ls.unscale(jax.grad(lambda p: ls.scale(loss_fn(p)))(params))
      ls = ls.adjust(all_finite(grads))
    """

    loss_scale: jax.Array
    counter: jax.Array | int = 0
    period: int = 2000
    factor: float = 2.0
    min_loss_scale: float = 1.0

    def __post_init__(self) -> None:
        period = _check_number("period", self.period, lambda v: v >= 1, "an integer >= 1", integral=True)
        factor = _check_number("factor", self.factor, lambda v: 1 < v < np.inf, "a finite number > 1")
        in_range = lambda v: 0 < v <= MAX_LOSS_SCALE  # noqa: E731
        rule = "a number, 0 < min_loss_scale <= 2**126"
        min_loss_scale = _check_number("min_loss_scale", self.min_loss_scale, in_range, rule)
        _check_loss_scale(self.loss_scale)
        scale = _concrete(self.loss_scale)
        if scale is not None and np.any(scale < min_loss_scale):
            raise ValueError(f"Invalid min_loss_scale: {min_loss_scale} > loss_scale {self.loss_scale}")
        if _is_bool(self.counter):
            raise TypeError(f"Invalid counter: {self.counter!r} (a bool; need an integer >= 0)")
        counter = _concrete(self.counter)
        if counter is not None and np.any(counter < 0):
            raise ValueError(f"Invalid counter: {self.counter} (need >= 0)")
        object.__setattr__(self, "loss_scale", jnp.asarray(self.loss_scale, jnp.float32))
        object.__setattr__(self, "counter", jnp.asarray(self.counter, jnp.int32))
        object.__setattr__(self, "period", int(period))
        object.__setattr__(self, "factor", float(factor))
        object.__setattr__(self, "min_loss_scale", float(min_loss_scale))

    def _static(self) -> tuple[tuple[str, Any], ...]:
        return tuple((name, getattr(self, name)) for name in ("period", "factor", "min_loss_scale"))

    def adjust(self, grads_finite: Any) -> DynamicLossScale:
        """The next loss scale, given whether this step's gradients were all finite.

        Pure and branch-free (``jnp.where``): ``grads_finite`` may be traced.
        """
        finite = jnp.asarray(grads_finite, jnp.bool_)
        counter = self.counter + 1
        grow = counter >= self.period
        grown = jnp.minimum(self.loss_scale * self.factor, MAX_LOSS_SCALE)
        shrunk = jnp.maximum(self.loss_scale / self.factor, self.min_loss_scale)
        loss_scale = jnp.where(finite, jnp.where(grow, grown, self.loss_scale), shrunk)
        counter = jnp.where(finite & ~grow, counter, 0)
        leaves = (loss_scale.astype(jnp.float32), counter.astype(jnp.int32))
        return _dynamic_unflatten(self._static(), leaves)


def _dynamic_flatten_with_keys(ls: DynamicLossScale) -> tuple[tuple, tuple]:
    keys = jax.tree_util.GetAttrKey
    children = ((keys("loss_scale"), ls.loss_scale), (keys("counter"), ls.counter))
    return children, ls._static()


def _dynamic_unflatten(static: tuple[tuple[str, Any], ...], children: Any) -> DynamicLossScale:
    # Skips __post_init__: the leaves may be traced (or placeholders), the static fields
    # were checked when the first object was built.
    new = object.__new__(DynamicLossScale)
    for name, value in (("loss_scale", children[0]), ("counter", children[1]), *static):
        object.__setattr__(new, name, value)
    return new


jax.tree_util.register_pytree_with_keys(
    DynamicLossScale,
    _dynamic_flatten_with_keys,
    _dynamic_unflatten,
    lambda ls: ((ls.loss_scale, ls.counter), ls._static()),
)


@dataclasses.dataclass(frozen=True, eq=False)
class StaticLossScale(_LossScaleMethods):
    """A fixed loss scale ``S``: :meth:`adjust` returns it unchanged. A pytree."""

    loss_scale: jax.Array

    def __post_init__(self) -> None:
        _check_loss_scale(self.loss_scale)
        object.__setattr__(self, "loss_scale", jnp.asarray(self.loss_scale, jnp.float32))

    def adjust(self, grads_finite: Any) -> StaticLossScale:
        """``self``: a static scale does not react to overflow."""
        del grads_finite
        return self


def _static_unflatten(_: Any, children: Any) -> StaticLossScale:
    new = object.__new__(StaticLossScale)
    object.__setattr__(new, "loss_scale", children[0])
    return new


jax.tree_util.register_pytree_with_keys(
    StaticLossScale,
    lambda ls: (((jax.tree_util.GetAttrKey("loss_scale"), ls.loss_scale),), None),
    _static_unflatten,
    lambda ls: ((ls.loss_scale,), None),
)


@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
    """No loss scaling (float32 or bfloat16 training): ``scale`` and ``unscale`` return
    their input untouched, :meth:`adjust` returns ``self``. A pytree with no leaves."""

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.ones((), jnp.float32)

    def scale(self, tree: Any) -> Any:
        return tree

    def unscale(self, tree: Any) -> Any:
        return tree

    def adjust(self, grads_finite: Any) -> NoOpLossScale:
        del grads_finite
        return self


jax.tree_util.register_pytree_node(
    NoOpLossScale, lambda ls: ((), None), lambda aux, children: NoOpLossScale()
)
