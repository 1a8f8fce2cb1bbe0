"""``funcpipe schedule`` and ``funcpipe check``: programs generated or read, checked, simulated, drawn.

``register(subparsers)`` adds both to the ``funcpipe`` parser (see :mod:`funcpipe.cli.app`). Neither
imports torch: they generate, read, lower, check, simulate and draw programs only.

Exit status: 0 sound, 1 the program is unsound (the :class:`ScheduleError` message, which names
the rank, the step and the rule, goes to stderr), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from funcpipe.cli.args import Subparsers, costs, memory, numbers, positive_int, seconds
from funcpipe.errors import InvalidArgument, ScheduleError

__all__ = ["register"]

# the most (stage, microbatch) pairs `funcpipe schedule` builds: generating, checking and
# simulating cost about 0.2 ms a pair (1f1b -p 2 -m 100000, 200,000 pairs: 38 s and 0.5 GB on
# two busy cores), so this is a few seconds; a program's pattern repeats with a period of
# about its ranks, so a few hundred microbatches already show its steady state
MAX_PAIRS = 20_000


def _generator_names() -> str:
    try:
        from funcpipe.schedule.generators import GENERATORS
    except ImportError:  # pragma: no cover - the generators ship with funcpipe
        return "e.g. 1f1b"
    return ", ".join(GENERATORS)


_COSTS_HELP = "costs per stage as F,B,W or F,B,W,COMM (default 1,1,1: a full B costs B+W)"


def register(subparsers: Subparsers) -> None:
    """Add the ``schedule`` and ``check`` subcommands to ``subparsers``."""
    _add_schedule(subparsers)
    _add_check(subparsers)


def _add_schedule(subparsers: Subparsers) -> None:
    sched = subparsers.add_parser(
        "schedule",
        help="generate a built-in schedule, check it, simulate it and print or draw it",
        description="Generate a built-in schedule (funcpipe.schedule.generators), check it, "
        "simulate it with the given costs and print its rank x step table and statistics "
        "(makespan, bubble fraction, peak activations per rank).",
    )
    sched.add_argument(
        "name", metavar="NAME", help=f"generator name: {_generator_names()}, or auto (search)"
    )
    sched.add_argument("--ranks", "-p", type=positive_int, required=True, metavar="P")
    sched.add_argument("--microbatches", "-m", type=positive_int, required=True, metavar="M")
    sched.add_argument(
        "--no-size-limit",
        action="store_true",
        help=f"build programs of more than {MAX_PAIRS:,} (stage, microbatch) pairs (slow)",
    )
    sched.add_argument(
        "--chunks", "-v", type=positive_int, default=None, metavar="V", help="stages per rank"
    )
    sched.add_argument(
        "--costs", type=costs, default=None, metavar="F,B,W[,COMM]", help=_COSTS_HELP
    )
    sched.add_argument(
        "--overlap",
        action="store_true",
        help="overlapped pairs ('&': one microbatch's F with another's B or I): dualpipev and "
        "zbv pair their steady phase, other schedules get the overlap pass",
    )
    sched.add_argument(
        "--stage-comm",
        type=numbers,
        default=None,
        metavar="F_COMM,B_COMM",
        help="the communication inside one stage's F and inside its B or I (an expert "
        "all-to-all, tensor-parallel collectives), during which it waits; a pair hides each "
        "half's behind the other's compute (funcpipe.schedule.Costs f_comm, b_comm)",
    )
    _add_auto_options(sched)
    sched.add_argument(
        "--memory",
        type=memory,
        default=None,
        metavar="ACT[,FOR_W]",
        help="also print each rank's peak activation memory (funcpipe.schedule.peak_memory): "
        "ACT what one F keeps, FOR_W what an I leaves for its W (default ACT), in any unit",
    )
    sched.add_argument(
        "--lower", action="store_true", help="add SEND/RECV (funcpipe.schedule.passes.lower)"
    )
    sched.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (statistics, the program text and, as 'lowered_program', "
        "the text of the lowered program with its communication groups)",
    )
    sched.add_argument("--png", type=Path, metavar="FILE", help="draw the timeline (.png/.svg)")
    sched.add_argument("--trace", type=Path, metavar="FILE", help="write a Chrome/Perfetto trace")
    sched.add_argument("--text", type=Path, metavar="FILE", help="write the program text form")
    sched.set_defaults(handler=_run_schedule)


def _add_auto_options(sched: argparse.ArgumentParser) -> None:
    """The options of ``funcpipe schedule auto`` (the search) only."""
    sched.add_argument(
        "--placement",
        choices=["loop", "v"],
        default=None,
        help="auto only: stage placement (default loop; v holds 2 chunks per rank)",
    )
    sched.add_argument(
        "--max-activations",
        type=positive_int,
        default=None,
        metavar="N",
        help="auto only: the most activations a rank may keep at once (default: no limit)",
    )
    sched.add_argument(
        "--exact",
        type=seconds,
        default=None,
        metavar="SECONDS",
        help="auto only: refine with an exact solver (needs scipy) for up to SECONDS",
    )
    sched.add_argument(
        "--max-memory",
        type=numbers,
        default=None,
        metavar="B[,B...]",
        help="auto only: the most activation bytes a rank may keep (one number, or one per "
        "rank), with --stage-memory",
    )
    sched.add_argument(
        "--stage-memory",
        type=numbers,
        default=None,
        metavar="A0,A1,...",
        help="auto only: each stage's activation bytes for one microbatch, in model order "
        "(funcpipe.measure_memory), with --max-memory",
    )


def _add_check(subparsers: Subparsers) -> None:
    chk = subparsers.add_parser(
        "check",
        help="check a hand-written program (text form, or torch CSV if FILE ends in .csv)",
        description="Read a program (funcpipe text form, or the torch.distributed.pipelining "
        "CSV format when FILE ends in .csv), add SEND/RECV if it is compute-only, and prove it "
        "sound under the point-to-point rules of --p2p. Exit 0 and print its statistics, or "
        "exit 1 and print the error (which names the rank, the step and the rule; for a hang "
        "under nccl, both ranks, both instructions and their steps) to stderr.",
    )
    chk.add_argument("file", type=Path, metavar="FILE")
    chk.add_argument(
        "--p2p",
        choices=["gloo", "nccl"],
        default="gloo",
        help="point-to-point rules: gloo (default; buffered sends) or nccl (NCCL's rules on the "
        "communicators Pipeline builds on NCCL: a process group per pair of ranks, so one stream "
        "per pair; an ungrouped SEND completes only when the peer's RECV is at the head of its "
        "side; a group's ('+') messages to one peer match together, to another peer they are "
        "another batch)",
    )
    chk.add_argument("--costs", type=costs, default=None, metavar="F,B,W[,COMM]", help=_COSTS_HELP)
    chk.add_argument("--json", action="store_true", help="print one JSON object")
    chk.set_defaults(handler=_run_check)


# ----------------------------------------------------------------------------- shared output
def _summary(timeline: Any) -> str:
    stats = timeline.stats()
    lines = [
        f"makespan          {stats['makespan']:g}",
        f"bubble            {100 * stats['bubble_fraction']:.1f}%",
        "peak activations  " + " ".join(str(a) for a in stats["peak_activations"]) + "  (per rank)",
        "busy              " + " ".join(f"{b:g}" for b in stats["busy"]) + "  (per rank)",
    ]
    c = timeline.costs
    if stats["pairs"] or c.f_comm or c.b_comm:
        lines.append(f"pairs             {stats['pairs']}  (overlapped F & B)")
        lines.append(
            f"hidden            {stats['hidden']:g}  (in-stage communication the pairs hide)"
        )
    return "\n".join(lines)


def _report(program: Any, timeline: Any, *, as_json: bool, extra: dict[str, Any]) -> None:
    from funcpipe.schedule.ir import format_program
    from funcpipe.schedule.render import ascii_timeline

    if as_json:
        payload = {**timeline.stats(), **extra, "program": format_program(program)}
        print(json.dumps(payload))
        return
    title = program.name or "program"
    print(
        f"{title}: {program.n_ranks} ranks, {program.n_stages} stages, "
        f"{program.microbatches} microbatches" + ("" if program.training else " (eval)")
    )
    print(program.table())
    print()
    print(ascii_timeline(timeline, width=None if timeline.makespan <= 120 else 120))
    print()
    print(_summary(timeline))


def _fail(command: str, error: ScheduleError) -> int:
    print(f"funcpipe {command}: {error}", file=sys.stderr)
    return 1


# ----------------------------------------------------------------------------- schedule
def _run_schedule(args: argparse.Namespace) -> int:
    from funcpipe.schedule.check import check
    from funcpipe.schedule.passes import lower
    from funcpipe.schedule.simulate import simulate

    program = _generate(args)
    try:
        check(program)
        if args.lower:
            program = lower(program)
            check(program)
        timeline = simulate(program, _with_stage_comm(args.costs, args.stage_comm))
    except ScheduleError as e:
        return _fail("schedule", e)
    extra: dict[str, Any] = {"lowered": program.lowered}
    if args.json:
        from funcpipe.schedule.ir import format_program
        from funcpipe.schedule.passes import add_communication

        extra["lowered_program"] = format_program(add_communication(program))
    sizes = args.memory or ((args.stage_memory, None) if args.stage_memory else None)
    if sizes is not None:
        from funcpipe.schedule.simulate import peak_memory

        extra["peak_memory"] = list(peak_memory(program, *sizes))
    written = _write_files(args, program, timeline)
    _report(program, timeline, as_json=args.json, extra={**extra, "files": written})
    if not args.json:
        if sizes is not None:
            peaks = " ".join(f"{m:g}" for m in extra["peak_memory"])
            print(f"peak memory       {peaks}  (per rank)")
        for kind, path in written.items():
            print(f"wrote {kind}: {path}")
    return 0


def _with_stage_comm(costs: Any, stage_comm: list[float] | None) -> Any:
    """``--costs`` with ``--stage-comm``'s F and B communication."""
    from dataclasses import replace

    from funcpipe.schedule.simulate import Costs

    if stage_comm is None:
        return costs
    if len(stage_comm) != 2:
        raise InvalidArgument(
            f"--stage-comm {','.join(f'{v:g}' for v in stage_comm)}: give two numbers, the "
            "communication inside a stage's F and inside its B (or I), e.g. --stage-comm 0.5,0.5"
        )
    return replace(costs or Costs(), f_comm=stage_comm[0], b_comm=stage_comm[1])


