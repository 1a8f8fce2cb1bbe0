"""Overlapped pairs: what the checker proves of them, and the pass that makes them.

A pair is two compute instructions of one rank, one microbatch's F with another's B or I,
written one after the other with ``& `` before the second (:mod:`funcpipe.schedule.instr`):

    F s0 m5
    & B s3 m2

They run together: where one half waits on communication (its stages' expert all-to-all, a
tensor-parallel collective, the forward's RECV), the other computes (DualPipe's F&B). Here a
pair starts when the inputs of both halves are in (their RECVs are posted before the pair:
lowering never puts a SEND or RECV between the halves; over processes the runtime starts the
backward as soon as its own are, which is never later) and ends when both are done; what
either half produces leaves after the pair.

The rules the checker proves of pairs, on top of every rule a program without pairs keeps:

1. **Different microbatches** (:func:`check_pairs`). One microbatch's F and backward of one
   chain are never independent.
2. **Independent.** Neither half needs, through any chain of data, messages and program order
   on any rank, something the other half produces: the pair would wait for itself. Such a
   pair can never start, so the simulator's run (every check ends with it) stops at it;
   :func:`not_independent` then names both halves and the chain of waits.
3. **One order of collectives per communicator.** A pair holds no SEND, RECV or collective
   (only its two computations). The collectives its halves call inside their stages (the
   expert all-to-all, tensor-parallel reductions) go on the axis's process group in an order
   the program fixes: the halves take turns, the turn changing hands at each collective issued
   (:mod:`funcpipe.runtime.turns`), and the ranks of an in-stage communicator are copies of one
   pipeline rank, running the same pairs; so no program can issue them in different orders.

:func:`funcpipe.schedule.overlap.overlap` is the pass: it pairs a program's adjacent
independent F and B (or I) on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from funcpipe.schedule.ir import COMM_OPS, Instr, Op, pairs

__all__ = ["PAIR_RULE", "check_pairs", "dependence", "needs", "not_independent", "partners_of"]

Node = tuple[int, int]  # (rank, step)
PAIR_RULE = "the two halves of an overlapped pair are independent"


def partners_of(ranks: Sequence[Sequence[Instr]]) -> dict[Node, Node]:
    """(rank, step) of each half of a pair -> (rank, step) of the other half."""
    out: dict[Node, Node] = {}
    for r, instrs in enumerate(ranks):
        for a, b in pairs(instrs):
            out[(r, a)] = (r, b)
            out[(r, b)] = (r, a)
    return out


def needs(
    ranks: Sequence[Sequence[Instr]],
    deps: Mapping[Node, Sequence[Any]],
    meetings: Mapping[Node, tuple[Node, ...]],
    partners: Mapping[Node, Node],
    start: Node,
    target: Node,
) -> list[Node] | None:
    """A chain by which instruction ``start`` waits for ``target`` to finish (``start``
    first, ``target`` last), or None; ``partners`` pairs the halves of ``ranks``' pairs.

    The waits, as the simulator runs a program: a compute instruction or a collective waits
    for the instruction before it on its rank, its dependencies (its inputs: a RECV's data, or
    the producer on another rank) and the other members of its collective; a half of a pair
    finishes with its pair, so it waits for what the other half waits for too. A SEND or RECV
    is *posted* once the instruction before it is (a SEND needs nothing more); a RECV
    *completes* once posted and its SEND is. The program-order edge from the second half of
    ``target``'s pair back to ``target`` is not a wait (the two run together)."""
    tr, tt = target
    # (rank, step, completes): ``completes`` False asks only for a SEND/RECV's posting
    State = tuple[int, int, bool]
    first: State = (*start, True)
    parent: dict[State, State | None] = {first: None}
    todo = [first]
    while todo:
        n = todo.pop()
        r, t, whole = n
        if (r, t) == target:
            chain = [n]
            while (up := parent[chain[-1]]) is not None:
                chain.append(up)
            return [(q, u) for q, u, _ in chain[::-1]]
        op = ranks[r][t].op
        talks = op in COMM_OPS
        if r == tr and t < tt and not (op is Op.RECV and whole):
            continue  # before the target on its rank: done or posted before it starts
        ups: list[State] = []
        if t > 0 and not ((r, t) == partners.get(target) and t - 1 == tt):
            ups.append((r, t - 1, ranks[r][t - 1].op not in COMM_OPS))
        if not talks or (op is Op.RECV and whole):
            wait = [(d.rank, d.step) for d in deps.get((r, t), ())]
            wait += list(meetings.get((r, t), ()))
            if (other := partners.get((r, t))) is not None:  # (a half finishes with its pair)
                wait += [(d.rank, d.step) for d in deps.get(other, ())]
                if 0 < other[1] < t:
                    ups.append((r, other[1] - 1, ranks[r][other[1] - 1].op not in COMM_OPS))
            for q, u in wait:
                ups.append((q, u, ranks[q][u].op is not Op.SEND))
        for up in ups:
            if up not in parent and up != n:
                parent[up] = n
                todo.append(up)
    return None


def dependence(
    ranks: Sequence[Sequence[Instr]],
    deps: Mapping[Node, Sequence[Any]],
    meetings: Mapping[Node, tuple[Node, ...]],
    partners: Mapping[Node, Node],
    r: int,
    x: int,
) -> tuple[Node, list[Node]] | None:
    """Whether the pair of steps ``x`` and ``x + 1`` of rank ``r`` waits for itself: (the
    half that waits, the chain of waits from one of its inputs to the other half), or None
    when the two are independent (rule 2)."""
    for early, late in (((r, x), (r, x + 1)), ((r, x + 1), (r, x))):
        for d in deps.get(late, ()):
            chain = needs(ranks, deps, meetings, partners, (d.rank, d.step), early)
            if chain is not None:
                return late, chain
    return None


def check_pairs(a: Any) -> None:
    """Rule 1 of the module docstring on every pair of the program (``a``: the checker's
    analyser, with ``p`` and ``fail``). Rule 2 needs no search of its own here: a pair that
    waits for itself can never start, so the simulator's run (which every check ends with)
    stops there, and names it with :func:`not_independent`."""
    p = a.p
    for r, instrs in enumerate(p.ranks):
        for x, y in pairs(instrs):
            first, second = instrs[x], instrs[y].join(False)
            if first.microbatch == second.microbatch:
                raise a.fail(
                    r,
                    y,
                    PAIR_RULE,
                    f"'{first}' (step {x}) and '{second}' (step {y}) are one microbatch's: its "
                    "backward needs its forward's outputs; pair the F with another "
                    "microbatch's B or I",
                )


def not_independent(
    ranks: Sequence[Sequence[Instr]],
    deps: Mapping[Node, Sequence[Any]],
    meetings: Mapping[Node, tuple[Node, ...]],
    r: int,
    x: int,
) -> tuple[int, str] | None:
    """Rule 2 for the pair at steps ``x``, ``x + 1`` of rank ``r``: (the step that waits, what
    to say) when one half needs what the other produces, else None."""
    found = dependence(ranks, deps, meetings, partners_of(ranks), r, x)
    if found is None:
        return None
    late, chain = found
    early = 2 * x + 1 - late[1]
    shown = ", which waits for ".join(
        f"rank {q} step {u} ({ranks[q][u].join(False)})" for q, u in [late, *chain]
    )
    return late[1], (
        f"'{ranks[r][late[1]].join(False)}' (step {late[1]}) needs what "
        f"'{ranks[r][early].join(False)}' (step {early}) produces, and the two start "
        f"together: {shown}; drop the '&' or pair the F with another backward"
    )
