"""Where a jitted JAX optimizer step spends its time: kernels per step and per-kernel times.

    python benchmarks/xla_profile.py                          # ResNet-50 shapes, CPU
    python benchmarks/xla_profile.py --device cuda --json out.json

For optax's ``lars``/``lamb``, ours (unfused and ``fused=True``), and LARS on a packed
buffer (benchmarks/jax_packed.py), each jitted as ``optimizer_step.py`` times them
(params and state donated), it prints:
the instructions of the compiled program's entry computation that launch work (fusions,
custom calls, copies, reductions: on a GPU each is a kernel, or a few), the kernels a
step ran under ``jax.profiler`` (``/device:GPU`` planes' stream lines; on the CPU the
XLA threads' operations), their summed time, the step's wall time, and the kernels that
took the most time. ``make gpu-check`` runs it on ResNet-50 shapes: where optax's step
and ours differ, and what each kernel costs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import optimizer_step as bench

# Entry-computation instructions that launch no work of their own.
_FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all", "opt-barrier"}
# Profiler events on the CPU that are the runtime's, not an operation's.
_CPU_RUNTIME = ("ThreadpoolListener", "ThunkExecutor", "end: ")


def entry_ops(hlo_text: str) -> collections.Counter:
    """The instructions of the compiled program's ENTRY computation, by opcode, less those
    that launch nothing (parameters, tuples, bitcasts, constants)."""
    ops: collections.Counter = collections.Counter()
    inside = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY "):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            m = re.match(r"\s*(?:ROOT )?\S+ = .*? ([a-z][a-z0-9-]*)\(", line)
            if m and m.group(1) not in _FREE:
                ops[m.group(1)] += 1
    return ops


def device_events(xplane: str, gpu: bool, seen: list[str]) -> list[tuple[str, float]]:
    """(name, duration in ns) of every kernel the trace recorded: on a GPU the events of
    the ``/device:GPU`` planes' stream lines (every line of those planes where none is
    named ``Stream``), on the CPU the XLA threads' operations. ``seen`` gets each plane's
    and line's name, for the report."""
    from jax.profiler import ProfileData

    events = []
    for plane in ProfileData.from_file(xplane).planes:
        seen.append(f"{plane.name}: " + ", ".join(sorted({ln.name for ln in plane.lines}))[:300])
        if gpu and plane.name.startswith("/device:GPU"):
            lines = [ln for ln in plane.lines if ln.name.startswith("Stream")] or list(plane.lines)
        elif not gpu and plane.name == "/host:CPU":
            lines = [ln for ln in plane.lines if ln.name.startswith("tf_XLA")]
        else:
            continue
        for line in lines:
            events += [(e.name, e.duration_ns) for e in line.events if not e.name.startswith(_CPU_RUNTIME)]
    return events


def _transformation(name: str) -> Any:
    """The program's optax transformation (a variant, "... (plain norms)" or "... (one
    pass)", is its program's with other norms: :func:`_norms_of`)."""
    import optax
    from jax_packed import packed_lars

    from largebatch import jax as lb

    lars = dict(momentum=bench.MOMENTUM, weight_decay=bench.LARS_WD)
    return {
        "optax lars": lambda: optax.lars(bench.LR, **lars),
        "ours lars": lambda: lb.lars(bench.LR, **lars, fused=False),
        "lars packed": lambda: packed_lars(bench.LR, **lars),
        "ours lars fused": lambda: lb.lars(bench.LR, **lars, fused=True),
        "optax lamb": lambda: optax.lamb(bench.LR, weight_decay=bench.LAMB_WD),
        "ours lamb": lambda: lb.lamb(bench.LR, weight_decay=bench.LAMB_WD, fused=False),
        "ours lamb fused": lambda: lb.lamb(bench.LR, weight_decay=bench.LAMB_WD, fused=True),
    }[name.split(" (")[0]]()


PROGRAMS = [
    "optax lars",
    "ours lars",
    "ours lars (plain norms)",
    "ours lars (one pass)",
    "lars packed",
    "optax lamb",
    "ours lamb",
    "ours lamb (one pass)",
    "ours lars fused",
    "ours lamb fused",
]


@contextlib.contextmanager
def _norms_of(name: str) -> Iterator[None]:
    """For "... (plain norms)": each norm the square root of its plain sum of squares,
    without the ``lax.cond`` to the scaled pass (what ours would cost if that pass cost
    nothing; not a correct norm where the sum overflows). For "... (one pass)": the
    norms of ``jax_norms.one_pass_norms``. Other programs run as they are."""
    from jax_norms import one_pass_norms

    from largebatch.lars.jax import _lamb, _lars, norms

    if name.endswith("(plain norms)"):
        patches = [(norms, "_from_squares", _plain_from_squares)]
    elif name.endswith("(one pass)"):
        patches = [(_lars, "leaf_norms", one_pass_norms), (_lamb, "leaf_norms", one_pass_norms)]
    else:
        patches = []
    kept = [(module, attr, getattr(module, attr)) for module, attr, _ in patches]
    for module, attr, value in patches:
        setattr(module, attr, value)
    try:
        yield
    finally:
        for module, attr, value in kept:
            setattr(module, attr, value)


