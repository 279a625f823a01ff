"""The statistics of the steps-to-target study: the critical batch from a fit of the steps
to a target against batch size, with a bootstrap interval, and paired t intervals.

The fit is McCandlish et al. 2018's model (arXiv 1812.06162, eq. 2.11),
``S(B) = S_min (1 + B_noise / B)``: below ``B_noise`` doubling the batch almost halves
the steps (perfect scaling), above it the steps approach ``S_min`` and the images
``S B`` grow with ``B``. ``B_noise`` is the critical batch, where a run needs twice the
fewest steps and twice the fewest images.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["CriticalBatch", "Interval", "critical_batch", "critical_ratio", "fit_steps", "paired_interval"]


class Interval(NamedTuple):
    """A mean difference and its two-sided 95% interval."""

    mean: float
    low: float
    high: float
    n: int

    def crosses(self, threshold: float) -> bool:
        """Whether ``threshold`` lies inside the interval (the data cannot tell which side)."""
        return self.low <= threshold <= self.high


def paired_interval(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Interval:
    """The mean of ``a[i] - b[i]`` (pairs that share a seed) and its Student t interval
    (``scipy.stats.t``) at ``level``; a ValueError for fewer than two pairs or lengths
    that differ."""
    from scipy import stats

    if len(a) != len(b):
        raise ValueError(f"paired_interval: {len(a)} values against {len(b)}")
    if len(a) < 2:
        raise ValueError(f"paired_interval: {len(a)} pair(s); an interval needs at least 2")
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    mean = float(d.mean())
    half = float(stats.t.ppf(0.5 + level / 2, len(d) - 1) * d.std(ddof=1) / math.sqrt(len(d)))
    return Interval(mean, mean - half, mean + half, len(d))


def fit_steps(batches: Sequence[float], steps: Sequence[float]) -> tuple[float, float]:
    """``(S_min, B_noise)`` of ``S(B) = S_min (1 + B_noise / B)`` fitted to the points by
    least squares on log S (each point's relative error weighs alike). For a given
    ``B_noise`` the best ``log S_min`` is the mean of ``log S - log(1 + B_noise / B)``; the
    ``B_noise`` is the best of a grid 100 to the decade from 1e-3 to 1e3 times the
    largest batch, refined by golden-section search. Needs two points or more."""
    b = np.asarray(batches, dtype=np.float64)
    log_s = np.log(np.asarray(steps, dtype=np.float64))
    if len(b) < 2 or len(b) != len(log_s):
        raise ValueError(f"fit_steps: {len(b)} batches and {len(log_s)} step counts; needs 2 or more of each")

    def loss(log_noise: float) -> tuple[float, float]:
        shape = np.log1p(np.exp(log_noise) / b)
        log_min = float(np.mean(log_s - shape))
        return float(np.sum((log_s - log_min - shape) ** 2)), log_min

    top = math.log(b.max())
    grid = np.linspace(top - 3 * math.log(10), top + 3 * math.log(10), 601)
    shapes = np.log1p(np.exp(grid)[:, None] / b[None, :])
    residual = log_s[None, :] - shapes
    losses = np.sum((residual - residual.mean(axis=1, keepdims=True)) ** 2, axis=1)
    i = int(np.argmin(losses))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        x1, x2 = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if loss(x1)[0] < loss(x2)[0]:
            hi = x2
        else:
            lo = x1
    best = (lo + hi) / 2
    return math.exp(loss(best)[1]), math.exp(best)


class CriticalBatch(NamedTuple):
    """The fit's ``S_min`` and ``B_noise`` (the critical batch) with bootstrap intervals."""

    s_min: float
    b_noise: float
    b_noise_low: float
    b_noise_high: float
    s_min_low: float
    s_min_high: float
    resamples: int


def _bootstrap(
    batches: Sequence[int], seed_steps: Sequence[Sequence[float]], resamples: int, seed: int
) -> tuple[tuple[float, float], np.ndarray]:
    """The fit to the medians, and ``(S_min, B_noise)`` of each bootstrap draw."""
    rng = np.random.default_rng(seed)

    def medians(draw: list[np.ndarray]) -> tuple[list[float], list[float]]:
        m = [float(np.median(x)) for x in draw]
        keep = [i for i, v in enumerate(m) if math.isfinite(v)]
        return [float(batches[i]) for i in keep], [m[i] for i in keep]

    values = [np.asarray(s, dtype=np.float64) for s in seed_steps]
    fit = fit_steps(*medians(values))
    fits = []
    for _ in range(resamples):
        bs, ms = medians([x[rng.integers(0, len(x), len(x))] for x in values])
        if len(bs) >= 2:
            fits.append(fit_steps(bs, ms))
    return fit, np.asarray(fits).reshape(-1, 2)


def critical_batch(
    batches: Sequence[int], seed_steps: Sequence[Sequence[float]], resamples: int = 2000, seed: int = 0
) -> CriticalBatch:
    """The fit of :func:`fit_steps` to each batch's median over seeds of the steps to the
    target (``seed_steps[i]``: batch ``i``'s seeds; ``inf`` for a seed that did not reach
    it), with percentile intervals (2.5% and 97.5%) from ``resamples`` bootstrap draws of
    each batch's seeds (a NumPy generator seeded with ``seed``). A batch whose median is
    not finite is left out of every fit."""
    (s_min, b_noise), draws = _bootstrap(batches, seed_steps, resamples, seed)
    lo_s, hi_s = np.percentile(draws[:, 0], [2.5, 97.5])
    lo_b, hi_b = np.percentile(draws[:, 1], [2.5, 97.5])
    return CriticalBatch(s_min, b_noise, float(lo_b), float(hi_b), float(lo_s), float(hi_s), len(draws))


def critical_ratio(
    batches: Sequence[int],
    steps_a: Sequence[Sequence[float]],
    steps_b: Sequence[Sequence[float]],
    resamples: int = 2000,
    seed: int = 0,
) -> Interval:
    """The ratio of two optimizers' critical batches, ``a`` over ``b``, with the 2.5% and
    97.5% percentiles of the ratio over ``resamples`` bootstrap draws (each optimizer's
    seeds drawn on their own, as :func:`critical_batch` draws them): above 1 with its
    interval, ``a`` extends perfect scaling to larger batches than ``b``."""
    (_, noise_a), draws_a = _bootstrap(batches, steps_a, resamples, seed)
    (_, noise_b), draws_b = _bootstrap(batches, steps_b, resamples, seed + 1)
    n = min(len(draws_a), len(draws_b))
    ratios = draws_a[:n, 1] / draws_b[:n, 1]
    low, high = np.percentile(ratios, [2.5, 97.5])
    return Interval(noise_a / noise_b, float(low), float(high), n)
