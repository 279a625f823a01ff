"""What each gradient exchange costs in a latency-bandwidth (alpha-beta) model: a dense
all-reduce (flat ring, hierarchical) and AdaComp's two compressed exchanges (:func:`ring`,
:func:`hierarchical`, :func:`allgather`, :func:`two_phase`), the hardware they run on
(:class:`Link`, :class:`Network`), and the choice between the compressed forms
(:func:`choose_form`, which the DDP hook's ``form="auto"`` calls). The symbols, formulas
and crossovers: docs/communication.md, "The scaling model". Pure Python."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

from largebatch import checks

__all__ = [
    "COMPRESSED",
    "DEFAULT_LINK",
    "DDP_BUCKET_BYTES",
    "FORMS",
    "Link",
    "Network",
    "allgather",
    "allgather_crossover",
    "choose_form",
    "ddp_buckets",
    "hierarchical",
    "ring",
    "two_phase",
]

FORMS = ("ring", "hierarchical", "allgather", "two_phase")
COMPRESSED = ("allgather", "two_phase")
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb=25

# ----------------------------------------------------------------------------- validation


def _common(
    size_bytes: Any, workers: Any, latency: Any, bandwidth: Any, buckets: Any
) -> tuple[float, int, float, float, int]:
    return (
        checks.number("size_bytes", size_bytes),
        checks.integer("workers", workers, 1),
        checks.number("latency", latency, strict=False),
        checks.number("bandwidth", bandwidth),
        checks.integer("buckets", buckets, 1),
    )


# ----------------------------------------------------------------------------- hardware


class Link(NamedTuple):
    """One kind of link: ``latency`` (seconds a message, ``a``) and ``bandwidth`` (bytes a
    second, ``B``). A plain ``(latency, bandwidth)`` tuple works wherever a link is asked."""

    latency: float
    bandwidth: float


DEFAULT_LINK = Link(5e-6, 10e9)  # what the DDP hook's form="auto" plans for by default


@dataclasses.dataclass(frozen=True)
class Network:
    """A cluster of nodes of ``gpus_per_node`` GPUs: one link inside a node, one between.

    Attributes:
        intra_latency: ``a_i``, seconds a message between GPUs of one node.
        intra_bandwidth: ``B_i``, bytes a second between GPUs of one node (per GPU).
        inter_latency: ``a_e``, seconds a message between nodes.
        inter_bandwidth: ``B_e``, bytes a second in and out of one node (its network
            adapters together): the GPUs of a node share it.
        gpus_per_node: ``g``. A job of ``n <= g`` workers stays inside one node.
    """

    intra_latency: float
    intra_bandwidth: float
    inter_latency: float
    inter_bandwidth: float
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        for name in ("intra_latency", "inter_latency"):
            checks.number(name, getattr(self, name), strict=False)
        for name in ("intra_bandwidth", "inter_bandwidth"):
            checks.number(name, getattr(self, name))
        checks.integer("gpus_per_node", self.gpus_per_node, 1)

    @classmethod
    def flat(cls, latency: float, bandwidth: float) -> Network:
        """One link everywhere, one GPU a node: every form sees the same ``a`` and ``B``."""
        return cls(latency, bandwidth, latency, bandwidth, 1)

    @property
    def intra(self) -> Link:
        """The link inside a node."""
        return Link(self.intra_latency, self.intra_bandwidth)

    @property
    def inter(self) -> Link:
        """The link between nodes."""
        return Link(self.inter_latency, self.inter_bandwidth)

    def link(self, workers: int) -> Link:
        """The link a flat collective over ``workers`` GPUs is bound by: inside the node
        while ``workers <= gpus_per_node``, between nodes beyond."""
        return self.intra if checks.integer("workers", workers, 1) <= self.gpus_per_node else self.inter

    def sharing(self, workers: int) -> int:
        """Workers whose all-to-all traffic shares one link: ``g`` once the job spans nodes
        (they all leave through the node's adapter), 1 inside a node."""
        return self.gpus_per_node if checks.integer("workers", workers, 1) > self.gpus_per_node else 1


def ddp_buckets(size_bytes: float, bucket_bytes: float = DDP_BUCKET_BYTES) -> int:
    """Buckets DDP cuts ``size_bytes`` of gradients into: ``ceil(S / bucket_bytes)`` (its
    default ``bucket_cap_mb=25``; DDP's first bucket is smaller, ignored here)."""
    return max(
        1, math.ceil(checks.number("size_bytes", size_bytes) / checks.number("bucket_bytes", bucket_bytes))
    )


# ----------------------------------------------------------------------------- the exchanges


def ring(size_bytes: float, workers: int, latency: float, bandwidth: float, *, buckets: int = 1) -> float:
    """Seconds of a flat ring all-reduce: ``2(n-1) k a + 2(n-1)/n S/B``.

    A reduce-scatter then an all-gather, each ``n - 1`` steps of ``S/(k n)`` bytes a bucket.
    On a two-level network, a ring whose ranks are numbered node by node crosses each
    node's adapter once in each direction: pass the inter-node link when ``n > g``
    (:meth:`Network.link`).

    Args:
        size_bytes: ``S``.
        workers: ``n`` (1: no exchange, 0 seconds).
        latency: ``a`` in seconds.
        bandwidth: ``B`` in bytes a second.
        buckets: ``k``, each paying the latency terms.
    """
    s, n, a, b, k = _common(size_bytes, workers, latency, bandwidth, buckets)
    return 2 * (n - 1) * k * a + 2 * (n - 1) / n * s / b


def hierarchical(size_bytes: float, workers: int, network: Network, *, buckets: int = 1) -> float:
    """Seconds of a hierarchical (2-D) all-reduce over ``m = n/g`` nodes of ``g`` GPUs.

    1. reduce-scatter inside each node: ``(g-1) k a_i + (g-1)/g S/B_i``;
    2. ``g`` concurrent ring all-reduces between nodes, one per shard of ``S/g``, which
       share each node's link (``B_e / g`` each): ``2(m-1) k a_e + 2(m-1)/m S/B_e``;
    3. all-gather inside each node: ``(g-1) k a_i + (g-1)/g S/B_i``.

    This is the reduce-scatter form, as Horovod's hierarchical all-reduce arranges it; Jia
    et al. 2018 (arXiv 1807.11205) use a hierarchical all-reduce too, whose phases inside
    the node may instead be a reduce to and a broadcast from one GPU (then ``S``, not
    ``S/g``, crosses between nodes per ring; not modelled). Its bytes between nodes are
    about the flat ring's (``2(m-1)/m S`` against ``2(n-1)/n S``); its gain is latency:
    ``2(g-1) + 2(m-1)`` messages a bucket instead of ``2(n-1)``. With ``n <= g`` it is the
    ring inside the node.

    Args:
        size_bytes: ``S``.
        workers: ``n``.
        network: the two links and ``g``.
        buckets: ``k``.

    Raises:
        ValueError: ``n > g`` and ``n`` is not a multiple of ``g``.
    """
    if not isinstance(network, Network):
        raise ValueError(f"Invalid network: {network!r} (must be a Network)")
    s, n, _, _, k = _common(size_bytes, workers, 0.0, 1.0, buckets)
    g = network.gpus_per_node
    if n <= g:
        return ring(s, n, *network.intra, buckets=k)
    if n % g:
        raise ValueError(
            f"Invalid workers: {n} (the hierarchical all-reduce needs a multiple "
            f"of gpus_per_node={g} beyond one node)"
        )
    m = n // g
    a_i, b_i = network.intra
    a_e, b_e = network.inter
    return (
        2 * (g - 1) * k * a_i + 2 * (g - 1) / g * s / b_i + 2 * (m - 1) * k * a_e + 2 * (m - 1) / m * s / b_e
    )


def allgather(
    size_bytes: float, workers: int, compression: float, latency: float, bandwidth: float, *, buckets: int = 1
) -> float:
    """Seconds of the compressed all-gather exchange: ``(n-1) k a + (n-1) S/(c B)``.

    Every worker ring-all-gathers every other worker's compressed message of ``S/c``
    bytes: ``n - 1`` steps a bucket, ``n - 1`` messages received in all. Its cost grows
    linearly with ``n``.

    Args:
        size_bytes: ``S``, the dense fp32 bytes.
        workers: ``n``.
        compression: ``c >= 1``: a message is ``S/c`` bytes.
        latency: ``a``; bandwidth: ``B`` (as :func:`ring`).
        buckets: ``k``.
    """
    s, n, a, b, k = _common(size_bytes, workers, latency, bandwidth, buckets)
    c = checks.number("compression", compression, low=1.0, strict=False)
    return (n - 1) * k * a + (n - 1) * s / (c * b)


def two_phase(
    size_bytes: float,
    workers: int,
    compression: float,
    latency: float,
    bandwidth: float,
    *,
    buckets: int = 1,
    sharing: int = 1,
) -> float:
    """Seconds of the compressed two-phase exchange:
    ``2(n-1) k a + (n-1)/n (s+1) S/(c B)``.

    1. all-to-all: each worker sends shard ``j`` (``S/(c n)`` bytes) of its compressed
       message to worker ``j``: ``(n-1) k a + (n-1)/n s S/(c B)``, where ``s`` workers
       share one link (``sharing``: ``g`` when the job spans nodes, since an all-to-all's
       messages all leave through the node's adapter);
    2. each owner sums its shard and compresses it again; a ring all-gather of the
       re-compressed shards: ``(n-1) k a + (n-1)/n S/(c B)``.

    Assumption: the re-compressed shard is ``S/(c n)`` bytes too, i.e. the sum of ``n``
    compressed shards compresses as well as one (AdaComp's per-bin selection keeps roughly
    the same count per bin). The second compression's compute is not counted.
    With ``s = 1`` and ``a = 0`` this is exactly ``ring / c``.
    """
    s_, n, a, b, k = _common(size_bytes, workers, latency, bandwidth, buckets)
    c = checks.number("compression", compression, low=1.0, strict=False)
    share = checks.integer("sharing", sharing, 1)
    return 2 * (n - 1) * k * a + (n - 1) / n * (share + 1) * s_ / (c * b)


def choose_form(
    workers: int,
    size_bytes: float,
    compression: float = 40.0,
    latency: float = DEFAULT_LINK.latency,
    bandwidth: float = DEFAULT_LINK.bandwidth,
    *,
    buckets: int = 1,
    sharing: int = 1,
) -> str:
    """``"allgather"`` or ``"two_phase"``: the compressed exchange the model predicts
    faster for ``n`` workers, ``S`` dense bytes, rate ``c`` and one link ``(a, B)``.

    All-gather ``(n-1)(k a + S/(c B))`` against two-phase ``(n-1)(2 k a + (s+1) S/(c n B))``;
    a tie goes to the all-gather (one collective instead of two). Two workers always get
    the all-gather (the same bytes, half the messages, with ``s = 1``). The switch is at
    :func:`allgather_crossover` with ``against="two_phase"``.

    >>> choose_form(4, 4_000_000, 40.0, 5e-6, 10e9)   # P = S/c = 100 kB: the tie
    'allgather'
    >>> choose_form(64, 4_000_000, 40.0, 5e-6, 10e9)
    'two_phase'
    """
    ag = allgather(size_bytes, workers, compression, latency, bandwidth, buckets=buckets)
    tp = two_phase(size_bytes, workers, compression, latency, bandwidth, buckets=buckets, sharing=sharing)
    return "allgather" if ag <= tp else "two_phase"


def allgather_crossover(
    compression: float,
    *,
    against: str = "ring",
    size_bytes: float = 1.0,
    latency: float = 0.0,
    bandwidth: float = 1.0,
    buckets: int = 1,
    sharing: int = 1,
) -> float:
    """The worker count ``n*`` at which the all-gather form costs as much as ``against``:
    it is faster for ``n < n*`` and slower for ``n > n*`` (``inf``: never slower).

    - ``against="ring"``: ``(n-1)(k a + S/(cB)) = 2(n-1)(k a + S/(nB))`` gives
      ``n* = 2c / (1 - c k a B / S)``; with negligible latency ``n* = 2c``.
    - ``against="two_phase"``: ``(n-1)(k a + S/(cB)) = (n-1)(2 k a + (s+1) S/(c n B))``
      gives ``n* = (s+1) / (1 - c k a B / S)``; with negligible latency ``n* = s + 1``.

    ``inf`` when ``c k a >= S/B``: a compressed message takes no longer to send than the
    latency the all-gather saves.
    """
    c = checks.number("compression", compression, low=1.0, strict=False)
    s, _, a, b, k = _common(size_bytes, 1, latency, bandwidth, buckets)
    share = checks.integer("sharing", sharing, 1)
    if against not in ("ring", "two_phase"):
        raise ValueError(f"Invalid against: {against!r} (must be 'ring' or 'two_phase')")
    margin = 1.0 - c * k * a * b / s
    if margin <= 0:
        return math.inf
    return (2 * c if against == "ring" else share + 1) / margin
