"""AdaComp (Chen et al. 2018, arXiv 1712.02679, Algorithm 1) in float64 NumPy: the statement
every other path is tested against. :func:`compress` is one layer on one worker;
:func:`allgather_exchange` and :func:`two_phase_exchange` average over ``n`` workers.
``select="all"`` and ``values="exact"`` switch selection and quantization off: with both,
the exchange is the plain average (how the hooks' plumbing is tested against the default
all-reduce). The algorithm: docs/communication.md."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from largebatch import checks

__all__ = [
    "CONV_BIN",
    "FC_BIN",
    "FORMS",
    "SELECTIONS",
    "VALUES",
    "Compressed",
    "allgather_exchange",
    "bin_length",
    "check_options",
    "chunk_bounds",
    "compress",
    "fit_bin",
    "two_phase_exchange",
]

CONV_BIN = 50  # L_T for convolution weights (Chen et al. 2018)
FC_BIN = 500  # L_T for fully connected and recurrent weights
SELECTIONS = ("adacomp", "all")
VALUES = ("ternary", "exact")
FORMS = ("allgather", "two_phase")  # the exchanges


def check_options(
    *,
    warmup_steps: Any = 0,
    conv_bin: Any = CONV_BIN,
    fc_bin: Any = FC_BIN,
    form: Any = "allgather",
    select: Any = "adacomp",
    values: Any = "ternary",
    forms: Sequence[str] = FORMS,
) -> dict[str, Any]:
    """AdaComp's settings, checked: the one rule of the DDP hook (``AdaCompState``, whose
    ``forms`` add ``"auto"``), the one-process simulation and the JAX transform. Returns
    them as ints and strs; a ``ValueError`` naming the first bad one otherwise."""
    return {
        "warmup_steps": checks.integer("warmup_steps", warmup_steps, 0),
        "conv_bin": checks.integer("conv_bin", conv_bin, 1),
        "fc_bin": checks.integer("fc_bin", fc_bin, 1),
        "form": checks.choice("form", form, forms),
        "select": checks.choice("select", select, SELECTIONS),
        "values": checks.choice("values", values, VALUES),
    }


def bin_length(shape: Sequence[int], conv_bin: int = CONV_BIN, fc_bin: int = FC_BIN) -> int | None:
    """``L_T`` for a parameter of this shape: rank 3 or more (convolutions) ``conv_bin``,
    rank 2 (fully connected) ``fc_bin``, rank 0 or 1 (biases, normalization) ``None``:
    sent uncompressed. Never more than the parameter's size: a bin longer than the layer
    is the same single bin, and it would cost memory in proportion to ``L_T``."""
    rank = len(shape)
    if rank < 2:
        return None
    return fit_bin(conv_bin if rank >= 3 else fc_bin, math.prod(shape))


def fit_bin(bin_len: int, numel: int) -> int:
    """``bin_len`` capped at ``numel`` (at least 1): the same bins, since one bin of a
    layer's size or longer holds the whole layer, without padding to ``bin_len``."""
    return max(1, min(bin_len, numel))


@dataclasses.dataclass(frozen=True)
class Compressed:
    """One layer's compression on one worker: ``sent`` is the decoded vector the others
    receive, ``residual`` the new residual, ``mask`` the selected elements, ``scale`` the
    ternary scale (0 when nothing is selected)."""

    sent: np.ndarray
    residual: np.ndarray
    mask: np.ndarray
    scale: float


def check_compression(bin_len: int, select: str, values: str) -> None:
    """The settings of one layer's compression: ``bin_len`` an integer >= 1, and the modes."""
    checks.integer("bin length L_T", bin_len, 1)
    _check_modes(select, values)


def _check_modes(select: str, values: str) -> None:
    """The selection and value modes every path accepts (the torch hook, the JAX transform)."""
    checks.choice("select", select, SELECTIONS)
    checks.choice("values", values, VALUES)


