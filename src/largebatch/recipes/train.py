"""``largebatch train``: run a named recipe (``largebatch.recipes.registry``) end to end.

One process, or many under ``torchrun`` (``RANK``/``WORLD_SIZE`` set): gloo on CPU,
NCCL on CUDA, ``DistributedDataParallel``, the recipe's global batch split evenly across
processes, gradient accumulation when ``--micro-batch`` is smaller than a process's share.
Before every evaluation the processes average their batch-norm running statistics, so
the test accuracy and the checkpoint are those of one model.

Every epoch appends a line to ``OUT/metrics.jsonl`` (train loss, test accuracy, lr,
images/s, min/median/max trust ratio over the adapted layers) and rewrites
``OUT/checkpoint.pt`` (model, optimizer, scheduler, GradScaler, epoch, RNG, the run's
settings) and ``OUT/plot.png``; the run ends with ``OUT/summary.json``. Every file is
replaced atomically (``largebatch.recipes.outputs.atomic_write``), and a lock on ``OUT``
keeps a second run out of it. ``--resume`` continues from the checkpoint, refuses
settings other than the run's own, and gives the same parameters as an uninterrupted run.

``--epochs`` other than the recipe's scales the recipe's warmup and milestones with it
(``Recipe.with_epochs``).

The trust ratio is recomputed here from params and gradients with the optimizer's own
formula (DESIGN §2) at the last step of each epoch; for SGD it is the ratio LARS would
apply, a diagnostic only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from largebatch.recipes.outputs import (
    CommandError, atomic_write, figure, lock_folder, plot_or_warn, remove_stale_temporaries,
    require,
)
from largebatch.recipes.registry import (
    DEFAULT_RECIPE, PRECISIONS, RECIPES, TRAIN_IMAGES, Recipe, get_recipe, imagenet_equivalent,
)
from largebatch.torch import LAMB, LARS, ScheduleLR, make_schedule, param_groups, to_half

__all__ = ["build_model", "build_optimizer", "trust_ratios", "train", "add_arguments", "main"]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _fail(message: str) -> CommandError:
    return CommandError("train", message)


# --------------------------------------------------------------------------- models


def alexnet_bn(num_classes: int = 1000) -> nn.Sequential:
    """torchvision's AlexNet layout with batch norm after every conv and hidden linear layer
    (conv and linear biases dropped where BN follows), as in You, Gitman, Ginsburg 2017."""
    from torchvision.models import alexnet

    base = alexnet(num_classes=num_classes)
    features: list[nn.Module] = []
    for m in base.features:
        if isinstance(m, nn.Conv2d):
            features += [nn.Conv2d(m.in_channels, m.out_channels, m.kernel_size, m.stride,
                                   m.padding, bias=False), nn.BatchNorm2d(m.out_channels)]
        else:
            features.append(m)
    classifier: list[nn.Module] = []
    linears = [m for m in base.classifier if isinstance(m, nn.Linear)]
    for m in base.classifier:
        if isinstance(m, nn.Linear) and m is not linears[-1]:
            classifier += [nn.Linear(m.in_features, m.out_features, bias=False),
                           nn.BatchNorm1d(m.out_features)]
        else:
            classifier.append(m)
    return nn.Sequential(*features, base.avgpool, nn.Flatten(), *classifier)


def build_model(name: str, num_classes: int) -> nn.Module:
    """``resnet50`` (torchvision, zero-init residual BN), ``alexnet_bn`` or ``small_cnn``."""
    if name == "resnet50":
        from torchvision.models import resnet50

        return resnet50(num_classes=num_classes, zero_init_residual=True)
    if name == "alexnet_bn":
        return alexnet_bn(num_classes)
    if name == "small_cnn":
        from largebatch.recipes.models import small_cnn

        return small_cnn(num_classes)
    raise ValueError(f"Unknown model {name!r}; known: resnet50, alexnet_bn, small_cnn")


# --------------------------------------------------------------------------- optimizer


def build_optimizer(
    recipe: Recipe, model: nn.Module, lr: float, precision: str = "fp32"
) -> torch.optim.Optimizer:
    """The recipe's optimizer. LARS/LAMB: ``param_groups`` (biases and BN excluded),
    fp32 masters for half params. SGD/Nesterov: weight decay on every param (Goyal et al.)."""
    kw, half = dict(recipe.optimizer_kwargs), precision != "fp32"
    if recipe.optimizer in ("lars", "lamb"):
        cls = LARS if recipe.optimizer == "lars" else LAMB
        return cls(param_groups(model, recipe.weight_decay), lr=lr, master_weights=half, **kw)
    if half:
        raise ValueError(
            f"precision {precision!r} needs fp32 master weights, which only the LARS and "
            f"LAMB recipes keep; recipe {recipe.name!r} uses {recipe.optimizer}"
        )
    return torch.optim.SGD(model.parameters(), lr=lr, weight_decay=recipe.weight_decay,
                           nesterov=recipe.optimizer == "nesterov", **{"momentum": 0.9, **kw})


@torch.no_grad()
def trust_ratios(optimizer: torch.optim.Optimizer, grad_scale: float = 1.0) -> list[float]:
    """The trust ratio of every adapted tensor, from its param and (unscaled) gradient.

    LAMB: ``||w|| / ||r + wd * w||`` with the moments this step would produce; LARS, and
    SGD as a diagnostic: ``tc * ||w|| / (||g|| + wd * ||w|| + eps)``. Ratio 1 on a zero norm.
    """
    out = []
    lamb, layerwise = isinstance(optimizer, LAMB), isinstance(optimizer, (LARS, LAMB))
    groups = [g for g in optimizer.param_groups if g.get("trust_ratio", True)]
    clip = 1.0
    if lamb and optimizer.max_grad_norm is not None:
        norms = [p.grad.float().norm() / grad_scale for g in optimizer.param_groups
                 for p in g["params"] if p.grad is not None]
        clip = max(1.0, float(torch.stack(norms).norm()) / optimizer.max_grad_norm)
    for group in groups:
        wd = group["weight_decay"]
        for p in group["params"]:
            if p.grad is None or (not layerwise and p.ndim <= 1):  # SGD: skip biases, BN
                continue
            state = optimizer.state.get(p, {})
            w = state.get("master_param", p).float()
            g = p.grad.float() / (grad_scale * clip)
            w_norm = w.norm()
            if lamb:
                b1, b2 = group["betas"]
                t = int(state["step"]) + 1 if "step" in state else 1
                m = b1 * state["exp_avg"] + (1 - b1) * g if "exp_avg" in state else (1 - b1) * g
                v = (b2 * state["exp_avg_sq"] + (1 - b2) * g * g if "exp_avg_sq" in state
                     else (1 - b2) * g * g)
                if group["bias_correction"]:
                    m, v = m / (1 - b1**t), v / (1 - b2**t)
                other = (m / (v.sqrt() + group["eps"]) + wd * w).norm()
                ratio = w_norm / other
            else:
                tc = group.get("trust_coefficient", 0.001)
                other = g.norm()
                ratio = tc * w_norm / (other + wd * w_norm + group.get("eps", 0.0))
            out.append(1.0 if w_norm == 0 or other == 0 else float(ratio))
    return out


# --------------------------------------------------------------------------- data


@dataclasses.dataclass
class _Data:
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


def _load_data(recipe: Recipe, data_dir: str | None, subset: int | None) -> _Data:
    if recipe.data == "fashion-mnist":
        from largebatch.recipes.data import fashion_mnist_tensors, load_fashion_mnist

        if data_dir is not None and not Path(data_dir).is_dir():
            raise _fail(f"data directory not found: {data_dir}")
        try:
            train = fashion_mnist_tensors(*load_fashion_mnist("train", data_dir), subset)
            test = fashion_mnist_tensors(*load_fashion_mnist("test", data_dir), subset)
        except (OSError, ValueError, EOFError) as err:  # missing, corrupt (checksum), unreadable
            raise _fail(str(err)) from None
        return _Data(train, test, 10, len(train[1]))
    # ImageNet recipes: an ImageFolder tree DIR/train/<class>/*.jpeg and DIR/val/<class>/*.
    if data_dir is None:
        raise _fail(f"recipe {recipe.name!r} trains on ImageNet: pass --data DIR, an "
                    "ImageFolder tree with DIR/train and DIR/val")
    root = Path(data_dir)
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise _fail(f"data directory not found: {root / split}")
    from torchvision import transforms as T

    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train = _image_folder(root / "train", T.Compose(
        [T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(), norm]))
    if len(train.classes) < 2:
        raise _fail(f"ImageFolder tree {root / 'train'} has {len(train.classes)} class "
                    f"({', '.join(train.classes)}); a classifier needs at least 2")
    test = _image_folder(root / "val", T.Compose(
        [T.Resize(256), T.CenterCrop(224), T.ToTensor(), norm]))
    if test.classes != train.classes:
        missing = sorted(set(train.classes) - set(test.classes))
        extra = sorted(set(test.classes) - set(train.classes))
        raise _fail(
            f"the classes of {root / 'val'} differ from those of {root / 'train'}, so its "
            "labels would not match: " + "; ".join(
                [f"missing in val: {', '.join(missing)}"] * bool(missing)
                + [f"not in train: {', '.join(extra)}"] * bool(extra)))
    num_classes = len(train.classes)
    if subset is not None:
        train = torch.utils.data.Subset(train, range(min(subset, len(train))))
        test = torch.utils.data.Subset(test, range(min(subset, len(test))))
    return _Data(train, test, num_classes, len(train))


def _batches(data: Any, sampler: Any, batch: int, workers: int):  # noqa: ANN202
    """Per-process batches of one epoch in the sampler's order (partial batch dropped)."""
    if isinstance(data, tuple):
        order = torch.tensor(list(sampler))
        for i in range(len(order) // batch):
            idx = order[i * batch : (i + 1) * batch]
            yield data[0][idx], data[1][idx]
    else:
        for item in torch.utils.data.DataLoader(data, batch_size=batch, sampler=sampler,
                                                drop_last=True, num_workers=workers,
                                                collate_fn=_collate):
            yield _checked(item)


@torch.no_grad()
def _evaluate(model: nn.Module, data: Any, dtype: torch.dtype, device: torch.device,
              rank: int, world: int, workers: int) -> float:
    """Top-1 accuracy: each process scores every world-th test image; the counts are summed."""
    model.eval()
    if isinstance(data, tuple):
        x, y = data[0][rank::world], data[1][rank::world]
        chunks = zip(x.split(1000), y.split(1000))
    else:
        shard = torch.utils.data.Subset(data, range(rank, len(data), world))
        chunks = map(_checked, torch.utils.data.DataLoader(
            shard, batch_size=256, num_workers=workers, collate_fn=_collate))
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    for xb, yb in chunks:
        xb, yb = xb.to(device, dtype), yb.to(device)
        counts += torch.tensor([int((model(xb).argmax(1) == yb).sum()), len(yb)],
                               dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(counts)
    model.train()
    return float(counts[0] / counts[1])


@torch.no_grad()
def _sync_buffers(model: nn.Module, world: int) -> None:
    """Average the floating buffers (batch-norm running mean and variance) over the
    processes; the others (``num_batches_tracked``) take rank 0's values. Params are equal
    on every rank already; after this the whole model is."""
    if world == 1:
        return
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer)
            buffer.div_(world)
        else:
            dist.broadcast(buffer, 0)


# --------------------------------------------------------------------------- outputs


def _plot(history: list[dict[str, Any]], path: Path, title: str) -> None:
    ep = [h["epoch"] for h in history]
    with figure(path, 2, 2, figsize=(10, 7)) as (fig, axes):
        panels = [("test accuracy", ["test_accuracy"]), ("train loss", ["train_loss"]),
                  ("lr (end of epoch)", ["lr"]),
                  ("trust ratio", ["trust_ratio_min", "trust_ratio_median", "trust_ratio_max"])]
        for ax, (label, keys) in zip(axes.flat, panels):
            for key in keys:
                values = [h.get(key) for h in history]
                if any(v is not None for v in values):
                    ax.plot(ep, [float("nan") if v is None else v for v in values], marker="o",
                            label=key.removeprefix("trust_ratio_"))
            ax.set_title(label)
            ax.set_xlabel("epoch")
            if label == "trust ratio":
                ax.set_yscale("log")
                ax.legend()
        fig.suptitle(title)


class _Plotter:
    """Rewrites the plot; a failure (say, matplotlib missing) is a warning, printed once,
    and never costs the run its other outputs."""

    def __init__(self, path: Path, title: str) -> None:
        self.path, self.title, self.failed = path, title, False

    def __call__(self, history: list[dict[str, Any]]) -> None:
        if not self.failed:
            self.failed = not plot_or_warn(
                "train", self.path, lambda: _plot(history, self.path, self.title),
                "; the metrics, checkpoint and summary are unaffected")


def _sha256(tensors: Any) -> str:
    digest = hashlib.sha256()
    for name, t in tensors:
        digest.update(name.encode())
        t = t.detach().cpu()
        digest.update((t.float() if t.is_floating_point() else t).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _params_sha256(model: nn.Module) -> str:
    return _sha256(model.named_parameters())


def _buffers_sha256(model: nn.Module) -> str:
    return _sha256(model.named_buffers())


# --------------------------------------------------------------------------- training


def _device(device_arg: str | None) -> str:
    """The ``--device`` value checked against this machine: ``cpu``, ``cuda`` or ``cuda:N``."""
    if device_arg is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device_arg == "cpu":
        return device_arg
    match = re.fullmatch(r"cuda(?::(\d+))?", device_arg)
    if match is None:
        raise _fail(f"invalid --device {device_arg!r} (cpu, cuda or cuda:N)")
    if not torch.cuda.is_available():
        raise _fail(f"--device {device_arg}: no CUDA GPU is available here "
                    "(torch.cuda.is_available() is False); use --device cpu")
    if match[1] is not None and int(match[1]) >= torch.cuda.device_count():
        raise _fail(f"--device {device_arg}: this machine has {torch.cuda.device_count()} "
                    "CUDA GPU(s)")
    return device_arg


def _distributed(name: str) -> tuple[int, int, torch.device]:
    """``(rank, world_size, device)``; joins the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local}" if name == "cuda" and world > 1 else name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


_OUTPUTS = ("checkpoint.pt", "metrics.jsonl", "summary.json", "plot.png")
# The settings a checkpoint records and ``--resume`` must match, with their flags.
_SETTINGS = {"recipe": "--recipe", "batch_size": "--batch-size", "epochs": "--epochs",
             "lr": "--lr", "seed": "--seed", "subset": "--subset", "precision": "--precision"}


def _show(value: Any) -> str:
    return "unset" if value is None else str(value)


def _read_checkpoint(path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint to resume from, after checking that it was made with ``settings``."""
    if not path.is_file():
        raise _fail(f"--resume: no checkpoint at {path}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 -- any unreadable checkpoint is a user error
        raise _fail(f"--resume: cannot read {path} ({type(err).__name__}: {err})") from None
    saved = state.get("settings") or {"recipe": state.get("recipe")}
    for key, flag in _SETTINGS.items():
        if key in saved and saved[key] != settings[key]:
            raise _fail(f"--resume: {path} is a run with {flag} {_show(saved[key])}, not "
                        f"{_show(settings[key])}; resume it with its own settings, or start "
                        "a new run in another --out")
    return state


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.recipe`` with the command-line overrides; returns the summary (all ranks)."""
    try:
        recipe = get_recipe(args.recipe)
    except ValueError as err:
        raise _fail(str(err)) from None
    if recipe.data == "imagenet" or recipe.model != "small_cnn":
        require("train", ("torchvision",))
    batch = args.batch_size or recipe.batch_size
    epochs = args.epochs or recipe.epochs
    precision = args.precision or recipe.precision
    lr = args.lr if args.lr is not None else recipe.lr_for(batch)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if batch % world:
        raise _fail(f"batch size {batch} is not divisible by the world size {world}")
    local_batch = batch // world
    micro = args.micro_batch or local_batch
    if micro > local_batch or local_batch % micro:
        raise _fail(f"micro-batch {micro} must divide the per-process batch {local_batch} "
                    f"(batch {batch} / world size {world})")
    device_name = _device(args.device)
    out = Path(args.out or Path("runs") / recipe.name)
    settings = {"recipe": recipe.name, "batch_size": batch, "epochs": epochs, "lr": lr,
                "seed": args.seed, "subset": args.subset, "precision": precision}
    with contextlib.ExitStack() as held:
        if rank == 0:  # only rank 0 writes: it holds the folder for the whole run
            held.enter_context(lock_folder(out, "train"))
            remove_stale_temporaries(out, _OUTPUTS)
        state = _read_checkpoint(out / "checkpoint.pt", settings) if args.resume else None
        done, stop = (state["epoch"] if state else 0), min(epochs, args.stop_after or epochs)
        if done >= stop and (out / "summary.json").is_file():
            if rank == 0:
                print(f"largebatch train: {out} "
                      + (f"already finished: {done} of {epochs} epochs" if done >= epochs else
                         f"is already at epoch {done} of {epochs} (--stop-after {stop})")
                      + "; nothing to do", flush=True)
            return _read_summary(out / "summary.json")
        return _fit(args, recipe, settings, out, state, device_name, micro)


def _fit(args: argparse.Namespace, recipe: Recipe, settings: dict[str, Any], out: Path,
         state: dict[str, Any] | None, device_name: str, micro: int) -> dict[str, Any]:
    batch, epochs, lr = settings["batch_size"], settings["epochs"], settings["lr"]
    precision = settings["precision"]
    rank, world, device = _distributed(device_name)
    local_batch = batch // world
    data = _load_data(recipe, args.data, args.subset)
    steps_per_epoch = data.n_train // world // local_batch
    if steps_per_epoch < 1:
        raise _fail(f"{data.n_train} training images hold no full batch of {batch}")

    torch.manual_seed(args.seed)
    model = build_model(recipe.model, data.num_classes)
    model = model.to(device, memory_format=torch.channels_last)
    dtype = _DTYPES[precision]
    if precision != "fp32":
        to_half(model, dtype)
    try:
        optimizer = build_optimizer(recipe, model, lr, precision)
    except ValueError as err:
        raise _fail(str(err)) from None
    # The recipe's schedule, its warmup and milestones scaled to --epochs.
    shape = recipe.with_epochs(epochs)
    total = epochs * steps_per_epoch
    warmup_steps = min(round(shape.warmup_epochs * steps_per_epoch), total)
    schedule = make_schedule(
        shape.schedule, peak_lr=lr, total_steps=total, warmup_steps=warmup_steps,
        power=shape.power,
        milestones=sorted({round(m * steps_per_epoch) for m in shape.milestones
                           if warmup_steps <= round(m * steps_per_epoch) < total}),
    )
    scheduler = ScheduleLR(optimizer, schedule, follow_optimizer=hasattr(optimizer, "num_steps"))
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    loss_fn = nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)
    sampler = torch.utils.data.DistributedSampler(
        range(data.n_train), num_replicas=world, rank=rank, shuffle=True, seed=args.seed,
        drop_last=True)

    start_epoch, history = 0, []
    checkpoint = out / "checkpoint.pt"
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
        cpu_rng, cuda_rng = state["rng"][rank if len(state["rng"]) > rank else 0]
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None and device.type == "cuda":
            torch.cuda.set_rng_state(cuda_rng, device)
        start_epoch, history = state["epoch"], state["history"]
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    nominal = imagenet_equivalent(batch, TRAIN_IMAGES[recipe.data])
    stop = min(epochs, args.stop_after or epochs)
    if rank == 0:
        scaled = (f" (the recipe's {recipe.schedule_text} over {recipe.epochs} epochs, "
                  f"scaled to {epochs})" if shape.schedule_text != recipe.schedule_text else "")
        span = (f"epochs {start_epoch + 1}-{stop} of {epochs}" if start_epoch < stop else
                f"{start_epoch} of {epochs} epochs done, writing the summary")
        print(f"{recipe.name}: {recipe.model} on {recipe.data} ({data.n_train:,} images), batch "
              f"{batch:,} (ImageNet-equivalent {nominal:,}) "
              f"= {world} x {local_batch // micro} x {micro}, {recipe.optimizer} peak lr {lr:g}, "
              f"{precision}, {span} x {steps_per_epoch} steps; "
              f"schedule {shape.schedule_text}{scaled}", flush=True)

    from tqdm import tqdm

    plot = _Plotter(out / "plot.png", f"{recipe.name} (batch {batch:,})")
    accumulate = local_batch // micro
    acc = history[-1]["test_accuracy"] if history else float("nan")
    for epoch in range(start_epoch, stop):
        sampler.set_epoch(epoch)
        loss_sum, ratios, seen = torch.zeros((), device=device), [], 0
        bar = tqdm(total=steps_per_epoch, desc=f"epoch {epoch + 1}/{epochs}", unit="step",
                   disable=rank != 0 or None, leave=False)
        t0 = time.perf_counter()
        for step, (x, y) in enumerate(_batches(data.train, sampler, local_batch, args.workers)):
            x = x.to(device, dtype, memory_format=torch.channels_last)
            y = y.to(device)
            for k, (xm, ym) in enumerate(zip(x.split(micro), y.split(micro))):
                sync = k == accumulate - 1 or world == 1
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    loss = loss_fn(ddp(xm).float(), ym) / accumulate
                    (scaler.scale(loss) if scaler else loss).backward()
                loss_sum += loss.detach()
            if step == steps_per_epoch - 1:
                ratios = trust_ratios(optimizer, scaler.get_scale() if scaler else 1.0)
            if scaler:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            seen += batch
            bar.update()
            bar.set_postfix(img_s=f"{seen / (time.perf_counter() - t0):,.0f}")
        bar.close()
        seconds = time.perf_counter() - t0
        if world > 1:
            dist.all_reduce(loss_sum)
            loss_sum /= world
        _sync_buffers(model, world)  # one model: evaluated, checkpointed and summarized
        acc = _evaluate(model, data.test, dtype, device, rank, world, args.workers)
        row = {
            "epoch": epoch + 1, "train_loss": float(loss_sum) / steps_per_epoch,
            "test_accuracy": acc, "lr": optimizer.param_groups[0]["lr"],
            "images_per_second": seen / seconds, "seconds": seconds,
            "trust_ratio_min": min(ratios) if ratios else None,
            "trust_ratio_median": statistics.median(ratios) if ratios else None,
            "trust_ratio_max": max(ratios) if ratios else None,
        }
        history.append(row)
        rng = [(torch.get_rng_state(),
                torch.cuda.get_rng_state(device) if device.type == "cuda" else None)]
        if world > 1:
            mine, rng = rng[0], [None] * world
            dist.all_gather_object(rng, mine)
        if rank == 0:
            print(f"epoch {epoch + 1:>3}/{epochs}  train loss {row['train_loss']:.4f}  "
                  f"test acc {acc:.2%}  lr {row['lr']:.4g}  "
                  f"{row['images_per_second']:,.0f} img/s", flush=True)
            snapshot = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict() if scaler else None,
                        "epoch": epoch + 1, "rng": rng, "history": history,
                        "recipe": recipe.name, "settings": settings}
            atomic_write(checkpoint, lambda f: torch.save(snapshot, f))
            atomic_write(out / "metrics.jsonl", "".join(json.dumps(h) + "\n" for h in history))
            if epoch + 1 < stop:  # the last plot comes after the summary
                plot(history)

    summary = {
        "recipe": recipe.name, "test_accuracy": acc, "epochs": len(history),
        "batch_size": batch, "imagenet_equivalent_batch": nominal,
        "world_size": world, "precision": precision, "peak_lr": lr,
        "schedule": shape.schedule_text, "published_top1": recipe.published_top1,
        "params_sha256": _params_sha256(model), "buffers_sha256": _buffers_sha256(model),
        "images_per_second": statistics.mean(h["images_per_second"] for h in history)
        if history else None,
    }
    print(f"rank {rank}/{world}: params sha256 {summary['params_sha256']}", flush=True)
    print(f"rank {rank}/{world}: buffers sha256 {summary['buffers_sha256']}", flush=True)
    if rank == 0:
        atomic_write(out / "summary.json", json.dumps(summary, indent=2) + "\n")
        plot(history)
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``largebatch train`` flags; every recipe value left unset keeps the recipe's."""
    add = parser.add_argument
    add("--recipe", default=DEFAULT_RECIPE, help=f"recipe name (default %(default)s; "
        f"'largebatch recipes' lists {len(RECIPES)})")
    add("--data", default=None, metavar="DIR", help="ImageFolder tree (DIR/train, DIR/val) for "
        "ImageNet recipes; Fashion-MNIST idx folder otherwise (default: the installed copy)")
    add("--batch-size", type=int, default=None, help="global batch (default: the recipe's)")
    add("--micro-batch", type=int, default=None,
        help="per-process micro-batch; smaller than the per-process batch: gradient accumulation")
    add("--epochs", type=int, default=None, help="epochs (default: the recipe's; another number "
        "scales the recipe's warmup and milestones with it)")
    add("--lr", type=float, default=None,
        help="peak lr (default: the recipe's, scaled to the batch)")
    add("--precision", choices=PRECISIONS, default=None, help="default: the recipe's")
    add("--out", default=None, metavar="DIR", help="output folder (default runs/RECIPE); "
        "one run at a time")
    add("--resume", action="store_true", help="continue from OUT/checkpoint.pt (same settings)")
    add("--stop-after", type=int, default=None, metavar="EPOCH",
        help="stop after this epoch (the schedule still spans --epochs); --resume continues")
    add("--seed", type=int, default=0)
    add("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    add("--subset", type=int, default=None, metavar="N", help="first N train (and test) images")
    add("--workers", type=int, default=4, help="data-loader workers for ImageFolder data")


def main(args: argparse.Namespace) -> int:
    for flag in ("batch_size", "micro_batch", "epochs", "subset", "stop_after"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise _fail(f"invalid --{flag.replace('_', '-')} {value} (must be >= 1)")
    if args.workers < 0:
        raise _fail(f"invalid --workers {args.workers} (must be >= 0)")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise _fail(f"invalid --lr {args.lr} (must be a finite number > 0)")
    require("train", ("tqdm", "matplotlib"))
    try:
        train(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
