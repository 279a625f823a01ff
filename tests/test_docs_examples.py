"""The Python examples of the README and docs/ run as they stand.

The blocks of one page run in order in one namespace, as a reader would run them, after
the page's prelude: stand-ins for what the prose assumes (a ``loader``, ``params``,
``grads``, a ``loss_fn``), small enough to run in seconds. A block that cannot run in
one process says so just above it, in an HTML comment that names the reason and
where it is tested instead.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
SKIP = "<!-- example not run by tests/test_docs_examples.py: "
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

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
T, W = 100, 10
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
    """Each Python block of ``page`` and the reason it is not run (None: it runs)."""
    text = (ROOT / page).read_text()
    out = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        reason = before[len(SKIP):].removesuffix("-->").strip() if before.startswith(SKIP) else None
        out.append((match.group(1), reason))
    return out


WITH_BLOCKS = [page for page in PAGES if blocks(page)]
# ResNet-50 with LARS: its default CPU path compiles the step first (about 10 s).
COMPILES = {"docs/torch.md", "docs/mixed_precision.md"}


def test_every_page_with_examples_is_covered():
    assert {"README.md", "docs/torch.md", "docs/jax.md"} <= set(WITH_BLOCKS)
    for page in WITH_BLOCKS:
        for _, reason in blocks(page):
            assert reason is None or len(reason) > 10, (page, reason)


@pytest.mark.filterwarnings("ignore::UserWarning")  # GradScaler("cuda") on a CPU machine
@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p in COMPILES else p
                                  for p in WITH_BLOCKS])
def test_page_examples_run(page):
    namespace: dict = {"__name__": "__docs__"}
    exec(compile(PRELUDES.get(page, ""), f"{page} (prelude)", "exec"), namespace)  # noqa: S102
    ran = 0
    for i, (code, reason) in enumerate(blocks(page)):
        if reason is None:
            exec(compile(code, f"{page} (block {i + 1})", "exec"), namespace)  # noqa: S102
            ran += 1
    if ran == 0:
        pytest.skip(f"every example of {page} is run elsewhere or needs processes")
