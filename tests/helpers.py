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
