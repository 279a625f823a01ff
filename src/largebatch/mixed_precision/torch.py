"""Half-precision models for PyTorch: cast a model, keep normalization in fp32."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

__all__ = ["NORM_LAYERS", "norms_in_float32", "to_half"]

NORM_LAYERS = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm)


def _to_float32(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _back_to_input_dtype(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.to(cast(torch.dtype, module._largebatch_io_dtype))


def to_half(model: nn.Module, dtype: torch.dtype = torch.float16) -> nn.Module:
    """Cast ``model`` to ``dtype`` (fp16 or bf16) in place, keeping normalization layers fp32.

    BatchNorm, LayerNorm and GroupNorm keep fp32 params and running statistics (their
    variance overflows or loses precision in fp16); their input is cast to fp32 and their
    output back to ``dtype``, so the rest of the model runs in half precision. Train with
    ``LARS(..., master_weights=True)`` (or LAMB) so the half params get fp32 masters.
    Returns ``model``.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"Invalid dtype: {dtype} (must be torch.float16 or torch.bfloat16)")
    model.to(dtype)
    for module in norms_in_float32(model, dtype):
        module.float()
    return model


def norms_in_float32(model: nn.Module, dtype: torch.dtype) -> list[nn.Module]:
    """Make each normalization layer of ``model`` compute in fp32 inside a ``dtype`` model:
    its input cast to fp32, its output back to ``dtype`` (forward hooks, added once).
    Returns the layers; their params are the caller's to keep fp32 (:func:`to_half` casts
    them, FSDP2 gives them a policy of their own: ``training.distributed.shard_model``)."""
    norms: list[nn.Module] = [m for m in model.modules() if isinstance(m, NORM_LAYERS)]
    for module in norms:
        if not getattr(module, "_largebatch_fp32", False):
            # Module.__setattr__ is typed for Tensor and Module values only
            module._largebatch_io_dtype = dtype  # type: ignore[assignment]
            module._largebatch_fp32 = True  # type: ignore[assignment]
            module.register_forward_pre_hook(_to_float32)
            module.register_forward_hook(_back_to_input_dtype)
    return norms
