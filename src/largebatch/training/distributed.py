"""The processes of ``largebatch train``: the ``--device`` check, joining the process group
under ``torchrun``, sharding the model with FSDP2 (``--fsdp``) and gathering it back whole,
one set of batch-norm statistics for all ranks, and the checksums each rank prints of its
final model.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import re
import sys
from typing import TYPE_CHECKING, Any, NoReturn, TypedDict, cast

import torch
import torch.distributed as dist
from torch import nn

from largebatch.mixed_precision.torch import norms_in_float32
from largebatch.outputs import CommandError

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "buffers_sha256",
    "check_device",
    "exit_process",
    "full_optimizer_state",
    "full_state",
    "join",
    "joined",
    "params_sha256",
    "shard_model",
    "sync_buffers",
]

_joined = False  # join() initialized the process group in this process


class _ShardOptions(TypedDict, total=False):
    """The options :func:`shard_model` gives ``fully_shard``."""

    mp_policy: MixedPrecisionPolicy


def check_device(device_arg: str | None, command: str = "train") -> str:
    """The ``--device`` value checked against this machine: ``cpu``, ``cuda`` or ``cuda:N``
    (default: ``cuda`` when available); an error of ``largebatch COMMAND`` otherwise."""
    if device_arg is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device_arg == "cpu":
        return device_arg
    match = re.fullmatch(r"cuda(?::(\d+))?", device_arg)
    if match is None:
        raise CommandError(command, f"invalid --device {device_arg!r} (cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        raise CommandError(
            command,
            f"--device {device_arg}: no CUDA GPU is available here "
            "(torch.cuda.is_available() is False); use --device cpu",
        )
    if match[1] is not None and int(match[1]) >= torch.cuda.device_count():
        raise CommandError(
            command, f"--device {device_arg}: this machine has {torch.cuda.device_count()} CUDA GPU(s)"
        )
    return device_arg


def join(name: str) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``; joins the process group under torchrun (NCCL on
    CUDA, gloo on CPU), each process on the GPU of its ``LOCAL_RANK``."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    # set_device needs an index: a bare ``cuda`` is this process's GPU, LOCAL_RANK's.
    device = torch.device("cuda", local) if name == "cuda" else torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        global _joined
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        _joined = True
    return rank, world, device


def joined() -> bool:
    """Whether :func:`join` initialized a process group in this process (the command
    then ends it with :func:`exit_process`)."""
    return _joined


def exit_process(status: int) -> NoReturn:
    """End a process that joined a process group: leave the group, run the ``atexit``
    handlers, flush the standard streams and exit with ``status``, without tearing the
    interpreter down.

    Why not a plain return: ``torch.autograd.backward`` stashes a ``contextvars.Context``
    in the thread's state while it runs, and every collective issued during the backward
    (DDP's and FSDP2's gradient reductions) keeps a copy of that state in its work
    object. Gloo's worker threads release the work after it completes, which takes the
    GIL; ``destroy_process_group`` does not stop them, because DTensor's caches keep the
    group alive. When that release comes after the interpreter began finalizing, CPython
    ends the thread inside a destructor that may not throw, and the process aborts
    (SIGABRT, "terminate called without an active exception") after its work is done.
    Skipping the finalization leaves those threads nothing to race with."""
    if dist.is_initialized():
        dist.destroy_process_group()
    atexit._run_exitfuncs()  # what a normal exit runs: multiprocessing's, logging's
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@torch.no_grad()
def sync_buffers(model: nn.Module, world: int) -> None:
    """Average the floating buffers (batch-norm running mean and variance) over the
    processes; the others (``num_batches_tracked``) take rank 0's values. Params are equal
    on every rank already; after this the whole model is."""
    if world == 1:
        return
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer)
            buffer.div_(world)
        else:
            dist.broadcast(buffer, 0)


def shard_model(model: nn.Module, dtype: torch.dtype) -> None:
    """Shard ``model`` in place with FSDP2 over all processes: each top-level child that
    holds params is one unit (its params all-gathered together), then the root. With a
    half ``dtype`` the sharded params stay fp32 and FSDP2's mixed-precision policy runs the
    forward and backward in ``dtype`` and reduces the grads in fp32; normalization layers
    are units of their own that compute in fp32, as :func:`to_half` keeps them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy: _ShardOptions = {}
    own: set[nn.Module] = set()
    if dtype != torch.float32:
        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        # Normalization layers compute in fp32, as to_half keeps them: a unit of their own
        # whose params stay fp32 (FSDP2 casts params, not BN's running statistics).
        fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
        for norm in norms_in_float32(model, dtype):
            if any(True for _ in norm.parameters()):
                fully_shard(norm, mp_policy=fp32)
                own.add(norm)
    for child in model.children():
        if child not in own and any(True for _ in child.parameters()):
            fully_shard(child, **policy)
    fully_shard(model, **policy)


def _full(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of the unsharded model, every sharded tensor gathered whole (a
    collective: every rank calls it): torch.distributed.checkpoint's
    ``get_model_state_dict`` with ``full_state_dict=True``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True)
    return cast("dict[str, torch.Tensor]", get_model_state_dict(model, options=options))


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every sharded state tensor gathered whole (a
    collective): loadable by the same optimizer on the unsharded model, or, sharded again
    on load, on a sharded one."""
    saved = optimizer.state_dict()
    state = {pid: {k: _full(v) for k, v in entry.items()} for pid, entry in saved["state"].items()}
    return {**saved, "state": state}


def _sha256(tensors: Any) -> str:
    digest = hashlib.sha256()
    for name, t in tensors:
        digest.update(name.encode())
        t = t.detach().cpu()
        digest.update((t.float() if t.is_floating_point() else t).contiguous().numpy().tobytes())
    return digest.hexdigest()


def params_sha256(model: nn.Module) -> str:
    """A checksum of the model's named parameters (as fp32 where floating)."""
    return _sha256(model.named_parameters())


def buffers_sha256(model: nn.Module) -> str:
    """A checksum of the model's named buffers (batch-norm statistics)."""
    return _sha256(model.named_buffers())
