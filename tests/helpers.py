"""Helpers shared by several test modules (the optimizer cases are ``cases.py``'s)."""

from __future__ import annotations

from typing import Any

import pytest

# AdaComp settings every form refuses with the same message (comm.reference.check_options):
# the DDP hook's state, the one-process simulation and the JAX transform.
BAD_ADACOMP_OPTIONS = [
    ({"warmup_steps": -1}, "Invalid warmup_steps: -1 (must be an integer >= 0)"),
    ({"warmup_steps": 1.5}, "Invalid warmup_steps: 1.5 (must be an integer >= 0)"),
    ({"conv_bin": 0}, "Invalid conv_bin: 0 (must be an integer >= 1)"),
    ({"fc_bin": -5}, "Invalid fc_bin: -5 (must be an integer >= 1)"),
    ({"fc_bin": True}, "Invalid fc_bin: True (must be an integer >= 1)"),
    ({"form": "ring"}, "Invalid form: 'ring' (must be one of allgather, two_phase)"),
    ({"select": "topk"}, "Invalid select: 'topk' (must be one of adacomp, all)"),
    ({"values": "binary"}, "Invalid values: 'binary' (must be one of ternary, exact)"),
]


def user_error(argv: list[str], capsys: Any) -> str:
    """Run ``largebatch ARGV`` in this process; its one stderr line, after checking the rest:
    exit status 2, one line naming the command, no traceback."""
    from largebatch.cli import main as cli

    capsys.readouterr()
    with pytest.raises(SystemExit) as err:
        cli(argv)
    stderr = capsys.readouterr().err
    assert err.value.code == 2, (err.value.code, stderr)
    assert stderr.count("\n") == 1 and stderr.endswith("\n"), stderr
    assert stderr.startswith(f"largebatch {argv[0]}: ") and "Traceback" not in stderr, stderr
    assert str(err.value) == stderr.rstrip("\n")
    return stderr.rstrip("\n")


def shard_map(f: Any, mesh: Any, in_specs: Any, out_specs: Any, check: bool = True) -> Any:
    """``jax.shard_map`` on any supported jax; ``check=False`` turns off its typing of
    values as varying or replicated over the mesh axes (``check_vma``, ``check_rep`` in
    older jax)."""
    import jax

    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as old  # pragma: no cover (older jax)

    return old(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)


# Elements of every magnitude class of the norms (float32): below the one-pass form's small
# threshold (~1.1e-19), medium, above its big one (~4.5e15), and past the square's range.
MAGNITUDES = {"small": 1e-25, "edge_small": 1e-19, "medium": 1.0, "edge_big": 1e16, "big": 1e30}
MIXES = [
    ("small",), ("medium",), ("big",), ("small", "medium"), ("medium", "big"), ("small", "big"),
    ("small", "medium", "big"), ("edge_small", "medium"), ("edge_big", "medium"),
    ("edge_small",), ("edge_big",), ("small", "edge_small"),
]  # fmt: skip
NON_FINITE = [
    ([1e30, float("inf")], float("inf")), ([1.0, -float("inf")], float("inf")),
    ([1e-30, float("nan")], float("nan")), ([float("inf"), float("nan")], float("nan")),
    ([1e30, float("nan")], float("nan")), ([0.0, 0.0], 0.0),
]  # fmt: skip


def run_optax(opt: Any, params: Any, grads: Any, *, jit: bool) -> tuple[Any, Any]:
    """Feed ``grads`` in turn to the optax transformation ``opt`` (its update jitted with
    ``jit``) from ``params``; returns the final params and state."""
    import jax
    import optax

    state = opt.init(params)
    update = jax.jit(opt.update) if jit else opt.update
    for g in grads:
        updates, state = update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def assert_trees_equal(a: Any, b: Any) -> None:
    """Two JAX trees with the same leaves, bit for bit."""
    import jax
    import numpy as np

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def assert_float64_norms(norms: Any, size: int, mix: tuple[str, ...], jit: bool) -> None:
    """``norms`` (a list of JAX arrays -> their norms), compiled or not, on a float32 and
    a complex64 leaf of ``size`` elements drawn from the classes ``mix``: each norm as
    float64 takes it, to 1e-6."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(size)
    scale = np.array([MAGNITUDES[m] for m in mix])[rng.integers(len(mix), size=size)]
    x = (rng.standard_normal(size) * scale).astype(np.float32)
    z = (x + 1j * (rng.standard_normal(size) * scale[::-1])).astype(np.complex64)
    got = (jax.jit(norms) if jit else norms)([jnp.asarray(x), jnp.asarray(z)])
    for value, leaf in zip(got, (x, z)):
        wide = np.abs(leaf.astype(np.complex128))
        top = wide.max()
        np.testing.assert_allclose(float(value), np.sqrt(np.sum(np.square(wide / top))) * top, rtol=1e-6)
