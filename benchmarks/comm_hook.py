"""Time DDP's gradient exchange with the AdaComp hook against DDP's default all-reduce.

    torchrun --standalone --nproc_per_node=N benchmarks/comm_hook.py --json out.json
    python benchmarks/comm_hook.py --device cuda          # one process: the hook's own cost

Every rank holds a model with ResNet-50's 161 parameter shapes (``--model``) whose loss is
``sum(p * c)``, so each backward pass makes the gradients ``c`` (random, fixed per rank)
at almost no cost and the time of a DDP iteration is its gradient exchange: DDP's buckets,
each through the registered hook. Per exchange (``default``: DDP's all-reduce; ``adacomp
allgather`` and ``adacomp two_phase``: :func:`largebatch.comm.torch.adacomp_hook`
compressing from the first step), ``--warmup`` untimed iterations, then the median of
``--steps`` timed ones (each ends with a device sync and a barrier), next to the same
backward pass without DDP (``local``). On CUDA the group is NCCL, else gloo; with one
process the collectives have no peer and the times are the hook's compression and
decoding work.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

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
    args = parser.parse_args(argv)
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
    gen = torch.Generator().manual_seed(rank)
    coefs = [torch.randn(s, generator=gen).to(device) for s in shapes]
    rows = []
    local = Shapes(shapes).to(device)
    rows.append(("local (no DDP)", time_iterations(local, coefs, device, args.warmup, args.steps), None))
    for name, form in (
        ("default all-reduce", None),
        ("adacomp allgather", "allgather"),
        ("adacomp two_phase", "two_phase"),
    ):
        model = DDP(
            Shapes(shapes).to(device),
            bucket_cap_mb=args.bucket_mb,
            device_ids=[device.index] if device.type == "cuda" else None,
        )
        state = None
        if form is not None:
            state = AdaCompState(model, form=form, warmup_steps=0)
            model.register_comm_hook(state, adacomp_hook)
        times = time_iterations(model, coefs, device, args.warmup, args.steps)
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
            dict(exchange=name, ms=statistics.median(t) * 1e3, min_ms=min(t) * 1e3, compression=rates)
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
        print(f"| {'exchange':<20} | {'ms/iter':>8} | {'min ms':>8} | compression rates |")
        print(f"|{'-' * 22}|{'-' * 9}:|{'-' * 9}:|{'-' * 19}|")
        for r in result["rows"]:
            rates = ", ".join(f"{k} {v:.0f}x" for k, v in (r["compression"] or {}).items()) or "-"
            print(f"| {r['exchange']:<20} | {r['ms']:>8.2f} | {r['min_ms']:>8.2f} | {rates} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
