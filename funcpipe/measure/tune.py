"""Choosing among programs (or pipelines) by measurement: run each on the real stages, keep the
fastest.

The simulator ranks programs by their predicted makespan, and on a real machine its costs are
off by 10-25% (caches and memory bandwidth shared by the ranks, message latency, noise), as
large as the differences between good schedules. :func:`fastest` settles it the direct way:
it runs one step of every candidate, round-robin for a few rounds, and returns the one whose
step time relative to the other candidates of the same round is lowest (optionally measuring
the leading half again, and again: ``halving=True``). Candidates usually come from
:func:`funcpipe.schedule.auto.auto_candidates` (auto's best few, which include the built-ins
that fit the memory limit)::

    from funcpipe.schedule import Costs
    from funcpipe.schedule.auto import auto_candidates

    candidates = auto_candidates(ranks=2, microbatches=8, costs=costs, max_activations=2)
    pipes = {p: Pipeline(stages, p, loss_fn=loss) for p in candidates}
    best = fastest(candidates, lambda p: pipes[p].step(params, x, y)).program

The candidates may also be :class:`funcpipe.Pipeline` objects, for choices a program does not
carry: e.g. which stages to recompute (a trade of compute for memory)::

    pipes = [Pipeline(stages, program, loss_fn=loss, recompute=r) for r in (False, [0], True)]
    best = fastest(pipes, lambda pipe: pipe.step(params, x, y)).choice

Under ``torch.distributed`` every process of the default group must call :func:`fastest` with
the same candidates in the same order: each step starts after a barrier, a step's time is the
slowest rank's (one all-reduce of the times at the end), so every process picks the same
candidate.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.ir import Program

__all__ = ["Tuned", "fastest"]


@dataclass(frozen=True)
class Tuned:
    """What :func:`fastest` measured: the winner, and every candidate's step times."""

    program: Program  # the winner's program (a Pipeline's: its lowered program)
    index: int  # the winner's position in the candidates
    times: tuple[tuple[float, ...], ...]  # per candidate, its timed steps (seconds)
    scores: tuple[float, ...] = ()  # per candidate, its last score (lower is faster)
    choice: Any = None  # the winning candidate itself (a Program or a Pipeline)

    @property
    def medians(self) -> tuple[float, ...]:
        return tuple(statistics.median(t) for t in self.times)


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _scores(rounds: Sequence[dict[int, float]], among: Sequence[int]) -> dict[int, float]:
    """Each candidate's median, over the rounds, of its time over that round's median time
    among ``among`` (who all ran in every one of those rounds)."""
    rel: dict[int, list[float]] = {k: [] for k in among}
    for times in rounds:
        mid = statistics.median(times[k] for k in among)
        for k in among:
            rel[k].append(times[k] / mid if mid > 0 else 1.0)
    return {k: statistics.median(v) for k, v in rel.items()}


def _is_pipeline(c: Any) -> bool:
    from funcpipe.pipeline.pipeline import (
        Pipeline,  # (the pipeline module does not import this one)
    )

    return isinstance(c, Pipeline)


def _label(c: Any) -> str:
    """A candidate's name in messages."""
    if isinstance(c, Program):
        return repr(c.name or "unnamed")
    name = c.program.name or "unnamed"
    return f"Pipeline({name!r}, recompute={sorted(c.recompute)})"


def _settle() -> None:
    """Wait for the GPU's queued work, where CUDA is in use, so the host's clock times kernels
    and not their launches."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def fastest(
    programs: Sequence[Any],
    step: Callable[[Any], Any],
    *,
    rounds: int = 3,
    warmup: int = 1,
    halving: bool = False,
) -> Tuned:
    """Run ``step(candidate)`` for every candidate and return the fastest.

    Args:
        programs: the candidates (at least one): programs, e.g. from ``auto_candidates``, or
            :class:`funcpipe.Pipeline` objects (to choose among options such as
            ``recompute``; a program may appear in several).
        step: runs one training step with the given candidate (for a program, typically with
            a ``Pipeline`` built for it, created once outside: its first steps infer shapes and
            fill caches).
        rounds: timed rounds; round ``r`` runs every candidate once, starting from a different
            one each round. A candidate's score is the median, over the rounds, of its step
            time over that round's median: a drift in the machine's speed between rounds falls
            on all candidates of the round alike and cancels out.
        warmup: untimed steps of each candidate first.
        halving: after ``rounds`` rounds keep the better-scoring half (rounded up) and run
            ``rounds`` more rounds of those, until two are left and have had theirs; scores are
            then taken among the survivors over all their rounds. The close contenders get the
            most measurements: with 8 candidates and ``rounds=6``, 84 steps give the last two
            18 rounds each (84 steps without halving give everyone 10).

    Ties go to the earlier candidate. Exceptions from ``step`` propagate with the failing
    candidate's name added.
    """
    progs = list(programs)
    if not progs or not all(isinstance(p, Program) or _is_pipeline(p) for p in progs):
        raise InvalidArgument(
            "fastest: programs must be a non-empty sequence of funcpipe.schedule.Program or "
            f"funcpipe.Pipeline (got {programs!r}); auto_candidates(...) returns programs"
        )
    if not callable(step):
        raise InvalidArgument(
            f"fastest: step={step!r} is not callable; pass step(candidate), e.g. "
            "lambda pipe: pipe.step(params, x, y)"
        )
    for name, value, least in (("rounds", rounds, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidArgument(f"fastest: {name}={value!r}; pass an int >= {least}")
    if not isinstance(halving, bool):
        raise InvalidArgument(f"fastest: halving={halving!r}; pass True or False")
    dist = _dist()

    def run(k: int) -> float:
        if dist:
            torch.distributed.barrier()
        _settle()
        t0 = time.perf_counter()
        try:
            step(progs[k])
        except Exception as e:
            note = getattr(e, "add_note", None)  # Python >= 3.11
            if note is not None:
                note(f"(while timing candidate #{k}, {_label(progs[k])})")
            raise
        _settle()
        return time.perf_counter() - t0

    for _ in range(warmup):
        for k in range(len(progs)):
            run(k)
    alive = list(range(len(progs)))
    done: list[dict[int, float]] = []  # per round: candidate -> its step time
    scores = [math.inf] * len(progs)
    while True:
        block = torch.zeros(rounds, len(alive), dtype=torch.float64)
        for r in range(rounds):
            first = len(done) + r
            for j in range(len(alive)):
                a = (first + j) % len(alive)
                block[r, a] = run(alive[a])
        if dist:  # a step's time is its slowest rank's; every rank decides alike
            torch.distributed.all_reduce(block, op=torch.distributed.ReduceOp.MAX)
        done += [{k: float(block[r, a]) for a, k in enumerate(alive)} for r in range(rounds)]
        got = _scores(done, alive)
        for k in alive:
            scores[k] = got[k]
        if not halving or len(alive) <= 2:
            break
        ranked = sorted(alive, key=lambda k: (got[k], k))
        alive = sorted(ranked[: (len(alive) + 1) // 2])
    best = min(alive, key=lambda k: (scores[k], k))
    per = tuple(tuple(times[k] for times in done if k in times) for k in range(len(progs)))
    won = progs[best]
    program = won if isinstance(won, Program) else won.program
    return Tuned(program, best, per, tuple(scores), won)
