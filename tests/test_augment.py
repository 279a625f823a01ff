"""``random_crop_flip`` (``largebatch.training.data``): torchvision's per-image pad, crop and
flip, drawn from one generator in a fixed order, on a whole batch."""

from __future__ import annotations

import re

import pytest
import torch
from torchvision.transforms.v2 import functional as TF

from largebatch.training.data import random_crop_flip


def _batch(dtype: torch.dtype, channels_last: bool, n: int = 16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (n, 3, 7, 5), generator=gen).to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def _torchvision(x: torch.Tensor, seed: int, padding: int) -> torch.Tensor:
    """Image by image with torchvision, the offsets and flips drawn in the documented order."""
    gen = torch.Generator().manual_seed(seed)
    n, _, h, w = x.shape
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=gen)
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=gen)
    flips = torch.randint(0, 2, (n,), generator=gen)
    out = []
    for image, top, left, flip in zip(x, dy.tolist(), dx.tolist(), flips.tolist(), strict=True):
        image = TF.crop(TF.pad(image, [padding]), top, left, h, w)
        out.append(TF.horizontal_flip(image) if flip else image)
    return torch.stack(out)


@pytest.mark.parametrize("padding", [0, 1, 2, 4])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_random_crop_flip_equals_torchvision_image_for_image(dtype, channels_last, padding):
    x = _batch(dtype, channels_last)
    got = random_crop_flip(x, torch.Generator().manual_seed(5), padding)
    assert got.dtype == dtype and got.shape == x.shape
    assert got.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert torch.equal(got, _torchvision(x, 5, padding))


def test_a_seed_fixes_the_draws():
    x = _batch(torch.float32, True, n=64)
    a = random_crop_flip(x, torch.Generator().manual_seed(1))
    b = random_crop_flip(x, torch.Generator().manual_seed(1))
    c = random_crop_flip(x, torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)
    flipped = random_crop_flip(x, torch.Generator().manual_seed(1), padding=0)
    assert not torch.equal(flipped, x)  # 64 coin flips: some images flipped
    assert all(torch.equal(f, i) or torch.equal(f, i.flip(-1)) for f, i in zip(flipped, x, strict=True))


def test_negative_padding_is_refused():
    with pytest.raises(ValueError, match=re.escape("Invalid padding: -1 (must be an integer >= 0)")):
        random_crop_flip(_batch(torch.float32, False), torch.Generator(), -1)


# ``largebatch train --augment``: 256 images, batch 128, 2 steps.
SHORT = ["train", "--recipe", "fmnist-sgd-128", "--subset", "256", "--epochs", "1"]


def _trained(out, *flags: str) -> dict[str, torch.Tensor]:
    from largebatch.cli import main as cli

    assert cli([*SHORT, *flags, "--out", str(out)]) == 0
    return torch.load(out / "checkpoint.pt", weights_only=False)["model"]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_train_augment_changes_the_run_and_repeats_with_the_seed(tmp_path, capsys):
    plain = _trained(tmp_path / "plain")
    a = _trained(tmp_path / "a", "--augment")
    b = _trained(tmp_path / "b", "--augment")
    assert any(not torch.equal(plain[k], a[k]) for k in plain)
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = _trained(tmp_path / "other", "--augment", "--seed", "1")
    assert any(not torch.equal(a[k], other[k]) for k in a)


def test_train_refuses_augment_on_imagefolder_data(tmp_path, capsys):
    from helpers import user_error

    line = user_error(
        [
            "train",
            "--recipe",
            "resnet50-goyal-8k",
            "--augment",
            "--data",
            str(tmp_path),
            "--out",
            str(tmp_path / "o"),
        ],
        capsys,
    )
    assert "--augment crops and flips Fashion-MNIST batches" in line and "RandomResizedCrop" in line
