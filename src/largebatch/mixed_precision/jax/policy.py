"""A precision policy: which dtype parameters are stored in, computed in, and returned in."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from largebatch.mixed_precision.jax.finite import is_float

# One line per dtype, holding its aliases (the layout the formatter would undo).
_DTYPE_NAMES = {
    "float32": jnp.float32, "f32": jnp.float32, "fp32": jnp.float32,
    "single": jnp.float32, "full": jnp.float32,
    "float16": jnp.float16, "f16": jnp.float16, "fp16": jnp.float16, "half": jnp.float16,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
}  # fmt: skip
# One line per field of the policy, holding its aliases.
_POLICY_KEYS = {
    "params": "param_dtype", "param": "param_dtype", "p": "param_dtype",
    "compute": "compute_dtype", "c": "compute_dtype",
    "output": "output_dtype", "o": "output_dtype",
}  # fmt: skip


def _as_float_dtype(dtype: Any, field: str) -> np.dtype:
    if isinstance(dtype, str):
        if dtype.strip().lower() not in _DTYPE_NAMES:
            raise ValueError(f"Unknown {field} name: {dtype!r} (known: {sorted(_DTYPE_NAMES)})")
        dtype = _DTYPE_NAMES[dtype.strip().lower()]
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise ValueError(f"Invalid {field}: {dtype!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"Invalid {field}: {dtype} is not a floating dtype")
    return dtype


def _cast_floats(tree: Any, dtype: np.dtype) -> Any:
    return jax.tree.map(lambda x: x.astype(dtype) if is_float(x) else x, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters are stored in, computed in, and returned in.

    Only floating leaves that carry a dtype (arrays) are cast: integer leaves, keys and
    Python scalars pass through. The usual float16 policy is
    ``Policy(float32, float16, float32)``: float32 master parameters (the optimizer,
    LARS/LAMB norms included, runs in float32), a float16 forward and backward, and a
    float32 output so that the loss is scaled in float32. ``str(policy)`` gives the
    string :func:`get_policy` reads back.

    Args:
      param_dtype: dtype of the stored (master) parameters and of the optimizer.
      compute_dtype: dtype of the forward and backward pass.
      output_dtype: dtype of the model's output (the loss).
    """

    param_dtype: Any = jnp.float32
    compute_dtype: Any = jnp.float32
    output_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, field, _as_float_dtype(getattr(self, field), field))

    def cast_to_param(self, tree: Any) -> Any:
        """Floating leaves to ``param_dtype``."""
        return _cast_floats(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Floating leaves to ``compute_dtype``."""
        return _cast_floats(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Floating leaves to ``output_dtype``."""
        return _cast_floats(tree, self.output_dtype)

    def __str__(self) -> str:
        names = (self.param_dtype.name, self.compute_dtype.name, self.output_dtype.name)
        return "params={},compute={},output={}".format(*names)


def get_policy(spec: str) -> Policy:
    """Read a :class:`Policy` from ``"params=float32,compute=bfloat16,output=float32"``.

    Keys: ``params``/``param``/``p``, ``compute``/``c``, ``output``/``o``; a key left
    out is float32. Dtypes: ``float32`` (``f32``, ``fp32``, ``single``, ``full``),
    ``float16`` (``f16``, ``fp16``, ``half``), ``bfloat16`` (``bf16``). Unknown or
    repeated keys and unknown dtypes raise ``ValueError``.
    """
    if not isinstance(spec, str):
        raise ValueError(f"Invalid policy: {spec!r} (need a string like 'compute=float16')")
    fields: dict[str, Any] = {}
    for item in spec.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in _POLICY_KEYS:
            raise ValueError(
                f"Invalid policy item: {item.strip()!r} in {spec!r} (keys: params, compute, output)"
            )
        field = _POLICY_KEYS[key]
        if field in fields:
            raise ValueError(f"Repeated policy key: {key!r} in {spec!r}")
        fields[field] = _as_float_dtype(value, field)
    return Policy(**fields)
