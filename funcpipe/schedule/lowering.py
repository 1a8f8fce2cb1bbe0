"""Where :func:`~funcpipe.schedule.passes.add_communication` puts each SEND and RECV.

*Talking* instructions are the F, B and I that produce or consume a message; W, R and REDUCE
never do, and the communication steps over them. A *reference run* orders every instruction of
the compute-only program: an F takes one unit, a B or an I two (the input gradient is out when
the whole B would have finished, so splitting a B changes nothing), W, R and REDUCE none (they
move no data); a rank runs its instructions in order and an instruction starts once its inputs
exist; ties go to the lower rank, then the earlier step. The rules:

1. **Sends after their producer.** Each SEND goes right after the instruction producing its data.
2. **Receives posted as the data is sent.** Each RECV goes right after the last talking
   instruction of its rank that starts, in the reference run, before the instruction producing
   its data (at the start of the rank if none). It is posted before the instructions that run
   while its data is computed and travels, so the data can arrive while they run, and never
   later than right after the talking instruction before its consumer.
3. **Groups per peer.** The SENDs and RECVs placed after one instruction for one peer are posted
   in the reference run's order of their data; the SENDs and the RECVs of the first instruction
   that reads any of them form one group (``+``: e.g. a 1F1B rank's forward SEND with the
   backward's gradient RECV, as torch.distributed.pipelining's ``batch_isend_irecv`` and
   Megatron's ``send_forward_recv_backward`` post them); RECVs read later get a group per
   reading instruction, so an instruction never waits for data it does not read (NCCL completes
   a group as one).

Why that cannot hang under NCCL's rules (:mod:`funcpipe.schedule.p2p`): on every pair of ranks
both ends post the pair's messages in the same order, the reference run's order of sending, and
a group only joins neighbours in that order. Take the first instruction of the reference run that
a stuck run has not done: every message it waits for, and every message before those on their
pair's stream, was sent by an instruction earlier in the reference run (done), and posted on both
ends; the earliest unmatched one of them is then in the head group of both ends, so it matches.
The checker (``check(program, p2p="nccl")``) proves each program anyway.

**Overlapped pairs** (``&``) stay whole: in the reference run a pair starts once the inputs of
both halves exist and lasts both halves' units, and what rules 1 and 2 would put right after
its first half goes right after its second, so no SEND or RECV falls between the halves.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

from funcpipe.schedule.analysis import analyse
from funcpipe.schedule.ir import Instr, Op, Program, pairs, recv, send

__all__ = ["Message", "place", "reference_order"]

MessageKey = tuple[str, tuple[int, int], int]
_UNITS = {Op.F: 1.0, Op.B: 2.0, Op.I: 2.0}


@dataclass
class Message:
    """One message and where its ends go: ``made`` (on ``src``) is the index, among that rank's
    instructions, of the producer, the SEND right after it; ``used`` (on ``dst``) the consumer's;
    the RECV goes right after instruction ``at`` of ``dst`` (-1: at the start)."""

    key: MessageKey
    src: int
    dst: int
    made: int
    used: int
    at: int = -1


def reference_order(program: Program) -> dict[tuple[int, int], tuple[float, int, int]]:
    """(rank, step) -> (start, rank, step) in the reference run of a compute-only ``program``
    (F 1, B and I 2, W, R and REDUCE 0); sorting by it orders every instruction after everything
    it needs. Raises the checker's :class:`ScheduleError` if the program cannot run."""
    analysis = analyse(program)
    n = program.n_ranks
    pc, clock = [0] * n, [0.0] * n
    end: dict[tuple[int, int], float] = {}
    key: dict[tuple[int, int], tuple[float, int, int]] = {}
    arrived: dict[tuple[int, int], float] = {}
    progressed = True
    while progressed:
        progressed = False
        for r, instrs in enumerate(program.ranks):
            while pc[r] < len(instrs):
                t = pc[r]
                deps = analysis.deps.get((r, t), ())
                if pair := t + 1 < len(instrs) and instrs[t + 1].joined:  # (both inputs first)
                    deps = deps + analysis.deps.get((r, t + 1), ())
                if any((d.rank, d.step) not in end for d in deps):
                    break
                ready = max([clock[r], *(end[(d.rank, d.step)] for d in deps)])
                if pair:  # an overlapped pair starts as one and ends as one
                    units = _UNITS.get(instrs[t].op, 0.0) + _UNITS.get(instrs[t + 1].op, 0.0)
                    for u in (t, t + 1):
                        key[(r, u)] = (ready, r, u)
                        end[(r, u)] = ready + units
                    clock[r] = ready + units
                    pc[r] += 2
                    progressed = True
                    continue
                members = analysis.meetings.get((r, t), ((r, t),))
                arrived[(r, t)] = ready
                if any(m not in arrived for m in members):
                    break
                start = max(arrived[m] for m in members)
                for mr, mt in members:
                    key[(mr, mt)] = (start, mr, mt)
                    end[(mr, mt)] = clock[mr] = start + _UNITS.get(program.ranks[mr][mt].op, 0.0)
                    pc[mr] += 1
                progressed = True
    if len(key) < sum(map(len, program.ranks)):
        from funcpipe.schedule.simulate import simulate

        simulate(program)  # raises the deadlock, naming the ranks and steps
    return key


def place(program: Program, messages: list[Message]) -> tuple[tuple[Instr, ...], ...]:
    """The ranks of ``program`` (compute-only) with every message's SEND and RECV placed and
    grouped by the rules of this module. ``messages`` carry ``made`` and ``used``."""
    order = reference_order(program)
    # what goes after the first half of an overlapped pair goes after the pair
    after = [{a: b for a, b in pairs(instrs)} for instrs in program.ranks]
    for m in messages:
        m.made = after[m.src].get(m.made, m.made)
    talking: list[list[tuple[tuple[float, int, int], int]]] = [[] for _ in program.ranks]
    for m in messages:
        talking[m.src].append((order[(m.src, m.made)], m.made))
        talking[m.dst].append((order[(m.dst, m.used)], m.used))
    ranked = [sorted(set(t)) for t in talking]
    for m in messages:
        sent = order[(m.src, m.made)]
        k = bisect.bisect_left(ranked[m.dst], (sent, -1))
        m.at = ranked[m.dst][k - 1][1] if k else -1
        m.at = after[m.dst].get(m.at, m.at)
    # one ordered list per (rank, after instruction, peer): the reference run's sending order
    runs: dict[tuple[int, int, int], list[tuple[tuple[object, ...], Instr, int]]] = defaultdict(
        list
    )
    for m in messages:
        when = (order[(m.src, m.made)], m.key)
        runs[(m.src, m.made, m.dst)].append((when, send(*m.key, m.dst), -1))
        runs[(m.dst, m.at, m.src)].append((when, recv(*m.key, m.src), m.used))
    out = []
    for r, instrs in enumerate(program.ranks):
        lowered: list[Instr] = []
        for t in range(-1, len(instrs)):
            if t >= 0:
                lowered.append(instrs[t])
            for peer in range(program.n_ranks):
                run = sorted(runs.get((r, t, peer), []), key=lambda e: e[0])
                reader = None  # the instruction reading the current group's RECVs
                for k, (_, i, used) in enumerate(run):
                    if i.op is Op.RECV and reader is not None and used != reader:
                        lowered.append(i)  # a new group: read by another instruction
                    else:
                        lowered.append(i if k == 0 else i.join())
                    if i.op is Op.RECV:
                        reader = used
        out.append(tuple(lowered))
    return tuple(out)
