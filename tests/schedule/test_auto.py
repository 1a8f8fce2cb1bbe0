"""Automatic schedules (funcpipe.schedule.auto) and stage profiling (funcpipe.measure.profile).

``auto`` is checked with the real checker and timed with the real simulator against the
built-in generators; its programs run through ``Pipeline`` against the single-device reference.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import funcpipe as fp
from funcpipe.cli.app import main
from funcpipe.errors import InvalidArgument
from funcpipe.measure.profile import measure_stages, profile_stages
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.schedule import auto as auto_from_package
from funcpipe.schedule.auto import BUILTINS, auto, auto_candidates, minimum_activations
from funcpipe.schedule.check import check
from funcpipe.schedule.costs import StageMemory
from funcpipe.schedule.generators import generate, to_eval
from funcpipe.schedule.ir import Op, Program, parse_program
from funcpipe.schedule.simulate import Costs, peak_activations, peak_memory, simulate
from funcpipe.testing import assert_trees_close
from tests.jobs_runtime import data, mse, toy

# (chunks, placement): the classes auto searches, each compared with its own built-ins
CLASSES = [(1, "loop"), (2, "loop"), (3, "loop"), (2, "v")]


def comparable(ranks: int, microbatches: int, chunks: int, placement: str) -> list[Program]:
    """The built-ins auto must beat: those of BUILTINS for this (placement, chunks) class."""
    if placement == "v":
        names, kw = BUILTINS[("v", 2)], {}
    elif chunks == 1:
        names, kw = BUILTINS[("loop", 1)], {}
    else:
        names, kw = BUILTINS[("loop", 0)], {"chunks": chunks}
    return [generate(n, ranks=ranks, microbatches=microbatches, **kw) for n in names]


def fits(program: Program, limits: Sequence[int]) -> bool:
    return all(a <= c for a, c in zip(peak_activations(program), limits, strict=True))


@st.composite
def problems(draw: Callable[..., Any]) -> dict[str, Any]:
    p = draw(st.integers(1, 8))
    m = draw(st.integers(1, 32))
    v, placement = draw(st.sampled_from(CLASSES))
    if p * m * v > 384:  # keep the ci profile quick: auto itself is timed elsewhere
        m = max(1, 384 // (p * v))
    n = p * v
    cost = st.floats(0.05, 4.0, allow_nan=False, allow_infinity=False)
    per_stage = draw(st.booleans())
    f, b, w = (
        draw(st.lists(cost, min_size=n, max_size=n)) if per_stage else draw(cost) for _ in range(3)
    )
    comm = draw(st.sampled_from([0.0, 0.1, 0.5]))
    # a full backward cheaper than its I and W apart (measured on small stages), or b + w
    full = draw(st.sampled_from([None, 0.6, 0.9]))
    if full is not None:
        bs = b if isinstance(b, list) else [b] * n
        ws = w if isinstance(w, list) else [w] * n
        full = [full * (x + y) for x, y in zip(bs, ws, strict=True)]
    kind = draw(st.sampled_from(["none", "one", "per-rank"]))
    top = 2 * p * v
    limit: Any
    if kind == "none":
        limit = None
    elif kind == "one":
        limit = draw(st.integers(v, top))
    else:
        limit = draw(st.lists(st.integers(v, top), min_size=p, max_size=p))
    return {
        "ranks": p,
        "microbatches": m,
        "chunks": v,
        "placement": placement,
        "costs": Costs(f=f, b=b, w=w, comm=comm, full=full),
        "max_activations": limit,
    }


@given(problem=problems())
@example(
    problem={
        "ranks": 8,
        "microbatches": 24,
        "chunks": 1,
        "placement": "loop",
        "costs": Costs(1, 2, 1, comm=0.1),
        "max_activations": 8,
    }
)
@example(
    problem={
        "ranks": 4,
        "microbatches": 16,
        "chunks": 2,
        "placement": "v",
        "costs": Costs(1, 1, 2),
        "max_activations": 8,
    }
)
def test_auto_is_sound_fits_and_beats_every_comparable_builtin(problem: dict[str, Any]) -> None:
    """For drawn sizes, costs (one number or one per stage, with a message latency) and limits
    (none, one for all ranks, one per rank, each >= chunks):

    - the program passes ``check`` and is compute-only, with ``ranks`` ranks and the class's
      placement (loop: stage s on rank s % ranks; v: ZB-V's);
    - ``peak_activations(program)[r] <= limit[r]`` on every rank;
    - its simulated makespan is <= that of every built-in of the same class that fits the
      same limits: one chunk, loop -> 1f1b, zb-h1, zb-h2, gpipe; chunks >= 2, loop ->
      interleaved and looped-bfs with those chunks; V (2 chunks) -> zbv and dualpipev.
    """
    program = auto(**problem)
    check(program)
    p, m, v = problem["ranks"], problem["microbatches"], problem["chunks"]
    assert program.n_ranks == p and program.microbatches == m and program.chunks == v
    assert {i.op for r in program.ranks for i in r} <= {Op.F, Op.B, Op.I, Op.W}
    assert program.name == "auto"
    limit = problem["max_activations"]
    limits = [m * v] * p if limit is None else [limit] * p if isinstance(limit, int) else limit
    assert fits(program, limits)
    costs = problem["costs"]
    span = simulate(program, costs).makespan
    for builtin in comparable(p, m, v, problem["placement"]):
        assert builtin.placement == program.placement
        if fits(builtin, limits):
            other = simulate(builtin, costs).makespan
            assert span <= other + 1e-9 * max(1.0, other), builtin.name


@st.composite
def memory_problems(draw: Callable[..., Any]) -> dict[str, Any]:
    """A problem with a limit in bytes: each stage's activation and what its I leaves for W
    drawn (stages differ, as a loss head or an embedding makes them), a limit per rank from
    what one microbatch needs there up to a few times more."""
    problem = draw(problems())
    problem.pop("max_activations")
    n = problem["ranks"] * problem["chunks"]
    problem["microbatches"] = min(problem["microbatches"], max(1, 128 // n))  # quick in ci
    act = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    kept = [draw(st.integers(0, a + 1)) for a in act]  # for_w may exceed the activation
    weights = [max(a, k) for a, k in zip(act, kept, strict=True)]
    placement = generate(
        "zbv"
        if problem["placement"] == "v"
        else "interleaved"
        if problem["chunks"] > 1
        else "1f1b",
        ranks=problem["ranks"],
        microbatches=max(problem["microbatches"], problem["ranks"]),
        **(
            {"chunks": problem["chunks"]}
            if problem["chunks"] > 1 and problem["placement"] == "loop"
            else {}
        ),
    ).placement
    least = [
        sum(w for w, q in zip(weights, placement, strict=True) if q == r)
        for r in range(problem["ranks"])
    ]
    caps = [x + draw(st.integers(0, 3 * x)) for x in least]
    problem["memory"] = StageMemory(tuple(act), tuple(kept))
    problem["max_memory"] = caps if draw(st.booleans()) else max(caps)
    return problem


@given(problem=memory_problems())
def test_auto_with_a_limit_in_bytes(problem: dict[str, Any]) -> None:
    """For drawn sizes, costs, per-stage bytes and limits in bytes: sound; within the limit by
    peak_memory, both as the search counts (an F holds max(activation, for_w) until its I,
    for_w from its I to its W) and as the activation walk (for_w may exceed the activation);
    and never slower than a built-in of the same class that fits the same limit."""
    program = auto(**problem)
    check(program)
    p = problem["ranks"]
    mem = problem["memory"]
    cap = problem["max_memory"]
    caps = cap if isinstance(cap, list) else [cap] * p
    weights = [max(a, k) for a, k in zip(mem.activation, mem.for_w, strict=True)]

    def fits(prog: Program, activation: Sequence[float]) -> bool:
        got = peak_memory(prog, activation, mem.for_w)
        return all(x <= c for x, c in zip(got, caps, strict=True))

    assert fits(program, weights) and fits(program, mem.activation)
    costs = problem["costs"]
    span = simulate(program, costs).makespan
    for builtin in comparable(p, problem["microbatches"], problem["chunks"], problem["placement"]):
        if fits(builtin, weights):
            other = simulate(builtin, costs).makespan
            assert span <= other + 1e-9 * max(1.0, other), builtin.name


def test_a_limit_in_bytes_sees_stages_of_different_sizes() -> None:
    """ZB-V's placement puts the last stage (here 4x the others' bytes: a loss head) with the
    first on rank 0. A byte limit converted to counts by the largest stage leaves rank 0 two
    activations; in bytes, its light stage may keep more in flight."""
    p, m = 4, 16
    act = [1, 1, 1, 1, 1, 1, 1, 4]
    caps = [10, 6, 6, 6]
    light = auto(ranks=p, microbatches=m, placement="v", max_memory=caps, memory=act)
    assert all(x <= c for x, c in zip(peak_memory(light, act), caps, strict=True))
    safe = auto(ranks=p, microbatches=m, placement="v", max_activations=[2, 6, 6, 6])
    assert simulate(light).makespan == 104 < simulate(safe).makespan == 167
    # as good as the best count limit that happens to fit these bytes (found by hand: 4 on rank 0)
    lucky = auto(ranks=p, microbatches=m, placement="v", max_activations=[4, 6, 6, 6])
    assert all(x <= c for x, c in zip(peak_memory(lucky, act), caps, strict=True))
    assert simulate(light).makespan <= simulate(lucky).makespan
    kw: dict[str, Any] = {"placement": "v", "max_memory": caps, "memory": act}
    found = auto_candidates(ranks=p, microbatches=m, count=3, **kw)
    assert found[0].ranks == light.ranks and len(found) == 3
    for program in found:
        check(program)
        assert all(x <= cap for x, cap in zip(peak_memory(program, act), caps, strict=True))


def test_a_limit_in_bytes_counts_what_i_frees() -> None:
    """An I frees what its W does not need (ZB's point: a W's memory is less than an F's): with
    W needing a quarter of the activation, more Ws may wait under the same bytes and fill the
    drain. 4 ranks, 12 microbatches, F = B = W = 1, latency 0.5, 20 bytes per rank (five
    4-byte activations)."""
    costs = Costs(1, 1, 1, comm=0.5)
    spans = {}
    for kept in (4, 2, 1):
        memory = StageMemory((4, 4, 4, 4), (kept,) * 4)
        program = auto(ranks=4, microbatches=12, costs=costs, memory=memory, max_memory=20)
        got = peak_memory(program, memory.activation, memory.for_w)
        assert all(x <= 20 for x in got)
        spans[kept] = simulate(program, costs).makespan
    assert spans == {4: 43.0, 2: 42.0, 1: 41.0}


def test_a_limit_in_bytes_rejects_bad_arguments() -> None:
    kw: dict[str, Any] = {"ranks": 2, "microbatches": 4}
    with pytest.raises(InvalidArgument, match="max_memory needs memory="):
        auto(**kw, max_memory=10)
    with pytest.raises(InvalidArgument, match="memory= is used with max_memory="):
        auto(**kw, memory=[1, 1])
    with pytest.raises(InvalidArgument, match="not both"):
        auto(**kw, max_memory=10, memory=[1, 1], max_activations=2)
    with pytest.raises(InvalidArgument, match=r"one number >= 0 per stage \(2 stages"):
        auto(**kw, max_memory=10, memory=[1, 1, 1])
    with pytest.raises(InvalidArgument, match="leaves rank 1 2, below what any schedule needs"):
        auto(**kw, max_memory=[10, 2], memory=StageMemory((1, 3), (1, 2)))
    with pytest.raises(InvalidArgument, match="2 value"):
        auto(ranks=3, microbatches=4, max_memory=[10, 10], memory=[1, 1, 1])


@given(problem=problems(), count=st.integers(1, 6))
def test_auto_candidates_are_sound_distinct_ranked_and_start_with_auto(
    problem: dict[str, Any], count: int
) -> None:
    """auto_candidates: at most ``count`` distinct programs, each sound and within the limit,
    in order of simulated makespan, the first auto's own; one equal to a built-in's program
    carries the built-in's name."""
    got = auto_candidates(**problem, count=count)
    assert 1 <= len(got) <= count
    p, m, v = problem["ranks"], problem["microbatches"], problem["chunks"]
    limit = problem["max_activations"]
    limits = [m * v] * p if limit is None else [limit] * p if isinstance(limit, int) else limit
    spans = []
    for program in got:
        check(program)
        assert fits(program, limits)
        spans.append(simulate(program, problem["costs"]).makespan)
    assert spans == sorted(spans)
    assert len({c.ranks for c in got}) == len(got)
    assert got[0].ranks == auto(**problem).ranks
    builtins: dict[Any, set[str | None]] = {}
    for b in comparable(p, m, v, problem["placement"]):
        builtins.setdefault(b.ranks, set()).add(b.name)  # some coincide (1 rank: ZB-H1 = H2)
    for program in got:
        if program.ranks in builtins:
            assert program.name in builtins[program.ranks]
        else:
            assert program.name is not None and program.name.startswith("auto")


def test_auto_candidates_rejects_a_bad_count() -> None:
    with pytest.raises(InvalidArgument, match="count"):
        auto_candidates(ranks=2, microbatches=4, count=0)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_half_of_1f1b_bubble_at_1f1b_memory(p: int, m: int) -> None:
    """F = B = W, max_activations = p (1F1B's peak): at most half of 1F1B's bubble."""
    one_f_one_b = simulate(generate("1f1b", ranks=p, microbatches=m)).bubble_fraction
    program = auto(ranks=p, microbatches=m, max_activations=p)
    assert max(peak_activations(program)) <= p
    assert simulate(program).bubble_fraction <= 0.5 * one_f_one_b
    # the V placement at the same memory: 2p chunk stages of half a rank each
    program = auto(ranks=p, microbatches=m, chunks=2, placement="v", max_activations=2 * p)
    assert max(peak_activations(program)) <= 2 * p
    assert simulate(program).bubble_fraction <= 0.5 * one_f_one_b


def test_a_cheap_full_backward_is_used() -> None:
    """When B costs less than I + W (small stages), auto keeps whole backwards where splitting
    does not pay, and is never slower than 1F1B under those costs."""
    costs = Costs(f=1, b=1, w=1, full=1.2)
    program = auto(ranks=4, microbatches=8, costs=costs, max_activations=4)
    assert any(i.op is Op.B for r in program.ranks for i in r)
    one_f_one_b = generate("1f1b", ranks=4, microbatches=8)
    assert simulate(program, costs).makespan <= simulate(one_f_one_b, costs).makespan
    assert simulate(one_f_one_b, costs).makespan < simulate(one_f_one_b, Costs(1, 1, 1)).makespan


def test_a_backward_within_noise_of_i_plus_w_is_not_merged() -> None:
    """The large benchmark model's in-step costs (ms, round 6): stage 0's B is 1% cheaper than
    its I + W. auto used to merge them on rank 0 (the same makespan, a smaller sum of finish
    times), a program that ran 2% slower than ZB-H1; now it returns ZB-H1's program."""
    costs = Costs(
        f=[6.359, 6.452], b=[4.971, 6.219], w=[5.620, 5.325], full=[10.482, 11.491], comm=0.041
    )
    program = auto(ranks=2, microbatches=8, costs=costs, max_activations=2)
    assert program.ranks == generate("zb-h1", ranks=2, microbatches=8).ranks
    # 10% cheaper: merged where W directly follows its I
    cheap = Costs(f=costs.f, b=costs.b, w=costs.w, full=[9.5, 11.491], comm=0.041)
    merged = auto(ranks=2, microbatches=8, costs=cheap, max_activations=2)
    assert any(i.op is Op.B and i.stage == 0 for i in merged.ranks[0])
    assert not any(i.op is Op.B for i in merged.ranks[1])  # stage 1: B is 0.5% cheaper


def test_auto_beats_interleaved_where_the_split_backward_helps() -> None:
    costs = Costs(1, 1, 1)
    program = auto(ranks=4, microbatches=8, chunks=2, max_activations=11)
    interleaved = generate("interleaved", ranks=4, microbatches=8, chunks=2)
    assert max(peak_activations(interleaved)) == 11
    assert simulate(program, costs).makespan < simulate(interleaved, costs).makespan


def test_auto_is_deterministic_and_exported() -> None:
    kw: dict[str, Any] = {"ranks": 3, "microbatches": 7, "costs": Costs(1, 2, 1, comm=0.2)}
    assert auto(**kw) == auto(**kw)
    assert auto_from_package is auto
    assert fp.profile_stages is profile_stages
    assert not hasattr(fp.schedule, "profile_stages")  # the schedule package runs no stages
    assert minimum_activations(chunks=2) == 2


def test_limit_equal_to_the_minimum_works() -> None:
    for v, placement in CLASSES:
        program = auto(ranks=3, microbatches=5, chunks=v, placement=placement, max_activations=v)
        check(program)
        assert max(peak_activations(program)) == v


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"ranks": 0}, ["ranks=0", ">= 1"]),
        ({"microbatches": "8"}, ["microbatches='8'", "int"]),
        ({"chunks": 3, "placement": "v"}, ["chunks=3", "exactly 2", "placement='loop'"]),
        ({"placement": "zigzag"}, ["placement='zigzag'", "'loop'", "'v'"]),
        ({"costs": "1,1,1"}, ["costs='1,1,1'", "Costs"]),
        ({"costs": Costs(f=[1, 2, 3])}, ["costs.f has 3 value(s)", "4 stages", "one value per"]),
        ({"max_activations": 0}, ["max_activations=0", "below what any", ">= 1"]),
        (
            {"chunks": 2, "max_activations": 1},
            ["max_activations=1", "below what any schedule needs", "max_activations >= 2"],
        ),
        ({"max_activations": [4, 4]}, ["max_activations=[4, 4]", "ranks=4", "one limit per"]),
        ({"max_activations": [4, 4, 0, 4]}, ["max_activations[2]=0", ">= 1"]),
        ({"max_activations": 2.5}, ["max_activations=2.5", "whole number"]),
        ({"max_activations": True}, ["max_activations=True", "whole number"]),
    ],
)
def test_bad_arguments_name_the_argument_the_rule_and_the_fix(
    kwargs: dict[str, Any], words: list[str]
) -> None:
    options: dict[str, Any] = {"ranks": 4, "microbatches": 8, **kwargs}
    with pytest.raises(InvalidArgument) as info:
        auto(**options)
    for word in words:
        assert word in str(info.value)


