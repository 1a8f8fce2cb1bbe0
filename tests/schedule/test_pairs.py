"""Overlapped pairs (``&``): text form, the checker's rules, lowering, passes, the simulator's
price and the generators that emit them."""

from __future__ import annotations

import importlib
import itertools
from math import isclose
from unittest import mock

import pytest

from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.schedule import (
    Costs,
    add_communication,
    check,
    generate,
    lower,
    merge_backward,
    overlap,
    parse_program,
    simulate,
    split_backward,
    strip_communication,
    weights_after_sends,
)
from funcpipe.schedule.generators import GENERATORS, dualpipe_v, zbv
from funcpipe.schedule.ir import COMM_OPS, Instr, Op, Program, pairs, parse_instr
from funcpipe.schedule.zero import shard_data

overlap_module = importlib.import_module("funcpipe.schedule.overlap")  # (the name is the pass)

TRAINING = [n for n in GENERATORS if n != "forward"]

ONE_RANK = """
placement 0 0
microbatches 2
rank 0
F s0 m0
F s1 m0
F s0 m1
& B s1 m0
B s0 m0
F s1 m1
B s1 m1
B s0 m1
"""


def _count(program: Program) -> int:
    return sum(len(pairs(r)) for r in program.ranks)


def _unpaired(program: Program) -> Program:
    return program.replace(
        ranks=tuple(tuple(i.join(False) if i.joined else i for i in r) for r in program.ranks)
    )


# ------------------------------------------------------------------ text form and structure
def test_a_pair_round_trips_through_its_text() -> None:
    i = parse_instr("& B s1 m0")
    assert i == Instr(Op.B, 1, 0, joined=True) and str(i) == "& B s1 m0"
    assert parse_instr("&I s2 m3") == Instr(Op.I, 2, 3, joined=True)
    p = parse_program(ONE_RANK)
    assert pairs(p.ranks[0]) == ((2, 3),)
    assert parse_program(p.to_text()) == p
    assert "& B s1 m0" in p.table()
    assert p != _unpaired(p)  # the pair is part of the value


