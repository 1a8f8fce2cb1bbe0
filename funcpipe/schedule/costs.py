"""Measured costs as schedule data: what profiling returns, and costs read off executed steps.

:class:`StageTimes` and :class:`StageMemory` are what :func:`funcpipe.measure_stages` and
:func:`funcpipe.measure_memory` return (those run the real stages, so they live above the
schedule package, in :mod:`funcpipe.measure.profile`). :func:`costs_from_timelines` reads the same
costs off executed steps instead (``Pipeline.step(..., trace=True).timeline``): what each
instruction took inside a real step, next to the other ranks and stages, which can differ from
a stage timed alone (caches, memory bandwidth shared by the ranks).

Nothing here imports torch: these are plain numbers and a walk over timelines.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.ir import Op
from funcpipe.schedule.simulate import Costs, Timeline

__all__ = ["StageMemory", "StageTimes", "costs_from_timelines"]


@dataclass(frozen=True)
class StageTimes:
    """Median seconds per stage: ``f`` forward, ``i`` input gradient, ``w`` weight gradient,
    ``b`` one full backward (input and weight gradients at once), and ``comm`` the latency of
    one point-to-point message of the largest activation (0 when not measured)."""

    f: tuple[float, ...]
    i: tuple[float, ...]
    w: tuple[float, ...]
    b: tuple[float, ...]
    comm: float = 0.0

    def costs(self) -> Costs:
        """The simulator's costs: ``f``, ``b`` = the input-gradient part (I), ``w``, ``full`` =
        the full backward (B), ``comm``."""
        return Costs(
            f=list(self.f), b=list(self.i), w=list(self.w), full=list(self.b), comm=self.comm
        )


@dataclass(frozen=True)
class StageMemory:
    """Bytes per stage, for :func:`funcpipe.schedule.simulate.peak_memory`: ``activation``
    what one F on one microbatch keeps for its backward (autograd's saved tensors, parameters
    excluded), ``for_w`` what an I of it leaves for its W (the rest is freed at I)."""

    activation: tuple[int, ...]
    for_w: tuple[int, ...]


_TIMED = (Op.F, Op.B, Op.I, Op.W)


def costs_from_timelines(timelines: Sequence[Timeline], *, comm: float = 0.0) -> Costs:
    """Per-stage costs measured inside executed steps, for the simulator and ``auto``.

    ``timelines`` are executed :class:`~funcpipe.schedule.simulate.Timeline` s of one program
    (``Pipeline.step(..., trace=True).timeline``, one per step; run a few and pass them all).
    Each stage's ``f``, ``b`` (input gradient), ``w`` (weight gradient) and ``full`` (a whole
    backward B) are the medians of its F, I, W and B instructions over all the steps: pass steps
    of a program that splits its backwards (ZB-H1, ZB-H2, ZB-V, DualPipeV, or
    ``passes.split_backward``) and, for ``full``, steps of one that does not (1F1B, GPipe) with
    the same stages. A stage seen only with B gets ``b = w = B / 2``; one never seen with B gets
    ``full = b + w``. ``comm`` is passed through.
    """
    if not timelines:
        raise InvalidArgument("costs_from_timelines needs at least one executed timeline")
    n = timelines[0].program.n_stages
    seen: dict[tuple[Op, int], list[float]] = {}
    for tl in timelines:
        if tl.program.n_stages != n:
            raise InvalidArgument(
                "costs_from_timelines: the timelines come from programs with different stages "
                f"({n} and {tl.program.n_stages}); pass steps of one program"
            )
        for events in tl.events:
            for e in events:
                if e.instr.op in _TIMED:
                    seen.setdefault((e.instr.op, e.instr.stage), []).append(e.end - e.start)

    def med(op: Op, stage: int) -> float | None:
        got = seen.get((op, stage))
        return statistics.median(got) if got else None

    f, b, w, fulls = [], [], [], []
    for s in range(n):
        fs, i, wt, full = med(Op.F, s), med(Op.I, s), med(Op.W, s), med(Op.B, s)
        if fs is None or ((i is None or wt is None) and full is None):
            raise InvalidArgument(
                f"costs_from_timelines: stage {s} has no forward or no backward in these "
                "timelines; pass training steps (step(..., trace=True)) of the program"
            )
        f.append(fs)
        if i is not None and wt is not None:
            b.append(i)
            w.append(wt)
        elif full is not None:
            b.append(full / 2)
            w.append(full / 2)
        fulls.append(full if full is not None else b[-1] + w[-1])
    return Costs(f=f, b=b, w=w, full=fulls, comm=comm)
