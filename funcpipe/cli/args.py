"""The command line's argument types: argparse ``type=`` functions every subcommand shares.

Each takes the option's text and returns its value, or raises :class:`argparse.ArgumentTypeError`
with the message argparse prints after ``argument --OPTION:`` (exit status 2). ``Subparsers`` is
what each subcommand module's ``register(subparsers)`` receives (see :mod:`funcpipe.cli.app`).
"""

from __future__ import annotations

import argparse
from typing import Any, TypeAlias

from funcpipe.errors import InvalidArgument

# what ``ArgumentParser.add_subparsers`` returns (argparse names its class as private)
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

__all__ = ["Subparsers", "costs", "memory", "numbers", "positive_int", "seconds"]


def positive_int(text: str) -> int:
    """A whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def seconds(text: str) -> float:
    """A number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0 seconds")
    return value


def numbers(text: str) -> list[float]:
    """Finite numbers >= 0 separated by commas (at least one)."""
    try:
        values = [float(p.strip()) for p in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 <= v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: write numbers >= 0 separated by commas, e.g. '4096' or '1024,1024,1536'"
        )
    return values


def memory(text: str) -> tuple[float, float | None]:
    """``ACTIVATION`` or ``ACTIVATION,FOR_W``: what one F keeps, what an I leaves for its W."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2) or not all(0 <= v < float("inf") for v in values):
        raise argparse.ArgumentTypeError(
            f"--memory={text!r}: write ACTIVATION or ACTIVATION,FOR_W as numbers >= 0 (what one "
            "F keeps, what an I leaves for its W, e.g. bytes: '131072' or '163840,131072')"
        )
    return values[0], values[1] if len(values) == 2 else None


def costs(text: str) -> Any:
    """The simulator's :class:`~funcpipe.schedule.simulate.Costs` from ``F,B,W[,COMM]``."""
    from funcpipe.schedule.simulate import Costs

    try:
        return Costs.parse(text)
    except InvalidArgument as e:
        raise argparse.ArgumentTypeError(str(e)) from None
