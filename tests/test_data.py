"""The command line's help, the framework-free package root, and the Fashion-MNIST loader."""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from largebatch.fashion_mnist import FASHION_MNIST_FILES, fashion_mnist_dir, load_fashion_mnist


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def test_cli_help_lists_every_command():
    proc = _run("-m", "largebatch", "--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("train", "recipes", "study"):
        assert command in proc.stdout


def test_import_largebatch_loads_no_framework():
    code = (
        "import sys, largebatch, largebatch.cli; "
        "loaded = [m for m in ('torch', 'jax') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    proc = _run("-c", code)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("split, n", [("train", 60_000), ("test", 10_000)])
def test_load_fashion_mnist_shapes_and_labels(split, n):
    images, labels = load_fashion_mnist(split)
    assert images.shape == (n, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (n,) and labels.dtype == np.int64
    # Fashion-MNIST is balanced: every one of the 10 classes holds a tenth of each split.
    np.testing.assert_array_equal(np.bincount(labels), np.full(10, n // 10))
    assert 0 < images.mean() < 255


def test_load_fashion_mnist_rejects_unknown_split():
    with pytest.raises(ValueError, match="Unknown split 'val'"):
        load_fashion_mnist("val")


def test_missing_data_says_how_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"apt-get install dataset-fashion-mnist") as err:
        load_fashion_mnist("train", root=tmp_path / "absent")
    assert str(tmp_path / "absent") in str(err.value)


def test_corrupted_file_fails_its_checksum(tmp_path):
    source = fashion_mnist_dir()
    for name in FASHION_MNIST_FILES:
        shutil.copy(source / name, tmp_path / name)
    target = tmp_path / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    target.write_bytes(bytes(raw))
    load_fashion_mnist("train", root=tmp_path)  # the untouched split still loads
    with pytest.raises(ValueError, match="Checksum mismatch"):
        load_fashion_mnist("test", root=tmp_path)


@pytest.mark.parametrize("split", ["train", "test"])
def test_reader_matches_torchvision(tmp_path, split):
    """torchvision's FashionMNIST, over the same files decompressed where it looks for them,
    reads the same images and labels: the reader here exists only so that the package reads
    the compressed files in place with their checksums, and without torchvision (the JAX
    install), docs/design.md section 6."""
    import gzip

    torchvision = pytest.importorskip("torchvision")
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for name in FASHION_MNIST_FILES:
        (raw / name.removesuffix(".gz")).write_bytes(
            gzip.decompress((fashion_mnist_dir() / name).read_bytes())
        )
    theirs = torchvision.datasets.FashionMNIST(str(tmp_path), train=split == "train", download=False)
    images, labels = load_fashion_mnist(split)
    np.testing.assert_array_equal(images, theirs.data.numpy())
    np.testing.assert_array_equal(labels, theirs.targets.numpy())
    assert labels.dtype == theirs.targets.numpy().dtype
