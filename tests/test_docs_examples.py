"""The Python examples of the README and docs/ run as they stand, every one of them.

The blocks of one page run in order in one namespace, as a reader would run them, after
the page's prelude: stand-ins for what the prose assumes (a ``loader``, ``params``,
``grads``, a ``loss_fn``), small enough to run in seconds. A block that needs a process
group says so just above it, in an HTML comment (``PROCESSES``), and runs on two gloo
processes (``docs_worker.py``, which holds its stand-ins). A block run by another test
says so in an HTML comment (``SKIP``) that names that test's file, which must read the
page.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
SKIP = "<!-- example not run by tests/test_docs_examples.py: "
PROCESSES = "<!-- example run on two processes by tests/test_docs_examples.py: "
ON_PROCESSES = "on two processes"  # blocks()'s mark for a block under PROCESSES
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
WORKER = Path(__file__).resolve().parent / "docs_worker.py"

_TORCH_28 = """
import torch
loader = [(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,)))] * 2
"""
_JAX_TREE = """
import jax.numpy as jnp
params = {"w": jnp.ones((16, 8)) / 4, "b": jnp.zeros(8)}
batch = jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
def loss_fn(params, batch=batch):
    return jnp.sum((batch @ params["w"] + params["b"]) ** 2)
grads = params
"""
_IMAGENET = """
import torch
loader = [(torch.randn(2, 3, 32, 32), torch.randint(0, 1000, (2,)))]
"""
PRELUDES = {
    "README.md": _TORCH_28 + _JAX_TREE,
    "docs/index.md": _TORCH_28 + _JAX_TREE,
    "docs/torch.md": _IMAGENET,
    "docs/mixed_precision.md": _IMAGENET,
    "docs/jax.md": _JAX_TREE,
    "docs/sources.md": "import torch\nmodel = torch.nn.Sequential(torch.nn.Linear(4, 3))\n",
}


def blocks(page: str) -> list[tuple[str, str | None]]:
    """Each Python block of ``page`` and where it runs: None (here, in this process),
    ``ON_PROCESSES`` (on two processes) or the reason it is not run here."""
    text = (ROOT / page).read_text()
    out = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        where = None
        if before.startswith(SKIP):
            where = before[len(SKIP) :].removesuffix("-->").strip()
        elif before.startswith(PROCESSES):
            where = ON_PROCESSES
        out.append((match.group(1), where))
    return out


WITH_BLOCKS = [page for page in PAGES if blocks(page)]
IN_PROCESS = [page for page in WITH_BLOCKS if any(where is None for _, where in blocks(page))]
ON_TWO = [page for page in WITH_BLOCKS if any(where == ON_PROCESSES for _, where in blocks(page))]
# ResNet-50 with LARS: its default CPU path compiles the step first (about 10 s).
COMPILES = {"docs/torch.md", "docs/mixed_precision.md"}


def test_every_example_is_run_by_a_test():
    """Each block runs here, on two processes here, or in the test its comment names,
    which reads the page."""
    assert {"README.md", "docs/torch.md", "docs/jax.md"} <= set(IN_PROCESS)
    assert {"docs/communication.md", "docs/distributed.md"} <= set(ON_TWO)
    for page in WITH_BLOCKS:
        for _, where in blocks(page):
            if where is None or where == ON_PROCESSES:
                continue
            named = re.findall(r"tests/\w+\.py", where)
            assert named, f"{page}: the example not run here names no test that runs it ({where!r})"
            for test in named:
                assert page in (ROOT / test).read_text(), f"{test} does not read {page}"


@pytest.mark.parametrize(
    "page", [pytest.param(p, marks=pytest.mark.slow) if p in COMPILES else p for p in IN_PROCESS]
)
def test_page_examples_run(page):
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(PRELUDES.get(page, ""), f"{page} (prelude)", "exec"), namespace)  # noqa: S102
    for i, (code, where) in enumerate(blocks(page)):
        if where is None:
            exec(compile(code, f"{page} (block {i + 1})", "exec"), namespace)  # noqa: S102


@pytest.mark.slow
@pytest.mark.parametrize("page", ON_TWO)
def test_process_examples_run(page, tmp_path):
    """The page's process-group examples on two gloo processes (``docs_worker.py``): every
    block runs on both ranks, and the processes end cleanly (exit status 0, no abort, none
    left behind)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        page,
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}  # the CPU form
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:  # torchrun and its workers are one session: nothing outlives the test
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    try:  # whatever of the session is still there is killed, and fails the test
        os.killpg(proc.pid, signal.SIGKILL)
        left = True
    except ProcessLookupError:
        left = False
    assert not left, "a process of torchrun's session outlived it"
    assert proc.returncode == 0, stderr[-3000:]
    assert "terminate called" not in stderr and "Traceback" not in stderr, stderr[-3000:]
    n = sum(where == ON_PROCESSES for _, where in blocks(page))
    for rank in (0, 1):
        lines = (tmp_path / f"rank{rank}.jsonl").read_text().splitlines()
        assert [json.loads(line)["block"] for line in lines] == list(range(1, n + 1)), stdout
