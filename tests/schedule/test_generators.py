"""The schedule generators: sound programs, the closed forms they promise, and their errors.

Every generator's program is checked with the real checker and timed with the real simulator;
the bubble and peak statements in the generator docstrings are asserted exactly here.

Golden tables live in ``tests/schedule/golden``; regenerate them with
``FUNCPIPE_REGEN_GOLDEN=1 pytest tests/schedule/test_generators.py`` and review the diff.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.check import check
from funcpipe.schedule.generators import (
    CHUNKS,
    CONSTRAINTS,
    GENERATORS,
    chimera,
    dualpipe_v,
    forward_only,
    generate,
    gpipe,
    interleave_groups,
    interleaved_1f1b,
    looped_bfs,
    one_f_one_b,
    placement_loop,
    placement_v,
    to_eval,
    zb_h1,
    zb_h2,
    zbv,
)
from funcpipe.schedule.ir import Op, Program, format_program, parse_program
from funcpipe.schedule.passes import add_communication
from funcpipe.schedule.simulate import Costs, Timeline, simulate

GOLDEN = Path(__file__).parent / "golden"
NAMES = sorted(GENERATORS)
EQUAL_FB = Costs(f=1.0, b=0.5, w=0.5)  # Chimera's model: forward = full backward

ranks_st = st.integers(1, 8)
microbatches_st = st.integers(1, 32)
chunks_st = st.integers(2, 4)


def spans(tl: Timeline) -> list[float]:
    """Per rank: last end minus first start (the zero-bubble paper's per-stage time)."""
    return [max(e.end for e in r) - min(e.start for e in r) for r in tl.events]


def isclose(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=0.0, abs_tol=1e-12)


def assert_sound_compute_only(program: Program, name: str) -> None:
    check(program)
    assert program.name == name
    assert not program.lowered
    assert {i.op for r in program.ranks for i in r} <= {Op.F, Op.B, Op.I, Op.W}
    assert parse_program(format_program(program)) == program
    evaluation = to_eval(program)
    check(evaluation)
    assert not evaluation.training
    assert [[i for i in r if i.op is Op.F] for r in program.ranks] == [
        list(r) for r in evaluation.ranks
    ]


# --------------------------------------------------------------------------- every generator
def _extremes(test: Callable[..., None]) -> Callable[..., None]:
    """The corners of the grid, always run, whatever hypothesis draws."""
    for p, m in [(1, 1), (1, 32), (8, 1), (8, 7), (8, 15), (8, 16), (8, 32), (7, 13), (5, 32)]:
        test = example(p=p, m=m)(test)
    return test


@settings(deadline=None)
@given(name=st.sampled_from(NAMES), p=ranks_st, m=microbatches_st)
@example(name="interleaved", p=8, m=32)
@example(name="zbv", p=8, m=32)
@example(name="dualpipev", p=8, m=32)
@example(name="chimera", p=7, m=31)
@example(name="zb-h2", p=8, m=32)
def test_every_generator_is_sound_and_round_trips(name: str, p: int, m: int) -> None:
    program = generate(name, ranks=p, microbatches=m)
    assert_sound_compute_only(program, name)
    assert program.n_ranks == p and program.microbatches == m
    assert program.training == (name != "forward")
    assert program.chunks == (CHUNKS[name] or (2 if name in ("interleaved", "looped-bfs") else 1))


@settings(deadline=None)
@given(
    name=st.sampled_from([n for n, fixed in CHUNKS.items() if fixed is None]),  # take chunks=
    p=ranks_st,
    m=microbatches_st,
    v=chunks_st,
)
def test_generators_with_chunks_are_sound(name: str, p: int, m: int, v: int) -> None:
    program = generate(name, ranks=p, microbatches=m, chunks=v)
    assert_sound_compute_only(program, name)
    assert program.n_stages == p * v and program.placement == placement_loop(p, v)


@settings(deadline=None)
@given(name=st.sampled_from(NAMES), p=st.integers(1, 4), m=st.integers(1, 8))
def test_every_generator_lowers_to_a_sound_program(name: str, p: int, m: int) -> None:
    program = generate(name, ranks=p, microbatches=m)
    lowered = add_communication(program)
    check(lowered)
    check(add_communication(to_eval(program)))
    check(to_eval(lowered))  # drops the gradient messages on both ends


def test_registry_tables_agree() -> None:
    assert list(GENERATORS) == [
        "gpipe",
        "1f1b",
        "interleaved",
        "looped-bfs",
        "zb-h1",
        "zb-h2",
        "zbv",
        "dualpipev",
        "chimera",
        "forward",
    ]
    assert set(CONSTRAINTS) == set(GENERATORS) == set(CHUNKS)
    assert all(isinstance(text, str) and "ranks" in text for text in CONSTRAINTS.values())


# --------------------------------------------------------------------------- closed forms
@settings(deadline=None)
@given(
    p=ranks_st,
    m=microbatches_st,
    f=st.sampled_from([0.5, 1.0, 2.0]),
    b=st.sampled_from([0.5, 1.0, 2.0]),
    w=st.sampled_from([0.5, 1.0, 2.0]),
)
def test_gpipe_and_1f1b_bubble(p: int, m: int, f: float, b: float, w: float) -> None:
    costs = Costs(f=f, b=b, w=w)
    for program in (gpipe(ranks=p, microbatches=m), one_f_one_b(ranks=p, microbatches=m)):
        tl = simulate(program, costs)
        assert isclose(tl.makespan, (m + p - 1) * (f + b + w))
        assert isclose(tl.bubble_fraction, (p - 1) / (m + p - 1))


@_extremes
@settings(deadline=None)
@given(p=ranks_st, m=microbatches_st)
def test_gpipe_and_1f1b_peaks(p: int, m: int) -> None:
    assert simulate(gpipe(ranks=p, microbatches=m)).peak_activations == (m,) * p
    peaks = simulate(one_f_one_b(ranks=p, microbatches=m)).peak_activations
    assert peaks == tuple(min(p - r, m) for r in range(p))
    assert peaks[0] == min(p, m)


@settings(deadline=None)
@given(p=ranks_st, m=microbatches_st)
def test_interleave_groups(p: int, m: int) -> None:
    groups = interleave_groups(p, m)
    assert sum(groups) == m
    assert list(groups) == sorted(groups, reverse=True)
    if m < p:
        assert groups == (m,)
    else:
        assert len(groups) == m // p and all(p <= g <= 2 * p - 1 for g in groups)
        if m % p == 0:
            assert groups == (p,) * (m // p)


@settings(deadline=None)
@given(
    p=ranks_st,
    m=microbatches_st,
    v=chunks_st,
    f=st.sampled_from([1.0, 2.0]),
    w=st.sampled_from([0.5, 1.0]),
)
def test_interleaved_bubble_and_peak(p: int, m: int, v: int, f: float, w: float) -> None:
    program = interleaved_1f1b(ranks=p, microbatches=m, chunks=v)
    assert program.placement == placement_loop(p, v)
    tl = simulate(program, Costs(f=f, b=1.0, w=w))
    if m >= p:  # the closed form holds for every m >= p, not only multiples of p
        assert isclose(tl.makespan, (m * v + p - 1) * (f + 1.0 + w))
        assert isclose(tl.bubble_fraction, (p - 1) / (m * v + p - 1))
    g0 = interleave_groups(p, m)[0]
    peaks = tl.peak_activations
    assert peaks == tuple(min((v - 1) * g0 + 2 * (p - 1 - r) + 1, m * v) for r in range(p))
    if m % p == 0 and m * v >= (v + 1) * p - 1:  # not capped by m * v
        assert isclose(peaks[0] / v, p + (p - 1) / v)  # in units of a full stage (v chunks)
    if m >= p:
        assert tl.bubble_fraction <= simulate(one_f_one_b(ranks=p, microbatches=m)).bubble_fraction


@settings(deadline=None)
@given(p=ranks_st, m=microbatches_st, v=st.integers(1, 4))
def test_looped_bfs(p: int, m: int, v: int) -> None:
    tl = simulate(looped_bfs(ranks=p, microbatches=m, chunks=v))
    if m >= p:
        assert tl.makespan == 3 * (m * v + p - 1)
    assert tl.peak_activations == (m * v,) * p


@_extremes
@settings(deadline=None)
@given(p=ranks_st, m=microbatches_st)
def test_zb_h1(p: int, m: int) -> None:
    tl = simulate(zb_h1(ranks=p, microbatches=m))
    one = simulate(one_f_one_b(ranks=p, microbatches=m))
    assert tl.peak_activations == (min(p, m),) * p
    assert max(tl.peak_activations) <= max(one.peak_activations)
    assert tl.makespan <= one.makespan and tl.bubble_fraction <= one.bubble_fraction
    if m >= p:
        assert tl.makespan == 3 * m + p - 1
        assert isclose(tl.bubble_fraction, (p - 1) / (3 * m + p - 1))
        # idle per rank: a third of 1F1B's (p - 1)(F + B + W)
        assert isclose(tl.makespan - 3 * m, (one.makespan - 3 * m) / 3)
    else:
        assert tl.makespan == 2 * m + 2 * p - 1


@settings(deadline=None)
@given(
    p=ranks_st,
    m=microbatches_st,
    f=st.sampled_from([0.5, 1.0, 1.5, 2.0]),
    b=st.sampled_from([0.5, 1.0, 1.5, 2.0]),
    w=st.sampled_from([0.5, 1.0, 1.5, 2.0]),
)
def test_zb_h1_bubble_formula_for_general_costs(
    p: int, m: int, f: float, b: float, w: float
) -> None:
    """m(F+B+W) + (p-1)(F+B-W): exact whenever W <= min(F, B), the paper's regime."""
    assume(m >= p and w <= min(f, b))
    tl = simulate(zb_h1(ranks=p, microbatches=m), Costs(f=f, b=b, w=w))
    assert isclose(tl.makespan, m * (f + b + w) + (p - 1) * (f + b - w))


@_extremes
@settings(deadline=None)
@given(p=ranks_st, m=microbatches_st)
def test_zb_h2(p: int, m: int) -> None:
    tl = simulate(zb_h2(ranks=p, microbatches=m))
    assert max(tl.peak_activations) <= 2 * p - 1
    assert tl.makespan <= simulate(zb_h1(ranks=p, microbatches=m)).makespan
    if m >= p:
        assert tl.makespan == 3 * m + p - 1  # the least any schedule can have
        assert isclose(tl.bubble_fraction, (p - 1) / (3 * m + p - 1))
    if m >= 2 * p - 1:
        assert spans(tl) == [3.0 * m] * p  # zero bubble in the paper's measure
        assert tl.peak_activations == (2 * p - 1,) * p


@_extremes
@settings(deadline=None)
@given(p=ranks_st, m=microbatches_st)
def test_zbv(p: int, m: int) -> None:
    program = zbv(ranks=p, microbatches=m)
    assert program.placement == placement_v(p)
    tl = simulate(program)
    if m >= 2 * p - 1:
        assert spans(tl) == [6.0 * m] * p  # zero bubble in the paper's measure
        assert tl.makespan == 6 * m + p - 1
        assert isclose(tl.bubble_fraction, (p - 1) / (6 * m + p - 1))
        # 2p chunk-stage activations = p full-rank activations, on every rank
        assert tl.peak_activations == (2 * p,) * p


@_extremes
@settings(deadline=None)
@given(p=ranks_st, m=microbatches_st)
def test_dualpipe_v(p: int, m: int) -> None:
    program = dualpipe_v(ranks=p, microbatches=m)
    assert program.placement == placement_v(p)
    ops = {i.op for r in program.ranks for i in r}
    assert Op.B in ops and (Op.I in ops) == (Op.W in ops)
    tl = simulate(program)
    if m >= 2 * p:
        assert tl.makespan == 6 * m + p - 1
        assert isclose(tl.bubble_fraction, (p - 1) / (6 * m + p - 1))
        assert spans(tl) == [6.0 * m + p - 1 - r for r in range(p)]
        assert tl.peak_activations == (2 * p + 1,) * p


@_extremes
@settings(deadline=None)
@given(p=ranks_st, m=microbatches_st)
def test_chimera(p: int, m: int) -> None:
    program = chimera(ranks=p, microbatches=m)
    assert program.placement == placement_v(p)
    assert program.replica_of == tuple(s % p for s in range(2 * p))
    assert (p - 1, p) not in (program.edges or ())
    assert len(program.edges or ()) == 2 * (p - 1)
    assert program.entries == tuple(p if k % 2 else 0 for k in range(m))
    tl = simulate(program)
    assert tl.makespan <= simulate(one_f_one_b(ranks=p, microbatches=m)).makespan
    assert max(tl.peak_activations) <= (p if p % 2 == 0 else p + 1)
    if p % 2 == 0 and m % 2 == 0 and m >= p:
        assert tl.makespan == 3 * m + 2 * (p - 2)
        paper = simulate(program, EQUAL_FB)
        assert paper.makespan == 2 * m + p - 2
        assert isclose(paper.bubble_fraction, (p - 2) / (2 * m + p - 2))
    if p % 2 == 0 and m == p:
        assert tl.peak_activations == tuple(p // 2 + 1 + min(r, p - 1 - r) for r in range(p))


@settings(deadline=None)
@given(p=ranks_st, m=microbatches_st, v=st.integers(1, 4))
def test_forward_only(p: int, m: int, v: int) -> None:
    loop = forward_only(ranks=p, microbatches=m, chunks=v)
    assert not loop.training and loop.placement == placement_loop(p, v)
    tl = simulate(loop)
    assert tl.makespan == (v - 1) * max(m, p) + m + p - 1
    assert tl.peak_activations == (1,) * p
    vee = forward_only(ranks=p, microbatches=m, placement="v")
    check(vee)
    assert vee.placement == placement_v(p) and not vee.training
    assert simulate(vee).makespan == 2 * m + 2 * p - 2


@pytest.mark.parametrize("p", [2, 4, 6, 8])
def test_chimera_merge_is_conflict_free_in_the_papers_model(p: int) -> None:
    """Even p, m <= p, forward = full backward: no piece of work waits past its slot."""
    for m in range(1, p + 1):
        tl = simulate(chimera(ranks=p, microbatches=m), EQUAL_FB)
        for events in tl.events:
            for e in events:
                j = e.instr.stage % p  # position in its pipeline
                base = 2 * (e.instr.microbatch // 2)
                slot = base + j if e.instr.op is Op.F else base + 2 * p - 1 - j
                assert e.end <= slot + 1, (m, e)


@pytest.mark.parametrize("name", ["zbv", "dualpipev", "chimera"])
def test_evaluation_of_v_shaped_schedules(name: str) -> None:
    """torch.distributed.pipelining crashes evaluating V schedules; funcpipe must not."""
    program = generate(name, ranks=4, microbatches=8)
    evaluation = to_eval(program)
    check(evaluation)
    check(add_communication(evaluation))
    assert simulate(evaluation).makespan > 0
    assert to_eval(evaluation) == evaluation


def test_table_numbers_p4() -> None:
    """The figures quoted in the report (F = B = W = 1)."""
    expected = {
        ("gpipe", 8): (33, 3 / 11),
        ("1f1b", 8): (33, 3 / 11),
        ("interleaved", 8): (57, 3 / 19),
        ("zb-h1", 8): (27, 3 / 27),
        ("zb-h2", 8): (27, 3 / 27),
        ("zbv", 8): (51, 3 / 51),
        ("dualpipev", 8): (51, 3 / 51),
        ("chimera", 8): (28, 4 / 28),
        ("gpipe", 16): (57, 3 / 19),
        ("interleaved", 16): (105, 3 / 35),
        ("zb-h1", 16): (51, 3 / 51),
        ("zbv", 16): (99, 3 / 99),
        ("chimera", 16): (52, 4 / 52),
    }
    for (name, m), (makespan, bubble) in expected.items():
        tl = simulate(generate(name, ranks=4, microbatches=m))
        assert tl.makespan == makespan, name
        assert isclose(tl.bubble_fraction, bubble), name


# --------------------------------------------------------------------------- golden tables
GOLDEN_CASES = {
    "1f1b_p2_m4": lambda: one_f_one_b(ranks=2, microbatches=4),
    "1f1b_p4_m8": lambda: one_f_one_b(ranks=4, microbatches=8),
    "interleaved_p2_v2_m4": lambda: interleaved_1f1b(ranks=2, microbatches=4, chunks=2),
    "zbv_p2_m4": lambda: zbv(ranks=2, microbatches=4),
}


@pytest.mark.parametrize("case", sorted(GOLDEN_CASES))
def test_golden_text(case: str) -> None:
    text = format_program(GOLDEN_CASES[case]())
    path = GOLDEN / f"{case}.txt"
    if os.environ.get("FUNCPIPE_REGEN_GOLDEN") == "1":
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing; run with FUNCPIPE_REGEN_GOLDEN=1 to write it"
    assert text == path.read_text()


# --------------------------------------------------------------------------- helpers and errors
def test_placements() -> None:
    assert placement_loop(2, 3) == (0, 1, 0, 1, 0, 1)
    assert placement_loop(3, 1) == (0, 1, 2)
    assert placement_v(3) == (0, 1, 2, 2, 1, 0)
    assert placement_v(1) == (0, 0)
    with pytest.raises(InvalidArgument, match="ranks=0"):
        placement_loop(0, 2)
    with pytest.raises(InvalidArgument, match="chunks=0"):
        placement_loop(2, 0)
    with pytest.raises(InvalidArgument, match="ranks=True"):
        placement_v(True)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("option", "value"),
    [("ranks", 0), ("ranks", 2.0), ("ranks", True), ("microbatches", 0), ("microbatches", "4")],
)
def test_bad_sizes_are_rejected(name: str, option: str, value: object) -> None:
    options: dict[str, object] = {"ranks": 2, "microbatches": 4, option: value}
    if name in ("interleaved", "looped-bfs"):
        options["chunks"] = 2
    with pytest.raises(InvalidArgument, match=f"{option}={value!r}".replace("(", r"\(")) as e:
        GENERATORS[name](**options)
    assert "must be" in str(e.value)


def test_chunk_errors() -> None:
    with pytest.raises(
        InvalidArgument,
        match=r"interleaved_1f1b: chunks=1; interleaving needs chunks >= 2 \(use one_f_one_b",
    ):
        interleaved_1f1b(ranks=2, microbatches=4, chunks=1)
    with pytest.raises(InvalidArgument, match="chunks=0"):
        looped_bfs(ranks=2, microbatches=4, chunks=0)
    with pytest.raises(InvalidArgument, match=r"chunks=3 with placement='v'"):
        forward_only(ranks=2, microbatches=4, chunks=3, placement="v")
    with pytest.raises(InvalidArgument, match="placement='ring'.*'loop'.*'v'"):
        forward_only(ranks=2, microbatches=4, placement="ring")
    with pytest.raises(TypeError):
        gpipe(2, 4)  # type: ignore[call-arg]  # options are keyword-only


def test_generate_dispatch_and_errors() -> None:
    assert generate("zbv", ranks=2, microbatches=4) == zbv(ranks=2, microbatches=4)
    assert generate("ZB_H1", ranks=2, microbatches=4) == zb_h1(ranks=2, microbatches=4)
    assert generate("zbv", ranks=2, microbatches=4, chunks=2).chunks == 2
    assert generate("interleaved", ranks=2, microbatches=4).chunks == 2
    assert generate("interleaved", ranks=2, microbatches=4, chunks=3).chunks == 3
    assert generate("forward", ranks=2, microbatches=4).chunks == 1
    assert generate("1f1b", ranks=2, microbatches=4, chunks=1) == one_f_one_b(
        ranks=2, microbatches=4
    )
    with pytest.raises(InvalidArgument, match="name='nope'.*gpipe, 1f1b, interleaved.*forward"):
        generate("nope", ranks=2, microbatches=4)
    with pytest.raises(InvalidArgument, match="chunks=3 for 'zbv'.*2 stage"):
        generate("zbv", ranks=2, microbatches=4, chunks=3)
    with pytest.raises(InvalidArgument, match="chunks=2 for '1f1b'"):
        generate("1f1b", ranks=2, microbatches=4, chunks=2)
    with pytest.raises(InvalidArgument, match="interleaving needs chunks >= 2"):
        generate("interleaved", ranks=2, microbatches=4, chunks=1)


def test_to_eval_rejects_non_programs() -> None:
    with pytest.raises(InvalidArgument, match="to_eval takes a funcpipe.schedule.ir.Program"):
        to_eval("F s0 m0")  # type: ignore[arg-type]