def _generate(args: argparse.Namespace) -> Any:
    """The program ``funcpipe schedule NAME`` names: a generator's, or ``auto``'s search."""
    try:
        from funcpipe.schedule.generators import generate
    except ImportError:
        raise InvalidArgument("funcpipe.schedule.generators is not available yet") from None
    _check_size(args)
    options: dict[str, Any] = {"ranks": args.ranks, "microbatches": args.microbatches}
    if args.chunks is not None:
        options["chunks"] = args.chunks
    if args.name.strip().lower() == "auto":
        from funcpipe.schedule.auto import auto

        found = auto(
            **options,
            placement=args.placement or "loop",
            costs=args.costs,
            max_activations=args.max_activations,
            exact=args.exact,
            max_memory=_one_or_all(args.max_memory),
            memory=args.stage_memory,
        )
        if not args.overlap:
            return found
        from funcpipe.schedule.overlap import overlap

        return overlap(found)
    if (
        args.placement is not None
        or args.max_activations is not None
        or args.exact
        or args.max_memory is not None
        or args.stage_memory is not None
    ):
        raise InvalidArgument(
            "--placement/--max-activations/--exact/--max-memory/--stage-memory are options of "
            f"'auto', not of {args.name!r}; drop them or run 'funcpipe schedule auto ...'"
        )
    return generate(args.name, **options, overlap=args.overlap)


