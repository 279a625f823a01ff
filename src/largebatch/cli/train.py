"""``largebatch train``: the flags, checked, then the run (:func:`largebatch.training.train`)."""

from __future__ import annotations

import argparse
import math

import torch.distributed as dist

from largebatch.outputs import require
from largebatch.recipes.registry import COMPRESSIONS, DEFAULT_RECIPE, PRECISIONS, RECIPES
from largebatch.training import check_loggers, fail, train

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``largebatch train`` flags; every recipe value left unset keeps the recipe's."""
    add = parser.add_argument
    add(
        "--recipe",
        default=DEFAULT_RECIPE,
        help=f"recipe name (default %(default)s; 'largebatch recipes' lists {len(RECIPES)})",
    )
    add(
        "--data",
        default=None,
        metavar="DIR",
        help="ImageFolder tree (DIR/train, DIR/val) for "
        "ImageNet recipes; Fashion-MNIST idx folder otherwise (default: the installed copy)",
    )
    add("--batch-size", type=int, default=None, help="global batch (default: the recipe's)")
    add(
        "--micro-batch",
        type=int,
        default=None,
        help="per-process micro-batch; smaller than the per-process batch: gradient accumulation",
    )
    add(
        "--ghost-batch",
        type=int,
        default=None,
        metavar="G",
        help="ghost batch norm: batch norm over chunks of G samples of each process's "
        "micro-batch, which G must divide (Hoffer et al. 2017)",
    )
    add(
        "--augment",
        action="store_true",
        help="crop each training image at a random offset of it zero-padded by 2 and flip it "
        "left-right with probability 1/2 (Fashion-MNIST recipes; drawn from --seed)",
    )
    add(
        "--epochs",
        type=int,
        default=None,
        help="epochs (default: the recipe's; another number "
        "scales the recipe's warmup and milestones with it)",
    )
    add("--lr", type=float, default=None, help="peak lr (default: the recipe's, scaled to the batch)")
    add("--precision", choices=PRECISIONS, default=None, help="default: the recipe's")
    add("--out", default=None, metavar="DIR", help="output folder (default runs/RECIPE); one run at a time")
    add("--resume", action="store_true", help="continue from OUT/checkpoint.pt (same settings)")
    add(
        "--stop-after",
        type=int,
        default=None,
        metavar="EPOCH",
        help="stop after this epoch (the schedule still spans --epochs); --resume continues",
    )
    add("--seed", type=int, default=0)
    add("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    add(
        "--subset",
        type=int,
        default=None,
        metavar="N",
        help="first N train (and test) images "
        "(the ImageNet-equivalent batch stays that of the full training set)",
    )
    add("--workers", type=int, default=4, help="data-loader workers for ImageFolder data")
    add(
        "--fsdp",
        action="store_true",
        help="under torchrun: shard params, grads and optimizer "
        "state with FSDP2 (fully_shard) instead of replicating them with DDP; trust ratios "
        "use each whole param's norm",
    )
    add(
        "--compression",
        choices=COMPRESSIONS,
        default="none",
        help="under torchrun: compress DDP's gradient all-reduce with AdaComp (a communication "
        "hook; docs/communication.md) after --compression-warmup epochs uncompressed",
    )
    add(
        "--compression-warmup",
        type=int,
        default=1,
        metavar="EPOCHS",
        help="epochs of plain all-reduce before AdaComp starts (default %(default)s)",
    )
    add(
        "--trust-ratio-every",
        type=int,
        default=50,
        metavar="N",
        help="sample the trust ratios by parameter name every N steps and at each epoch's "
        "last step (OUT/trust_ratios.jsonl; default %(default)s)",
    )
    add(
        "--tensorboard",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="also log the metrics and trust ratios as TensorBoard events in DIR (default OUT/tensorboard)",
    )
    add("--wandb", default=None, metavar="PROJECT", help="also log them to a Weights & Biases run of PROJECT")


def main(args: argparse.Namespace) -> int:
    """Check the flags, then train; the process group, if joined, is left at the end."""
    for flag in (
        "batch_size",
        "micro_batch",
        "ghost_batch",
        "epochs",
        "subset",
        "stop_after",
        "trust_ratio_every",
    ):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise fail(f"invalid --{flag.replace('_', '-')} {value} (must be >= 1)")
    if args.workers < 0:
        raise fail(f"invalid --workers {args.workers} (must be >= 0)")
    if args.compression_warmup < 0:
        raise fail(f"invalid --compression-warmup {args.compression_warmup} (must be >= 0)")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise fail(f"invalid --lr {args.lr} (must be a finite number > 0)")
    require("train", ("tqdm", "matplotlib"))
    check_loggers(args.tensorboard, args.wandb)
    try:
        train(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
