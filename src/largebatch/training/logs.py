"""``largebatch train``'s logs beside ``metrics.jsonl``: the trust ratios sampled every N
steps (``trust_ratios.jsonl``), and the metrics as TensorBoard events (``--tensorboard``)
or a Weights & Biases run (``--wandb``), each written by rank 0 as the run goes."""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path
from typing import Any

from largebatch.outputs import CommandError

__all__ = ["MetricsLog", "check_loggers", "ratio_stats"]


def check_loggers(tensorboard: str | None, wandb: str | None) -> None:
    """Before any work: the packages that ``--tensorboard`` and ``--wandb`` write with."""
    for flag, value, module in (("--tensorboard", tensorboard, "tensorboard"), ("--wandb", wandb, "wandb")):
        if value is not None and importlib.util.find_spec(module) is None:
            raise CommandError("train", f"{flag} writes with {module}, not installed: pip install {module}")


def ratio_stats(ratios: dict[str, float]) -> dict[str, float | None]:
    """The min, median and max of a sample of trust ratios (Nones for no ratios)."""
    values = list(ratios.values())
    return {
        "trust_ratio_min": min(values) if values else None,
        "trust_ratio_median": statistics.median(values) if values else None,
        "trust_ratio_max": max(values) if values else None,
    }


class MetricsLog:
    """The run's live logs on rank 0 (on other ranks every call does nothing): scalars by
    the optimizer step, to TensorBoard's ``SummaryWriter`` under ``tensorboard`` and to a
    W&B run of project ``wandb``, when given. A resumed run starts at ``start_step``:
    TensorBoard drops the events a stopped run wrote past it."""

    def __init__(
        self,
        rank: int,
        out: Path,
        settings: dict[str, Any],
        *,
        tensorboard: str | None,
        wandb: str | None,
        start_step: int,
    ) -> None:
        self.writer: Any = None
        self.wandb: Any = None
        if rank != 0:
            return
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(
                tensorboard or str(out / "tensorboard"), purge_step=start_step or None
            )
        if wandb is not None:
            import wandb as wandb_module

            self.wandb = wandb_module.init(project=wandb, dir=str(out), config=settings, name=out.name)

    def scalars(self, values: dict[str, Any], step: int) -> None:
        """``values`` at optimizer step ``step`` (Nones and non-numbers left out)."""
        numbers = {
            k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if self.writer is not None:
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, step)
        if self.wandb is not None and numbers:
            self.wandb.log(numbers, step=step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
