"""The study's model candidates: parameters, CPU cost per epoch and small-batch accuracy.

    .venv/bin/python benchmarks/fmnist_models.py                 # params and s/epoch
    .venv/bin/python benchmarks/fmnist_models.py --train 30      # + validation accuracy
    .venv/bin/python benchmarks/fmnist_models.py --only fmnist_cnn,fmnist_alexnet_bn

Cost: one torch thread (the study runs one thread per run, two runs at a time on two
cores), seconds per epoch of 60,000 images, timed over a few steps of random inputs at
B=128 and B=1536 with the optimizers of ``fmnist-sgd-128`` and ``fmnist-lars-1536``.
``--train N``: N epochs of momentum SGD at B=128 (lr 0.2, no warmup, poly 2, weight decay
5e-4 on every parameter, no label smoothing, seed 0) on the study's tuning split (50,000
images), scored on its 10,000 validation images. Candidates run one after another; run
it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from largebatch import models
from largebatch.recipes.build import build_optimizer
from largebatch.recipes.registry import get_recipe
from largebatch.torch import ScheduleLR, make_schedule
from largebatch.training.loop import evaluate, tensor_chunks, train_epoch

CANDIDATES = {
    "small_cnn (width 8, pooled head)": models.small_cnn,
    "fmnist_cnn (small_cnn width 8, 128 hidden)": models.fmnist_cnn,
    "small_cnn (width 16, 128 hidden)": functools.partial(models.small_cnn, width=16, hidden=128),
    "small_resnet (width 16, 1 block/stage)": models.small_resnet,
    "small_resnet (width 16, 2 blocks/stage)": functools.partial(models.small_resnet, blocks=2),
    "fmnist_alexnet_bn (width 8, 2x256 hidden)": models.fmnist_alexnet_bn,
    "fmnist_alexnet_bn (width 4, 2x128 hidden)": functools.partial(
        models.fmnist_alexnet_bn, width=4, hidden=128
    ),
}


def seconds_per_epoch(factory, batch: int, steps: int) -> float:
    torch.manual_seed(0)
    model = factory().to(memory_format=torch.channels_last)
    recipe = get_recipe("fmnist-sgd-128" if batch == 128 else "fmnist-lars-1536")
    opt = build_optimizer(recipe, model, recipe.peak_lr)
    x = torch.randn(batch, 1, 28, 28).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))
    for i in range(steps + 2):
        if i == 2:
            start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - start) / steps * 60_000 / batch


def validation_accuracy(factory, epochs: int) -> float:
    from largebatch.study.worker import init_worker, phase_tensors

    init_worker(1, None, "cpu")
    x, y, x_val, y_val = phase_tensors("tune", None)
    torch.manual_seed(0)
    model = factory().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=5e-4)
    steps = len(y) // 128
    sched = ScheduleLR(opt, make_schedule("poly", peak_lr=0.2, total_steps=epochs * steps))
    order = torch.Generator().manual_seed(0)
    loss = torch.nn.CrossEntropyLoss()
    for _ in range(epochs):
        perm = torch.randperm(len(y), generator=order)[: steps * 128]
        train_epoch(model, ((x[i], y[i]) for i in perm.split(128)), opt, sched, loss)
    return evaluate(model, tensor_chunks(x_val, y_val, 2000), device="cpu").accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--train",
        type=int,
        default=0,
        metavar="EPOCHS",
        help="also train each candidate and report validation accuracy",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps at B=128")
    parser.add_argument(
        "--only",
        default="",
        metavar="NAMES",
        help="comma-separated model names: only the candidates of these models",
    )
    args = parser.parse_args()
    wanted = [n for n in args.only.split(",") if n]
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread")
    print(
        "| candidate | params | s/epoch at B=128 | s/epoch at B=1536 |"
        + (f" val. acc. % ({args.train} epochs) |" if args.train else "")
    )
    print("|---|---:|---:|---:|" + ("---:|" if args.train else ""))
    for name, factory in CANDIDATES.items():
        if wanted and name.split(" ")[0] not in wanted:
            continue
        params = sum(p.numel() for p in factory().parameters())
        small = seconds_per_epoch(factory, 128, args.steps)
        large = seconds_per_epoch(factory, 1536, max(2, args.steps // 10))
        acc = f" {100 * validation_accuracy(factory, args.train):.2f} |" if args.train else ""
        print(f"| {name} | {params:,} | {small:.1f} | {large:.1f} |{acc}", flush=True)


if __name__ == "__main__":
    main()
