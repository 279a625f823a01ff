"""The host's share of one fused step: everything but the kernels, on the CPU.

    .venv/bin/python benchmarks/fused_host.py
    .venv/bin/python benchmarks/fused_host.py --model bert-large --precision fp16

On a GPU the fused step costs the kernels' time plus the host's: gathering each group's
tensors and state, checking the grads, keying the plan cache, and the launches' Python
(docs/design.md §3). A benchmark that waits for the device after
every step (``optimizer_step.py``) pays both in series, so on a small model the host's part
bounds the step. This script measures that part alone: it replaces every kernel launch of
``largebatch.lars.kernels.plan`` by a call that does nothing and times ``step()`` on CPU
tensors of the model's shapes (``TRITON_INTERPRET=1``, so that no GPU is needed). A CUDA
graph of the step replays the kernels without any of it (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the fused path on CPU tensors

import torch

sys.path.insert(0, str(Path(__file__).parent))
import optimizer_step as bench

from largebatch.lars.kernels import plan
from largebatch.torch import LAMB, LARS


class _NoLaunch:
    """Stands for a ``@triton.jit`` function: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def host_ms(cls, shapes, precision: str, steps: int, warmup: int) -> list[float]:
    """ms per ``step()`` of ``cls(fused=True)`` over ``shapes`` with no kernel run."""
    dtype = torch.float32 if precision == "fp32" else torch.float16
    params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = cls(params, lr=0.1, weight_decay=1e-4, fused=True, master_weights=precision != "fp32")
    times = []
    for k in range(warmup + steps):
        start = time.perf_counter()
        opt.step()
        if k >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(bench.MODELS), default="resnet50")
    parser.add_argument("--precision", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be at least 1 and --warmup at least 0 (got {args.steps}, {args.warmup})")

    kernels = [name for name in dir(plan) if name.endswith("_kernel")]
    for name in kernels:
        setattr(plan, name, _NoLaunch())
    shapes = bench.MODELS[args.model]()
    print(
        f"{args.model}: {len(shapes)} tensors, {args.precision}; the fused step with "
        f"{len(kernels)} kernels launching nothing; {args.steps} steps after {args.warmup}"
    )
    for cls in (LARS, LAMB):
        times = host_ms(cls, shapes, args.precision, args.steps, args.warmup)
        median = statistics.median(times)
        print(
            f"{cls.__name__}: host {median:.3f} ms/step median, {min(times):.3f} min, "
            f"{1e3 * median / len(shapes):.2f} us per tensor"
        )


if __name__ == "__main__":
    main()
