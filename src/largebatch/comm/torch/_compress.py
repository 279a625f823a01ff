"""AdaComp's compressor for torch: one layer on one worker, on flat tensors."""

from __future__ import annotations

import dataclasses

import torch

from largebatch.comm.reference import fit_bin


@dataclasses.dataclass(frozen=True)
class Compressed:
    """One layer's compression on one worker (flat tensors): the decoded ``sent`` vector,
    the new ``residual``, the selection ``mask`` and the ternary ``scale`` (a 0-d tensor)."""

    sent: torch.Tensor
    residual: torch.Tensor
    mask: torch.Tensor
    scale: torch.Tensor


def compress(
    residual: torch.Tensor,
    grad: torch.Tensor,
    bin_len: int,
    *,
    select: str = "adacomp",
    values: str = "ternary",
) -> Compressed:
    """:func:`largebatch.comm.reference.compress` on flat tensors of one floating dtype."""
    big_g = residual + grad
    if select == "all":
        mask = big_g != 0
    else:
        h = big_g + grad
        bin_len = fit_bin(bin_len, big_g.numel())
        nbins = -(-big_g.numel() // bin_len)
        padded = big_g.new_zeros(nbins * bin_len)
        padded[: big_g.numel()] = big_g.abs()
        gmax = padded.view(nbins, bin_len).amax(dim=1).repeat_interleave(bin_len)[: big_g.numel()]
        mask = (h.abs() >= gmax) & (big_g != 0)
    if values == "exact":
        scale = big_g.new_zeros(())
        sent = torch.where(mask, big_g, torch.zeros_like(big_g))
    else:
        count = mask.sum()
        total = torch.where(mask, big_g.abs(), torch.zeros_like(big_g)).sum(dtype=torch.float64)
        scale = (total / count.clamp(min=1)).to(big_g.dtype)
        sent = torch.where(mask, big_g.sign() * scale, torch.zeros_like(big_g))
    return Compressed(sent=sent, residual=big_g - sent, mask=mask, scale=scale)