def compress(
    residual: np.ndarray, grad: np.ndarray, bin_len: int, *, select: str = "adacomp", values: str = "ternary"
) -> Compressed:
    """Algorithm 1 of Chen et al. 2018 on one layer (flattened), in float64."""
    check_compression(bin_len, select, values)
    r = np.asarray(residual, dtype=np.float64).ravel()
    g = np.asarray(grad, dtype=np.float64).ravel()
    if r.shape != g.shape:
        raise ValueError(f"residual has {r.size} elements, gradient {g.size}")
    big_g = r + g
    if select == "all":
        mask = big_g != 0
    else:
        h = big_g + g
        bin_len = fit_bin(bin_len, big_g.size)
        nbins = -(-big_g.size // bin_len)
        padded = np.zeros(nbins * bin_len)
        padded[: big_g.size] = np.abs(big_g)
        gmax = np.repeat(padded.reshape(nbins, bin_len).max(axis=1), bin_len)[: big_g.size]
        mask = (np.abs(h) >= gmax) & (big_g != 0)
    if values == "exact":
        scale = 0.0
        sent = np.where(mask, big_g, 0.0)
    else:
        count = int(mask.sum())
        scale = math.fsum(np.abs(big_g[mask])) / count if count else 0.0
        sent = np.where(mask, np.sign(big_g) * scale, 0.0)
    return Compressed(sent=sent, residual=big_g - sent, mask=mask, scale=scale)


def allgather_exchange(
    residuals: Sequence[np.ndarray], grads: Sequence[np.ndarray], bin_len: int | None, **kwargs: str
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The average over the workers of what each sends (summed in worker order, then divided
    by the number of workers), and each worker's new residual. ``bin_len=None``: the layer
    is sent uncompressed (the plain average; residuals are returned as they came)."""
    n = len(grads)
    if n < 1 or len(residuals) != n:
        raise ValueError(f"need one residual per worker: {len(residuals)} residuals, {n} grads")
    if bin_len is None:
        return _ordered_sum([np.asarray(g, np.float64).ravel() for g in grads]) / n, list(residuals)
    parts = [compress(r, g, bin_len, **kwargs) for r, g in zip(residuals, grads)]
    return _ordered_sum([p.sent for p in parts]) / n, [p.residual for p in parts]


def chunk_bounds(numel: int, bin_len: int, n: int) -> list[tuple[int, int]]:
    """The two-phase exchange's chunks: ``n`` ranges of whole bins (the last ones may be
    short or empty) covering ``numel`` elements; chunk ``j`` belongs to worker ``j``."""
    nbins = -(-numel // bin_len)
    size = -(-nbins // n) * bin_len
    return [(min(j * size, numel), min((j + 1) * size, numel)) for j in range(n)]


def two_phase_exchange(
    residuals: Sequence[np.ndarray],
    server_residuals: Sequence[np.ndarray],
    grads: Sequence[np.ndarray],
    bin_len: int,
    **kwargs: str,
) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Phase 1: each worker compresses its layer (as :func:`compress`) and worker ``j``
    averages everyone's chunk ``j`` (:func:`chunk_bounds`). Phase 2: worker ``j`` compresses
    that average with its own residual for the chunk (``server_residuals[j]``, the chunk's
    length) and everyone receives every re-compressed chunk. Returns the result, the new
    residuals and the new chunk residuals."""
    n = len(grads)
    if len(residuals) != n or len(server_residuals) != n:
        raise ValueError(f"need one residual and one chunk residual per worker for {n} grads")
    parts = [compress(r, g, bin_len, **kwargs) for r, g in zip(residuals, grads)]
    numel = parts[0].sent.size
    out = np.zeros(numel)
    new_server = []
    for j, (lo, hi) in enumerate(chunk_bounds(numel, bin_len, n)):
        mean = _ordered_sum([p.sent[lo:hi] for p in parts]) / n
        again = compress(server_residuals[j], mean, bin_len, **kwargs)
        out[lo:hi] = again.sent
        new_server.append(again.residual)
    return out, [p.residual for p in parts], new_server


def _ordered_sum(arrays: Sequence[np.ndarray]) -> np.ndarray:
    total = np.array(arrays[0], dtype=np.float64, copy=True)
    for a in arrays[1:]:
        total = total + a
    return total
