"""The ``largebatch`` command line: ``train``, ``recipes``, ``study`` and ``scaling``."""

from largebatch.cli.commands import COMMANDS, main

__all__ = ["COMMANDS", "main"]
