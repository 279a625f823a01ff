"""Every ``>>>`` example in the package's docstrings runs and prints what it shows."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil

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


WITH_EXAMPLES = [name for name in MODULES if _examples(name)]


def test_the_examples_are_found():
    assert len(WITH_EXAMPLES) >= 8, WITH_EXAMPLES


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_docstring_examples_run(name):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in _examples(name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