@pytest.mark.parametrize(
    "body, match",
    [
        ("F s0 m0\n& F s1 m0", "is not an F with a B or I"),
        ("F s0 m0\nF s1 m0\nB s1 m0\n& B s0 m0", "is not an F with a B or I"),
        ("& F s0 m0", "first instruction of the rank"),
        ("F s0 m0\nF s0 m1\n& B s0 m0\n& F s1 m0", "itself the second half of a pair"),
        ("F s0 m0\n& W s0 m0", "W, R, SEND, RECV and the collectives run alone"),
        ("F s0 m0\n& SEND act s0>s1 m0 to r1", "run alone"),
    ],
)
def test_a_malformed_pair_is_refused_naming_it(body: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        parse_program("placement 0 0\nmicrobatches 2\nrank 0\n" + body)


# ------------------------------------------------------------------ the checker
def test_an_independent_pair_is_accepted() -> None:
    check(parse_program(ONE_RANK))


def test_a_pair_of_one_microbatch_is_refused_naming_both() -> None:
    text = ONE_RANK.replace("F s0 m1\n& B s1 m0\nB s0 m0", "B s1 m0\nF s0 m1\nB s0 m0")
    text = text.replace("F s1 m1\nB s1 m1", "F s1 m1\n& B s1 m1")
    with pytest.raises(ScheduleError, match=r"'F s1 m1' \(step \d\) and 'B s1 m1' \(step \d\)"):
        check(parse_program(text))


def test_a_pair_whose_backward_needs_its_forward_is_refused_with_the_chain() -> None:
    # B s0 m0 needs B s1 m0 (rank 1), which rank 1 runs after F s1 m1, which needs F s0 m1
    text = """
    placement 0 1
    microbatches 2
    rank 0: F s0 m0; F s0 m1; & B s0 m0; B s0 m1
    rank 1: F s1 m0; F s1 m1; B s1 m0; B s1 m1
    """
    program = parse_program(text)
    for p in (program, add_communication(_unpaired(program))):
        if p.lowered:  # the same pair, made in the lowered program
            ranks = list(p.ranks)
            t = next(t for t, i in enumerate(ranks[0]) if i == Instr(Op.B, 0, 0))
            if ranks[0][t - 1] != Instr(Op.F, 0, 1):
                continue
            ranks[0] = (*ranks[0][:t], ranks[0][t].join(), *ranks[0][t + 1 :])
            p = p.replace(ranks=tuple(ranks))
        with pytest.raises(ScheduleError) as e:
            check(p)
        msg = str(e.value)
        assert "'B s0 m0'" in msg and "'F s0 m1'" in msg and "rank 1 step" in msg
        assert e.value.rule == "the two halves of an overlapped pair are independent"
    with pytest.raises(ScheduleError, match="overlapped pair are independent"):
        add_communication(program)  # refused before it is lowered, too


# ------------------------------------------------------------------ lowering and the passes
@pytest.mark.parametrize("name", TRAINING)
@pytest.mark.parametrize("ranks, microbatches", [(2, 5), (4, 8), (3, 3)])
def test_lowering_keeps_every_pair_whole_and_sound_under_nccl_rules(
    name: str, ranks: int, microbatches: int
) -> None:
    paired = generate(name, ranks=ranks, microbatches=microbatches, overlap=True)
    assert _unpaired(paired) == generate(name, ranks=ranks, microbatches=microbatches)
    lowered = add_communication(paired)
    check(lowered, p2p="nccl")
    assert _count(lowered) == _count(paired)
    for instrs in lowered.ranks:
        for a, b in pairs(instrs):
            assert instrs[a].op not in COMM_OPS and instrs[b].op not in COMM_OPS
    assert strip_communication(lowered) == paired
    more = overlap(paired)  # (the generators' own pairs kept, more where the pass finds them)
    assert _count(more) >= _count(paired) and overlap(more) == more  # idempotent
    assert overlap(add_communication(more)) == add_communication(more)


def test_the_pass_keeps_what_the_one_by_one_search_keeps() -> None:
    """pair_where_sound first proves every wanted pair at once; where that fails (here F s0 m1
    & B s0 m0 waits for itself through rank 1) it searches pair by pair, and either way keeps
    what the one-by-one search keeps."""
    dependent = _unpaired(
        parse_program(
            """
    placement 0 1
    microbatches 2
    rank 0: F s0 m0; F s0 m1; & B s0 m0; B s0 m1
    rank 1: F s1 m0; F s1 m1; B s1 m0; B s1 m1
    """
        )
    )
    paired = overlap(dependent)  # (the fallback: rank 0's refused pair by pair, rank 1's kept)
    assert not pairs(paired.ranks[0]) and len(pairs(paired.ranks[1])) == 1
    cases = [dependent, generate("1f1b", ranks=4, microbatches=8)]
    cases += [generate(n, ranks=4, microbatches=8) for n in ("interleaved", "zb-h1", "chimera")]
    for p in cases:
        got = overlap(p)
        with mock.patch.object(overlap_module, "simulate", side_effect=[ScheduleError("x"), None]):
            searched = overlap(p)  # (the first, all-at-once proof made to fail)
        assert got == searched, p.name


def test_the_pass_pairs_what_it_can_and_nothing_else() -> None:
    p = generate("1f1b", ranks=4, microbatches=8)
    q = overlap(p)
    assert _count(q) > 0 and _unpaired(q) == p
    for instrs in q.ranks:
        for a, b in pairs(instrs):
            assert {instrs[a].op, instrs[b].op} == {Op.F, Op.B}
            assert instrs[a].microbatch != instrs[b].microbatch
    assert _count(overlap(p, stages=[0])) == len(pairs(q.ranks[0]))
    assert overlap(generate("forward", ranks=2, microbatches=2)) == generate(
        "forward", ranks=2, microbatches=2
    )
    for bad in ([9], [-1], [0.5], [True], "01", 3):
        with pytest.raises(InvalidArgument, match="overlap: stages="):
            overlap(p, stages=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="pass a funcpipe.schedule.Program"):
        overlap("1f1b")  # type: ignore[arg-type]


@pytest.mark.parametrize("gen", [dualpipe_v, zbv])
def test_the_other_passes_keep_the_pairs(gen) -> None:  # type: ignore[no-untyped-def]
    p = gen(ranks=2, microbatches=6, overlap=True)
    n = _count(p)
    assert n > 0
    for split, rec, red in itertools.product(
        [None, True], [None, [0, 1, 2, 3], [1]], [None, "data"]
    ):
        q = lower(p, split=split, recompute=rec, reduce=red)
        check(q, p2p="nccl")
        assert _count(q) == n, (split, rec, red)
    for zero in (1, 2):
        q = shard_data(lower(p, reduce="data"), zero=zero)
        check(q, p2p="nccl")
        assert _count(q) == n
    q = weights_after_sends(lower(p))
    check(q, p2p="nccl")
    assert _count(q) == n
    b_only = merge_backward(p)
    assert _count(b_only) == n and merge_backward(split_backward(b_only)) == b_only


# ------------------------------------------------------------------ the simulator's price
def test_a_pair_costs_the_overlap_of_its_compute_and_communication() -> None:
    p = parse_program(ONE_RANK)
    alone = _unpaired(p)
    c = Costs(f=2.0, b=3.0, w=1.0, f_comm=1.5, b_comm=2.5)
    # alone: F 3.5, B (full = b + w = 4) 6.5; the pair F s0 m1 & B s1 m0 together:
    # max(2 + 4, 1.5 + 2.5, 2 + 1.5, 4 + 2.5) = 6.5 instead of 3.5 + 6.5 = 10
    t0, t1 = simulate(alone, c), simulate(p, c)
    assert isclose(t0.makespan - t1.makespan, 3.5)
    assert isclose(t1.hidden, 3.5) and t0.hidden == 0.0
    assert t1.stats()["pairs"] == 1 and isclose(t1.stats()["hidden"], 3.5)
    assert isclose(t1.busy[0], t1.makespan)  # (the pair's span counted once)
    # without communication inside the stages a pair is the two in sequence
    assert simulate(p).makespan == simulate(alone).makespan


def test_a_pair_starts_once_both_halves_inputs_are_in() -> None:
    text = """
    placement 0 1
    microbatches 2
    rank 0: F s0 m0; F s0 m1; B s0 m0; B s0 m1
    rank 1: F s1 m0; F s1 m1; & B s1 m0; B s1 m1
    """
    # rank 1's pair: F s1 m1 needs F s0 m1 (ends at 2 + 2 = 4), B s1 m0 needs F s1 m0 (ends 4)
    c = Costs(f=2.0, b=1.0, w=0.0, f_comm=0.0, b_comm=3.0)
    tl = simulate(parse_program(text), c)
    f, b = tl.events[1][1], tl.events[1][2]
    assert (f.start, b.start) == (4.0, 4.0)
    assert f.end == b.end == 4.0 + max(2 + 1, 0 + 3, 2 + 0, 1 + 3)


@pytest.mark.parametrize("gen", [dualpipe_v, zbv])
def test_the_generators_pair_their_steady_phase(gen) -> None:  # type: ignore[no-untyped-def]
    for p, m in [(1, 4), (2, 8), (4, 16)]:
        paired, plain = gen(ranks=p, microbatches=m, overlap=True), gen(ranks=p, microbatches=m)
        assert _count(plain) == 0 and _count(paired) >= m - 1
        assert _unpaired(paired) == plain
        check(add_communication(paired), p2p="nccl")
        c = Costs(f=1.0, b=1.0, w=1.0, f_comm=0.5, b_comm=0.5)
        assert simulate(paired, c).makespan < simulate(plain, c).makespan
    with pytest.raises(InvalidArgument, match="overlap='yes'; pass True or False"):
        gen(ranks=2, microbatches=4, overlap="yes")


@pytest.mark.parametrize("name", TRAINING)
def test_every_pass_keeps_every_generators_pairs(name: str) -> None:
    p = generate(name, ranks=4, microbatches=8, overlap=True)
    n = _count(p)
    for zero, kw in itertools.product((0, 1, 2), ({}, {"split": True}, {"recompute": [0, 1]})):
        q = lower(p, reduce="data", **kw)  # type: ignore[arg-type]
        if zero:
            q = shard_data(q, zero=zero)
        for r in (q, weights_after_sends(q)):
            check(r, p2p="nccl")
            assert _count(r) == n, (zero, kw)


def test_auto_pairs_where_the_stages_communicate() -> None:
    from funcpipe.schedule import auto

    comm = Costs(f=1.0, b=1.0, w=1.0, f_comm=0.5, b_comm=0.5)
    chosen = auto(ranks=4, microbatches=8, placement="v", costs=comm)
    assert _count(chosen) > 0
    unpaired = auto(ranks=4, microbatches=8, placement="v", costs=Costs(f=1.5, b=1.5, w=1.0))
    assert simulate(chosen, comm).makespan < simulate(unpaired, comm).makespan
    assert _count(auto(ranks=4, microbatches=8, placement="v")) == 0  # nothing to hide
    with pytest.raises(InvalidArgument, match="costs.f_comm has 3 value"):
        auto(ranks=2, microbatches=4, costs=Costs(f_comm=[1.0, 1.0, 1.0]))


def test_the_trace_and_the_picture_show_both_halves_and_the_collectives(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from dataclasses import replace

    from funcpipe.schedule import chrome_trace, draw_timeline
    from funcpipe.schedule.simulate import Span

    p = parse_program(ONE_RANK)
    tl = simulate(p, Costs(f_comm=0.5, b_comm=0.5))
    f, b = tl.events[0][2], tl.events[0][3]  # the pair: F s0 m1 & B s1 m0
    assert (f.start, f.end) == (b.start, b.end)
    calls = ((Span(0, "all_to_all expert (forward)", f.start + 0.1, f.start + 0.4),),)
    measured = replace(tl, spans=calls)
    events = chrome_trace(measured)["traceEvents"]
    halves = [e for e in events if e.get("ph") == "X" and e["name"] in ("F s0 m1", "& B s1 m0")]
    assert sorted(e["tid"] for e in halves) == [0, 2]
    (call,) = [e for e in events if e.get("cat") == "collective"]
    assert call["tid"] == 1 and call["dur"] == pytest.approx(300.0)
    out = draw_timeline(measured, tmp_path / "pair.png")
    assert out.stat().st_size > 0


def test_a_measured_pairs_halves_count_once_where_they_overlap() -> None:
    from funcpipe.schedule.simulate import Event, Timeline

    p = parse_program(ONE_RANK)
    spans = [(0, 1), (1, 2), (2, 5), (3, 6), (6, 7), (7, 8), (8, 9), (9, 10)]  # pair: 2-5, 3-6
    events = (
        tuple(
            Event(0, t, i, a, b)
            for t, (i, (a, b)) in enumerate(zip(p.ranks[0], spans, strict=True))
        ),
    )
    assert Timeline(program=p, events=events).busy == (10.0,)
