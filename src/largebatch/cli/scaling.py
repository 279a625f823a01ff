"""``largebatch scaling``: the step time and scaling efficiency :mod:`largebatch.comm.scaling`
predicts for dense and compressed all-reduce, as a table, JSON or a plot (docs/design.md §6).
A bad value is one line, ``largebatch scaling: ...``, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from largebatch.comm import published
from largebatch.comm import scaling as model
from largebatch.outputs import CommandError, atomic_write, figure, require, writable_folder

__all__ = ["add_arguments", "default_workers", "main"]

_GBIT = 1e9 / 8  # bytes a second in one Gbit/s
DEFAULTS = {
    "compute_ms": 256.0,
    "gpus_per_node": 8,
    "intra_gbps": 160.0,
    "inter_gbps": 100.0,
    "intra_latency_us": 5.0,
    "inter_latency_us": 10.0,
    "compression": 40.0,
    "overlap": 0.0,
}
# The AdaComp hook's own work, ns a gradient byte (all-gather, two-phase form): the fused
# hook (the default on CUDA) on one H200, 2026-11-28, benchmarks/comm_hook.py --device cuda
# on ResNet-50's shapes, its iteration less DDP's all-reduce's (docs/benchmarks.md).
COMPRESSOR_NS_PER_BYTE = (0.15, 0.23)
_NETWORK_FLAGS = ("intra_gbps", "inter_gbps", "intra_latency_us", "inter_latency_us")
_LABELS = {
    "ring": "ring",
    "hierarchical": "hierarchical",
    "allgather": "all-gather",
    "two_phase": "two-phase",
}


def _fail(message: str) -> CommandError:
    return CommandError("scaling", message)


def default_workers(gpus_per_node: int, top: int = 1024) -> list[int]:
    """Powers of two below one node, then whole nodes doubling up to ``top``:
    ``1, 2, 4, 8, ..., 1024`` for 8 GPUs a node; ``1, 2, 4, 6, 12, ..., 768`` for 6."""
    below = [2**i for i in range(gpus_per_node.bit_length()) if 2**i < gpus_per_node]
    nodes = [
        gpus_per_node * 2**j
        for j in range(top.bit_length() + 1)
        if gpus_per_node * 2**j <= max(top, gpus_per_node)
    ]
    return below + nodes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``largebatch scaling`` flags."""
    add = parser.add_argument
    add(
        "--model",
        choices=sorted(model.MODELS),
        default=None,
        help="parameter count preset (default resnet50: 25.6e6)",
    )
    add(
        "--params",
        type=float,
        default=None,
        help="parameters (fp32 gradients: 4 bytes each), e.g. 25.6e6; instead of --model",
    )
    add(
        "--compute-ms",
        type=float,
        default=None,
        help="forward+backward ms a step on one worker (default 256: ResNet-50 at 32 images a "
        "P100, the step time of Goyal et al. 2017's hour)",
    )
    add(
        "--workers",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="worker counts (default: 1, 2, 4 ... within a node, then whole nodes up to 1024)",
    )
    add("--gpus-per-node", type=int, default=None, help="GPUs a node (default 8)")
    add(
        "--intra-gbps",
        type=float,
        default=None,
        help="Gbit/s between GPUs of a node, per GPU (default 160: 20 GB/s)",
    )
    add(
        "--inter-gbps",
        type=float,
        default=None,
        help="Gbit/s in and out of a node, shared by its GPUs (default 100)",
    )
    add("--intra-latency-us", type=float, default=None, help="us a message in a node (default 5)")
    add("--inter-latency-us", type=float, default=None, help="us a message between nodes (default 10)")
    add(
        "--buckets",
        type=int,
        default=None,
        help="gradient buckets, each paying the latencies (default: DDP's, 25 MiB each)",
    )
    add(
        "--compression",
        type=float,
        default=None,
        help="compression rate c of the compressed forms (default 40)",
    )
    add(
        "--compressor-ns-per-byte",
        default=None,
        metavar="NS[,NS]",
        help="the compressor's own work, ns a gradient byte, for the all-gather and the two-phase "
        "form (one value: both); 0 counts bytes only (default %s, one H200)"
        % ",".join(f"{x:g}" for x in COMPRESSOR_NS_PER_BYTE),
    )
    add(
        "--overlap",
        type=float,
        default=None,
        help="fraction of the exchange hidden behind backward, 0..1 (default 0)",
    )
    add(
        "--calibration",
        default=None,
        metavar="FILE",
        help="one measured link's latency (s) and bandwidth (bytes/s) for both links, instead "
        'of the four network flags: a JSON file {"fit": {"latency_s": S, "bandwidth_Bps": B}}, '
        "as benchmarks/comm_calibrate.py in the source repository writes from timed all-reduces",
    )
    add(
        "--published",
        action="store_true",
        help="print the published scaling points next to the model's prediction instead",
    )
    add("--plot", default=None, metavar="FILE.png", help="draw efficiency against workers")
    add(
        "--json",
        nargs="?",
        const="-",
        default=None,
        metavar="FILE",
        help="print JSON instead of the table (--json), or also write it to FILE",
    )


