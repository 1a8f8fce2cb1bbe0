"""Overlapped pairs: what the checker proves of them, and the pass that makes them.

A pair is two compute instructions of one rank, one microbatch's F with another's B or I,
written one after the other with ``& `` before the second (:mod:`funcpipe.schedule.instr`):

    F s0 m5
    & B s3 m2

They run together: where one half waits on communication (its stages' expert all-to-all, a
tensor-parallel collective), the other computes (DualPipe's F&B). A pair starts when the inputs
of both halves are in (their RECVs are posted before the pair: lowering never puts a SEND or
RECV between the halves) and ends when both are done; what either half produces leaves after
the pair.

The rules :func:`check_pairs` proves, on top of every rule a program without pairs keeps:

1. **Different microbatches.** One microbatch's F and backward of one chain are never
   independent.
2. **Independent.** Neither half needs, through any chain of data, messages and program order
   on any rank, something the other half produces: the pair would wait for itself. The error
   names both halves and the chain.
3. **One order of collectives per communicator.** A pair holds no SEND, RECV or collective
   (only its two computations), so the collectives its halves issue inside their stages (the
   expert all-to-all, tensor-parallel reductions) run over groups of the data-parallel copies
   of this rank, which all run this program: each issues them in the order the pair fixes (the
   runtime's order of a pair's pieces is a function of the program alone, never of timing).

:func:`funcpipe.schedule.overlap.overlap` is the pass: it pairs a program's adjacent
independent F and B (or I) on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from funcpipe.schedule.ir import COMM_OPS, Op, Program, pairs

__all__ = ["check_pairs", "needs"]

Node = tuple[int, int]  # (rank, step)


def _partners(program: Program) -> dict[Node, Node]:
    """(rank, step) of each half -> (rank, step) of the other half."""
    out: dict[Node, Node] = {}
    for r, instrs in enumerate(program.ranks):
        for a, b in pairs(instrs):
            out[(r, a)] = (r, b)
            out[(r, b)] = (r, a)
    return out


def needs(
    program: Program,
    deps: Mapping[Node, Sequence[Any]],
    meetings: Mapping[Node, tuple[Node, ...]],
    start: Node,
    target: Node,
) -> list[Node] | None:
    """A chain by which instruction ``start`` waits for ``target`` to finish (``start``
    first, ``target`` last), or None.

    The waits, as the simulator runs a program: a compute instruction or a collective waits
    for the instruction before it on its rank, its dependencies (its inputs: a RECV's data, or
    the producer on another rank) and the other members of its collective; a half of a pair
    finishes with its pair, so it waits for what the other half waits for too. A SEND or RECV
    is *posted* once the instruction before it is (a SEND needs nothing more); a RECV
    *completes* once posted and its SEND is. The program-order edge from the second half of
    ``target``'s pair back to ``target`` is not a wait (the two run together)."""
    partners = _partners(program)
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
        op = program.ranks[r][t].op
        talks = op in COMM_OPS
        if r == tr and t < tt and not (op is Op.RECV and whole):
            continue  # before the target on its rank: done or posted before it starts
        ups: list[State] = []
        if t > 0 and not ((r, t) == partners.get(target) and t - 1 == tt):
            before = program.ranks[r][t - 1].op
            ups.append((r, t - 1, before not in COMM_OPS))
        if not talks or (op is Op.RECV and whole):
            wait = [(d.rank, d.step) for d in deps.get((r, t), ())]
            wait += list(meetings.get((r, t), ()))
            if (other := partners.get((r, t))) is not None:  # (a half finishes with its pair)
                wait += [(d.rank, d.step) for d in deps.get(other, ())]
                if 0 < other[1] < t:
                    ups.append((r, other[1] - 1, program.ranks[r][other[1] - 1].op not in COMM_OPS))
            for q, u in wait:
                ups.append((q, u, program.ranks[q][u].op is not Op.SEND))
        for up in ups:
            if up not in parent and up != n:
                parent[up] = n
                todo.append(up)
    return None


def check_pairs(a: Any) -> None:
    """Rules 1 and 2 of the module docstring on every pair of the program (``a``: the
    checker's analyser, with ``p``, ``deps``, ``meetings`` and ``fail``, after the
    dependencies and messages are known)."""
    p = a.p
    for r, instrs in enumerate(p.ranks):
        for x, y in pairs(instrs):
            first, second = instrs[x], instrs[y].join(False)
            rule = "the two halves of an overlapped pair are independent"
            if first.microbatch == second.microbatch:
                raise a.fail(
                    r,
                    y,
                    rule,
                    f"'{first}' (step {x}) and '{second}' (step {y}) are one microbatch's: its "
                    "backward needs its forward's outputs; pair the F with another "
                    "microbatch's B or I",
                )
            for early, late in (((r, x), (r, y)), ((r, y), (r, x))):
                for d in a.deps.get(late, ()):
                    chain = needs(p, a.deps, a.meetings, (d.rank, d.step), early)
                    if chain is None:
                        continue
                    shown = ", which waits for ".join(
                        f"rank {q} step {u} ({p.ranks[q][u].join(False)})"
                        for q, u in [late, *chain]
                    )
                    raise a.fail(
                        r,
                        late[1],
                        rule,
                        f"'{p.ranks[r][late[1]].join(False)}' (step {late[1]}) needs what "
                        f"'{p.ranks[r][early[1]].join(False)}' (step {early[1]}) produces, "
                        f"and the two start together: {shown}; drop the '&' or pair the F "
                        "with another backward",
                    )
