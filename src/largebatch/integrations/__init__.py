"""Hooks into the tools people train with: timm's optimizer factory (``.timm``), Hugging
Face's ``Trainer`` (``.huggingface``) and PyTorch Lightning (``.lightning``). Each of those
modules imports its library; this package and the helpers it re-exports import none."""

from largebatch.integrations.build import OPTIMIZERS, make_optimizer, optimizer_and_scheduler
from largebatch.torch import named_trust_ratios

__all__ = ["OPTIMIZERS", "make_optimizer", "optimizer_and_scheduler", "named_trust_ratios"]
