"""Fine-tune a small BERT classifier with Hugging Face's ``Trainer`` and our LAMB (or LARS).

    python examples/hf_trainer.py --max-steps 20
    python examples/hf_trainer.py --optimizer lars --lr 1.0 --max-steps 40

The model is built from a config (no download) and the data are made up: a sentence's
label says which half of the vocabulary its tokens come from. ``trainer_optimizers``
reads the rate, weight decay, warmup and schedule from ``TrainingArguments`` and gives
``Trainer(optimizers=...)`` our optimizer, with biases and LayerNorms excluded from
weight decay and the trust ratio, and its scheduler. LAMB is the one made for
transformers (LARS is offered for comparison). Prints the last training loss.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

from largebatch.integrations.huggingface import trainer_optimizers


def made_up_data(n: int, length: int = 12, vocab: int = 32, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=generator)
    half = vocab // 2
    ids = torch.randint(0, half, (n, length), generator=generator) + half * labels[:, None]
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def main(argv: list[str] | None = None) -> Trainer:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("lamb", "lars"), default="lamb")
    parser.add_argument("--lr", type=float, default=None, help="peak rate (default: LAMB 0.1, LARS 1.0)")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--examples", type=int, default=512)
    parser.add_argument("--output-dir", default=None, help="the Trainer's folder (default: a temporary one)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, num_labels=2,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as scratch:
        training = TrainingArguments(
            output_dir=args.output_dir or scratch,
            max_steps=args.max_steps,
            per_device_train_batch_size=args.batch_size,
            learning_rate=args.lr or {"lamb": 0.1, "lars": 1.0}[args.optimizer],
            weight_decay=0.01,
            warmup_steps=max(1, args.max_steps // 10),
            lr_scheduler_type="linear",  # our poly schedule with power 1
            logging_steps=max(1, args.max_steps // 4),
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            use_cpu=True,
        )
        trainer = Trainer(
            model=model,
            args=training,
            train_dataset=made_up_data(args.examples),
            optimizers=trainer_optimizers(model, training, args.optimizer),
        )
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    print(f"last training loss: {losses[-1]:.4f}")
    return trainer


if __name__ == "__main__":
    main()
