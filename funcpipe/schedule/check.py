"""The checker: prove a program sound before anything runs.

:func:`check` accepts compute-only programs (cross-rank data is taken to travel implicitly once it
is produced) and lowered programs (every cross-rank edge has its SEND and RECV). It raises a
:class:`~funcpipe.errors.ScheduleError` naming the rank, the step, the instruction and the rule,
with the rank x step table around the bad step; it never hangs.

Two layers: :mod:`funcpipe.schedule.analysis` checks every static rule and yields the dependency
graph; :mod:`funcpipe.schedule.simulate` runs that graph, which proves there is no deadlock. The
checker sits above both, so neither imports it.
"""

from __future__ import annotations

from funcpipe.schedule.analysis import Analysis, Dep, analyse, in_program
from funcpipe.schedule.ir import Program
from funcpipe.schedule.simulate import simulate

__all__ = ["Analysis", "Dep", "analyse", "check", "in_program"]


def check(program: Program, *, p2p: str = "gloo") -> None:
    """Prove ``program`` sound: complete, inputs before use, messages matched, no deadlock.

    ``p2p`` names the point-to-point rules the program must not hang under
    (:mod:`funcpipe.schedule.p2p`): ``"gloo"`` (default; sends are buffered) or ``"nccl"``
    (one FIFO stream per pair of ranks, both directions; an ungrouped SEND completes only when
    the peer's RECV is at the head of its side; a group's members match together and the
    group completes as one). Both require the in-program collectives in the same order on
    every rank of their group.

    Raises :class:`~funcpipe.errors.ScheduleError` naming the rank, the step, the instruction and
    the rule broken, with the rank x step table around the bad step; under ``"nccl"`` a hang
    names both ranks, both instructions and their steps.
    """
    simulate(program, p2p=p2p)  # the static rules (analysis.analyse), then the run