def _plain_from_squares(squares: Any, x: Any, axis_name: Any) -> Any:
    import jax.numpy as jnp

    return jnp.sqrt(squares)


def profile(name: str, shapes: bench.Shapes, device: str, steps: int, top: int) -> dict:
    """One program's entry instructions, kernels per step, their time, the step's wall time."""
    with _norms_of(name):
        return _profile(name, shapes, device, steps, top)


def _profile(name: str, shapes: bench.Shapes, device: str, steps: int, top: int) -> dict:
    import jax

    params, gs = bench.jax_arrays(shapes, device, 0, "fp32")
    tx = _transformation(name)
    jitted = bench.jitted_update(tx)
    state = tx.init(params)
    ops = entry_ops(jitted.lower(params, state, gs).compile().as_text())
    carry = (params, state)
    for _ in range(3):
        carry = jitted(*carry, gs)
    jax.block_until_ready(carry)
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        carry = jitted(*carry, gs)
        jax.block_until_ready(carry)
        walls.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                carry = jitted(*carry, gs)
            jax.block_until_ready(carry)
        xplane = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        seen: list[str] = []
        events = device_events(xplane[0], device.startswith("cuda"), seen) if xplane else []
    by_kernel: dict[str, list[float]] = collections.defaultdict(list)
    for kernel, ns in events:
        by_kernel[kernel].append(ns)
    heaviest = sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
    return dict(
        program=name,
        entry_ops=sum(ops.values()),
        entry_by_op=dict(ops.most_common()),
        kernels_per_step=len(events) / steps,
        kernel_ms_per_step=sum(ns for _, ns in events) / steps / 1e6,
        wall_ms=statistics.median(walls) * 1e3,
        trace_lines=seen,
        heaviest=[
            dict(kernel=k[:80], per_step=len(v) / steps, ms_per_step=sum(v) / steps / 1e6)
            for k, v in heaviest
        ],
    )


def format_report(res: dict) -> str:
    lines = [
        f"{res['model']}: {res['tensors']} tensors on {res['device']} ({res['device_name']}), jax "
        f"{res['jax']}; {res['steps']} profiled steps",
        "",
        "| program | entry instructions | kernels/step | kernel ms/step | wall ms/step |",
        "|---|--:|--:|--:|--:|",
    ]
    for r in res["rows"]:
        lines.append(
            f"| {r['program']} | {r['entry_ops']} | {r['kernels_per_step']:.0f} | "
            f"{r['kernel_ms_per_step']:.3f} | {r['wall_ms']:.3f} |"
        )
    for r in res["rows"]:
        ops = ", ".join(f"{op} {n}" for op, n in r["entry_by_op"].items())
        lines += ["", f"{r['program']}: entry {ops}", "", "| kernel | per step | ms/step |", "|---|--:|--:|"]
        lines += [
            f"| `{h['kernel']}` | {h['per_step']:.0f} | {h['ms_per_step']:.3f} |" for h in r["heaviest"]
        ]
    for name, why in res["failed"].items():
        lines.append(f"failed {name}: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(bench.MODELS), default="resnet50")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--programs", default=",".join(PROGRAMS), help=f"comma-separated, of: {PROGRAMS}")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=8, help="the heaviest kernels listed per program")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.programs.split(",") if n.strip()]
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        parser.error(f"--programs: unknown {unknown}; known: {PROGRAMS}")
    import jax

    shapes = bench.MODELS[args.model]()
    rows, failed = [], {}
    for name in names:
        try:
            rows.append(profile(name, shapes, args.device, args.steps, args.top))
        except Exception as error:  # noqa: BLE001 - one program failing is a line of the report
            failed[name] = f"{type(error).__name__}: {error}"
        print(f"  {name}: done", file=sys.stderr, flush=True)
    gpu = args.device.startswith("cuda")
    res = dict(
        model=args.model,
        tensors=len(shapes),
        device=args.device,
        device_name=str(jax.devices("gpu" if gpu else "cpu")[0].device_kind),
        jax=jax.__version__,
        steps=args.steps,
        rows=rows,
        failed=failed,
    )
    print(format_report(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 1 if failed and not rows else 0


if __name__ == "__main__":
    sys.exit(main())
