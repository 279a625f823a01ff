"""Time AdaComp's JAX exchange, leaf by leaf and packed (``fused=True``), against ``lax.pmean``.

    python benchmarks/jax_adacomp.py                     # the default devices (a GPU: one)
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/jax_adacomp.py

Each device holds gradients of a model's parameter shapes (``--model``: ResNet-50's 161,
BERT-large's 391), random and fixed per device, and one jitted ``shard_map`` step over
all devices runs ``adacomp(...).update`` on them (compressing from the first step):
``--warmup`` untimed calls, then ``--rounds`` rounds over the rows of ``--steps`` timed
calls each (each ends when the result is ready), and each row's median. Rows: ``pmean``
(the dense average every leaf would otherwise take), and per form (``allgather``,
``two_phase``) the exchange leaf by leaf and packed (on a GPU, the packed exchange's
passes are Pallas kernels; on the CPU, their bodies as XLA).
Beside each time: its ratio to ``pmean``. On one device the collectives move nothing,
and the times are the compressor's and decoder's own work: the number that says whether
compression can pay for itself (``largebatch scaling --compressor-ns-per-byte``; the
last column gives it, ns a gradient byte beyond ``pmean``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, str(Path(__file__).parent))
import optimizer_step as bench  # the models' parameter shapes

from largebatch.comm.jax import adacomp, adacomp_init_state

AXIS = "data"


def build(kind: str, shapes: list[tuple[int, ...]], mesh: Mesh) -> tuple[object, object]:
    """A jitted step ``grads -> updates`` (and its state) for one row."""
    params = {f"p{i:03d}": jnp.zeros(s, jnp.float32) for i, s in enumerate(shapes)}
    if kind == "pmean":

        def mean(grads: dict) -> dict:
            return jax.lax.pmean(jax.tree.map(lambda g: g[0], grads), AXIS)

        fn = jax.shard_map(mean, mesh=mesh, in_specs=(P(AXIS),), out_specs=P(), check_vma=False)
        return jax.jit(fn), None
    form, how = kind.split()
    tx = adacomp(AXIS, form=form, fused=how == "(packed)")
    state, specs = adacomp_init_state(tx, params, mesh, AXIS)

    def step(grads: dict, state: object) -> tuple:
        return tx.update(jax.tree.map(lambda g: g[0], grads), state)

    fn = jax.shard_map(step, mesh=mesh, in_specs=(P(AXIS), specs), out_specs=(P(), specs), check_vma=False)
    return jax.jit(fn), state


KINDS = (
    "pmean",
    "allgather (per-leaf)",
    "allgather (packed)",
    "two_phase (per-leaf)",
    "two_phase (packed)",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(bench.MODELS), default="resnet50")
    parser.add_argument("--steps", type=int, default=5, help="timed calls a round (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the rows (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default %(default)s)")
    parser.add_argument("--devices", type=int, default=0, help="devices of the mesh (default: all)")
    parser.add_argument("--only", default=None, help="comma-separated rows to run (default: all)")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the results to OUT")
    args = parser.parse_args(argv)
    devices = jax.devices()[: args.devices or None]
    mesh = Mesh(np.array(devices), (AXIS,))
    shapes = bench.MODELS[args.model]()
    n = len(devices)
    rng = np.random.default_rng(0)
    grads = {f"p{i:03d}": rng.standard_normal((n, *s)).astype(np.float32) for i, s in enumerate(shapes)}
    grads = jax.device_put(grads, NamedSharding(mesh, P(AXIS)))
    grad_bytes = 4 * sum(int(np.prod(s)) for s in shapes)
    kinds = KINDS if args.only is None else tuple(k for k in KINDS if k.split()[0] in args.only.split(","))
    print(
        f"{args.model}: {len(shapes)} tensors, {sum(int(np.prod(s)) for s in shapes) / 1e6:.1f}M params, "
        f"{n} {devices[0].platform} device(s); jax {jax.__version__}"
    )
    programs = {}
    for kind in kinds:
        fn, state = build(kind, shapes, mesh)
        operands = (grads,) if state is None else (grads, state)
        for _ in range(args.warmup):
            jax.block_until_ready(fn(*operands))
        programs[kind] = (fn, operands)
    # Rounds alternate the rows, so that a load that comes and goes falls on all alike.
    times: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind, (fn, operands) in programs.items():
            for _ in range(args.steps):
                start = time.perf_counter()
                jax.block_until_ready(fn(*operands))
                times[kind].append(time.perf_counter() - start)
    rows = []
    base = None
    for kind in kinds:
        ms = 1e3 * statistics.median(times[kind])
        base = ms if kind == "pmean" else base
        ratio = f"{ms / base:6.2f}x" if base else "      "
        per_byte = 1e6 * (ms - base) / grad_bytes if base is not None and kind != "pmean" else None
        cost = f"{per_byte:8.3f} ns/byte" if per_byte is not None else ""
        print(f"  {kind:<22} {ms:10.2f} ms  {ratio} pmean  {cost}")
        rows.append({"kind": kind, "ms": ms, "ns_per_byte": per_byte})
    if args.json:
        meta = {
            "model": args.model,
            "devices": n,
            "platform": devices[0].platform,
            "device": devices[0].device_kind,
            "jax": jax.__version__,
            "date": datetime.date.today().isoformat(),
        }
        Path(args.json).write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
