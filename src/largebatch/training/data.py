"""The data of ``largebatch train``: Fashion-MNIST tensors, or ImageFolder trees for the
ImageNet recipes; each process's batches of an epoch (cropped and flipped by
:func:`random_crop_flip` with ``--augment``) and its shard of the test set.

A data error is a one-line ``largebatch train: ...`` (:class:`CommandError`), raised
while loading, or when a batch holds an image that cannot be read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from largebatch import checks
from largebatch.outputs import CommandError
from largebatch.recipes.registry import Recipe
from largebatch.training.loop import Batches, tensor_chunks

__all__ = [
    "StreamSampler",
    "TrainData",
    "augment_generator",
    "batches",
    "epoch_sampler",
    "eval_chunks",
    "load_data",
    "random_crop_flip",
]


def _fail(message: str) -> CommandError:
    return CommandError("train", message)


@dataclasses.dataclass
class TrainData:
    train: Any  # (x, y) tensors, or a torch Dataset
    test: Any
    num_classes: int
    n_train: int


@dataclasses.dataclass(frozen=True)
class _Unreadable:
    """Stands for a sample whose image file could not be read; it crosses data-loader
    worker processes intact, and the training loop turns it into a one-line error."""

    path: str
    reason: str


class _CheckedFolder(torch.utils.data.Dataset):
    """An ImageFolder whose unreadable images come back as :class:`_Unreadable`."""

    def __init__(self, folder: Any) -> None:
        self.folder = folder
        self.classes = folder.classes

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.folder[index]
        except (OSError, ValueError, SyntaxError) as err:  # PIL: unidentified, truncated
            return _Unreadable(self.folder.samples[index][0], f"{type(err).__name__}: {err}")


def _collate(items: list[Any]) -> Any:
    bad = next((item for item in items if isinstance(item, _Unreadable)), None)
    return bad if bad is not None else torch.utils.data.default_collate(items)


def _checked(batch: Any) -> Any:
    if isinstance(batch, _Unreadable):
        raise _fail(f"cannot read image {batch.path}: {batch.reason}")
    return batch


def _image_folder(path: Path, transform: Any) -> Any:
    from torchvision import datasets

    try:
        return _CheckedFolder(datasets.ImageFolder(path, transform))
    except (FileNotFoundError, OSError) as err:  # a class without images, no class folder
        raise _fail(f"ImageFolder tree {path}: {err}") from None


def load_data(recipe: Recipe, data_dir: str | None, subset: int | None) -> TrainData:
    """The recipe's training and test data: ``data_dir`` or the installed Fashion-MNIST,
    or an ImageFolder tree ``DIR/train``, ``DIR/val``; the first ``subset`` images of each."""
    if recipe.data == "fashion-mnist":
        from largebatch.fashion_mnist import fashion_mnist_tensors, load_fashion_mnist

        if data_dir is not None and not Path(data_dir).is_dir():
            raise _fail(f"data directory not found: {data_dir}")
        try:
            train_xy = fashion_mnist_tensors(*load_fashion_mnist("train", data_dir), subset)
            test_xy = fashion_mnist_tensors(*load_fashion_mnist("test", data_dir), subset)
        except (OSError, ValueError, EOFError) as err:  # missing, corrupt (checksum), unreadable
            raise _fail(str(err)) from None
        return TrainData(train_xy, test_xy, 10, len(train_xy[1]))
    # ImageNet recipes: an ImageFolder tree DIR/train/<class>/*.jpeg and DIR/val/<class>/*.
    if data_dir is None:
        raise _fail(
            f"recipe {recipe.name!r} trains on ImageNet: pass --data DIR, an "
            "ImageFolder tree with DIR/train and DIR/val"
        )
    root = Path(data_dir)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise _fail(f"data directory not found: {root / split}")
    from torchvision import transforms as T

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = _image_folder(
        root / "train", T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm])
    )
    if len(train.classes) < 2:
        raise _fail(
            f"ImageFolder tree {root / 'train'} has {len(train.classes)} class "
            f"({', '.join(train.classes)}); a classifier needs at least 2"
        )
    test = _image_folder(root / "val", T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    if test.classes != train.classes:
        missing = sorted(set(train.classes) - set(test.classes))
        extra = sorted(set(test.classes) - set(train.classes))
        raise _fail(
            f"the classes of {root / 'val'} differ from those of {root / 'train'}, so its "
            "labels would not match: "
            + "; ".join(
                [f"missing in val: {', '.join(missing)}"] * bool(missing)
                + [f"not in train: {', '.join(extra)}"] * bool(extra)
            )
        )
    num_classes = len(train.classes)
    if subset is not None:
        train = torch.utils.data.Subset(train, range(min(subset, len(train))))
        test = torch.utils.data.Subset(test, range(min(subset, len(test))))
    return TrainData(train, test, num_classes, len(train))


class StreamSampler(torch.utils.data.Sampler[int]):
    """This process's images for global steps ``start`` to ``stop`` of one stream of
    shuffled passes over ``n`` images: pass ``p`` is ``torch.randperm(n)`` drawn with seed
    ``seed + p``, the passes follow each other without a gap, global step ``s`` takes the
    stream's images ``s * batch`` to ``(s + 1) * batch``, and process ``rank`` of ``world``
    the ``rank``-th equal slice of those. A batch may span two passes; where an epoch ends
    is the recipe's (``Recipe.epoch_end``), so a resumed run reads the same images."""

    def __init__(self, n: int, batch: int, rank: int, world: int, seed: int, start: int, stop: int) -> None:
        if batch % world:
            raise ValueError(f"batch {batch} is not divisible by the world size {world}")
        self.n, self.batch, self.rank, self.world = n, batch, rank, world
        self.seed, self.start, self.stop = seed, start, stop

    def __len__(self) -> int:
        return (self.stop - self.start) * (self.batch // self.world)

    def __iter__(self) -> Iterator[int]:
        local = self.batch // self.world
        steps = torch.arange(self.start, self.stop).unsqueeze(1)
        where = (steps * self.batch + self.rank * local + torch.arange(local)).flatten()
        passes = where // self.n
        order = torch.empty_like(where)
        for p in passes.unique().tolist():
            chosen = passes == p
            perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + p))
            order[chosen] = perm[where[chosen] % self.n]
        return iter(order.tolist())


