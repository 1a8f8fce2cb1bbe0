"""Choosing among programs by measurement: run each on the real stages, keep the fastest.

The simulator ranks programs by their predicted makespan, and on a real machine its costs are
off by 10-25% (caches and memory bandwidth shared by the ranks, message latency, noise), as
large as the differences between good schedules. :func:`fastest` settles it the direct way:
it runs one step of every candidate, round-robin for a few rounds, and returns the one whose
median step time is lowest. Candidates usually come from
:func:`funcpipe.schedule.auto.auto_candidates` (auto's best few, which include the built-ins
that fit the memory limit)::

    from funcpipe.schedule import Costs
    from funcpipe.schedule.auto import auto_candidates

    candidates = auto_candidates(ranks=2, microbatches=8, costs=costs, max_activations=2)
    pipes = {p: Pipeline(stages, p, loss_fn=loss) for p in candidates}
    best = fastest(candidates, lambda p: pipes[p].step(params, x, y)).program

Under ``torch.distributed`` every process of the default group must call :func:`fastest` with
the same programs in the same order: each step starts after a barrier, a step's time is the
slowest rank's (one all-reduce of the times at the end), so every process picks the same
program.
"""

from __future__ import annotations

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

    program: Program
    index: int  # the winner's position in the candidates
    times: tuple[tuple[float, ...], ...]  # per candidate, its timed steps (seconds)

    @property
    def medians(self) -> tuple[float, ...]:
        return tuple(statistics.median(t) for t in self.times)


def _dist() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def fastest(
    programs: Sequence[Program],
    step: Callable[[Program], Any],
    *,
    rounds: int = 3,
    warmup: int = 1,
) -> Tuned:
    """Run ``step(program)`` for every candidate and return the fastest (lowest median).

    Args:
        programs: the candidates (at least one), e.g. from ``auto_candidates``.
        step: runs one training step with the given program (typically a ``Pipeline`` built
            for it, created once outside: its first steps infer shapes and fill caches).
        rounds: timed steps per candidate, interleaved: round ``r`` runs every candidate once,
            starting from a different one each round, so drifts in the machine's speed fall on
            all of them alike.
        warmup: untimed steps of each candidate first.

    Ties go to the earlier candidate. Exceptions from ``step`` propagate with the failing
    candidate's name added.
    """
    progs = list(programs)
    if not progs or not all(isinstance(p, Program) for p in progs):
        raise InvalidArgument(
            "fastest: programs must be a non-empty sequence of funcpipe.schedule.Program "
            f"(got {programs!r}); auto_candidates(...) returns one"
        )
    if not callable(step):
        raise InvalidArgument(f"fastest: step={step!r} is not callable; pass step(program)")
    for name, value, least in (("rounds", rounds, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InvalidArgument(f"fastest: {name}={value!r}; pass an int >= {least}")
    dist = _dist()

    def run(k: int) -> float:
        if dist:
            torch.distributed.barrier()
        t0 = time.perf_counter()
        try:
            step(progs[k])
        except Exception as e:
            note = getattr(e, "add_note", None)  # Python >= 3.11
            if note is not None:
                note(f"(while timing candidate #{k}, {progs[k].name or 'unnamed'!r})")
            raise
        return time.perf_counter() - t0

    for _ in range(warmup):
        for k in range(len(progs)):
            run(k)
    times = torch.zeros(rounds, len(progs), dtype=torch.float64)
    for r in range(rounds):
        for j in range(len(progs)):
            k = (r + j) % len(progs)
            times[r, k] = run(k)
    if dist:
        torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
    per = tuple(tuple(float(t) for t in times[:, k]) for k in range(len(progs)))
    medians = [statistics.median(t) for t in per]
    best = min(range(len(progs)), key=lambda k: (medians[k], k))
    return Tuned(progs[best], best, per)
