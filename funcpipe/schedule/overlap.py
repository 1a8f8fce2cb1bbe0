"""The pass that makes overlapped pairs: ``overlap(program)``.

It pairs each F with the B or I right after it on its rank (or each B or I with the F right
after it) where the two are independent (:mod:`funcpipe.schedule.pairs` has the rules), one
rank after another and, on a rank, first to last; each pair it makes is proved against the
pairs made before it, and the result is checked whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.schedule.analysis import analyse
from funcpipe.schedule.ir import BACKWARD_OPS, PAIR_OPS, Instr, Op, Program, pairs
from funcpipe.schedule.pairs import dependence, partners_of
from funcpipe.schedule.passes import _stage_set, add_communication, strip_communication
from funcpipe.schedule.simulate import simulate

__all__ = ["overlap", "pair_where_sound", "sound_pairs"]


def overlap(program: Program, *, stages: Iterable[int] | None = None) -> Program:
    """``program`` with each adjacent independent F and B (or I) of a rank made a pair.

    ``stages`` limits the pairs to those whose two halves are both on those stages. Nothing
    moves: where an F and a backward are not next to each other there is no pair. A lowered
    program is stripped of its SEND/RECV, paired and lowered again (lowering keeps every SEND
    and RECV outside the pairs); pairs already there are kept; an eval program is returned
    unchanged. Idempotent.

    >>> from funcpipe.schedule import generate
    >>> paired = overlap(generate("dualpipev", ranks=2, microbatches=4))
    """
    if not isinstance(program, Program):
        raise InvalidArgument(
            f"overlap: program={type(program).__name__}; pass a funcpipe.schedule.Program"
        )
    chosen = None if stages is None else _stage_set(program, stages, "overlap")
    if not program.training:
        return program
    lowered = program.lowered
    base = strip_communication(program) if lowered else program
    wanted = [
        [t for t in range(len(instrs) - 1) if _candidate(instrs[t], instrs[t + 1], chosen)]
        for instrs in base.ranks
    ]
    out = pair_where_sound(base, wanted)
    return add_communication(out) if lowered else out


def pair_where_sound(program: Program, wanted: Sequence[Sequence[int]]) -> Program:
    """Compute-only ``program`` with step ``t + 1`` of rank ``r`` made the second half of a pair
    with step ``t`` for each ``t`` in ``wanted[r]`` where that is sound (rank by rank, first to
    last, each proved against the pairs made before it: :func:`~funcpipe.schedule.pairs.needs`);
    the generators use it for the pairs they want, :func:`overlap` for every candidate.

    First every wanted pair at once, proved by one simulation: pairs only add waits, so when
    none of them waits for itself with all of them there, each is sound against those before
    it, and the one-by-one search would keep them all (DualPipeV at 16 ranks and 64
    microbatches: 1,416 pairs, 3.2 s searched one by one). Only where that run stops does the
    search go pair by pair."""
    everything = _joined(program, wanted, lambda r, t, ranks: True)
    try:
        simulate(everything)
        return everything
    except ScheduleError:
        pass
    a = analyse(program)
    ranks = [list(r) for r in program.ranks]
    partners = partners_of(ranks)

    def sound(r: int, t: int, ranks: list[list[Instr]]) -> bool:
        partners[(r, t)], partners[(r, t + 1)] = (r, t + 1), (r, t)
        if dependence(ranks, a.deps, a.meetings, partners, r, t) is None:
            return True
        del partners[(r, t)], partners[(r, t + 1)]
        return False

    out = _joined(program, wanted, sound, ranks)
    simulate(out)  # (proves it whole)
    return out


def _joined(
    program: Program,
    wanted: Sequence[Sequence[int]],
    keep: Callable[[int, int, list[list[Instr]]], bool],
    ranks: list[list[Instr]] | None = None,
) -> Program:
    """``program`` with the pairs of ``wanted`` that can be written (rank by rank, first to
    last: neither half already in one, different microbatches) and that ``keep(rank, step,
    ranks)`` accepts once joined."""
    ranks = [list(r) for r in program.ranks] if ranks is None else ranks
    for r, instrs in enumerate(ranks):
        free = -1  # the last step already in a pair
        for t in wanted[r]:
            x, y = instrs[t], instrs[t + 1]
            taken = t + 2 < len(instrs) and instrs[t + 2].joined  # (y heads another pair)
            if t <= free or taken or x.joined or y.joined or x.microbatch == y.microbatch:
                continue
            instrs[t + 1] = y.join()  # (a trial: joining changes no op the search reads)
            if keep(r, t, ranks):
                free = t + 1
            else:
                instrs[t + 1] = y
    return program.replace(ranks=tuple(tuple(i) for i in ranks))


def sound_pairs(program: Program) -> Program:
    """Compute-only ``program`` with only those of its pairs that are sound (each proved
    against the ones before it, as :func:`pair_where_sound`); the others run alone. The
    generators write the pairs their schedule wants and keep these."""
    wanted = [[a for a, _ in pairs(instrs)] for instrs in program.ranks]
    alone = program.replace(
        ranks=tuple(tuple(i.join(False) if i.joined else i for i in r) for r in program.ranks)
    )
    return pair_where_sound(alone, wanted)


def _candidate(x: Instr, y: Instr, chosen: frozenset[int] | None) -> bool:
    if x.joined or y.joined or x.op not in PAIR_OPS or y.op not in PAIR_OPS:
        return False
    ops = {x.op, y.op}
    if Op.F not in ops or not ops & BACKWARD_OPS or x.microbatch == y.microbatch:
        return False
    return chosen is None or (x.stage in chosen and y.stage in chosen)
