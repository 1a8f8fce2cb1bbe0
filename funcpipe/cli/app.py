"""The ``funcpipe`` command: its parser, built from the subcommand modules, and :func:`main`.

Every module of ``_COMMANDS`` has a ``register(subparsers)`` that adds its parser(s) and sets
``handler`` to a function of the parsed arguments returning the exit status; the modules are
imported when the parser is built (``import funcpipe.cli`` stays light, and ``python -m
funcpipe.cli.demo`` runs the module it names). :func:`main` parses once and calls the handler; a :class:`~funcpipe.errors.FuncpipeError` it raises is printed as
``funcpipe COMMAND: error: ...`` with exit status 2, and an argument no subcommand knows is
reported by that subcommand's parser (its usage, exit status 2).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from funcpipe.cli.args import Subparsers
from funcpipe.errors import FuncpipeError

__all__ = ["main"]

# modules of funcpipe.cli, in the order `funcpipe --help` lists their subcommands (schedule
# registers `schedule` and `check`)
_COMMANDS = ("demo", "tour", "schedule", "plan", "checkpoint")


def _build() -> tuple[argparse.ArgumentParser, Subparsers]:
    parser = argparse.ArgumentParser(
        prog="funcpipe", description="Pure-functional pipeline-parallel training for PyTorch."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _COMMANDS:
        importlib.import_module(f"funcpipe.cli.{name}").register(subparsers)
    return parser, subparsers


def _build_parser() -> argparse.ArgumentParser:
    return _build()[0]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``funcpipe`` command; returns the exit status."""
    parser, subparsers = _build()
    args, unknown = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if unknown:  # as the subcommand's own parser says it (usage and all), exit status 2
        subparsers.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        status: int = args.handler(args)
    except FuncpipeError as e:
        print(f"funcpipe {args.command}: error: {e}", file=sys.stderr)
        return 2
    return status
