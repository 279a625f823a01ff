"""A steps study run's two costs on the CPU: its training step in micro-batches of
several sizes, and its scoring of the validation split in chunks of several sizes.

    .venv/bin/python benchmarks/study_cpu.py
    .venv/bin/python benchmarks/study_cpu.py --models small_resnet --batch 4096 --micro 128,1024

A run of ``largebatch steps`` trains a batch above the ghost batch in micro-batches
(:func:`largebatch.study.steps.trial.micro_batch`), their gradients summed and batch
norm's running statistics folded into one update (``StepStatistics``): the same step
whatever the micro-batch. This times that step, as a run takes it (ghost batch norm over
128 images, channels-last, Nesterov momentum, one torch thread), on random images for
each model, batch and micro-batch (the whole batch too), and prints images a second and
each micro-batch's speed over the whole batch's. Then it times the scoring
(:func:`largebatch.training.loop.evaluate`, as a run scores its 10,000 validation images)
in chunks of each ``--eval-chunks`` size. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from largebatch.recipes.build import build_model
from largebatch.study.steps.trial import StepStatistics
from largebatch.training.loop import evaluate, tensor_chunks, train_epoch


def images_per_second(model_name: str, batch: int, micro: int | None, ghost: int, steps: int) -> float:
    """Images a second of ``steps`` training steps (after one untimed step)."""
    torch.manual_seed(0)
    model = build_model(model_name, 10, ghost_batch=ghost).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    statistics = StepStatistics(model) if micro else None
    x = torch.randn(batch, 1, 28, 28).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,))

    def run(n: int) -> None:
        train_epoch(
            model,
            ((x, y) for _ in range(n)),
            optimizer,
            scheduler,
            nn.CrossEntropyLoss(),
            micro_batch=micro,
            before_step=statistics.step if statistics else None,
        )

    run(1)
    start = time.perf_counter()
    run(steps)
    return steps * batch / (time.perf_counter() - start)


def scoring_seconds(model_name: str, chunk: int, ghost: int, images: int = 10_000) -> float:
    """Seconds to score ``images`` random images in chunks of ``chunk`` (after one untimed
    chunk), in eval mode."""
    torch.manual_seed(0)
    model = build_model(model_name, 10, ghost_batch=ghost).to(memory_format=torch.channels_last)
    x = torch.randn(images, 1, 28, 28).to(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (images,))
    evaluate(model, tensor_chunks(x[:chunk], y[:chunk], chunk), device="cpu")
    start = time.perf_counter()
    evaluate(model, tensor_chunks(x, y, chunk), device="cpu")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="fmnist_cnn,fmnist_alexnet_bn,small_resnet")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--micro", default="128,256,1024", help="micro-batches, each dividing --batch")
    parser.add_argument("--ghost-batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--eval-chunks", default="2000,500,128", help="scoring chunks (images)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    micros = [int(m) for m in args.micro.split(",")]
    if any(args.batch % m for m in micros):
        parser.error(f"every --micro must divide --batch {args.batch}, got {args.micro}")
    print(
        f"B = {args.batch:,}, ghost batch {args.ghost_batch}, one thread: images a second (x the whole batch)"
    )
    print("| model | whole | " + " | ".join(f"micro {m:,}" for m in micros) + " |")
    print("|---|---:|" + "---:|" * len(micros))
    for name in args.models.split(","):
        whole = images_per_second(name, args.batch, None, args.ghost_batch, args.steps)
        cells = [
            f"{v:,.0f} ({v / whole:.2f}x)"
            for v in (images_per_second(name, args.batch, m, args.ghost_batch, args.steps) for m in micros)
        ]
        print(f"| {name} | {whole:,.0f} | " + " | ".join(cells) + " |", flush=True)
    chunks = [int(c) for c in args.eval_chunks.split(",")]
    print()
    print("Scoring 10,000 images, one thread: seconds (x the first chunk's speed)")
    print("| model | " + " | ".join(f"chunk {c:,}" for c in chunks) + " |")
    print("|---|" + "---:|" * len(chunks))
    for name in args.models.split(","):
        seconds = [scoring_seconds(name, c, args.ghost_batch) for c in chunks]
        cells = [f"{s:.2f} ({seconds[0] / s:.2f}x)" for s in seconds]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
