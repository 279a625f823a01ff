"""``largebatch recipes``: print the recipes table (:mod:`largebatch.recipes.registry`)."""

from __future__ import annotations

import argparse

from largebatch.recipes.registry import recipes_table

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``largebatch recipes`` takes no flags."""


def main(args: argparse.Namespace) -> int:
    """Print the recipes table."""
    print(recipes_table())
    return 0
