"""Fashion-MNIST, the embedded default data set, as NumPy arrays (no framework needed).

The files come from Debian's ``dataset-fashion-mnist`` package (installed by ``make``),
under ``/usr/share/datasets/fashion-mnist/``; set ``LARGEBATCH_FASHION_MNIST=DIR`` or pass
``root=`` to read the same four files from elsewhere (torchvision's download writes them
under ``FashionMNIST/raw/``). Checksums are pinned, so every user trains on the same bytes.

Xiao, Rasul, Vollgraf 2017, "Fashion-MNIST", https://arxiv.org/abs/1708.07747.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = [
    "FASHION_MNIST_DIR",
    "FASHION_MNIST_FILES",
    "fashion_mnist_dir",
    "fashion_mnist_tensors",
    "load_fashion_mnist",
]

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_FILES = {
    "train-images-idx3-ubyte.gz": "b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7",
    "train-labels-idx1-ubyte.gz": "0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056",
    "t10k-images-idx3-ubyte.gz": "cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa",
    "t10k-labels-idx1-ubyte.gz": "8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05",
}
_SPLITS = {"train": "train", "test": "t10k"}
# Training-set statistics of Fashion-MNIST pixels scaled to [0, 1].
_MEAN, _STD = 0.2860, 0.3530


def fashion_mnist_dir(root: str | os.PathLike | None = None) -> Path:
    """The folder holding the four Fashion-MNIST files; a clear error if it is missing."""
    path = Path(root or os.environ.get("LARGEBATCH_FASHION_MNIST") or FASHION_MNIST_DIR)
    missing = [name for name in FASHION_MNIST_FILES if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST not found in {path} (missing {', '.join(missing)}). "
            "Install it with 'sudo apt-get install dataset-fashion-mnist' (make demo and "
            "make test do this), or point LARGEBATCH_FASHION_MNIST / --data at a folder "
            "holding the four idx .gz files."
        )
    return path


def _read_idx(path: Path, expected_sha256: str, verify: bool) -> np.ndarray:
    raw = path.read_bytes()
    if verify:
        digest = hashlib.sha256(raw).hexdigest()
        if digest != expected_sha256:
            raise ValueError(f"Checksum mismatch for {path}: sha256 {digest}, expected {expected_sha256}")
    data = gzip.decompress(raw)
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


@functools.lru_cache(maxsize=4)
def _load(path: Path, split: str, verify: bool) -> tuple[np.ndarray, np.ndarray]:
    prefix = _SPLITS[split]
    images_name = f"{prefix}-images-idx3-ubyte.gz"
    labels_name = f"{prefix}-labels-idx1-ubyte.gz"
    images = _read_idx(path / images_name, FASHION_MNIST_FILES[images_name], verify)
    labels = _read_idx(path / labels_name, FASHION_MNIST_FILES[labels_name], verify)
    images.flags.writeable = False
    labels = labels.astype(np.int64)
    labels.flags.writeable = False
    return images, labels


def load_fashion_mnist(
    split: str = "train", root: str | os.PathLike | None = None, *, verify: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """``(images, labels)``: uint8 ``[N, 28, 28]`` and int64 ``[N]`` (read-only arrays).

    ``split`` is ``"train"`` (60,000 images) or ``"test"`` (10,000).
    """
    if split not in _SPLITS:
        raise ValueError(f"Unknown split {split!r}; known splits: {', '.join(_SPLITS)}")
    return _load(fashion_mnist_dir(root), split, verify)


def fashion_mnist_tensors(
    images: np.ndarray, labels: np.ndarray, limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch tensors from :func:`load_fashion_mnist` arrays, first ``limit`` images:
    normalized float32 images ``[N, 1, 28, 28]`` (channels-last) and int64 labels."""
    import torch

    images, labels = images[:limit], labels[:limit]
    x = torch.from_numpy(images.copy()).unsqueeze(1).float().div_(255.0)
    x = x.sub_(_MEAN).div_(_STD).contiguous(memory_format=torch.channels_last)
    return x, torch.from_numpy(labels.copy())
