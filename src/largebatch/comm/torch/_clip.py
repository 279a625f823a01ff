"""Each process clips its own gradients, then the all-reduce sums them: the step of the
LAMB authors' ResNet-50 code on a TPU pod (fastalgo/imagenet_resnet50_lamb,
``optimization.py``, ``create_optimizer``: every core clips the gradients of its own
batch to global norm 1.0 with ``tf.clip_by_global_norm``, and the ``CrossShardOptimizer``
around LAMB adds the cores' clipped gradients in ``apply_gradients``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from largebatch import checks


class LocalClipState:
    """The state of :func:`local_clip_hook`.

    Args:
        max_norm: each process scales all its gradients by ``max_norm / max(norm,
            max_norm)``, ``norm`` being their global norm (TensorFlow's
            ``clip_by_global_norm``), before they are summed over the processes.
        process_group: the group to sum over (default: the default group).
        scaler: the run's ``torch.amp.GradScaler``, if any: the gradients DDP hands the
            hook carry its scale, and the norm compared with ``max_norm`` is the unscaled
            one.

    The buckets of an iteration are held until its last one, whose hook knows the
    process's whole norm; then every bucket is scaled and summed. A non-finite norm
    makes every gradient NaN, as TensorFlow's clip does, so a loss scaler skips the step.
    """

    def __init__(
        self,
        max_norm: float,
        process_group: dist.ProcessGroup | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.max_norm = checks.number("max_norm", max_norm, 0.0)
        self.process_group = process_group
        self.scaler = scaler
        self._held: list[tuple[torch.Tensor, torch.futures.Future[torch.Tensor]]] = []


def local_clip_hook(state: LocalClipState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``model.register_comm_hook(state, local_clip_hook)``.
    The result is the sum over the processes of their clipped gradients (not the mean)."""
    buf = bucket.buffer()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    state._held.append((buf, future))
    if bucket.is_last():
        held, state._held = state._held, []
        squares = torch.stack([b.double().pow(2).sum() for b, _ in held]).sum()
        loss_scale = 1.0 if state.scaler is None else float(state.scaler.get_scale())
        norm = squares.sqrt() / loss_scale
        factor = state.max_norm / torch.clamp(norm, min=state.max_norm)
        for b, f in held:
            b.mul_(factor.to(b.dtype))
            dist.all_reduce(b, group=state.process_group)
            f.set_result(b)
    return future


# DDP checks the hook's annotations as objects; this module's are strings (PEP 563).
local_clip_hook.__annotations__.update(
    state=LocalClipState, bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)
