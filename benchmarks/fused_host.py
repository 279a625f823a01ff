"""The host's share of one fused step: everything but the kernels, on the CPU.

    .venv/bin/python benchmarks/fused_host.py
    .venv/bin/python benchmarks/fused_host.py --model bert-large --precision fp16
    .venv/bin/python benchmarks/fused_host.py --base d41b1d7 --grads moved

On a GPU the fused step costs the kernels' time plus the host's: checking what the step
runs on, the launches' Python and, when something moved, gathering each group's tensors
and state, keying the plan cache (docs/design.md §3). A benchmark that waits for the
device after every step (``optimizer_step.py``) pays both in series, so on a small model
the host's part bounds the step. This script measures that part alone: it replaces every
kernel launch of ``largebatch.lars.kernels.plan`` by a call that does nothing and times
``step()`` on CPU tensors of the model's shapes (``TRITON_INTERPRET=1``, so that no GPU
is needed), with the grads written in place at every step (``static``: the replayed
step) or new grad tensors at every step (``moved``: ``zero_grad()``'s default). With
``--base`` the same steps of another revision's package alternate with this tree's. A
CUDA graph of the step replays the kernels without any of it (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the fused path on CPU tensors

import importlib

import torch

sys.path.insert(0, str(Path(__file__).parent))
import optimizer_step as bench
from compare_revisions import _load_base

# The goal of a step with static grads on this CPU, ms (the issue on the fastest step).
GOALS = {"resnet50": 0.1, "bert-large": 0.2}


class _NoLaunch:
    """Stands for a ``@triton.jit`` function: ``kernel[grid](...)`` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _silence(package: str) -> int:
    """Replace every kernel of ``package``'s plan module by a launch that does nothing."""
    plan = importlib.import_module(f"{package}.lars.kernels.plan")
    kernels = [name for name in dir(plan) if name.endswith("_kernel")]
    for name in kernels:
        setattr(plan, name, _NoLaunch())
    return len(kernels)


class _Steps:
    """One optimizer of a package over ``shapes``, and its grads for each step."""

    def __init__(self, module, name: str, shapes, precision: str, grads: str) -> None:
        dtype = torch.float32 if precision == "fp32" else torch.float16
        self.params = [torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes]
        # "moved": three sets of grads in turn, all alive, so each step's are at new addresses
        self.sets = [[torch.zeros_like(p) for p in self.params] for _ in range(3 if grads == "moved" else 1)]
        self.opt = getattr(module, name)(
            self.params, lr=0.1, weight_decay=1e-4, fused=True, master_weights=precision != "fp32"
        )
        self.k = 0

    def step(self) -> float:
        """Set this step's grads (untimed), then time ``step()``: ms."""
        grads = self.sets[self.k % len(self.sets)]
        self.k += 1
        if len(self.sets) > 1 or self.params[0].grad is None:
            for p, g in zip(self.params, grads):
                p.grad = g
        start = time.perf_counter()
        self.opt.step()
        return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(bench.MODELS), default="resnet50")
    parser.add_argument("--precision", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--grads", choices=["static", "moved", "both"], default="both")
    parser.add_argument("--base", help="a git revision whose step alternates with this tree's")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps must be at least 1 and --warmup at least 0 (got {args.steps}, {args.warmup})")

    with tempfile.TemporaryDirectory() as tmp:
        modules = {"this tree": importlib.import_module("largebatch.torch")}
        if args.base:
            modules[args.base] = _load_base(args.base, Path(tmp))
        n_kernels = [_silence(m.__name__.split(".")[0]) for m in modules.values()][0]
        shapes = bench.MODELS[args.model]()
        print(
            f"{args.model}: {len(shapes)} tensors, {args.precision}; the fused step with "
            f"{n_kernels} kernels launching nothing; {args.steps} steps after {args.warmup}"
            + (f", alternating with {args.base}'s" if args.base else "")
        )
        modes = ["static", "moved"] if args.grads == "both" else [args.grads]
        for name in ("LARS", "LAMB"):
            for grads in modes:
                runs = {tree: _Steps(m, name, shapes, args.precision, grads) for tree, m in modules.items()}
                times: dict[str, list[float]] = {tree: [] for tree in runs}
                for k in range(args.warmup + args.steps):
                    for tree, run in runs.items():
                        t = run.step()
                        if k >= args.warmup:
                            times[tree].append(t)
                for tree, ts in times.items():
                    median = statistics.median(ts)
                    goal = GOALS.get(args.model) if grads == "static" and tree == "this tree" else None
                    print(
                        f"{name} {grads:<6} {tree:<10} host {median:.3f} ms/step median, {min(ts):.3f} min, "
                        f"{1e3 * median / len(shapes):.2f} us per tensor"
                        + (
                            ""
                            if goal is None
                            else f" (goal {goal} ms: {'met' if median <= goal else 'not met'})"
                        )
                    )


if __name__ == "__main__":
    main()
