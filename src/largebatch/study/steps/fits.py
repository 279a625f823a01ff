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

__all__ = [
    "CriticalBatch",
    "Interval",
    "critical_batch",
    "critical_ratio",
    "fit_steps",
    "paired_interval",
    "steps_ratio",
]


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
    largest batch, refined by bisection on the sign of the loss's slope. Needs two points or more."""
    b = np.asarray(batches, dtype=np.float64)
    s = np.asarray(steps, dtype=np.float64)
    if len(b) < 2 or len(b) != len(s):
        raise ValueError(f"fit_steps: {len(b)} batches and {len(s)} step counts; needs 2 or more of each")
    s_min, b_noise = _fit_many(b, s[None, :])
    return float(s_min[0]), float(b_noise[0])


def _fit_many(b: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`fit_steps` of each row of ``steps`` (shape ``(fits, len(b))``) at once; a
    step count that is not finite leaves its batch out of that row's fit. Each row needs
    two finite counts."""
    keep = np.isfinite(steps)
    w = keep.astype(np.float64)
    count = w.sum(axis=1)
    log_s = np.log(np.where(keep, steps, 1.0))

    def parts(log_noise: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ratio = np.exp(log_noise)[:, None] / b
        residual = log_s - np.log1p(ratio)
        log_min = (w * residual).sum(axis=1) / count
        return residual - log_min[:, None], log_min, ratio / (1 + ratio)

    top = np.log(np.where(keep, b, 0.0).max(axis=1))
    grid = top[:, None] + np.linspace(-3 * math.log(10), 3 * math.log(10), 601)
    residual = log_s[:, None, :] - np.log1p(np.exp(grid)[:, :, None] / b)
    weights = w[:, None, :]
    mean = (weights * residual).sum(axis=2, keepdims=True) / count[:, None, None]
    i = np.argmin((weights * (residual - mean) ** 2).sum(axis=2), axis=1)
    rows = np.arange(len(steps))
    lo, hi = grid[rows, np.maximum(i - 1, 0)], grid[rows, np.minimum(i + 1, grid.shape[1] - 1)]
    # Bisection on the sign of the loss's slope, not on comparisons of the loss: at the
    # bottom the loss is flat to its rounding over a width of about the square root of
    # the float spacing, so comparisons there follow the last bits of exp and log (which
    # differ between CPUs) and move B_noise by 1e-8; the slope crosses zero cleanly.
    # d loss / d log B_noise = -2 sum w (r - mean r) q, q = (B_noise / B) / (1 + B_noise / B).
    for _ in range(64):
        mid = (lo + hi) / 2
        centred, _, q = parts(mid)
        rising = (w * centred * q).sum(axis=1) < 0
        hi, lo = np.where(rising, mid, hi), np.where(rising, lo, mid)
    best = (lo + hi) / 2
    return np.exp(parts(best)[1]), np.exp(best)


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
    """The fit to the medians, and ``(S_min, B_noise)`` of each bootstrap draw (a draw
    with fewer than two finite medians has no fit and is left out)."""
    rng = np.random.default_rng(seed)
    b = np.asarray(batches, dtype=np.float64)
    values = [np.asarray(s, dtype=np.float64) for s in seed_steps]
    medians = np.array([[np.median(x) for x in values]])
    if np.isfinite(medians).sum() < 2:
        raise ValueError(f"critical_batch: {int(np.isfinite(medians).sum())} finite median(s); needs 2")
    fit = _fit_many(b, medians)
    drawn = np.stack(
        [np.median(x[rng.integers(0, len(x), (resamples, len(x)))], axis=1) for x in values], axis=1
    )
    drawn = drawn[np.isfinite(drawn).sum(axis=1) >= 2]
    draws = _fit_many(b, drawn)
    return (float(fit[0][0]), float(fit[1][0])), np.stack(draws, axis=1).reshape(-1, 2)


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


def steps_ratio(
    steps_a: Sequence[float], steps_b: Sequence[float], resamples: int = 2000, seed: int = 0
) -> Interval:
    """The median over seeds of ``a``'s steps to the target over ``b``'s, at one batch
    (``inf`` for a seed that did not reach it), with the 2.5% and 97.5% percentiles of
    the ratio over ``resamples`` bootstrap draws of each one's seeds (the draws' values
    on either side, not interpolated): below 1 with its
    interval, ``a`` reaches the target in fewer steps. A draw whose two medians are both
    infinite has no ratio and is left out (``n`` counts the draws kept)."""
    a = np.asarray(steps_a, dtype=np.float64)
    b = np.asarray(steps_b, dtype=np.float64)
    if len(a) < 1 or len(b) < 1:
        raise ValueError(f"steps_ratio: {len(a)} and {len(b)} seeds; needs one or more of each")
    rng = np.random.default_rng(seed)
    draws_a = np.median(a[rng.integers(0, len(a), (resamples, len(a)))], axis=1)
    draws_b = np.median(b[rng.integers(0, len(b), (resamples, len(b)))], axis=1)
    with np.errstate(invalid="ignore"):
        ratios = draws_a / draws_b
        mean = float(np.median(a) / np.median(b))
    ratios = ratios[~np.isnan(ratios)]
    if not len(ratios):
        return Interval(mean, math.nan, math.nan, 0)
    # the draws' own values, outward (no interpolation between a ratio and an infinite one)
    low = np.percentile(ratios, 2.5, method="lower")
    high = np.percentile(ratios, 97.5, method="higher")
    return Interval(mean, float(low), float(high), len(ratios))