# ----------------------------------------------------------------------------- checking


def _positive(
    args: argparse.Namespace,
    flag: str,
    *,
    allow_zero: bool = False,
    at_least: float | None = None,
    at_most: float | None = None,
) -> None:
    value = getattr(args, flag)
    if value is None:
        return
    name = "--" + flag.replace("_", "-")
    if at_least is not None:
        ok, rule = math.isfinite(value) and value >= at_least, f"a finite number >= {at_least:g}"
    elif allow_zero:
        ok, rule = math.isfinite(value) and value >= 0, "a finite number >= 0"
    else:
        ok, rule = math.isfinite(value) and value > 0, "a finite number > 0"
    if at_most is not None:
        ok, rule = ok and value <= at_most, f"between 0 and {at_most:g}"
    if not ok:
        raise _fail(f"invalid {name} {value} (must be {rule})")


def _read_calibration(path: str) -> model.Link:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise _fail(f"cannot read --calibration {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _fail(f"--calibration {path} is not JSON: {err}") from None
    fit: Any = data.get("fit") if isinstance(data, dict) else None  # None: a TypeError below
    try:
        link = model.Link(float(fit["latency_s"]), float(fit["bandwidth_Bps"]))
        model.Network.flat(*link)
    except (TypeError, KeyError, ValueError):
        raise _fail(
            f"--calibration {path} has no valid fit (a 'fit' with latency_s >= 0 and bandwidth_Bps > 0)"
        ) from None
    return link


def _compressor_cost(text: str | None) -> tuple[float, float]:
    """``--compressor-ns-per-byte`` as seconds a byte for the two compressed forms."""
    if text is None:
        return (1e-9 * COMPRESSOR_NS_PER_BYTE[0], 1e-9 * COMPRESSOR_NS_PER_BYTE[1])
    parts = text.split(",")
    try:
        values = [float(x) for x in parts]
    except ValueError:
        values = []
    if (
        len(parts) not in (1, 2)
        or len(values) != len(parts)
        or not all(math.isfinite(v) and v >= 0 for v in values)
    ):
        raise _fail(
            f"invalid --compressor-ns-per-byte {text} (one or two comma-separated finite numbers >= 0)"
        )
    ag, tp = values * 2 if len(values) == 1 else values
    return (1e-9 * ag, 1e-9 * tp)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The checked inputs: workload, network, workers, and how they were chosen."""
    for flag in ("params", "compute_ms", "intra_gbps", "inter_gbps"):
        _positive(args, flag)
    for flag in ("intra_latency_us", "inter_latency_us"):
        _positive(args, flag, allow_zero=True)
    _positive(args, "compression", at_least=1)
    _positive(args, "overlap", allow_zero=True, at_most=1)
    for flag in ("gpus_per_node", "buckets"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise _fail(f"invalid --{flag.replace('_', '-')} {value} (must be >= 1)")
    for n in args.workers or ():
        if n < 1:
            raise _fail(f"invalid --workers {n} (must be >= 1)")
    if args.model is not None and args.params is not None:
        raise _fail("give --model or --params, not both")
    compressor_cost = _compressor_cost(args.compressor_ns_per_byte)
    opts: dict[str, Any] = {
        k: (v if getattr(args, k) is None else getattr(args, k)) for k, v in DEFAULTS.items()
    }
    name = args.model or ("resnet50" if args.params is None else None)
    params = model.MODELS[name][0] if name else args.params
    size = 4 * params
    if not math.isfinite(size):
        raise _fail(f"invalid --params {params:g} (its fp32 gradients, 4 bytes each, overflow a float)")
    buckets = args.buckets or model.ddp_buckets(size)
    g = opts["gpus_per_node"]
    if args.calibration is not None:
        given = [f"--{f.replace('_', '-')}" for f in _NETWORK_FLAGS if getattr(args, f) is not None]
        if given:
            raise _fail(f"--calibration sets the links: drop {', '.join(given)}")
        link = _read_calibration(args.calibration)
        network = model.Network(link.latency, link.bandwidth, link.latency, link.bandwidth, g)
    else:
        network = model.Network(
            1e-6 * opts["intra_latency_us"],
            _GBIT * opts["intra_gbps"],
            1e-6 * opts["inter_latency_us"],
            _GBIT * opts["inter_gbps"],
            g,
        )
    workers = args.workers or default_workers(g)
    for n in workers:
        if n > g and n % g:
            raise _fail(
                f"invalid --workers {n}: beyond one node the hierarchical all-reduce "
                f"needs a multiple of --gpus-per-node {g}"
            )
    workload = model.Workload(
        size,
        1e-3 * opts["compute_ms"],
        buckets=buckets,
        compression=opts["compression"],
        overlap=opts["overlap"],
        compressor_cost=compressor_cost,
    )
    return {
        "model": name or "custom",
        "params": params,
        "workload": workload,
        "network": network,
        "workers": workers,
        "calibration": args.calibration,
    }


# ----------------------------------------------------------------------------- output


def _header(s: dict[str, Any]) -> list[str]:
    w, net = s["workload"], s["network"]
    source = f"fit of {s['calibration']}" if s["calibration"] else "flags"
    return [
        f"model {s['model']}: {s['params']:.4g} params, {w.size_bytes / 1e6:.1f} MB of fp32 "
        f"gradients in {w.buckets} bucket(s); compute {1e3 * w.compute_time:g} ms a step a "
        f"worker; overlap {w.overlap:g}",
        f"network ({source}): {net.gpus_per_node} GPUs a node; inside "
        f"{net.intra_bandwidth / 1e9:.3g} GB/s, {1e6 * net.intra_latency:.3g} us; between "
        f"nodes {net.inter_bandwidth / 1e9:.3g} GB/s, {1e6 * net.inter_latency:.3g} us; "
        f"compression c = {w.compression:g}",
        f"compressor: {1e9 * w.compressor_cost[0]:g} / {1e9 * w.compressor_cost[1]:g} ns a gradient "
        f"byte (all-gather / two-phase), {1e3 * w.size_bytes * w.compressor_cost[0]:.3g} / "
        f"{1e3 * w.size_bytes * w.compressor_cost[1]:.3g} ms a step beyond one worker, in their "
        "columns",
    ]


def _crossovers(s: dict[str, Any]) -> dict[str, float]:
    """The all-gather form's break-even worker counts on the link between nodes."""
    w, net = s["workload"], s["network"]
    kw = {
        "size_bytes": w.size_bytes,
        "latency": net.inter_latency,
        "bandwidth": net.inter_bandwidth,
        "buckets": w.buckets,
    }
    return {
        "allgather_vs_ring": model.allgather_crossover(w.compression, **kw),
        "allgather_vs_ring_no_latency": 2 * w.compression,
        "allgather_vs_two_phase": model.allgather_crossover(
            w.compression, against="two_phase", sharing=net.gpus_per_node, **kw
        ),
    }


def _table(s: dict[str, Any], predictions: list[model.Prediction]) -> str:
    c = s["workload"].compression
    heads = ["ring", "hierarchical", f"all-gather c={c:g}", f"two-phase c={c:g}"]
    lines = _header(s) + [""]
    lines.append(f"{'workers':>7}  " + "  ".join(f"{h:>20}" for h in heads) + "  compressed pick")
    lines.append(f"{'':>7}  " + "  ".join(f"{'step ms':>10}{'eff %':>10}" for _ in heads))
    for p in predictions:
        cells = "  ".join(
            f"{1e3 * p.forms[f].step_time:>10.1f}{100 * p.forms[f].efficiency:>10.1f}" for f in model.FORMS
        )
        lines.append(f"{p.workers:>7}  {cells}  {_LABELS[p.choice]}")
    x = _crossovers(s)
    lines += [
        "",
        f"all-gather beats the dense ring below n* = {x['allgather_vs_ring']:.1f} "
        f"workers on the link between nodes (2c = {x['allgather_vs_ring_no_latency']:g} "
        "with no latency); two-phase beats all-gather above n* = "
        f"{x['allgather_vs_two_phase']:.1f} there (bytes and latencies only)",
    ]
    return "\n".join(lines)


def _published_text() -> str:
    lines = [
        f"{'point':<10} {'GPUs':>5} {'reported':>9} {'baseline':>9} {'compute ms':>10}  "
        + "  ".join(f"{_LABELS[f]:>12}" for f in model.FORMS)
    ]
    for r in published.published_table():
        rep = "-" if r["efficiency"] is None else f"{100 * r['efficiency']:.0f}%"
        base = r["baseline"] or "1*"
        lines.append(
            f"{r['name']:<10} {r['gpus']:>5} {rep:>9} {base!s:>9} "
            f"{1e3 * r['compute_time']:>10.1f}  "
            + "  ".join(f"{100 * r['model'][f]:>11.1f}%" for f in model.FORMS)
        )
    lines += [
        "",
        "reported: the paper's scaling efficiency (- where it reports none); the model's "
        "columns are relative to the baseline GPU count (* none stated: one worker)",
        "",
    ]
    for r in published.published_table():
        lines += [
            f"{r['name']}: {r['paper']}",
            f"  reported: {r['reported']}",
            f"  assumed: {r['assumptions']}",
        ]
    return "\n".join(lines)


def _draw(path: Path, s: dict[str, Any], predictions: list[model.Prediction]) -> None:
    c = s["workload"].compression
    styles = {"ring": "-", "hierarchical": "--", "allgather": ":", "two_phase": "-."}
    with figure(path, figsize=(8, 5)) as (_, ax):
        ns = [p.workers for p in predictions]
        for form in model.FORMS:
            label = _LABELS[form] + (f" (c={c:g})" if form in ("allgather", "two_phase") else "")
            ax.plot(
                ns,
                [100 * p.forms[form].efficiency for p in predictions],
                linestyle=styles[form],
                marker=".",
                label=label,
            )
        markers = iter("osD^v")
        for r in published.published_table():
            m = next(markers)
            if r["efficiency"] is not None:
                ax.plot(
                    [r["gpus"]],
                    [100 * r["efficiency"]],
                    marker=m,
                    color="black",
                    linestyle="none",
                    label=f"{r['name']}: reported",
                )
            ax.plot(
                [r["gpus"]],
                [100 * r["model"]["hierarchical"]],
                marker=m,
                markerfacecolor="none",
                color="gray",
                linestyle="none",
                label=f"{r['name']}: model, its hardware (hierarchical)",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers (GPUs)")
        ax.set_ylabel("scaling efficiency (%)")
        net = s["network"]
        ax.set_title(
            f"{s['model']}, {1e3 * s['workload'].compute_time:g} ms compute a step; "
            f"{net.gpus_per_node} GPUs a node, {8 * net.inter_bandwidth / 1e9:.3g} "
            f"Gbit/s and {1e6 * net.inter_latency:.3g} us between nodes",
            fontsize=10,
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="lower left")


def main(args: argparse.Namespace) -> int:
    """Run ``largebatch scaling``; 0 on success, a :class:`CommandError` on bad input."""
    if args.published:
        print(_published_text())
        return 0
    try:
        s = _settings(args)
        predictions = model.predict_many(s["workload"], s["network"], s["workers"])
    except ValueError as err:  # the model's own checks, worded with its parameter names
        raise _fail(str(err)) from None
    data = {
        "model": s["model"],
        "params": s["params"],
        "workload": {
            k: getattr(s["workload"], k)
            for k in ("size_bytes", "compute_time", "buckets", "compression", "overlap", "compressor_cost")
        },
        "network": {
            k: getattr(s["network"], k)
            for k in ("intra_latency", "intra_bandwidth", "inter_latency", "inter_bandwidth", "gpus_per_node")
        },
        "calibration": s["calibration"],
        "crossovers": {k: None if math.isinf(v) else v for k, v in _crossovers(s).items()},
        "rows": [p.to_dict() for p in predictions],
    }
    wrote = []
    if args.plot is not None:
        require("scaling", ("matplotlib",))
        plot = Path(args.plot)
        writable_folder(plot.parent, "scaling", "--plot")
        try:
            _draw(plot, s, predictions)
        except OSError as err:
            raise _fail(f"cannot write --plot {plot}: {err.strerror or err}") from None
        wrote.append(plot)
    text = json.dumps(data, indent=2, allow_nan=False) + "\n"
    if args.json == "-":
        print(text, end="")
        if wrote:  # stdout holds the JSON alone
            print(f"largebatch scaling: wrote {', '.join(map(str, wrote))}", file=sys.stderr)
        return 0
    if args.json is not None:
        out = Path(args.json)
        writable_folder(out.parent, "scaling", "--json")
        atomic_write(out, text)
        wrote.append(out)
    print(_table(s, predictions))
    if wrote:
        print(f"\nwrote {', '.join(map(str, wrote))}")
    return 0
