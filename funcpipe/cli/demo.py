"""``funcpipe demo``: train a GPT with pipeline x tensor x data parallelism on local processes.

The job: a byte-level GPT (:mod:`funcpipe.models.gpt`) on text that ships with Python
(:mod:`funcpipe.train.data`), split into pipeline stages that are each tensor-parallel (1D, with
vocabulary-parallel embedding and cross-entropy), trained with the pure AdamW of
:mod:`funcpipe.train.optim` and global-norm clipping across every rank. It evaluates on the validation
split, writes a loss curve, the executed timeline of one step (picture and Chrome trace) and a
checkpoint, and prints a summary with the measured against the simulated bubble.

It starts ``pipeline x tensor x data`` local processes with :func:`funcpipe.launch`: CPU ranks
over gloo, or with ``--device cuda`` one GPU per rank over NCCL (``auto``, the default, takes the
GPUs when there is one per rank); or, under ``torchrun``, runs as one rank of the job torchrun
describes (the same script). ``--size`` picks the model and batch, ``--precision bf16`` runs every
stage under bf16 autocast on float32 parameters (:func:`funcpipe.autocast_stage`), ``--compile``
compiles every stage (:func:`funcpipe.compile_stage`). The summary reports tokens/s over the
steps after the warm-up and, on GPUs of known peak (:data:`funcpipe.train.throughput.PEAK_FLOPS`), the model FLOPs
utilisation: ``tokens/s x`` :func:`funcpipe.models.gpt.flops_per_token` ``/ (peak x GPUs)``.

The command's pieces: :mod:`funcpipe.cli.demo_options` (the options, resolved and checked into
:class:`DemoOptions`), :mod:`funcpipe.cli.demo_loop` (:func:`train_rank`, what one rank does) and
:mod:`funcpipe.cli.demo_report` (progress, summary, pictures). This module registers the
subcommand and starts the job (:func:`run`); it keeps the names those modules define.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from funcpipe.cli.args import Subparsers
from funcpipe.cli.demo_loop import train_rank
from funcpipe.cli.demo_options import (
    COMPILE_BACKEND,
    DEVICES,
    PRECISIONS,
    SIZES,
    DemoOptions,
    Size,
    add_options,
    parse,
    resolve,
    resolve_device,
    validate,
)
from funcpipe.cli.demo_report import print_summary
from funcpipe.errors import InvalidArgument, RankFailed

if TYPE_CHECKING:
    from funcpipe.schedule.ir import Program

__all__ = [
    "COMPILE_BACKEND",
    "DEVICES",
    "PRECISIONS",
    "SIZES",
    "DemoOptions",
    "Size",
    "main",
    "parse",
    "register",
    "resolve_device",
    "run",
    "train_rank",
]


def register(subparsers: Subparsers) -> None:
    """Add the ``demo`` subcommand (its options: :func:`funcpipe.cli.demo_options.add_options`)."""
    from funcpipe.cli.demo_options import DESCRIPTION

    parser = subparsers.add_parser(
        "demo",
        help="train a GPT with pipeline x tensor x data parallelism on local processes",
        description=DESCRIPTION,
    )
    add_options(parser)
    parser.set_defaults(handler=_run_command)


def _run_command(args: argparse.Namespace) -> int:
    o = resolve(args)
    _start(o, validate(o))
    return 0


def run(o: DemoOptions) -> dict[str, Any] | None:
    """Check ``o`` and run the job: local processes, or this rank under torchrun. Prints the
    summary and returns it (None on every process but the first rank's)."""
    return _start(o, validate(o))


def _start(o: DemoOptions, program: Program) -> dict[str, Any] | None:
    """Run the job of validated options, every rank on ``program``."""
    from funcpipe.distributed.launcher import launch, under_torchrun

    _check_out(o)
    o = replace(o, device=resolve_device(o.device, o.world))
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != o.world:
            nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1") or 1)
            per_node = (
                f"--nproc-per-node {o.world // nodes} on each of the {nodes} nodes"
                if nodes > 1 and o.world % nodes == 0
                else f"--nproc-per-node {o.world}"
                if nodes == 1
                else f"processes per node that add up to {o.world} over the {nodes} nodes"
            )
            raise InvalidArgument(
                f"torchrun started {world} processes but pipeline x tensor x data = {o.world}; "
                f"pass {per_node} (or change the sizes)"
            )
    backend = "nccl" if o.device == "cuda" else "gloo"
    try:
        results = launch(
            train_rank,
            o.world,
            o,
            program,
            backend=backend,
            timeout=o.timeout,
            pg_timeout=o.pg_timeout,
        )
    except RankFailed as e:
        if o.timeout is None or "job's deadline" not in str(e):
            raise
        raise RankFailed(
            f"{e}\n(funcpipe demo: that deadline is --timeout {o.timeout:g}; leave it out for "
            "none. The process group's timeout is --pg-timeout.)",
            rank=e.rank,
            cause=e.cause,
        ) from e
    summary = next((r for r in results if r is not None), None)
    if summary is not None:
        print_summary(summary)
    return summary


def _check_out(o: DemoOptions) -> None:
    """``--out`` can be written (found now, not at the final save after the whole run), and
    ``--resume`` has a checkpoint there to resume from (never a silent start from step 0)."""
    probe = os.path.join(o.out, f".funcpipe-write-test-{os.getpid()}")
    try:
        os.makedirs(o.out, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise InvalidArgument(
            f"--out {o.out!r} cannot be written ({type(e).__name__}: {e.strerror or e}): the "
            "run would train and then lose its checkpoint, history and pictures; choose a "
            "writable directory"
        ) from None
    from funcpipe.train import checkpoint

    found = checkpoint.latest(o.out) if o.resume else None
    if o.resume is True and found is None:
        raise InvalidArgument(
            f"--resume: there is no complete checkpoint in --out {o.out!r} to resume from; "
            "point --out at the run to continue, drop --resume to start from step 0, or pass "
            "--resume auto (resume if there is one, else start)"
        )
    _check_run(o, resuming=found is not None)


# what fixes the batches each step reads (and the dtypes): a resumed run must keep them
_KEPT = ("batch", "data", "context", "seed", "corpus_bytes", "precision", "experts", "top_k",
         "moe_every", "shared_experts")  # fmt: skip


def _check_run(o: DemoOptions, *, resuming: bool) -> None:
    """``out/run.json`` records the options a resume must keep (:data:`_KEPT`): written when a
    run starts, compared when one resumes; another value is refused, naming the option."""
    import json

    path = os.path.join(o.out, "run.json")
    mine = {k: getattr(o, k) for k in _KEPT}
    if not resuming:
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(mine, f)
        os.replace(tmp, path)  # (every torchrun process writes the same)
        return
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return  # (a run of a funcpipe that did not record them)
    changed = [k for k in _KEPT if k in saved and saved[k] != mine[k]]
    if changed:
        said = ", ".join(f"--{k.replace('_', '-')} {saved[k]} (now {mine[k]})" for k in changed)
        raise InvalidArgument(
            f"--resume: the run in --out {o.out!r} was trained with {said}; a resumed run must "
            "keep what fixes the batches each step reads and the dtypes "
            f"({', '.join('--' + k.replace('_', '-') for k in _KEPT)}), or its losses are not "
            "the uninterrupted run's. Pass the run's values, or start a new run in another --out"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """``funcpipe demo ARGS``: parse ``argv`` (``sys.argv[1:]`` when None) and run the job."""
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
