"""Every ``>>>`` example in the package's docstrings runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import largebatch

# The framework hooks import their framework, which may not be installed.
FRAMEWORKS = {
    "largebatch.integrations.timm": "timm",
    "largebatch.integrations.huggingface": "transformers",
    "largebatch.integrations.lightning": "lightning",
}
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(largebatch.__path__, "largebatch.")
    if m.name != "largebatch.__main__" and importlib.util.find_spec(FRAMEWORKS.get(m.name, "largebatch"))
)


def _examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    return [t for t in doctest.DocTestFinder().find(module, name) if t.examples]


def _has_prompt(name: str) -> bool:
    """The module's source holds a ``>>>`` prompt: read, not imported, so that collecting
    the tests imports no framework (each test process collects every test)."""
    origin = importlib.util.find_spec(name).origin
    return origin is not None and ">>>" in Path(origin).read_text(encoding="utf-8")


WITH_EXAMPLES = [name for name in MODULES if _has_prompt(name)]


def test_the_examples_are_found():
    assert len(WITH_EXAMPLES) >= 8, WITH_EXAMPLES


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name):
    examples = _examples(name)
    assert examples, f"{name} has a >>> prompt but no docstring example that doctest finds"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in examples:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
