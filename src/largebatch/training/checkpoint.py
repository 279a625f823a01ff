"""``largebatch train``'s checkpoint, ``OUT/checkpoint.pt``: reading it back for ``--resume``
(refused when it was made with other settings, or for AdaComp on another number of processes),
gathering every process's RNG states and AdaComp residuals for it, and writing it atomically.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from largebatch.outputs import CommandError, atomic_write

__all__ = ["gather_residuals", "gather_rng", "read_checkpoint", "to_device", "write_checkpoint"]

# The settings a checkpoint records and ``--resume`` must match, with their flags.
_SETTINGS = {
    "recipe": "--recipe",
    "batch_size": "--batch-size",
    "epochs": "--epochs",
    "lr": "--lr",
    "seed": "--seed",
    "subset": "--subset",
    "precision": "--precision",
    "fsdp": "--fsdp",
    "compression": "--compression",
    "compression_warmup": "--compression-warmup",
    "ghost_batch": "--ghost-batch",
    "augment": "--augment",
}
# What a checkpoint made before a setting existed ran with.
_SETTINGS_BEFORE = {"compression": "none", "compression_warmup": None, "ghost_batch": None, "augment": False}


def _fail(message: str) -> CommandError:
    return CommandError("train", message)


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` (dicts of tensors and plain values) with every tensor on ``device``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    return tree


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def read_checkpoint(path: Path, settings: dict[str, Any], world: int) -> dict[str, Any]:
    """The checkpoint to resume from, after checking that it was made with ``settings``
    (and, for AdaComp, on ``world`` processes: each kept its own residuals)."""
    if not path.is_file():
        raise _fail(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 -- any unreadable checkpoint is a user error
        raise _fail(f"--resume: cannot read {path} ({type(err).__name__}: {err})") from None
    saved = (
        {**_SETTINGS_BEFORE, **state["settings"]}
        if state.get("settings")
        else {"recipe": state.get("recipe")}
    )
    for key, flag in _SETTINGS.items():
        if key in saved and saved[key] != settings[key]:
            raise _fail(
                f"--resume: {path} is a run with {flag} {_show(saved[key])}, not "
                f"{_show(settings[key])}; resume it with its own settings, or start "
                "a new run in another --out"
            )
    saved_world = len(state.get("adacomp") or ())
    if settings["compression"] == "adacomp" and saved_world and saved_world != world:
        raise _fail(
            f"--resume: {path} holds the AdaComp residuals of {saved_world} processes, "
            f"not {world}: resume it on {saved_world} (each process keeps its own "
            "residuals), or start a new run in another --out"
        )
    return state


def gather_rng(device: torch.device, world: int) -> list[tuple[torch.Tensor, torch.Tensor | None] | None]:
    """Every process's CPU and (on CUDA) device RNG states, by rank (a collective when
    ``world`` > 1)."""
    rng: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [
        (torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None)
    ]
    if world > 1:
        mine, rng = rng[0], [None] * world
        dist.all_gather_object(rng, mine)
    return rng


def gather_residuals(comm: Any, world: int) -> list[Any] | None:
    """Every process's AdaComp state (``comm``'s, its residuals on the CPU), by rank (a
    collective); None without AdaComp (``comm`` None)."""
    if comm is None:
        return None
    residuals: list[Any] = [None] * world
    dist.all_gather_object(residuals, to_device(comm.state_dict(), torch.device("cpu")))
    return residuals


def write_checkpoint(path: Path, snapshot: dict[str, Any]) -> None:
    """Replaces ``path`` with ``snapshot`` (``torch.save``), atomically."""
    atomic_write(path, functools.partial(torch.save, snapshot))
