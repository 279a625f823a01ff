"""Time DDP's gradient exchange with the AdaComp hook against DDP's default all-reduce.

    torchrun --standalone --nproc_per_node=N benchmarks/comm_hook.py --json out.json
    python benchmarks/comm_hook.py --device cuda          # one process: the hook's own cost
    python benchmarks/comm_hook.py --count                # the CPU: launches, not times

Every rank holds a model with ResNet-50's 161 parameter shapes (``--model``) whose loss is
``sum(p * c)``, so each backward pass makes the gradients ``c`` (random, fixed per rank)
at almost no cost and the time of a DDP iteration is its gradient exchange: DDP's buckets,
each through the registered hook. Per exchange (``default``: DDP's all-reduce; ``adacomp
allgather`` and ``adacomp two_phase``: :func:`largebatch.comm.torch.adacomp_hook`
compressing from the first step, on torch operations per layer; ``(fused)``: on the
Triton kernels, CUDA only), ``--warmup`` untimed iterations, then the median of
``--steps`` timed ones (each ends with a device sync and a barrier), next to the same
backward pass without DDP (``local``), and each one's ratio to DDP's all-reduce. On CUDA
the group is NCCL, else gloo; with one process the collectives have no peer and the times
are the hook's compression and decoding work.

``--count`` (one process, the CPU): no times, but what one iteration of each form runs,
on torch operations and on the kernels: the torch operations and Triton launches of
largebatch's code, and its reads of device values on the host. The kernels run on the
CPU only under Triton's interpreter, far too slowly for ResNet-50, so here stand-ins
launch nothing (the scan writes messages of headers only; each decode counts as the
launch it would be).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

if "--count" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the kernels' path on the CPU

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).parent))
import optimizer_step as bench  # the models' parameter shapes

from largebatch.comm.torch import AdaCompState, adacomp_hook


class Shapes(nn.Module):
    """Parameters of the given shapes; ``forward(coefs)`` is ``sum(p * c)``."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.zeros(s)) for s in shapes)

    def forward(self, coefs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([(p * c).sum() for p, c in zip(self.weights, coefs)]).sum()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_iterations(
    model: nn.Module, coefs: list[torch.Tensor], device: torch.device, warmup: int, steps: int
) -> list[float]:
    """Seconds of each timed forward + backward (the exchange included, under DDP)."""
    times = []
    for i in range(warmup + steps):
        for p in model.parameters():
            p.grad = None
        _sync(device)
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        model(coefs).backward()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


@contextlib.contextmanager
def _counted_kernels(launches: list[str]):
    """Stand-ins for the hook's kernels that launch nothing, while the context lasts: each
    call counted; the scan sizes every message as its headers alone, the per-segment pass
    counts nothing selected (the rest reads what they leave)."""
    from largebatch.comm.torch import _fused, _kernels

    def stand_in(name: str):
        def launch(*args, **kwargs):
            launches.append(name)
            if name == "scan_kernel":
                sizes, k, item = args[5], args[7], kwargs["ITEM"]
                sizes.fill_(k * (8 + item))
            elif name == "finish_kernel":
                args[4].zero_()
                args[5].zero_()

        class Kernel:
            def __getitem__(self, grid):
                return launch

        return Kernel()

    kernels = {name: getattr(_kernels, name) for name in _fused.KERNELS}
    decode = _fused.decode

    def counted_decode(message, size, targets, dst, k, width, values):
        if k:
            launches.append("decode_kernel")
        return decode(message, size, targets, dst, k, width, values)

    try:
        for name in kernels:
            setattr(_kernels, name, stand_in(name))
        _fused.decode = counted_decode
        yield
    finally:
        for name, kernel in kernels.items():
            setattr(_kernels, name, kernel)
        _fused.decode = decode


_PACKAGE = str(Path(__import__("largebatch").__file__).parent)


def _ours(frame) -> bool:
    """Whether largebatch's code is the nearest caller (not a stand-in of this script)."""
    while frame is not None:
        path = frame.f_code.co_filename
        if path == __file__:
            return False
        if path.startswith(_PACKAGE):
            return True
        frame = frame.f_back
    return False


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """The torch operations largebatch's code runs (each a launch on a GPU, or less), and
    its scalar reads."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.reads = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _ours(sys._getframe(1)):
            self.ops += 1
            self.reads += func._schema.name in ("aten::_local_scalar_dense", "aten::is_nonzero")
        return func(*args, **(kwargs or {}))


def count(shapes: list[tuple[int, ...]], bucket_mb: float) -> list[dict]:
    """One iteration per form and path (after two: DDP orders its buckets anew after the
    first): buckets, torch operations, Triton launches, host reads."""
    launches: list[str] = []
    tolist = torch.Tensor.tolist
    reads = [0]

    def counted_tolist(t):
        if _ours(sys._getframe(1)):
            reads[0] += 1
        return tolist(t)

    rows = []
    gen = torch.Generator().manual_seed(0)
    coefs = [torch.randn(s, generator=gen) for s in shapes]
    for form, fused in itertools.product(("allgather", "two_phase"), (False, True)):
        with _counted_kernels(launches):
            model = DDP(Shapes(shapes), bucket_cap_mb=bucket_mb)
            state = AdaCompState(model, form=form, warmup_steps=0, fused=fused)
            buckets: list[int] = []

            def hook(state, bucket, buckets=buckets):
                buckets.append(bucket.index())
                return adacomp_hook(state, bucket)

            hook.__annotations__.update(adacomp_hook.__annotations__)
            model.register_comm_hook(state, hook)
            for _ in range(2):
                model(coefs).backward()
            launches.clear()
            buckets.clear()
            reads[0] = 0
            before = state.stats["steps"]
            torch.Tensor.tolist = counted_tolist
            try:
                with _Ops() as ops:
                    model(coefs).backward()
            finally:
                torch.Tensor.tolist = tolist
            assert state.stats["steps"] == before + 1
            rows.append(
                dict(
                    form=form,
                    path="fused" if fused else "torch",
                    buckets=len(buckets),
                    torch_ops=ops.ops,
                    triton_launches=len(launches),
                    host_reads=ops.reads + reads[0],
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(bench.MODELS), default="resnet50")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda (default %(default)s); under torchrun each rank takes cuda:LOCAL_RANK",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed iterations (default %(default)s)")
    parser.add_argument(
        "--warmup", type=int, default=3, help="untimed iterations first (default %(default)s)"
    )
    parser.add_argument(
        "--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (default %(default)s)"
    )
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the results to OUT (rank 0)")
    parser.add_argument(
        "--count",
        action="store_true",
        help="one process on the CPU: count each form's operations, launches and host reads",
    )
    args = parser.parse_args(argv)
    if args.count:
        args.device = "cpu"
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be >= 1 and --warmup >= 0 (got {args.steps}, {args.warmup})")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available to torch here")

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.device.startswith("cuda"):
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=device if device.type == "cuda" else None,
        )

    shapes = bench.MODELS[args.model]()
    if args.count:
        if world != 1:
            parser.error("--count runs in one process")
        counts = count(shapes, args.bucket_mb)
        print(
            f"{args.model}: {len(shapes)} tensors; one iteration on the CPU, buckets of {args.bucket_mb} MB"
        )
        print("")
        print("| form | path | buckets | torch operations | Triton launches | host reads |")
        print("|---|---|---:|---:|---:|---:|")
        for r in counts:
            print(
                f"| {r['form']} | {r['path']} | {r['buckets']} | {r['torch_ops']} | "
                f"{r['triton_launches']} | {r['host_reads']} |"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(model=args.model, bucket_mb=args.bucket_mb, rows=counts), f, indent=2)
        dist.destroy_process_group()
        return 0
    gen = torch.Generator().manual_seed(rank)
    coefs = [torch.randn(s, generator=gen).to(device) for s in shapes]
    rows = []
    local = Shapes(shapes).to(device)
    rows.append(("local (no DDP)", time_iterations(local, coefs, device, args.warmup, args.steps), None))
    exchanges = [
        ("default all-reduce", None, False),
        ("adacomp allgather", "allgather", False),
        ("adacomp two_phase", "two_phase", False),
    ]
    if device.type == "cuda":
        exchanges += [
            ("adacomp allgather (fused)", "allgather", True),
            ("adacomp two_phase (fused)", "two_phase", True),
        ]
    for name, form, fused in exchanges:
        model = DDP(
            Shapes(shapes).to(device),
            bucket_cap_mb=args.bucket_mb,
            device_ids=[device.index] if device.type == "cuda" else None,
        )
        state = None
        if form is not None:
            state = AdaCompState(model, form=form, warmup_steps=0, fused=fused)
            model.register_comm_hook(state, adacomp_hook)
        times = time_iterations(model, coefs, device, args.warmup, args.steps)
        if fused and state.stats["fused_buckets"] == 0:
            raise RuntimeError(f"{name}: no bucket took the kernels")
        rows.append((name, times, None if state is None else state.compression_rates()))
        del model

    n_params = sum(c.numel() for c in coefs)
    result = dict(
        model=args.model,
        tensors=len(shapes),
        params=n_params,
        world=world,
        backend=backend,
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        nccl=".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None,
        steps=args.steps,
        warmup=args.warmup,
        bucket_mb=args.bucket_mb,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        rows=[
            dict(
                exchange=name,
                ms=statistics.median(t) * 1e3,
                min_ms=min(t) * 1e3,
                vs_ddp=statistics.median(t) / statistics.median(rows[1][1]),
                compression=rates,
            )
            for name, t, rates in rows
        ],
    )
    if rank == 0:
        print(
            f"{args.model}: {len(shapes)} tensors, {n_params / 1e6:.1f}M fp32 params; {world} "
            f"process(es), {backend} on {result['device_name']}; median of {args.steps} "
            f"iterations after {args.warmup}"
        )
        print("")
        print(f"| {'exchange':<26} | {'ms/iter':>8} | {'min ms':>8} | {'x DDP':>6} | compression rates |")
        print(f"|{'-' * 28}|{'-' * 9}:|{'-' * 9}:|{'-' * 7}:|{'-' * 19}|")
        for r in result["rows"]:
            rates = ", ".join(f"{k} {v:.0f}x" for k, v in (r["compression"] or {}).items()) or "-"
            times = f"{r['ms']:>8.2f} | {r['min_ms']:>8.2f} | {r['vs_ddp']:>6.2f}"
            print(f"| {r['exchange']:<26} | {times} | {rates} |")
        print("")
        print("x DDP: the median over DDP's all-reduce's (the goal for the fused hook: at most 1.5)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
