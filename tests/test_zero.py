"""Sharded data parallelism (ZeRO-1, issue 44): SCATTER and GATHER as program instructions.

The schedule half (text form, the pass, the checker's rules, the simulator's prices, the
timeline) runs here; the runtime half (equal to the unsharded run over processes, optimizer
state per rank) at the end of this file, its jobs in ``tests/jobs_zero.py``.
"""

from __future__ import annotations

import pytest

from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.schedule import (
    Costs,
    ascii_timeline,
    check,
    chrome_trace,
    gather,
    parse_instr,
    parse_program,
    scatter,
    shard_data,
    simulate,
    strip_communication,
)
from funcpipe.schedule.generators import CHUNKS, GENERATORS, generate
from funcpipe.schedule.ir import Op, Program
from funcpipe.schedule.p2p import PAIR
from funcpipe.schedule.passes import add_reduce, lower


# ------------------------------------------------------------------ the instructions
def test_text_form_round_trips() -> None:
    for i in (scatter(1, "data"), gather(0, "data")):
        assert parse_instr(str(i)) == i
    assert str(scatter(1, "data")) == "SCATTER s1 data"
    assert str(gather(0, "data")) == "GATHER s0 data"
    assert parse_instr("  GATHER  s2 data ").op is Op.GATHER
    with pytest.raises(ScheduleError, match="without the '\\+'"):
        parse_instr("+ SCATTER s0 data")


def _sharded(name: str, ranks: int = 2, microbatches: int = 4) -> Program:
    return shard_data(lower(generate(name, ranks=ranks, microbatches=microbatches)))


@pytest.mark.parametrize("name", sorted(n for n in GENERATORS if n != "chimera"))
def test_every_generator_shards_to_a_program_nccl_accepts(name: str) -> None:
    for ranks, microbatches in ((2, 4), (4, 8), (3, 5)):
        if CHUNKS[name] is not None and microbatches < ranks:
            continue
        p = _sharded(name, ranks, microbatches)
        check(p, p2p="nccl", layout=PAIR)
        assert parse_program(p.to_text()) == p
        assert shard_data(p) is p  # idempotent
        ops = [i.op for r in p.ranks for i in r]
        assert Op.REDUCE not in ops
        gathered = {i.stage for r in p.ranks for i in r if i.op is Op.GATHER}
        assert gathered == set(range(p.n_stages))
        if p.training:
            assert {i.stage for r in p.ranks for i in r if i.op is Op.SCATTER} == gathered
        for instrs in p.ranks:  # the GATHERs open each rank, in the order of first forwards
            heads = [i for i in instrs if i.op is Op.GATHER]
            assert instrs[: len(heads)] == tuple(heads)
            firsts = list(dict.fromkeys(i.stage for i in instrs if i.op is Op.F))
            assert [i.stage for i in heads] == firsts
        assert strip_communication(p) == strip_communication(
            lower(generate(name, ranks=ranks, microbatches=microbatches))
        )


def test_chimera_is_refused_naming_the_fix() -> None:
    with pytest.raises(InvalidArgument, match="replicas yet.*zero=0"):
        _sharded("chimera", 2, 4)


def test_a_program_reduced_already_gets_scatters_in_place_of_its_reduces() -> None:
    base = lower(generate("1f1b", ranks=2, microbatches=4))
    reduced = add_reduce(base)
    assert shard_data(reduced) == shard_data(base)
    where = [t for t, i in enumerate(reduced.ranks[0]) if i.op is Op.REDUCE]
    sharded = shard_data(reduced).ranks[0]
    assert [t + 1 for t in where] == [t for t, i in enumerate(sharded) if i.op is Op.SCATTER]


# ------------------------------------------------------------------ the checker's rules
ONE = """\
placement 0
microbatches 2
rank 0: {body}
"""


def _check(body: str) -> None:
    check(parse_program(ONE.format(body=body)), p2p="nccl")


def test_the_checker_accepts_the_simple_order() -> None:
    _check("GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 data")


@pytest.mark.parametrize(
    ("body", "rule"),
    [
        (
            "F s0 m0; GATHER s0 data; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 data",
            "before every forward",
        ),
        (
            "GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; SCATTER s0 data; B s0 m1",
            "after every gradient",
        ),
        ("GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; B s0 m1", "if and only if"),
        ("F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 data", "if and only if"),
        (
            "GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 data; REDUCE s0 data",
            "not both",
        ),
        (
            "GATHER s0 data; GATHER s0 data; F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 data",
            "at most one GATHER",
        ),
        ("GATHER s0 tie:w; F s0 m0; F s0 m1; B s0 m0; B s0 m1; SCATTER s0 tie:w", "copies"),
    ],
)
def test_the_checker_rejects_naming_the_rule(body: str, rule: str) -> None:
    with pytest.raises(ScheduleError, match=rule):
        _check(body)


def test_an_eval_program_gathers_and_never_scatters() -> None:
    text = "placement 0\nmicrobatches 1\nmode eval\nrank 0: GATHER s0 data; F s0 m0"
    check(parse_program(text))
    with pytest.raises(ScheduleError, match="eval program"):
        check(parse_program(text + "; SCATTER s0 data"))


# ------------------------------------------------------------------ priced and shown
def test_the_simulator_prices_each_at_half_a_reduce() -> None:
    costs = Costs(reduce=3.0)
    reduced = simulate(add_reduce(lower(generate("1f1b", ranks=2, microbatches=4))), costs)
    sharded = simulate(_sharded("1f1b"), costs)
    for events in sharded.events:
        for e in events:
            if e.instr.op in (Op.SCATTER, Op.GATHER):
                assert e.end - e.start == pytest.approx(1.5)
    # a GATHER at the start of every rank and a SCATTER where the REDUCE was: the same total
    assert sharded.makespan == pytest.approx(reduced.makespan)
    text = ascii_timeline(sharded)
    assert text.splitlines()[0].split("|")[1].startswith("g")
    assert "s|" in text.splitlines()[1] or "s." in text.splitlines()[1]
    names = {e["name"] for e in chrome_trace(sharded)["traceEvents"] if e.get("ph") == "X"}
    assert {"GATHER s0 data", "SCATTER s1 data"} <= names
