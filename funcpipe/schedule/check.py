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
from funcpipe.schedule.p2p import PAIR
from funcpipe.schedule.simulate import simulate

__all__ = ["Analysis", "Dep", "analyse", "check", "in_program"]


def check(program: Program, *, p2p: str = "gloo", layout: str = PAIR) -> None:
    """Prove ``program`` sound: complete, inputs before use, messages matched, no deadlock.

    ``p2p`` names the point-to-point rules the program must not hang under
    (:mod:`funcpipe.schedule.p2p`): ``"gloo"`` (default; sends are buffered) or ``"nccl"``
    (NCCL's rules on the communicator ``layout`` the transport builds: ``"pair"``, the only
    one, is a process group per pair of ranks that exchange messages, so one FIFO stream per
    pair of ranks, both directions; an ungrouped SEND completes only when the peer's RECV is at
    the head of its side; a group's messages to one peer are one batch on that pair's stream,
    they match together and complete as one; its messages to another peer are another batch).
    Both require the in-program collectives in the same order on every rank of their group and
    model each as a meeting that holds its ranks until every member reached it (as a rank whose
    host waits on the device, e.g. in a device-wide synchronisation, is held).

    Raises :class:`~funcpipe.errors.ScheduleError` naming the rank, the step, the instruction and
    the rule broken, with the rank x step table around the bad step; under ``"nccl"`` a hang
    names both ranks, both instructions and their steps.
    """
    simulate(program, p2p=p2p, layout=layout)  # the static rules (analysis.analyse), then the run
