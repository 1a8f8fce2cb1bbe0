"""The exact refinement of ``auto`` (funcpipe.schedule.exact): a mixed-integer program.

Its programs are checked with the real checker and timed with the real simulator; on tiny
problems its optimum is compared with every valid program enumerated by brute force.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from funcpipe.cli.app import main
from funcpipe.errors import InvalidArgument
from funcpipe.schedule import exact
from funcpipe.schedule.auto import _peak, _problem, _timing, auto
from funcpipe.schedule.check import check
from funcpipe.schedule.problem import OP_B, OP_F, OP_I, OP_W, Problem
from funcpipe.schedule.simulate import Costs, peak_activations, peak_memory, simulate

pytestmark = pytest.mark.skipif(not exact.available(), reason="scipy (the solver) not installed")


@st.composite
def small_problems(draw: Callable[..., Any]) -> dict[str, Any]:
    p = draw(st.integers(1, 3))
    v, placement = draw(st.sampled_from([(1, "loop"), (2, "loop"), (2, "v")]))
    m = draw(st.integers(1, 4 if v == 1 else 3))
    n = p * v
    cost = st.sampled_from([0.5, 1.0, 2.0, 3.0])
    f, b, w = (draw(st.lists(cost, min_size=n, max_size=n)) for _ in range(3))
    if draw(st.booleans()):
        w = [0.0] * n  # no split: one B per stage and microbatch
    limit: Any = draw(st.integers(v, m * v))
    if draw(st.booleans()):  # one limit per rank
        limit = draw(st.lists(st.integers(v, m * v), min_size=p, max_size=p))
    return {
        "ranks": p,
        "microbatches": m,
        "chunks": v,
        "placement": placement,
        "costs": Costs(f=f, b=b, w=w, comm=draw(st.sampled_from([0.0, 0.5]))),
        "max_activations": limit,
    }


@settings(max_examples=20)
@given(problem=small_problems())
def test_exact_is_sound_fits_and_never_worse_than_the_heuristic(problem: dict[str, Any]) -> None:
    heuristic = auto(**problem)
    refined = auto(**problem, exact=2.0)
    check(refined)
    assert refined.name == "auto" and refined.placement == heuristic.placement
    limit = problem["max_activations"]
    limits = limit if isinstance(limit, list) else [limit] * problem["ranks"]
    assert all(a <= c for a, c in zip(peak_activations(refined), limits, strict=True))
    costs = problem["costs"]
    assert simulate(refined, costs).makespan <= simulate(heuristic, costs).makespan + 1e-9


def test_exact_finds_a_shorter_program_than_the_heuristic() -> None:
    """A V placement with uneven stages: the heuristic's best takes 41, the optimum 38."""
    problem: dict[str, Any] = {
        "ranks": 2,
        "microbatches": 3,
        "placement": "v",
        "costs": Costs(f=[1, 3, 1, 1], b=[3, 3, 3, 1], w=[1, 1, 1, 2]),
        "max_activations": 3,
    }
    heuristic = simulate(auto(**problem), problem["costs"]).makespan
    refined = auto(**problem, exact=60.0)
    check(refined)
    assert max(peak_activations(refined)) <= 3
    assert simulate(refined, problem["costs"]).makespan == 38.0 < heuristic


def _orders(problem: Problem, r: int) -> Iterator[list[tuple[int, int, int]]]:
    """Every order of rank r's instructions that keeps each stage's microbatches in order and
    each microbatch's F before its I (or B) before its W."""
    items = []
    for s in problem.local(r):
        for k in range(problem.m):
            ops = [OP_F, OP_I, OP_W] if problem.w[s] > 0 else [OP_F, OP_B]
            items += [(op, s, k) for op in ops]

    def before(a: tuple[int, int, int], b: tuple[int, int, int]) -> bool:
        if a[1] != b[1]:
            return False
        if a[0] == b[0]:
            return a[2] < b[2]
        return a[2] == b[2] and (a[0], b[0]) in {
            (OP_F, OP_I),
            (OP_F, OP_W),
            (OP_I, OP_W),
            (OP_F, OP_B),
        }

    def extend(rest: list[tuple[int, int, int]]) -> Iterator[list[tuple[int, int, int]]]:
        if not rest:
            yield []
            return
        for x in rest:
            if not any(before(y, x) for y in rest if y != x):
                for tail in extend([y for y in rest if y != x]):
                    yield [x, *tail]

    yield from extend(items)


def _brute_force(problem: Problem) -> float:
    best = float("inf")
    for combo in itertools.product(*(list(_orders(problem, r)) for r in range(problem.p))):
        order = [list(x) for x in combo]
        if any(_peak(x, problem) > c for x, c in zip(order, problem.cap, strict=True)):
            continue
        timing = _timing(problem, order)
        if timing is not None:
            best = min(best, timing.makespan)
    return best


