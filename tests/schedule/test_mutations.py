"""Random damage to valid programs is either harmless or a ScheduleError: never another
exception, never a hang."""

from __future__ import annotations

import contextlib
import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from funcpipe.errors import ScheduleError
from funcpipe.schedule.check import check
from funcpipe.schedule.generators import GENERATORS, generate
from funcpipe.schedule.ir import Instr, Program, parse_program
from funcpipe.schedule.passes import add_communication
from funcpipe.schedule.simulate import simulate

# every training schedule of the registry (the evaluation one, ``forward``, has no backward)
NAMES = [n for n in GENERATORS if generate(n, ranks=1, microbatches=1).training]


@st.composite
def programs(draw: st.DrawFn) -> Program:
    name = draw(st.sampled_from(NAMES))
    p = draw(st.integers(1, 4))
    m = draw(st.integers(1, 6))
    program = generate(name, ranks=p, microbatches=m)
    return add_communication(program) if draw(st.booleans()) else program


def _retarget(draw: st.DrawFn, i: Instr) -> Instr:
    field = draw(st.sampled_from(["stage", "microbatch", "peer", "other", "kind", "group"]))
    if field in ("kind", "group"):
        value = draw(st.sampled_from(["act", "grad", "data", "tie:x", ""]))
    else:
        value = draw(st.integers(-1, 9))
    return dataclasses.replace(i, **{field: value})


@st.composite
def mutated(draw: st.DrawFn) -> tuple[Program, list[list[Instr]], list[str]]:
    program = draw(programs())
    ranks = [list(r) for r in program.ranks]
    done = []
    for _ in range(draw(st.integers(1, 3))):
        r = draw(st.integers(0, len(ranks) - 1))
        if not ranks[r]:
            continue
        t = draw(st.integers(0, len(ranks[r]) - 1))
        kind = draw(st.sampled_from(["drop", "duplicate", "swap", "retarget", "move", "regroup"]))
        done.append(f"{kind} r{r} t{t}")
        if kind == "drop":
            del ranks[r][t]
        elif kind == "duplicate":
            ranks[r].insert(draw(st.integers(0, len(ranks[r]))), ranks[r][t])
        elif kind == "swap":
            u = draw(st.integers(0, len(ranks[r]) - 1))
            ranks[r][t], ranks[r][u] = ranks[r][u], ranks[r][t]
        elif kind == "retarget":
            ranks[r][t] = _retarget(draw, ranks[r][t])
        elif kind == "regroup":  # join a SEND/RECV to the one before it, or split it off
            ranks[r][t] = dataclasses.replace(ranks[r][t], joined=not ranks[r][t].joined)
        else:
            q = draw(st.integers(0, len(ranks) - 1))
            ranks[q].insert(draw(st.integers(0, len(ranks[q]))), ranks[r].pop(t))
    return program, ranks, done


@given(mutated(), st.sampled_from(["gloo", "nccl"]))
def test_mutations_are_valid_or_schedule_errors(
    case: tuple[Program, list[list[Instr]], list[str]], p2p: str
) -> None:
    original, ranks, _ = case
    try:
        program = original.replace(ranks=tuple(tuple(x) for x in ranks))
        check(program, p2p=p2p)
    except ScheduleError as e:
        assert e.rule, "every ScheduleError names its rule"
        return
    # still valid: it must simulate and round-trip through its text form
    simulate(program, p2p=p2p)
    assert parse_program(program.to_text()) == program


_TOKENS = st.sampled_from(
    [
        "placement",
        "microbatches",
        "ranks",
        "stages",
        "mode",
        "edges",
        "entries",
        "replicas",
        "name",
        "rank",
        "F",
        "B",
        "I",
        "W",
        "R",
        "SEND",
        "RECV",
        "REDUCE",
        "+",
        "act",
        "grad",
        "to",
        "from",
        "s0",
        "s1",
        "m0",
        "m1",
        "r0",
        "r1",
        "0",
        "1",
        "2",
        "-1",
        "0>1",
        "train",
        "eval",
        ";",
        ":",
        "#",
        "\n",
        " ",
        "data",
        "tie:x",
        "\x00",
        "é",
    ]
)


@given(st.one_of(st.text(max_size=200), st.lists(_TOKENS, max_size=60).map(" ".join)))
def test_program_parser_never_fails_otherwise(text: str) -> None:
    try:
        program = parse_program(text)
    except ScheduleError:
        return
    with contextlib.suppress(ScheduleError):
        check(program)


@given(
    st.one_of(
        st.text(max_size=200),
        st.lists(
            st.sampled_from(
                [
                    "0F0",
                    "1B2",
                    "0I1",
                    "0W1",
                    ",",
                    "\n",
                    "",
                    "x",
                    "3SEND_F1",
                    "(0F0;1B0)OVERLAP_F_B",
                    "-1F0",
                ]
            ),
            max_size=40,
        ).map("".join),
    )
)
def test_csv_parser_never_fails_otherwise(text: str) -> None:
    from funcpipe.errors import InvalidArgument
    from funcpipe.schedule.interop import read_csv

    try:
        program = read_csv(text if ("," in text or "\n" in text) else text + "\n")
    except (ScheduleError, InvalidArgument):
        return
    with contextlib.suppress(ScheduleError):
        check(program)
