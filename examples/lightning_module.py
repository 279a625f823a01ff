"""Train a small network with PyTorch Lightning and our LARS (or LAMB), logging the trust
ratio of every layer by name.

    python examples/lightning_module.py --max-steps 60
    python examples/lightning_module.py --optimizer lamb --lr 0.02

``configure_optimizers`` returns our optimizer, with biases and BatchNorm excluded from
weight decay and the trust ratio, and its warmup-then-poly schedule stepped every step;
``TrustRatioCallback`` logs ``trust_ratio/<name>`` every few steps to the Trainer's
logger (here its ``callback_metrics``). The data are made up: two Gaussian blobs per
class. Prints the last loss and the trust ratios.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from largebatch.integrations.lightning import TrustRatioCallback, configure_optimizers
from largebatch.schedules import make_schedule


class Classifier(pl.LightningModule):
    def __init__(self, optimizer: str = "lars", lr: float = 2.0, total_steps: int = 60) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        schedule = make_schedule(
            "poly", peak_lr=hp.lr, total_steps=hp.total_steps, warmup_steps=hp.total_steps // 10
        )
        return configure_optimizers(self, hp.optimizer, schedule, weight_decay=5e-4)


def made_up_data(n: int = 2048, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    centers = 3.0 * torch.randn(8, 16, generator=generator)
    which = torch.randint(0, 8, (n,), generator=generator)
    x = centers[which] + torch.randn(n, 16, generator=generator)
    return TensorDataset(x, which % 4)


def main(argv: list[str] | None = None) -> pl.Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("lars", "lamb"), default="lars")
    parser.add_argument("--lr", type=float, default=None, help="peak rate (default: LARS 2.0, LAMB 0.02)")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--log-every", type=int, default=10, help="steps between trust-ratio logs")
    args = parser.parse_args(argv)

    pl.seed_everything(0, verbose=False)
    lr = args.lr or {"lars": 2.0, "lamb": 0.02}[args.optimizer]
    model = Classifier(args.optimizer, lr, args.max_steps)
    ratios = TrustRatioCallback(every_n_steps=args.log_every)
    trainer = pl.Trainer(
        max_steps=args.max_steps,
        accelerator="cpu",
        callbacks=[ratios],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(made_up_data(), batch_size=args.batch_size, shuffle=True)
    trainer.fit(model, loader)
    print(f"last loss: {float(trainer.callback_metrics['loss']):.4f}")
    for name, ratio in ratios.latest.items():
        print(f"trust ratio of {name}: {ratio:.4g}")
    return trainer


if __name__ == "__main__":
    main()
