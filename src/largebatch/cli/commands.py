"""The ``largebatch`` command line: the table of commands, and the entry point.

Each command is a row of :data:`COMMANDS`: a module of this package with
``add_arguments(parser)`` and ``main(args) -> int``; only the chosen one is imported, so
``largebatch --help`` loads no framework. A :class:`~largebatch.outputs.CommandError` ends
the command with one line on stderr and exit status 2 (docs/design.md §6).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from types import ModuleType

import largebatch
from largebatch.outputs import CommandError

__all__ = ["COMMANDS", "main"]

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("largebatch.cli.train", "train a named recipe (largebatch recipes lists them)"),
    "recipes": ("largebatch.cli.recipes", "list the recipes: model, batch, optimizer, paper"),
    "study": (
        "largebatch.cli.study",
        "the batch-size sweep on Fashion-MNIST, every optimizer tuned alike (--quick: make demo)",
    ),
    "steps": (
        "largebatch.cli.steps",
        "steps to a validation target against batch size, each optimizer searched alike; "
        "critical batches and paired intervals",
    ),
    "scaling": (
        "largebatch.cli.scaling",
        "step time and scaling efficiency of dense and compressed all-reduce, modelled",
    ),
}


def _load(name: str) -> ModuleType:
    module = COMMANDS[name][0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise CommandError(
            name, f"needs {err.name}, not installed: pip install 'largebatch[recipes]'"
        ) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the command, return its exit status.

    A user error prints its one line on stderr and raises :class:`CommandError`, a
    ``SystemExit`` with status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        status = _main(argv)
    except CommandError as err:
        print(err.message, file=sys.stderr, flush=True)
        _exit_if_joined(err.code)
        raise
    except BrokenPipeError:  # the reader went away (``largebatch recipes | head -1``)
        _silence_stdout()
        status = BROKEN_PIPE
    _exit_if_joined(status)
    return status


# A command whose output pipe closed ends as a shell reports a process killed by SIGPIPE.
BROKEN_PIPE = 128 + 13


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that flushing it at exit raises nothing more."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _exit_if_joined(status: object) -> None:
    """A process that joined a process group (``train`` under torchrun) ends through
    ``largebatch.training.distributed.exit_process``, which says why."""
    module = sys.modules.get("largebatch.training.distributed")
    if module is not None and module.joined():
        module.exit_process(status if isinstance(status, int) else 1)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="largebatch", description="Large-minibatch training: LARS, LAMB, warmup schedules."
    )
    parser.add_argument("--version", action="version", version=f"largebatch {largebatch.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text, description=help_text)
        if argv[:1] == [name]:  # only the chosen command's module is imported
            _load(name).add_arguments(sub)
    args = parser.parse_args(argv)
    return _load(args.command).main(args)
