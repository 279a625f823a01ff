"""What the JAX LARS and LAMB share: the argument checks' view of traced values, the
learning rate as optax takes it, the leaves in the dtype norms are computed in, and the
wrapper that keeps the chains' dtypes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from largebatch.lars import spec
from largebatch.lars.jax.norms import compute_dtype
from largebatch.schedules import Schedule
from largebatch.schedules.jax import as_optax_schedule

NO_PARAMS = "this transformation needs the params: call update(updates, state, params)"

ScalarOrSchedule = float | Callable[[jax.Array], jax.Array]


def concrete_or_unknown(value: Any) -> Any:
    """``value``, or :data:`spec.UNKNOWN` where it is traced (its value cannot be read
    and is not checked)."""
    return spec.UNKNOWN if isinstance(value, jax.core.Tracer) else value


def as_optax_rate(learning_rate: Any) -> ScalarOrSchedule:
    """A :class:`largebatch.schedules.Schedule` becomes its jit-traceable JAX twin."""
    if isinstance(learning_rate, Schedule):
        return as_optax_schedule(learning_rate)
    return learning_rate


def check_fused(fused: Any) -> bool:
    """``fused`` checked (True, False or None; a TypeError naming it otherwise): whether
    the fused path is taken. ``None`` takes it where JAX's default backend is a GPU, where
    it is the faster, and keeps the unfused path elsewhere (docs/jax.md, "The fused
    path")."""
    if fused is None:
        return jax.default_backend() == "gpu"
    if isinstance(fused, (bool, np.bool_)):
        return bool(fused)
    raise TypeError(f"Invalid fused: {fused!r} (must be True, False or None)")


def rate_at(learning_rate: ScalarOrSchedule, count: jax.Array) -> Any:
    """The rate at step ``count``: a schedule's value there, or the number itself."""
    return learning_rate(count) if callable(learning_rate) else learning_rate


def rate_to_check(learning_rate: Any) -> dict[str, Any]:
    """The spec's ``lr`` entry for ``learning_rate``: none for a schedule (a callable)."""
    return {} if callable(learning_rate) else {"lr": concrete_or_unknown(learning_rate)}


def computed_leaves(updates: Any, params: Any) -> tuple[list, list, Any]:
    """The leaves of ``updates`` and of ``params`` (its structure), both in the dtype
    norms and ratios are computed in (that of the update leaf), and the treedef."""
    leaves, treedef = jax.tree.flatten(updates)
    dtypes = [compute_dtype(u) for u in leaves]
    us = [u.astype(d) for u, d in zip(leaves, dtypes)]
    param_leaves = treedef.flatten_up_to(params)  # type: ignore[attr-defined]  # PyTreeDef: no stubs
    ws = [w.astype(d) for w, d in zip(param_leaves, dtypes)]
    return us, ws, treedef


def keep_dtypes(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` with its updates in the incoming updates' dtypes and its state in the
    dtypes ``init`` gave it, so that float32 hyperparameters (injected, or passed as
    arrays) never promote bf16 updates or state, and ``jit`` sees the same state types
    at every step."""

    inner = optax.with_extra_args_support(inner)

    def update_fn(
        updates: optax.Updates, state: optax.OptState, params: optax.Params | None = None, **extra_args: Any
    ) -> tuple[optax.Updates, optax.OptState]:  # as optax's aliases
        new_updates, new_state = inner.update(updates, state, params, **extra_args)
        new_updates = jax.tree.map(lambda u, g: u.astype(jnp.result_type(g)), new_updates, updates)
        new_state = jax.tree.map(lambda n, o: n.astype(jnp.result_type(o)), new_state, state)
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(inner.init, update_fn)