def test_bad_profile_arguments() -> None:
    stages, params = toy(2)
    x, _ = data(4)
    cases: list[tuple[dict[str, Any], str]] = [
        ({"stages": []}, "non-empty list of funcpipe.Stage"),
        ({"stages": [print, print]}, "stages[0]="),
        ({"params": params[:1]}, "2 stage(s) but 1 params"),
        ({"repeats": 0}, "repeats=0"),
        ({"warmup": -1}, "warmup=-1"),
        ({"comm": -1.0}, "comm=-1.0"),
    ]
    for change, words in cases:
        options: dict[str, Any] = {"stages": stages, "params": params, **change}
        with pytest.raises(InvalidArgument, match=None) as info:
            profile_stages(options.pop("stages"), options.pop("params"), x, **options)
        assert words in str(info.value)


# ------------------------------------------------------------------------------ CLI
def test_cli_auto_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "auto", "--ranks", "4", "--microbatches", "8", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    for key in ("bubble_fraction", "makespan", "peak_activations", "program"):
        assert key in stats
    program = parse_program(stats["program"])
    check(program)
    assert stats["name"] == "auto" and stats["makespan"] == simulate(program).makespan
    argv = ["schedule", "auto", "-p", "4", "-m", "8", "--max-activations", "4", "--json"]
    assert main([*argv, "--costs", "1,2,1,0.1", "--chunks", "2", "--placement", "v"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert max(stats["peak_activations"]) <= 4 and stats["stages"] == 8


def test_cli_auto_bad_limit_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["schedule", "auto", "-p", "4", "-m", "8", "--chunks", "2", "--max-activations", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "max_activations=1" in err and ">= 2" in err
    assert main(["schedule", "1f1b", "-p", "2", "-m", "2", "--max-activations", "2"]) == 2
    assert "options of 'auto'" in capsys.readouterr().err


# ------------------------------------------------------------------------------ profiling
def _model(n: int) -> tuple[list[fp.Stage], list[dict[str, torch.Tensor]]]:
    torch.manual_seed(0)
    pairs = [
        fp.from_module(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        )
        for _ in range(n)
    ]
    return [s for s, _ in pairs], [p for _, p in pairs]


def test_profile_stages_on_a_real_model_feeds_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    from funcpipe.runtime import autodiff

    # what each timed I sees: whether the stage's inputs ask for a gradient (no timing compared)
    wants: list[bool] = []
    real = autodiff.backward_input

    def spy(saved: Any, *args: Any, **kwargs: Any) -> Any:
        wants.append(any(t.requires_grad for t in saved.inputs))
        return real(saved, *args, **kwargs)

    monkeypatch.setattr(autodiff, "backward_input", spy)
    stages, params = _model(4)
    x = torch.randn(16, 32)
    costs = profile_stages(stages, params, x, repeats=3)
    # warmup 1 + repeats 3 I's per stage, in stage order
    assert len(wants) == 4 * 4
    # stage 0's inputs need no gradient (as in the interpreter), so its I computes none for them
    assert wants[:4] == [False] * 4 and all(wants[4:]), wants
    for name in ("f", "b", "w"):
        values = getattr(costs, name)
        assert len(values) == 4 and all(0 < t < 1.0 for t in values), (name, values)
    assert costs.comm == 0.0  # no process group
    times = measure_stages(stages, params, x, repeats=3, comm=1e-4)
    assert len(times.b) == 4 and all(t > 0 for t in times.b) and times.comm == 1e-4
    assert times.costs().comm == 1e-4
    for v, placement in [(1, "loop"), (2, "loop"), (2, "v")]:
        program = auto(ranks=4 // v, microbatches=6, chunks=v, placement=placement, costs=costs)
        check(program)


@pytest.mark.parametrize(("ranks", "chunks", "placement"), [(3, 1, "loop"), (2, 2, "v")])
def test_an_auto_program_runs_and_matches_the_reference(
    ranks: int, chunks: int, placement: str
) -> None:
    n = ranks * chunks
    stages, params = toy(n)
    x, y = data(10)
    costs = profile_stages(stages, params, x[:2], repeats=2)
    program = auto(
        ranks=ranks,
        microbatches=5,
        chunks=chunks,
        placement=placement,
        costs=costs,
        max_activations=2 * chunks,
    )
    result = Pipeline(stages, program, loss_fn=mse).step(params, x, y)
    ref_loss, ref_grads = fp.reference_step(stages, params, x, mse, targets=y, microbatches=5)
    assert_trees_close((result.loss, result.grads), (ref_loss, ref_grads))
    assert max(result.peak_activations.values()) <= 2 * chunks


def test_costs_from_executed_timelines_feed_auto() -> None:
    from funcpipe.schedule import costs_from_timelines

    stages, params = toy(4)
    x, y = data(8)
    pipe = Pipeline(stages, generate("zb-h1", ranks=4, microbatches=4), loss_fn=mse)
    timelines = [pipe.step(params, x, y, trace=True).timeline for _ in range(2)]
    costs = costs_from_timelines(timelines, comm=2e-5)
    for name in ("f", "b", "w"):
        values = getattr(costs, name)
        assert len(values) == 4 and all(0 < t < 1.0 for t in values), (name, values)
    assert costs.comm == 2e-5
    check(auto(ranks=4, microbatches=4, costs=costs, max_activations=4))
    # a program with full backwards only: B is halved between b and w
    full = Pipeline(stages, generate("1f1b", ranks=4, microbatches=4), loss_fn=mse)
    tl = full.step(params, x, y, trace=True).timeline
    halves = costs_from_timelines([tl])
    assert halves.b == halves.w
    with pytest.raises(InvalidArgument, match="at least one"):
        costs_from_timelines([])
    evaluation = Pipeline(stages, to_eval(generate("1f1b", ranks=4, microbatches=4)))
    with pytest.raises(InvalidArgument, match="no forward or no backward"):
        costs_from_timelines([evaluation.step(params, x, trace=True).timeline])


def profile_job(rank: int, n: int) -> Costs:
    """Pool job: every rank profiles the same toy stages; ranks 0 and 1 time the messages."""
    stages, params = toy(n)
    x, _ = data(4)
    return profile_stages(stages, params, x, repeats=1)


def test_profile_measures_the_latency_over_a_process_group(pool: Callable[[int], Any]) -> None:
    costs = pool(2).run(profile_job, 2)
    assert costs[0].comm > 0 and costs[0].comm == costs[1].comm


def test_benchmark_grid_cell() -> None:
    """benchmarks/auto_grid.py at one cell: auto at or below every built-in that fits."""
    grid = pytest.importorskip("benchmarks.auto_grid")
    row = grid.cell(4, 8, (1, 1, 2), 4)
    assert row["interleaved"]["bubble"] is None and row["zb-h2"]["bubble"] is None
    assert row["auto"]["bubble"] <= min(row[n]["bubble"] for n in ("1f1b", "zb-h1")) + 1e-12
    assert row["auto-v"]["bubble"] <= row["zbv"]["bubble"] + 1e-12
    assert row["auto"]["peak"] <= 4 and row["auto-v"]["peak"] <= 4
