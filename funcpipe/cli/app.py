"""The ``funcpipe`` command.

Each subcommand lives in one ``_add_<name>(subparsers)`` function that registers its parser and
sets ``handler`` to a ``_run_<name>(args) -> int`` function; add new ones to ``_SUBCOMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from funcpipe.errors import FuncpipeError

__all__ = ["main"]

Subparsers = Any  # argparse's _SubParsersAction is private


def _add_demo(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a GPT with pipeline x tensor x data parallelism on local processes",
        description="Train a byte-level GPT on text that ships with Python, with pipeline x "
        "tensor x data parallelism on local CPU processes (or under torchrun). All options: "
        "funcpipe demo --help.",
    )
    parser.set_defaults(handler=lambda args: 0)  # main() hands `demo ...` to funcpipe.cli.demo


def _add_tour(subparsers: Subparsers) -> None:
    parser = subparsers.add_parser(
        "tour",
        help="partition an MLP, infer its shapes, check the reference step and train it",
        description="Partition a float64 MLP into stages by parameter count, infer every "
        "stage's shapes without data, compare reference_step with plain autograd on "
        "the whole module, then train with pure SGD updates (one process).",
    )
    parser.add_argument("--microbatches", type=int, default=4, metavar="M", help="default: 4")
    parser.add_argument("--stages", type=int, default=2, metavar="N", help="default: 2")
    parser.add_argument("--steps", type=int, default=20, help="SGD steps (default: 20)")
    parser.set_defaults(handler=_run_tour)


def _run_tour(args: argparse.Namespace) -> int:
    from funcpipe.cli.tour import run_demo

    run_demo(microbatches=args.microbatches, stages=args.stages, steps=args.steps)
    return 0


_SUBCOMMANDS: tuple[Callable[[Subparsers], None], ...] = (_add_demo, _add_tour)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="funcpipe", description="Pure-functional pipeline-parallel training for PyTorch."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _SUBCOMMANDS:
        add(subparsers)
    from funcpipe.cli.schedule import register as add_schedule_commands  # schedule, check

    add_schedule_commands(subparsers)
    from funcpipe.cli.plan import register as add_plan_command  # plan

    add_plan_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``funcpipe`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:  # the demo parses its own options (it also runs under torchrun)
        from funcpipe.cli.demo import main as demo_main

        try:
            return demo_main(argv[1:])
        except FuncpipeError as e:
            print(f"funcpipe demo: error: {e}", file=sys.stderr)
            return 2
    args = _build_parser().parse_args(argv)
    try:
        status: int = args.handler(args)
    except FuncpipeError as e:
        print(f"funcpipe {args.command}: error: {e}", file=sys.stderr)
        return 2
    return status
