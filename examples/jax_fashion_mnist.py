"""Train a small Flax (nnx) network on Fashion-MNIST with LARS or LAMB, warmup and poly decay.

    python examples/jax_fashion_mnist.py --optimizer lamb --batch-size 1024 --epochs 5
    python examples/jax_fashion_mnist.py --optimizer lars --subset 6000 --epochs 2

Biases are excluded from the trust ratio and weight decay (``exclusion_mask``), the peak
rate follows the linear scaling rule, and the rate warms up linearly before a poly (power
2) decay. Prints the test accuracy.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from largebatch.fashion_mnist import load_fashion_mnist
from largebatch.jax import exclusion_mask, lamb, lars, linear_scaling, make_schedule

# Peak rate per 256 examples, scaled linearly with the batch size.
BASE_LR = {"lars": 2.0, "lamb": 0.02}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, hidden: int = 256):
        self.hidden = nnx.Linear(28 * 28, hidden, rngs=rngs)
        self.out = nnx.Linear(hidden, 10, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(nnx.relu(self.hidden(x)))


def prepare(split: str, subset: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    images, labels = load_fashion_mnist(split)
    if subset:
        images, labels = images[:subset], labels[:subset]
    x = images.reshape(len(images), -1).astype(np.float32) / 255.0
    return (x - 0.2860) / 0.3530, labels.astype(np.int32)  # the training set's mean and std


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=("lars", "lamb"), default="lamb")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--subset", type=int, default=None, help="train on the first N images")
    parser.add_argument("--warmup-epochs", type=float, default=1.0)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    x_train, y_train = prepare("train", args.subset)
    x_test, y_test = prepare("test")
    steps_per_epoch = len(x_train) // args.batch_size
    if steps_per_epoch == 0:
        parser.error(f"--batch-size {args.batch_size} exceeds the {len(x_train)} training images")
    total = args.epochs * steps_per_epoch
    schedule = make_schedule(
        "poly",
        peak_lr=linear_scaling(BASE_LR[args.optimizer], args.batch_size),
        total_steps=total,
        warmup_steps=min(total, round(args.warmup_epochs * steps_per_epoch)),
    )
    make = lars if args.optimizer == "lars" else lamb
    tx = make(schedule, weight_decay=args.weight_decay, trust_ratio_mask=exclusion_mask)

    graphdef, params = nnx.split(MLP(nnx.Rngs(args.seed)), nnx.Param)
    opt_state = tx.init(params)

    def loss_fn(params, x, y):
        logits = nnx.merge(graphdef, params)(x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def accuracy(params, x, y):
        return jnp.mean(jnp.argmax(nnx.merge(graphdef, params)(x), -1) == y)

    rng = np.random.default_rng(args.seed)
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_train))
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx])
        print(f"epoch {epoch + 1}/{args.epochs}  last batch loss {float(loss):.4f}")
    acc = float(accuracy(params, x_test, y_test))
    run = f"{args.optimizer}, batch {args.batch_size}, {len(x_train)} training images"
    print(f"test accuracy: {acc:.4f} ({run})")
    return acc


if __name__ == "__main__":
    main()
