"""funcpipe.measure.tune.fastest: choose among programs by measured step time."""

from __future__ import annotations

import time

import pytest

import funcpipe as fp
from funcpipe.errors import InvalidArgument
from funcpipe.measure.tune import Tuned, fastest
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.schedule import generate
from funcpipe.schedule.auto import auto_candidates
from funcpipe.testing import assert_trees_close
from tests import jobs_runtime
from tests.jobs_runtime import data, mse, toy


def test_picks_the_lowest_median_and_reports_every_time() -> None:
    progs = [generate(n, ranks=2, microbatches=2) for n in ("gpipe", "1f1b", "zb-h1")]
    delay = {"gpipe": 0.2, "1f1b": 0.0, "zb-h1": 0.1}  # margins far above scheduling noise
    calls: list[str] = []

    def step(program: fp.schedule.Program) -> None:
        calls.append(str(program.name))
        time.sleep(delay[str(program.name)])

    got = fastest(progs, step, rounds=3, warmup=1)
    assert isinstance(got, Tuned)
    assert got.program is progs[1] and got.index == 1
    assert len(got.times) == 3 and all(len(t) == 3 for t in got.times)
    assert got.medians[0] >= 0.2 and got.medians[1] < got.medians[2] < got.medians[0]
    # warm-up once each, then 3 rounds, each starting one candidate further on
    assert calls[:3] == ["gpipe", "1f1b", "zb-h1"]
    assert calls[3:6] == ["gpipe", "1f1b", "zb-h1"]
    assert calls[6:9] == ["1f1b", "zb-h1", "gpipe"]
    assert calls[9:] == ["zb-h1", "gpipe", "1f1b"]


def test_ties_go_to_the_first_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal medians (a clock that makes every step last exactly 1 s): the earlier candidate
    wins, whichever program it is."""
    import funcpipe.measure.tune as tune

    ticks = iter(range(10_000))
    monkeypatch.setattr(tune.time, "perf_counter", lambda: float(next(ticks)))
    a = generate("1f1b", ranks=2, microbatches=2)
    b = generate("gpipe", ranks=2, microbatches=2)
    for progs in ([a, b], [b, a]):
        got = fastest(progs, lambda p: None, rounds=3, warmup=0)
        assert got.index == 0 and got.program is progs[0]
        assert got.medians == (1.0, 1.0)


def _clocked(monkeypatch: pytest.MonkeyPatch, cost: dict[str, float], slow: set[int]):  # type: ignore[no-untyped-def]
    """A fake clock: a step of program ``p`` lasts ``cost[p]``, 3x as long in the rounds
    counted in ``slow`` (the machine slowing down for a while). Returns (step, calls)."""
    import funcpipe.measure.tune as tune

    now = [0.0]
    calls: list[str] = []
    monkeypatch.setattr(tune.time, "perf_counter", lambda: now[0])

    def step(program: fp.schedule.Program) -> None:
        name = str(program.name)
        calls.append(name)
        n = len(cost)  # every candidate once per round while all are alive; enough for the test
        now[0] += cost[name] * (3.0 if (len(calls) - 1) // n in slow else 1.0)

    return step, calls


def test_halving_measures_the_leading_half_again_until_two_are_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"]
    cost = {"gpipe": 5.0, "1f1b": 3.0, "interleaved": 4.0, "zb-h1": 1.0, "zb-h2": 2.0}
    progs = [generate(n, ranks=2, microbatches=4) for n in names]
    step, calls = _clocked(monkeypatch, cost, slow=set())
    got = fastest(progs, step, rounds=2, warmup=0, halving=True)
    assert got.program is progs[3]
    # 5 candidates for 2 rounds, the best 3 for 2 more, the best 2 for 2 more
    assert len(calls) == 5 * 2 + 3 * 2 + 2 * 2
    assert set(calls[10:16]) == {"zb-h1", "zb-h2", "1f1b"}
    assert set(calls[16:]) == {"zb-h1", "zb-h2"}
    assert [len(t) for t in got.times] == [2, 4, 2, 6, 6]
    assert got.scores[3] < got.scores[4]
    assert fastest(progs, step, rounds=2, warmup=0).index == 3  # without halving: all 2 rounds


def test_a_round_on_a_slower_machine_does_not_change_the_pick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scores are times relative to the same round's: 2 of 5 rounds 3x slower for everyone
    leave every candidate's score, and so the pick, as on a steady machine."""
    cost = {"gpipe": 1.1, "1f1b": 1.0}
    progs = [generate(n, ranks=2, microbatches=4) for n in cost]
    step, _ = _clocked(monkeypatch, cost, slow={1, 3})
    got = fastest(progs, step, rounds=5, warmup=0)
    assert got.index == 1
    steady, _ = _clocked(monkeypatch, cost, slow=set())
    assert fastest(progs, steady, rounds=5, warmup=0).scores == pytest.approx(got.scores)


