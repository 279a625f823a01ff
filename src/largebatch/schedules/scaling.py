"""The batch-size rules for the peak learning rate: linear (Goyal et al. 2017) and
square-root scaling."""

from __future__ import annotations

import math

from largebatch import checks

__all__ = ["linear_scaling", "sqrt_scaling"]


def linear_scaling(base_lr: float, batch_size: int, base_batch_size: int = 256) -> float:
    """The linear scaling rule (Goyal et al. 2017): ``base_lr * batch_size / base_batch_size``,
    for momentum SGD (docs/choosing.md says where it stops holding).

    Raises:
      ValueError: naming the bad argument: ``base_lr`` not a finite number >= 0, a batch
        size not a positive integer (bools are neither), or a product too large for a float.

    Examples:
      >>> linear_scaling(0.1, 8192)
      3.2
    """
    return _scaled("linear_scaling", base_lr, batch_size, base_batch_size, 1.0)


def sqrt_scaling(base_lr: float, batch_size: int, base_batch_size: int = 256) -> float:
    """The square-root scaling rule: ``base_lr * sqrt(batch_size / base_batch_size)``
    (Krizhevsky 2014, https://arxiv.org/abs/1404.5997; the LAMB paper's rule for LAMB,
    You et al. 2019, https://arxiv.org/abs/1904.00962). In this package's study LAMB's best
    peak rate grew 1.41x from the 32K- to the 64K-equivalent batch (docs/choosing.md).

    Raises:
      ValueError: as :func:`linear_scaling`.

    Examples:
      >>> sqrt_scaling(0.064, 3072, 1536)
      0.0905...
    """
    return _scaled("sqrt_scaling", base_lr, batch_size, base_batch_size, 0.5)


def _scaled(name: str, base_lr: float, batch_size: int, base_batch_size: int, power: float) -> float:
    """``base_lr * (batch_size / base_batch_size) ** power``, its arguments checked."""
    checks.number("base_lr", base_lr, 0.0, strict=False)
    checks.integer("batch_size", batch_size, 1)
    checks.integer("base_batch_size", base_batch_size, 1)
    try:
        lr = (
            base_lr * batch_size / base_batch_size
            if power == 1.0
            else base_lr * (batch_size / base_batch_size) ** power
        )
    except OverflowError:
        lr = math.inf
    if not math.isfinite(lr):
        raise ValueError(
            f"{name}({base_lr!r}, {batch_size!r}, {base_batch_size!r}) = {lr} is not a finite rate"
        )
    return lr
