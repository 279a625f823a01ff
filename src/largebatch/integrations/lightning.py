"""LARS or LAMB in PyTorch Lightning: :func:`configure_optimizers` for the module's hook
of that name, and :class:`TrustRatioCallback`, which logs the trust ratio of each
parameter by name every few steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

try:
    import lightning.pytorch as pl
except ImportError:  # the standalone package, before "lightning" held it
    import pytorch_lightning as pl  # type: ignore[no-redef]

from largebatch.integrations.build import optimizer_and_scheduler
from largebatch.torch import Schedule, named_trust_ratios

__all__ = ["TrustRatioCallback", "configure_optimizers"]


def configure_optimizers(
    module: torch.nn.Module,
    optimizer: str,
    schedule: Schedule,
    *,
    weight_decay: float = 0.0,
    exclude: Callable[[str, Tensor], bool] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """What ``LightningModule.configure_optimizers`` returns: ``LARS`` or ``LAMB`` over
    ``module``'s params grouped by :func:`~largebatch.torch.param_groups`, and a
    ``ScheduleLR`` stepped after every optimizer step (``"interval": "step"``).
    ``kwargs`` go to the optimizer."""
    opt, scheduler = optimizer_and_scheduler(
        module, optimizer, schedule, weight_decay=weight_decay, exclude=exclude, **kwargs
    )
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class TrustRatioCallback(pl.Callback):
    """Logs ``{prefix}{name}``: the trust ratio of each adapted parameter, by its name in
    the module, every ``every_n_steps`` optimizer steps (from step 0).

    The ratios are those the coming step applies (:func:`named_trust_ratios`), read in
    ``on_before_optimizer_step``: after the backward pass and AMP's unscaling, before
    Lightning's gradient clipping. Any optimizer works; for one other than LARS and LAMB
    they are the LARS ratio, as a diagnostic. The latest ratios stay in ``self.latest``.
    """

    def __init__(self, every_n_steps: int = 50, prefix: str = "trust_ratio/") -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"Invalid every_n_steps: {every_n_steps!r} (must be an integer >= 1)")
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.latest: dict[str, float] = {}

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if trainer.global_step % self.every_n_steps:
            return
        opt = getattr(optimizer, "optimizer", optimizer)  # a LightningOptimizer's own
        self.latest = named_trust_ratios(opt, pl_module)
        pl_module.log_dict({self.prefix + k: v for k, v in self.latest.items()}, on_step=True, on_epoch=False)