def test_auto_candidates_tuned_on_a_real_pipeline_match_the_reference() -> None:
    stages, params = toy(2)
    x, y = data(8)
    cands = auto_candidates(ranks=2, microbatches=4, max_activations=2, count=3)
    pipes = {id(c): Pipeline(stages, c, loss_fn=mse) for c in cands}
    got = fastest(cands, lambda p: pipes[id(p)].step(params, x, y), rounds=2)
    assert got.program in cands
    result = pipes[id(got.program)].step(params, x, y)
    ref = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    assert_trees_close((result.loss, result.grads), ref)


def test_pipelines_are_candidates_too() -> None:
    """Options a program does not carry (here recompute) are chosen the same way:
    the winner comes back as ``choice``, its lowered program as ``program``, and its step
    gives the one-process gradients."""
    stages, params = toy(2)
    x, y = data(8)
    program = generate("1f1b", ranks=2, microbatches=4)
    options: list[bool | list[int]] = [False, [0], True]
    pipes = [Pipeline(stages, program, loss_fn=mse, recompute=r) for r in options]
    delay = {0: 0.2, 1: 0.0, 2: 0.1}  # margins far above scheduling noise

    def step(pipe: Pipeline) -> None:
        pipe.step(params, x, y)
        time.sleep(delay[len(pipe.recompute)])

    got = fastest(pipes, step, rounds=2, warmup=0)
    assert got.index == 1 and got.choice is pipes[1] and got.program is pipes[1].program
    result = got.choice.step(params, x, y)
    ref = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    assert_trees_close((result.loss, result.grads), ref)
    # programs still come back as themselves
    assert fastest([program], lambda p: None, rounds=1, warmup=0).choice is program


def test_bad_arguments_are_named() -> None:
    prog = generate("1f1b", ranks=2, microbatches=2)
    with pytest.raises(InvalidArgument, match="non-empty sequence"):
        fastest([], lambda p: None)
    with pytest.raises(InvalidArgument, match="non-empty sequence"):
        fastest(["1f1b"], lambda p: None)  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="not callable"):
        fastest([prog], None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="rounds=0"):
        fastest([prog], lambda p: None, rounds=0)
    with pytest.raises(InvalidArgument, match="warmup=-1"):
        fastest([prog], lambda p: None, warmup=-1)
    with pytest.raises(InvalidArgument, match="halving=1"):
        fastest([prog], lambda p: None, halving=1)  # type: ignore[arg-type]


def test_a_failing_candidate_is_named() -> None:
    prog = generate("1f1b", ranks=2, microbatches=2)

    def step(program: fp.schedule.Program) -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom") as info:
        fastest([prog], step)
    assert any("'1f1b'" in note for note in info.value.__notes__)
    stages, _ = toy(2)
    pipes = [Pipeline(stages, prog, loss_fn=mse, recompute=r) for r in (False, True)]
    with pytest.raises(ValueError, match="boom") as info:
        fastest(pipes, step, warmup=1)
    assert any("#0" in n and "recompute=[]" in n for n in info.value.__notes__)


@pytest.mark.timeout(120)
def test_every_rank_picks_by_the_slowest_rank(pool) -> None:  # type: ignore[no-untyped-def]
    got = pool(2).run(jobs_runtime.tune_agrees_across_ranks)
    assert [g[0] for g in got] == [20, 20]
    assert got[0][1] == got[1][1]  # the same (all-reduced) medians on both ranks
