"""The ``dflashkit`` command line: one module per command group, heavy imports deferred to the command that runs."""

from dflashkit.cli.main import main

__all__ = ["main"]
