"""examples/jax_fashion_mnist.py trains to well above chance on a small subset."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("flax")

from largebatch.fashion_mnist import fashion_mnist_dir

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "jax_fashion_mnist.py"


@pytest.fixture(scope="module")
def example():
    try:
        fashion_mnist_dir()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    spec = importlib.util.spec_from_file_location("jax_fashion_mnist", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("optimizer", ["lamb", "lars"])
def test_example_learns(example, optimizer, capsys):
    args = ["--optimizer", optimizer, "--subset", "2000", "--epochs", "2", "--batch-size", "200"]
    acc = example.main(args)
    assert f"test accuracy: {acc:.4f}" in capsys.readouterr().out
    assert acc > 0.5, f"{optimizer}: test accuracy {acc:.3f} (chance is 0.1)"