def epoch_sampler(
    recipe: Recipe, n: int, batch: int, rank: int, world: int, seed: int, epoch: int
) -> torch.utils.data.Sampler[int]:
    """This process's images for epoch ``epoch`` (from 0) under the recipe's
    ``epoch_steps``: for ``floor``, a fresh shuffle of the ``n`` images split over the
    processes, the remainder dropped (``DistributedSampler``); otherwise the steps
    ``Recipe.epoch_end(epoch)`` to ``Recipe.epoch_end(epoch + 1)`` of a
    :class:`StreamSampler`."""
    if recipe.epoch_steps == "floor":
        images = cast("torch.utils.data.Dataset[int]", range(n))  # the sampler needs only its length
        sampler: torch.utils.data.DistributedSampler[int] = torch.utils.data.DistributedSampler(
            images, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        sampler.set_epoch(epoch)
        return sampler
    return StreamSampler(
        n, batch, rank, world, seed, recipe.epoch_end(epoch, n, batch), recipe.epoch_end(epoch + 1, n, batch)
    )


def batches(
    data: Any,
    sampler: Any,
    batch: int,
    workers: int,
    device: torch.device,
    dtype: torch.dtype,
    augment: torch.Generator | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This process's batches of one epoch in the sampler's order (partial batch dropped),
    on ``device``: images as ``dtype``, channels-last; with an ``augment`` generator, each
    batch cropped and flipped by :func:`random_crop_flip` (padding 2) on ``device``."""
    for x, y in _cpu_batches(data, sampler, batch, workers):
        x = x.to(device, dtype, memory_format=torch.channels_last)
        yield (x if augment is None else random_crop_flip(x, augment)), y.to(device)


def augment_generator(seed: int, epoch: int, rank: int = 0, world: int = 1) -> torch.Generator:
    """The generator of ``--augment``'s draws in epoch ``epoch`` (from 0) on process ``rank``
    of ``world``: seeded with ``(seed * 1_000_003 + epoch) * world + rank``, so each epoch
    and process has its own stream, and a resumed run draws the crops it would have drawn."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * world + rank)


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 2) -> torch.Tensor:
    """Each image of the batch ``x`` (N, C, H, W) cropped back to H x W at a random offset of
    itself zero-padded by ``padding`` on every side, and flipped left-right with probability
    1/2: the standard small-image augmentation, on a whole batch on its own device.

    The draws come from ``generator`` (a CPU generator) in this order, which fixes what a
    seed gives: the N row offsets ``dy``, then the N column offsets ``dx`` (each uniform in
    0 to ``2 padding``: ``torch.randint(0, 2 padding + 1, (N,))``), then the N flips
    (``torch.randint(0, 2, (N,))``, 1 flips). Image i is the padded image's rows ``dy[i]``
    to ``dy[i] + H`` and columns ``dx[i]`` to ``dx[i] + W``, then flipped. ``padding=0``
    flips only. One pad and one gather, no loop over the images; the output keeps ``x``'s
    dtype, device and memory format (channels-last or contiguous)."""
    padding = checks.integer("padding", padding, 0)
    n, _, h, w = x.shape
    dy = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (n,), generator=generator)
    flip = torch.randint(0, 2, (n,), generator=generator).bool()
    cols = dx[:, None] + torch.arange(w)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    rows = (dy[:, None] + torch.arange(h)).to(x.device)
    cols, images = cols.to(x.device), torch.arange(n, device=x.device)
    padded = F.pad(x, (padding,) * 4) if padding else x
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        # Gathered as (N, H, W, C), which is channels-last (N, C, H, W) in memory.
        nhwc = padded.permute(0, 2, 3, 1)[images[:, None, None], rows[:, :, None], cols[:, None, :]]
        return nhwc.permute(0, 3, 1, 2)
    channels = torch.arange(x.shape[1], device=x.device)
    return padded[
        images[:, None, None, None],
        channels[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]


def _cpu_batches(data: Any, sampler: Any, batch: int, workers: int) -> Iterator[Any]:
    if isinstance(data, tuple):
        order = torch.tensor(list(sampler))
        for i in range(len(order) // batch):
            idx = order[i * batch : (i + 1) * batch]
            yield data[0][idx], data[1][idx]
    else:
        for item in torch.utils.data.DataLoader(
            data, batch_size=batch, sampler=sampler, drop_last=True, num_workers=workers, collate_fn=_collate
        ):
            yield _checked(item)


def eval_chunks(data: Any, rank: int, world: int, workers: int) -> Batches:
    """This process's shard of the test set, every ``world``-th image from ``rank`` on, in
    chunks for :func:`largebatch.training.loop.evaluate`."""
    if isinstance(data, tuple):
        return tensor_chunks(data[0][rank::world], data[1][rank::world], 1000)
    shard = torch.utils.data.Subset(data, range(rank, len(data), world))
    return map(
        _checked, torch.utils.data.DataLoader(shard, batch_size=256, num_workers=workers, collate_fn=_collate)
    )
