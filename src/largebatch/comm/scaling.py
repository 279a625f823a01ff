"""Step time and scaling efficiency of data-parallel training under the model of
:mod:`largebatch.comm.costs` (whose formulas are importable from here too): :func:`predict`
turns a :class:`Workload` (weak scaling: a fixed batch per worker) and a :class:`Network`
into step time and efficiency for every exchange form; :func:`fit_ring` fits a link to
measured all-reduce times. docs/communication.md, "The scaling model". No framework."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from largebatch import checks
from largebatch.comm.costs import (
    DDP_BUCKET_BYTES,
    DEFAULT_LINK,
    FORMS,
    Link,
    Network,
    allgather,
    allgather_crossover,
    choose_form,
    ddp_buckets,
    hierarchical,
    ring,
    two_phase,
)

__all__ = [
    "DEFAULT_LINK",
    "DDP_BUCKET_BYTES",
    "FORMS",
    "MODELS",
    "Estimate",
    "Link",
    "Network",
    "Prediction",
    "Workload",
    "allgather",
    "allgather_crossover",
    "choose_form",
    "compressed_best",
    "ddp_buckets",
    "fit_ring",
    "hierarchical",
    "predict",
    "predict_many",
    "ring",
    "two_phase",
]

# Parameter counts of the presets (fp32 gradients: 4 bytes each).
MODELS: dict[str, tuple[float, str]] = {
    "resnet50": (25.6e6, "ResNet-50 (He et al. 2016); torchvision's has 25,557,032"),
    "bert-large": (340e6, "BERT-Large (Devlin et al. 2019, arXiv 1810.04805): 340M"),
    "alexnet": (61.1e6, "AlexNet; torchvision's has 61,100,840"),
}


# ----------------------------------------------------------------------------- workloads


@dataclasses.dataclass(frozen=True)
class Workload:
    """One training step of one worker (weak scaling: the batch per worker is fixed).

    Attributes:
        size_bytes: ``S``, bytes of the fp32 gradients exchanged each step.
        compute_time: seconds of forward and backward a step on one worker.
        buckets: ``k`` (:func:`ddp_buckets` gives DDP's count).
        compression: ``c`` for the compressed forms.
        overlap: fraction of the exchange hidden behind the backward pass (0: none; the
            hidden part is at most ``compute_time``).
        compressor_cost: seconds a gradient byte that each worker spends compressing and
            decoding, for the all-gather and the two-phase form: added to their exchange
            beyond one worker (``S * cost``). 0 counts bytes and latencies only.
    """

    size_bytes: float
    compute_time: float
    buckets: int = 1
    compression: float = 40.0
    overlap: float = 0.0
    compressor_cost: tuple[float, float] = (0.0, 0.0)

    def __post_init__(self) -> None:
        checks.number("size_bytes", self.size_bytes)
        checks.number("compute_time", self.compute_time)
        checks.integer("buckets", self.buckets, 1)
        checks.number("compression", self.compression, low=1.0, strict=False)
        overlap = checks.number("overlap", self.overlap, strict=False)
        if overlap > 1:
            raise ValueError(f"Invalid overlap: {self.overlap!r} (must be between 0 and 1)")
        cost = self.compressor_cost
        if not isinstance(cost, tuple) or len(cost) != 2:
            raise ValueError(f"Invalid compressor_cost: {cost!r} (must be a pair of seconds a byte)")
        for value in cost:
            checks.number("compressor_cost", value, strict=False)

    @classmethod
    def from_params(cls, params: float, compute_time: float, **kwargs: Any) -> Workload:
        """The workload of a model of ``params`` parameters (fp32 gradients: ``4 * params``
        bytes); ``kwargs`` as the class's."""
        return cls(4 * checks.number("params", params), compute_time, **kwargs)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One form at one worker count: ``comm_time`` (the whole exchange), ``step_time``
    (compute plus the exposed exchange) and ``efficiency = compute_time / step_time``
    (against one worker that exchanges nothing). Seconds."""

    comm_time: float
    step_time: float
    efficiency: float


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Every form at ``workers``: ``forms[name]`` is an :class:`Estimate` for each of
    :data:`FORMS`; ``choice`` is the compressed form :func:`compressed_best` picks."""

    workers: int
    compute_time: float
    forms: dict[str, Estimate]
    choice: str

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for JSON)."""
        return {
            "workers": self.workers,
            "compute_time": self.compute_time,
            "choice": self.choice,
            "forms": {k: dataclasses.asdict(v) for k, v in self.forms.items()},
        }


def _comm_times(workload: Workload, network: Network, workers: int) -> dict[str, float]:
    n = checks.integer("workers", workers, 1)
    s, k, c = workload.size_bytes, workload.buckets, workload.compression
    a, b = network.link(n)
    # The compressor's own work, where there is an exchange to compress.
    ag_cost, tp_cost = (s * cost for cost in workload.compressor_cost) if n > 1 else (0.0, 0.0)
    return {
        "ring": ring(s, n, a, b, buckets=k),
        "hierarchical": hierarchical(s, n, network, buckets=k),
        "allgather": allgather(s, n, c, a, b, buckets=k) + ag_cost,
        "two_phase": two_phase(s, n, c, a, b, buckets=k, sharing=network.sharing(n)) + tp_cost,
    }


def compressed_best(workload: Workload, network: Network, workers: int) -> str:
    """The compressed form faster on ``network`` at ``workers``, the compressor's own work
    (``workload.compressor_cost``) included; a tie goes to the all-gather. Without that
    work it is :func:`choose_form` with the link of :meth:`Network.link` and the sharing
    of :meth:`Network.sharing`."""
    times = _comm_times(workload, network, workers)
    return "allgather" if times["allgather"] <= times["two_phase"] else "two_phase"


def predict(workload: Workload, network: Network, workers: int) -> Prediction:
    """Step time and scaling efficiency of every form at ``workers``.

    ``step = compute + comm - min(overlap * comm, compute)``; ``efficiency = compute /
    step``: 1 at one worker, and the fraction of the ideal weak-scaling speedup ``n``
    reached at ``n`` (throughput ``n * efficiency`` workers' worth).
    """
    if not isinstance(workload, Workload):
        raise ValueError(f"Invalid workload: {workload!r} (must be a Workload)")
    if not isinstance(network, Network):
        raise ValueError(f"Invalid network: {network!r} (must be a Network)")
    t = workload.compute_time
    forms = {}
    for name, comm in _comm_times(workload, network, workers).items():
        step = t + comm - min(workload.overlap * comm, t)
        forms[name] = Estimate(comm, step, t / step)
    return Prediction(int(workers), t, forms, compressed_best(workload, network, workers))


def predict_many(workload: Workload, network: Network, workers: Iterable[int]) -> list[Prediction]:
    """:func:`predict` at each of ``workers``, in order."""
    return [predict(workload, network, n) for n in workers]


# ----------------------------------------------------------------------------- calibration


def fit_ring(samples: Iterable[Sequence[float]]) -> Link:
    """``(latency, bandwidth)`` of the ring formula fitted to measured all-reduce times.

    ``samples``: ``(workers, size_bytes, seconds)`` triples, ``workers >= 2``. The model
    ``t = a * 2(n-1) + (1/B) * 2(n-1)/n S`` is linear in ``a`` and ``1/B``; it is fitted by
    least squares on relative residuals (each row divided by its ``t``), so 4 kB and 16 MB
    timings weigh alike. A negative ``a`` (noise on a link whose latency is below the
    timer's reach) is refitted as ``a = 0``.

    Raises:
        ValueError: fewer than two samples, a sample out of range, sizes that do not
            vary, or data with no bandwidth term (``1/B <= 0``).
    """
    rows = [tuple(x) for x in samples]
    if len(rows) < 2:
        raise ValueError(f"Invalid samples: {len(rows)} given (fit_ring needs at least 2)")
    lat, vol, t = [], [], []
    for row in rows:
        if len(row) != 3:
            raise ValueError(f"Invalid sample: {row!r} (must be (workers, size_bytes, seconds))")
        n = checks.integer("workers", row[0], 2)
        s = checks.number("size_bytes", row[1])
        lat.append(2 * (n - 1))
        vol.append(2 * (n - 1) / n * s)
        t.append(checks.number("seconds", row[2]))
    x = np.column_stack([lat, vol]) / np.asarray(t)[:, None]
    ones = np.ones(len(t))
    if np.linalg.matrix_rank(x) < 2:
        raise ValueError("Invalid samples: latency and volume terms are proportional (vary the sizes)")
    (a, inv_b), *_ = np.linalg.lstsq(x, ones, rcond=None)
    if a < 0:
        a = 0.0
        inv_b = float(x[:, 1] @ ones / (x[:, 1] @ x[:, 1]))
    if inv_b <= 0:
        raise ValueError(
            f"Invalid samples: the fitted 1/bandwidth is {inv_b!r} (the times do not grow with size)"
        )
    return Link(float(a), float(1.0 / inv_b))
