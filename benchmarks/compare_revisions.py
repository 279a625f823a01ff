"""Time the torch optimizer step of this tree against an earlier revision, in one process.

    .venv/bin/python benchmarks/compare_revisions.py --base HEAD~3 --optimizer LAMB
    .venv/bin/python benchmarks/compare_revisions.py --base main --path foreach --steps 60

The ``largebatch`` package of ``--base`` (read with ``git archive``) is loaded as a second
package, ``largebatch_base``, beside this tree's; both optimizers are built on the same ResNet-50
parameter shapes, and their steps alternate, so that both see the same machine: on a
shared 2-core CPU, separate runs of the same code differ by up to 2x, alternating steps
by a few percent. Prints the median and the minimum ms per step of each.
"""

from __future__ import annotations

import argparse
import importlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import optimizer_step as bench

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "src/largebatch"
PATHS = {
    "compiled": dict(compiled=True),
    "foreach": dict(foreach=True, compiled=False),
    "loop": dict(foreach=False, compiled=False),
}


def _load_base(revision: str, tmp: Path):
    """``largebatch.torch`` of ``revision``, imported as ``largebatch_base.torch``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, PACKAGE], capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"cannot read {PACKAGE} at {revision!r}: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    package = tmp / "src" / "largebatch_base"
    (tmp / PACKAGE).rename(package)
    for source in package.rglob("*.py"):
        source.write_text(re.sub(r"\blargebatch\b", "largebatch_base", source.read_text()))
    sys.path.insert(0, str(tmp / "src"))
    return importlib.import_module("largebatch_base.torch")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="git revision to compare against")
    parser.add_argument("--optimizer", choices=["LARS", "LAMB"], default="LAMB")
    parser.add_argument("--path", choices=sorted(PATHS), default="compiled")
    parser.add_argument("--model", choices=sorted(bench.MODELS), default="resnet50")
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each (default 40)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        modules = {
            "this tree": importlib.import_module("largebatch.torch"),
            args.base: _load_base(args.base, Path(tmp)),
        }
        shapes = bench.MODELS[args.model]()
        kwargs = dict(bench._LAMB if args.optimizer == "LAMB" else bench._LARS, **PATHS[args.path])
        opts = {}
        for name, module in modules.items():
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
            for p in params:
                p.grad = torch.randn_like(p) * 0.01
            opts[name] = getattr(module, args.optimizer)(params, **kwargs)
        for opt in opts.values():  # compile and warm up
            for _ in range(3):
                opt.step()
        times: dict[str, list[float]] = {name: [] for name in opts}
        for _ in range(args.steps):
            for name, opt in opts.items():
                start = time.perf_counter()
                opt.step()
                times[name].append(time.perf_counter() - start)
    print(f"{args.model}, {args.optimizer} {args.path}, {args.steps} alternating steps each")
    for name, ts in times.items():
        print(f"  {name:<12} median {statistics.median(ts) * 1e3:7.2f} ms   min {min(ts) * 1e3:7.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
