"""Published scaling results of data-parallel ResNet-50 training (:data:`PUBLISHED`), each
with the hardware that the scaling model (:mod:`largebatch.comm.scaling`) assumes for it,
and the model's efficiencies set against them (:func:`published_table`). Importable from
:mod:`largebatch.comm.scaling` too."""

from __future__ import annotations

import dataclasses
from typing import Any

from largebatch.comm.scaling import FORMS, MODELS, Network, Prediction, Workload, predict

__all__ = ["PUBLISHED", "PublishedPoint", "published_table"]

_GBIT = 1e9 / 8  # bytes a second in one Gbit/s
_IMAGENET = 1_281_167
_RESNET50 = 4 * MODELS["resnet50"][0]


def _step_time(minutes: float, epochs: int, batch: int) -> float:
    """Wall-clock seconds a step, from a run's total time: ``60 m / (epochs * N / batch)``."""
    return 60 * minutes / (epochs * _IMAGENET / batch)


@dataclasses.dataclass(frozen=True)
class PublishedPoint:
    """A published scaling result and the hardware the model assumes for it.

    Attributes:
        name: short key.
        paper: authors, year, arXiv id.
        reported: what the paper (or its authors' announcement) reports, in words.
        gpus: ``n`` of the result.
        efficiency: the reported scaling efficiency, ``None`` where none is reported.
        baseline: the GPU count ``efficiency`` is relative to (``None``: not stated, or 1).
        network: the assumed :class:`Network`.
        workload: the assumed :class:`Workload` (ResNet-50 gradients, compute time).
        assumptions: where each assumed number comes from.
    """

    name: str
    paper: str
    reported: str
    gpus: int
    efficiency: float | None
    baseline: int | None
    network: Network
    workload: Workload
    assumptions: str

    def prediction(self) -> Prediction:
        """The model at :attr:`gpus`."""
        return predict(self.workload, self.network, self.gpus)

    def model_efficiency(self, form: str) -> float:
        """The model's efficiency of ``form`` at :attr:`gpus`, relative to :attr:`baseline`
        GPUs when the paper states one (as the reported number is), else to one."""
        eff = self.prediction().forms[form].efficiency
        if self.baseline:
            eff /= predict(self.workload, self.network, self.baseline).forms[form].efficiency
        return eff


# Goyal et al.: 90 epochs of 8,192 images a step in one hour on 256 P100: 0.256 s a step.
_P100_STEP = _step_time(60, 90, 8192)
_P100_NOTE = (
    "compute: 0.256 s a step for 32 images a P100, the wall-clock a step implied by Goyal et "
    "al.'s abstract (ResNet-50, 90 epochs at 8,192 a step in one hour on 256 P100); it "
    "includes their exchange, evaluation and data loading, so it overstates compute and "
    "the model's efficiency errs high; ResNet-50: 25.6M fp32 gradients (102.4 MB); "
    "4 buckets (DDP's 25 MiB); no overlap with backward"
)

PUBLISHED: tuple[PublishedPoint, ...] = (
    PublishedPoint(
        name="ddl-256",
        paper="Cho et al. 2017, PowerAI DDL, arXiv 1708.02188",
        reported=(
            "95% scaling efficiency on 256 P100 GPUs (64 IBM S822LC servers of 4) with "
            "Caffe, as IBM announced it (Aug 2017); the abstract says only 'better "
            "communication overhead for Resnet-50' than Goyal et al.; baseline not "
            "stated"
        ),
        gpus=256,
        efficiency=0.95,
        baseline=None,
        network=Network(5e-6, 20e9, 5e-6, 100 * _GBIT, 4),
        workload=Workload(_RESNET50, _P100_STEP, buckets=4),
        assumptions=(
            "network assumed, not from the paper: 100 Gbit/s InfiniBand a server, "
            "5 us; NVLink 20 GB/s, 5 us inside; " + _P100_NOTE
        ),
    ),
    PublishedPoint(
        name="goyal-256",
        paper="Goyal et al. 2017, arXiv 1706.02677",
        reported=(
            "'~90% scaling efficiency when moving from 8 to 256 GPUs' (abstract): "
            "ResNet-50, 8,192 a step, 256 P100 in 32 servers of 8, 50 Gbit Ethernet"
        ),
        gpus=256,
        efficiency=0.90,
        baseline=8,
        network=Network(5e-6, 20e9, 10e-6, 50 * _GBIT, 8),
        workload=Workload(_RESNET50, _P100_STEP, buckets=4),
        assumptions=(
            "50 Gbit/s Ethernet a server (the paper's); 10 us latency assumed; "
            "NVLink 20 GB/s, 5 us inside assumed; " + _P100_NOTE
        ),
    ),
    PublishedPoint(
        name="jia-1024",
        paper="Jia et al. 2018, arXiv 1807.11205",
        reported=(
            "ResNet-50, 64K batch, 1024 Tesla P40: 8.7 minutes; no scaling efficiency "
            "reported (the 8.7 is not in the abstract; not re-checked against the "
            "paper's tables here)"
        ),
        gpus=1024,
        efficiency=None,
        baseline=None,
        network=Network(5e-6, 10e9, 5e-6, 100 * _GBIT, 8),
        workload=Workload(_RESNET50, _step_time(8.7, 90, 65536), buckets=4),
        assumptions=(
            "network assumed, not from the paper: 100 Gbit/s InfiniBand a node of 8, "
            "5 us; PCIe 10 GB/s, 5 us inside; compute: 0.297 s a step for 64 images "
            "a P40, the wall-clock a step of the 8.7 minutes (90 epochs assumed, of "
            "65,536 a step), an overstatement as for the P100 points; fp32 "
            "gradients (the paper's fp16 exchange, if any, would halve S); 4 "
            "buckets; no overlap"
        ),
    ),
    PublishedPoint(
        name="jia-2048",
        paper="Jia et al. 2018, arXiv 1807.11205",
        reported=(
            "ResNet-50, 64K batch, 2048 Tesla P40: 6.6 minutes to 75.8% top-1 "
            "(abstract); no scaling efficiency reported"
        ),
        gpus=2048,
        efficiency=None,
        baseline=None,
        network=Network(5e-6, 10e9, 5e-6, 100 * _GBIT, 8),
        workload=Workload(_RESNET50, _step_time(6.6, 90, 65536), buckets=4),
        assumptions=(
            "as jia-1024; compute: 0.225 s a step for 32 images a P40, the "
            "wall-clock a step of the 6.6 minutes"
        ),
    ),
)


def published_table() -> list[dict[str, Any]]:
    """One row a :data:`PUBLISHED` point: the reported efficiency (``None`` where none is
    reported) and the model's, for every form, relative to the point's baseline."""
    rows = []
    for p in PUBLISHED:
        pred = p.prediction()
        rows.append(
            {
                "name": p.name,
                "paper": p.paper,
                "gpus": p.gpus,
                "reported": p.reported,
                "efficiency": p.efficiency,
                "baseline": p.baseline,
                "compute_time": p.workload.compute_time,
                "choice": pred.choice,
                "model": {form: p.model_efficiency(form) for form in FORMS},
                "assumptions": p.assumptions,
            }
        )
    return rows
