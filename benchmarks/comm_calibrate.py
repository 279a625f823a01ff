"""Calibrate the scaling model's ring formula on this machine: gloo all-reduce timings.

    python benchmarks/comm_calibrate.py                         # 2 and 4 processes
    python benchmarks/comm_calibrate.py --workers 2 4 8 --repeats 30 --out my.json

Starts ``N`` CPU processes (``torch.multiprocessing.spawn``) that join a gloo group on
127.0.0.1, and for each size in ``--sizes`` (bytes of float32) times ``all_reduce``:
``--warmup`` untimed calls, then ``--repeats`` timed ones, each after a barrier; a call's
time is the slowest rank's, and the median over repeats is kept. It then fits ``a``
(latency) and ``B`` (bandwidth) of the ring formula ``2(n-1) a + 2(n-1)/n S/B`` to all
samples (:func:`largebatch.comm.scaling.fit_ring`: least squares on relative residuals),
and per worker count.

It also times ``all_gather`` of a ``S/c`` payload (``--compression``, default 40) for
each size, as the AdaComp all-gather exchange sends it, next to the model's prediction
``(n-1)(a + S/(c B))`` from the fit.

Everything, raw samples included, goes to ``--out`` (JSON; default
``docs/comm/calibration.json``) with the date, torch version and a machine summary.
``largebatch scaling --calibration FILE`` reads the fit. Processes share the machine's
cores (one torch thread each): on a small box with more processes than cores, the fit is
an effective latency and bandwidth of the oversubscribed host, not of a network.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from largebatch.comm.scaling import allgather, fit_ring, ring

DEFAULT_SIZES = [4096 * 2**i for i in range(0, 13)]  # 4 KiB .. 16 MiB, powers of two


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time(op, repeats: int, warmup: int) -> float:
    """Median over ``repeats`` of the slowest rank's time of ``op()``, after ``warmup``."""
    for _ in range(warmup):
        op()
    times = torch.empty(repeats, dtype=torch.float64)
    for r in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        op()
        times[r] = time.perf_counter() - t0
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return statistics.median(times.tolist())


def _worker(
    rank: int,
    world: int,
    port: int,
    sizes: list[int],
    repeats: int,
    warmup: int,
    compression: float,
    out: str,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        warm = torch.ones(max(sizes) // 4, dtype=torch.float32)
        for _ in range(max(warmup, 1)):  # connections and buffers, before any timing
            dist.all_reduce(warm)
        rows = []
        for size in sizes:
            x = torch.ones(max(1, size // 4), dtype=torch.float32)
            reduce_s = _time(lambda x=x: dist.all_reduce(x), repeats, warmup)
            payload = torch.ones(max(1, round(size / 4 / compression)), dtype=torch.float32)
            gathered = [torch.empty_like(payload) for _ in range(world)]
            gather_s = _time(lambda out=gathered, x=payload: dist.all_gather(out, x), repeats, warmup)
            rows.append(
                {
                    "workers": world,
                    "size_bytes": x.numel() * 4,
                    "allreduce_s": reduce_s,
                    "payload_bytes": payload.numel() * 4,
                    "allgather_s": gather_s,
                }
            )
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def measure(world: int, sizes: list[int], repeats: int, warmup: int, compression: float) -> list[dict]:
    """The timings of one group of ``world`` processes (one row a size)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.spawn(
            _worker,
            args=(world, _free_port(), sizes, repeats, warmup, compression, out),
            nprocs=world,
            join=True,
        )
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workers", type=int, nargs="+", default=[2, 4], help="process counts to measure (default: 2 4)"
    )
    parser.add_argument(
        "--sizes",
        type=int,
        nargs="+",
        default=DEFAULT_SIZES,
        help="all-reduce sizes in bytes (default: 4 KiB to 16 MiB, x2)",
    )
    parser.add_argument("--repeats", type=int, default=30, help="timed calls a size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls a size first")
    parser.add_argument(
        "--compression", type=float, default=40.0, help="c of the all-gather payload S/c (default 40)"
    )
    parser.add_argument("--out", default="docs/comm/calibration.json", help="JSON output")
    args = parser.parse_args(argv)
    if (
        min(args.workers) < 2
        or min(args.sizes) < 4
        or args.repeats < 1
        or args.warmup < 0
        or args.compression < 1
    ):
        parser.error("need --workers >= 2, --sizes >= 4, --repeats >= 1, --warmup >= 0, --compression >= 1")

    started = time.perf_counter()
    rows = []
    for world in args.workers:
        t0 = time.perf_counter()
        rows += measure(world, args.sizes, args.repeats, args.warmup, args.compression)
        print(f"{world} processes: {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    samples = [(r["workers"], r["size_bytes"], r["allreduce_s"]) for r in rows]
    fit = fit_ring(samples)
    per_world = {str(w): fit_ring([s for s in samples if s[0] == w])._asdict() for w in args.workers}
    for r in rows:
        n = r["workers"]
        r["ring_model_s"] = ring(r["size_bytes"], n, *fit)
        # the payload's own bytes: S/c rounded to whole float32 elements
        r["allgather_model_s"] = allgather(r["payload_bytes"], n, 1.0, *fit)

    print(
        f"{'n':>3} {'bytes':>10} {'all-reduce ms':>14} {'ring model':>11} "
        f"{'payload':>8} {'all-gather ms':>14} {'model':>8}"
    )
    for r in rows:
        print(
            f"{r['workers']:>3} {r['size_bytes']:>10} {1e3 * r['allreduce_s']:>14.3f} "
            f"{1e3 * r['ring_model_s']:>11.3f} {r['payload_bytes']:>8} "
            f"{1e3 * r['allgather_s']:>14.3f} {1e3 * r['allgather_model_s']:>8.3f}"
        )
    print(f"fit: latency {1e6 * fit.latency:.1f} us, bandwidth {fit.bandwidth / 1e9:.3f} GB/s")

    result = {
        "what": "gloo all_reduce on 127.0.0.1, median of repeats of the slowest rank's time; "
        "fit of t = 2(n-1) a + 2(n-1)/n S/B (largebatch.comm.scaling.fit_ring)",
        "command": " ".join(
            ["python benchmarks/comm_calibrate.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "machine": {
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "settings": {
            "workers": args.workers,
            "sizes": args.sizes,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "compression": args.compression,
        },
        "fit": {"latency_s": fit.latency, "bandwidth_Bps": fit.bandwidth},
        "fit_per_workers": {
            w: {"latency_s": f["latency"], "bandwidth_Bps": f["bandwidth"]} for w, f in per_world.items()
        },
        "samples": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
