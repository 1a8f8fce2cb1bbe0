"""The simulator against timelines worked out by hand."""

from __future__ import annotations

import math

import pytest

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.ir import Program, backward, forward, parse_program
from funcpipe.schedule.simulate import Costs, peak_activations, simulate


def _fill_drain_compute_only(p: int, m: int) -> Program:
    ranks = [
        [forward(r, k) for k in range(m)] + [backward(r, k) for k in range(m)] for r in range(p)
    ]
    return Program(ranks=ranks, placement=range(p), microbatches=m)


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (4, 8), (3, 1)])
def test_fill_drain_matches_the_closed_form(p: int, m: int) -> None:
    tl = simulate(_fill_drain_compute_only(p, m))
    assert tl.makespan == 3 * (m + p - 1)
    assert math.isclose(tl.bubble_fraction, (p - 1) / (m + p - 1), abs_tol=1e-12)
    assert tl.peak_activations == (m,) * p
    assert tl.busy == (3.0 * m,) * p


def test_lowered_timeline_with_latency_by_hand() -> None:
    text = """
    placement 0 1
    microbatches 1
    rank 0: F s0 m0; SEND act s0>s1 m0 to r1; RECV grad s0>s1 m0 from r1; B s0 m0
    rank 1: RECV act s0>s1 m0 from r0; F s1 m0; I s1 m0; SEND grad s0>s1 m0 to r0; W s1 m0
    """
    tl = simulate(parse_program(text), Costs(f=2, b=3, w=1, comm=0.5))
    spans = [[(str(e.instr), e.start, e.end) for e in r] for r in tl.events]
    assert spans[0] == [
        ("F s0 m0", 0, 2),
        ("SEND act s0>s1 m0 to r1", 2, 2),
        ("RECV grad s0>s1 m0 from r1", 2, 8.0),  # I on rank 1 ends at 7.5, + 0.5 latency
        ("B s0 m0", 8, 12),
    ]
    assert spans[1] == [
        ("RECV act s0>s1 m0 from r0", 0, 2.5),
        ("F s1 m0", 2.5, 4.5),
        ("I s1 m0", 4.5, 7.5),
        ("SEND grad s0>s1 m0 to r0", 7.5, 7.5),
        ("W s1 m0", 7.5, 8.5),
    ]
    assert tl.makespan == 12
    assert tl.busy == (6.0, 6.0)
    assert math.isclose(tl.bubble_fraction, 1 - 12 / 24)


def test_compute_only_cross_rank_data_pays_latency() -> None:
    program = parse_program(
        "placement 0 1\nmicrobatches 1\nmode eval\nrank 0: F s0 m0\nrank 1: F s1 m0"
    )
    tl = simulate(program, Costs(comm=0.25))
    assert [e.start for e in tl.events[1]] == [1.25]


def test_per_stage_costs_and_replicas() -> None:
    program = parse_program(
        "placement 0 1\nmicrobatches 1\nmode eval\nrank 0: F s0 m0\nrank 1: F s1 m0"
    )
    tl = simulate(program, Costs(f=[1, 4]))
    assert tl.makespan == 5
    chimera_like = parse_program(
        "placement 0 1 1 0\nmicrobatches 2\nmode eval\nedges 0>1 2>3\nentries 0 2\nreplicas 0 1 0 1\n"
        "rank 0: F s0 m0; F s3 m1\nrank 1: F s2 m1; F s1 m0"
    )
    # two logical stages: the replica at slot 2 costs like stage 0, slot 3 like stage 1
    tl = simulate(chimera_like, Costs(f=[1, 10]))
    assert [(e.start, e.end) for e in tl.events[1]] == [(0, 1), (1, 11)]
    with pytest.raises(InvalidArgument, match="one value per stage"):
        simulate(program, Costs(f=[1, 2, 3]))


def test_collective_starts_when_all_members_arrive() -> None:
    text = (
        "placement 0 1\nmicrobatches 1\n"
        "rank 0: F s0 m0; B s0 m0; REDUCE s0 tie:w\n"
        "rank 1: F s1 m0; B s1 m0; REDUCE s1 tie:w"
    )
    tl = simulate(parse_program(text), Costs(reduce=0.5))
    r0, r1 = (r[-1] for r in tl.events)
    # rank 0: F 0-1, B 4-6 (after rank 1's B 2-4); rank 1 arrives at 4 and waits for rank 0
    assert (r0.start, r0.end) == (r1.start, r1.end) == (6.0, 6.5)


def test_peak_activations_count_until_the_last_backward_and_honour_recompute() -> None:
    split = parse_program(
        "placement 0\nmicrobatches 2\nrank 0: F s0 m0; F s0 m1; I s0 m0; I s0 m1; W s0 m0; W s0 m1"
    )
    assert peak_activations(split) == (2,)
    recomputed = parse_program(
        "placement 0\nmicrobatches 2\nrank 0: F s0 m0; F s0 m1; R s0 m0; B s0 m0; R s0 m1; B s0 m1"
    )
    assert peak_activations(recomputed) == (1,)
    evaluation = parse_program(
        "placement 0\nmicrobatches 3\nmode eval\nrank 0: F s0 m0; F s0 m1; F s0 m2"
    )
    assert peak_activations(evaluation) == (1,)


def test_stats_are_json_ready() -> None:
    import json

    stats = simulate(_fill_drain_compute_only(2, 2)).stats()
    assert json.loads(json.dumps(stats))["peak_activations"] == [2, 2]
    assert set(stats) >= {"makespan", "bubble_fraction", "peak_activations", "busy"}


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("1,1,1", (1.0, 1.0, 1.0, 0.0)),
        ("1, 2 ,0.5,0.1", (1.0, 2.0, 0.5, 0.1)),
        ("1,1", None),
        ("a,b,c", None),
    ],
)
def test_costs_parse(text: str, ok: tuple[float, ...] | None) -> None:
    if ok is None:
        with pytest.raises(InvalidArgument, match="F,B,W"):
            Costs.parse(text)
    else:
        c = Costs.parse(text)
        assert (c.f, c.b, c.w, c.comm) == ok


@pytest.mark.parametrize(
    "bad", [{"f": -1}, {"comm": float("nan")}, {"b": "x"}, {"comm": [1, 2]}, {"w": True}]
)
def test_bad_costs_are_invalid_arguments(bad: dict[str, object]) -> None:
    with pytest.raises(InvalidArgument, match="Costs"):
        Costs(**bad)  # type: ignore[arg-type]


def test_simulate_rejects_a_non_costs() -> None:
    with pytest.raises(InvalidArgument, match="costs="):
        simulate(_fill_drain_compute_only(1, 1), costs=(1, 1, 1))  # type: ignore[arg-type]