def _check_size(args: argparse.Namespace) -> None:
    """At most :data:`MAX_PAIRS` (stage, microbatch) pairs, unless ``--no-size-limit``."""
    pairs = args.ranks * (args.chunks or 1) * args.microbatches
    if pairs > MAX_PAIRS and not args.no_size_limit:
        raise InvalidArgument(
            f"--ranks {args.ranks} x --chunks {args.chunks or 1} x --microbatches "
            f"{args.microbatches} = {pairs:,} (stage, microbatch) pairs: more than the "
            f"{MAX_PAIRS:,} that build in seconds (about 0.2 ms a pair; 200,000 take half a "
            "minute and 0.5 GB). A schedule's pattern repeats every few microbatches: use fewer "
            f"(e.g. -m {max(1, MAX_PAIRS // (args.ranks * (args.chunks or 1)))}), or pass "
            "--no-size-limit to build it anyway"
        )


def _write_files(args: argparse.Namespace, program: Any, timeline: Any) -> dict[str, str]:
    """``--text``, ``--png`` and ``--trace``: what was written where. A path that cannot be
    written is an :class:`InvalidArgument` naming the option, the path and why."""
    from funcpipe.schedule.render import draw_timeline, write_chrome_trace

    def text(path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(program.to_text())
        return path

    written: dict[str, str] = {}
    for kind, path, write in (
        ("text", args.text, text),
        ("png", args.png, lambda p: draw_timeline(timeline, p)),
        ("trace", args.trace, lambda p: write_chrome_trace(timeline, p)),
    ):
        if path is None:
            continue
        try:
            written[kind] = str(write(path))
        except OSError as e:
            raise InvalidArgument(
                f"--{kind} {path}: cannot be written ({_why_unwritable(path, e)}); give a path "
                "in a directory you can write to"
            ) from None
    return written


def _why_unwritable(path: Path, error: OSError) -> str:
    """A file where a directory should be, or the error's own words."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{parent} is a file, not a directory"
            break
    where = f": {error.filename}" if error.filename else ""
    return f"{type(error).__name__}: {error.strerror or error}{where}"


def _one_or_all(values: list[float] | None) -> float | list[float] | None:
    return values[0] if values is not None and len(values) == 1 else values


# ----------------------------------------------------------------------------- check
def _read(path: Path) -> Any:
    from funcpipe.schedule.interop import read_csv
    from funcpipe.schedule.ir import parse_program

    if not path.is_file():
        raise InvalidArgument(f"FILE={str(path)!r} does not exist or is not a file")
    if path.suffix.lower() == ".csv":
        return read_csv(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"cannot read FILE={str(path)!r}: {e}") from None
    program = parse_program(text)
    return program if program.name else program.replace(name=path.stem)


def _run_check(args: argparse.Namespace) -> int:
    from funcpipe.schedule.check import check
    from funcpipe.schedule.p2p import PAIR
    from funcpipe.schedule.passes import add_communication
    from funcpipe.schedule.simulate import simulate

    try:
        program = _read(args.file)
        check(program)
        was_lowered = program.lowered
        if not was_lowered:
            program = add_communication(program)
        # nccl: under the communicator layout Pipeline's transports build (Pipeline.p2p_layout)
        check(program, p2p=args.p2p, layout=PAIR)
        timeline = simulate(program, args.costs, p2p=args.p2p, layout=PAIR)
    except ScheduleError as e:
        return _fail("check", e)
    if not args.json:
        note = "" if was_lowered else " (compute-only: lowered with add_communication)"
        print(f"{args.file}: sound under {args.p2p}'s point-to-point rules{note}")
    extra = {"lowered_by_check": not was_lowered, "p2p": args.p2p, "layout": PAIR}
    _report(program, timeline, as_json=args.json, extra=extra)
    return 0