@pytest.mark.parametrize(
    ("m", "placement", "f", "b", "w", "comm", "cap"),
    [
        (3, "loop", [1, 2], [2, 1], [1, 2], 0.0, 2),
        (3, "loop", [2, 1], [1, 3], [2, 1], 1.0, 1),
        (3, "loop", [1, 3], [3, 1], [2, 2], 0.5, 3),
        (2, "v", [2, 1, 1, 2], [1, 2, 2, 1], [0, 0, 0, 0], 0.5, 3),
    ],
)
def test_the_solver_reaches_the_brute_force_optimum(
    m: int, placement: str, f: list[float], b: list[float], w: list[float], comm: float, cap: int
) -> None:
    problem = _problem(2, m, None, placement, Costs(f=f, b=b, w=w, comm=comm), cap)
    optimum = _brute_force(problem)
    costs = Costs(f=f, b=b, w=w, comm=comm)
    program = auto(ranks=2, microbatches=m, placement=placement, costs=costs, max_activations=cap)
    incumbent = simulate(program, costs).makespan
    order = exact.refine(problem, incumbent, time_limit=60.0)
    assert order is not None
    timing = _timing(problem, order)
    assert timing is not None
    assert all(_peak(x) <= c for x, c in zip(order, problem.cap, strict=True))
    assert timing.makespan == pytest.approx(optimum)


def test_the_solver_reaches_the_brute_force_optimum_with_a_limit_in_bytes() -> None:
    """Stages of different sizes (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2): the
    memory rows weigh each activation by its stage's bytes."""
    costs = Costs(f=[2, 1, 1, 2], b=[1, 2, 2, 1], w=[0, 0, 0, 0], comm=0.5)
    memory, caps = [1, 2, 1, 3], [5, 4]
    problem = _problem(2, 2, None, "v", costs, None, caps, memory)
    optimum = _brute_force(problem)
    program = auto(
        ranks=2, microbatches=2, placement="v", costs=costs, max_memory=caps, memory=memory
    )
    assert all(x <= c for x, c in zip(peak_memory(program, memory), caps, strict=True))
    order = exact.refine(problem, simulate(program, costs).makespan, time_limit=60.0)
    assert order is not None
    timing = _timing(problem, order)
    assert timing is not None
    assert all(_peak(x, problem) <= c for x, c in zip(order, caps, strict=True))
    assert timing.makespan == pytest.approx(optimum)
    # the limit binds: without it the optimum is shorter (18 against 24)
    assert _brute_force(_problem(2, 2, None, "v", costs, None)) < optimum == 24


def test_the_solver_reaches_the_brute_force_optimum_when_i_frees_memory() -> None:
    """Split backwards whose W needs less than the F kept: the memory rows count each I's
    release (one chunk, 2 ranks, 3 microbatches, activation 3, W needs 1, 5 per rank)."""
    from funcpipe.schedule.costs import StageMemory

    costs = Costs(f=[1, 2], b=[2, 1], w=[1, 2], comm=0.5)
    memory = StageMemory((3, 3), (1, 1))
    problem = _problem(2, 3, None, "loop", costs, None, 5, memory)
    optimum = _brute_force(problem)
    program = auto(ranks=2, microbatches=3, costs=costs, max_memory=5, memory=memory)
    assert all(x <= 5 for x in peak_memory(program, memory.activation, memory.for_w))
    order = exact.refine(problem, simulate(program, costs).makespan, time_limit=60.0)
    assert order is not None
    timing = _timing(problem, order)
    assert timing is not None
    assert all(_peak(x, problem) <= 5 for x in order)
    assert timing.makespan == pytest.approx(optimum)
    # what I frees matters: counting the whole activation until W, the optimum is longer
    whole = _problem(2, 3, None, "loop", costs, None, 5, StageMemory((3, 3), (3, 3)))
    assert optimum < _brute_force(whole)


@pytest.mark.parametrize("bad", [0, -1.0, True, "5", float("nan")])
def test_a_bad_time_budget_is_named(bad: Any) -> None:
    with pytest.raises(InvalidArgument, match=r"exact=.*seconds"):
        auto(ranks=2, microbatches=4, exact=bad)


def test_a_missing_solver_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exact, "available", lambda: False)
    with pytest.raises(InvalidArgument, match=r"needs SciPy.*pip install scipy"):
        auto(ranks=2, microbatches=4, exact=1.0)


def test_a_problem_too_large_for_the_solver_keeps_the_heuristic_and_says_so() -> None:
    kw: dict[str, Any] = {"ranks": 8, "microbatches": 64, "chunks": 2, "placement": "v"}
    assert exact.pairs_bound(_problem(8, 64, 2, "v", Costs(), None)) > exact.MAX_PAIRS
    with pytest.warns(UserWarning, match="exact refinement skipped"):
        refined = auto(**kw, exact=1.0)
    assert refined.ranks == auto(**kw).ranks


def test_cli_exact(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["schedule", "auto", "-p", "2", "-m", "3", "--placement", "v"]
    argv += ["--costs", "1,2,1", "--max-activations", "3", "--exact", "5", "--json"]
    assert main(argv) == 0
    assert '"name": "auto"' in capsys.readouterr().out
    assert main(["schedule", "1f1b", "-p", "2", "-m", "2", "--exact", "1"]) == 2
    assert "options of 'auto'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse rejects it
        main(["schedule", "auto", "-p", "2", "-m", "2", "--exact", "0"])
    assert "must be > 0 seconds" in capsys.readouterr().err


def test_benchmark_script_runs(tmp_path: Any) -> None:
    """benchmarks/auto_exact.py at its smallest: the refined program is never longer."""
    from benchmarks import auto_exact

    out = tmp_path / "exact.json"
    rows = auto_exact.main(
        ["--ranks", "2", "--microbatches", "2", "--seconds", "2", "--json", str(out)]
    )
    assert out.exists() and len(rows) >= 3
    assert all(r["exact"] <= r["heuristic"] + 1e-9 for r in rows)
