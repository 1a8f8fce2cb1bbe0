"""Where :func:`~funcpipe.schedule.passes.add_communication` puts each SEND and RECV.

The rules, in order (``talking`` instructions are the F, B and I that produce or consume a
message; W, R and REDUCE never do, so the communication steps over them):

1. **Sends after their producer.** Each SEND goes right after the instruction producing its data.
2. **Receives before the talking instruction that precedes their consumer.** A RECV is posted
   right after the last talking instruction before its consumer (at the start of the rank if
   none), so it shares that instruction's group with its SENDs, as
   torch.distributed.pipelining's ``batch_isend_irecv`` and Megatron's
   ``send_forward_recv_backward`` do. Messages between two ranks match in the order they were
   sent, so a RECV pulls every earlier message from the same sender with it.
3. **One group per peer between two talking instructions.** The SENDs and RECVs placed after
   one instruction are grouped by peer (ascending rank; SENDs, then RECVs): a group touches one
   pair of ranks, so a slow peer never holds another pair's stream.
4. **Both ends of a pair agree on the order.** On the stream of a pair (a, b), rank a posts its
   groups in its order and rank b in its; if a sends x before it receives y while b sends y
   before it receives x, the two SENDs wait on each other forever (``p2p="nccl"``). Such a
   *crossing* is undone by posting one of the two RECVs earlier, in the group of the SEND it
   crossed (the RECV needing the shorter move; on a tie the lower rank's).
5. **Receives posted early where safe.** Then, rank by rank, each RECV is moved one talking
   instruction earlier (into the group before the talking instruction that precedes its
   consumer), so its data can arrive while that instruction runs, when the group it leaves
   sends nothing to the same peer (such a SEND would queue behind the early RECV on the pair's
   stream and wait for its data: a 1F1B rank's forward SEND and backward RECV stay together)
   and it does not overtake an earlier message from the same sender. Such a move cannot make a
   crossing and delays no other message.

Why that cannot hang: with one group per peer between two talking instructions, a lowered
program in which every RECV comes before its consumer and no pair has a crossing runs under
NCCL's rules whenever its compute-only program runs (take the first compute instruction of a
valid order that cannot start: the RECV it waits for and its SEND are both posted, and the
entries ahead of them on their pair's stream cannot be stuck without two of them crossing).
The checker (``check(program, p2p="nccl")``) proves each program anyway.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

from funcpipe.schedule.ir import Instr, Program, recv, send

__all__ = ["Message", "place"]

MessageKey = tuple[str, tuple[int, int], int]


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


class _Ranks:
    """The talking instructions of each rank, to step from one to the previous."""

    def __init__(self, n: int, messages: list[Message]) -> None:
        talking: list[set[int]] = [set() for _ in range(n)]
        for m in messages:
            talking[m.src].add(m.made)
            talking[m.dst].add(m.used)
        self.talking = [sorted(t) for t in talking]

    def before(self, rank: int, index: int) -> int:
        """The last talking instruction of ``rank`` before ``index`` (-1: none)."""
        t = self.talking[rank]
        k = bisect.bisect_left(t, index)
        return t[k - 1] if k else -1

    def steps(self, rank: int, lo: int, hi: int) -> int:
        """How many talking instructions of ``rank`` lie in ``(lo, hi]``."""
        t = self.talking[rank]
        return bisect.bisect_right(t, hi) - bisect.bisect_right(t, lo)


def place(program: Program, messages: list[Message]) -> tuple[tuple[Instr, ...], ...]:
    """The ranks of ``program`` (compute-only) with every message's SEND and RECV placed and
    grouped by the rules of this module. ``messages`` carry ``made`` and ``used``."""
    ranks = _Ranks(program.n_ranks, messages)
    fifo: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for m in sorted(messages, key=lambda m: (m.made, m.key)):
        fifo[(m.src, m.dst)].append(m)
    for (_, dst), queue in fifo.items():
        for m in queue:
            m.at = ranks.before(dst, m.used)
        _fifo(queue)
    for a, b in sorted({(min(s, d), max(s, d)) for s, d in fifo}):
        _uncross(fifo[(a, b)], fifo[(b, a)], ranks)
    for r in range(program.n_ranks):
        for src in range(program.n_ranks):
            _early(fifo.get((src, r), []), fifo.get((r, src), []), ranks)
    return _emit(program, fifo)


def _fifo(queue: list[Message]) -> None:
    """Receive in sending order: no RECV after a later message's RECV."""
    low = len(queue) and queue[-1].at
    for m in reversed(queue):
        low = min(low, m.at)
        m.at = low


def _uncross(xs: list[Message], ys: list[Message], ranks: _Ranks) -> None:
    """Rule 4 on one pair: ``xs`` go a -> b, ``ys`` b -> a, each in sending order."""
    changed = True
    while changed:
        changed = False
        for y in ys:
            # the xs that a sends before it receives y but b receives after it sends y
            crossed = [x for x in xs if x.made < y.at and x.at > y.made]
            if not crossed:
                continue
            a, b = y.dst, y.src
            move_y = ranks.steps(a, crossed[0].made, y.at)
            move_x = max(ranks.steps(b, y.made, x.at) for x in crossed)
            if (move_y, a) <= (move_x, b):
                y.at = crossed[0].made
                _fifo(ys)
            else:
                for x in crossed:
                    x.at = y.made
            changed = True


def _early(incoming: list[Message], outgoing: list[Message], ranks: _Ranks) -> None:
    """Rule 5 for the messages one rank receives from one peer (``incoming``, in sending
    order) against those it sends that peer (``outgoing``).

    A RECV moves only if its group sends the peer nothing: a SEND left behind would queue behind
    the early RECV on the pair's stream and wait for its data (and a RECV ahead of a SEND the
    peer receives first would cross it). So the move never delays another message.
    """
    floor = -1
    for m in incoming:
        target = ranks.before(m.dst, ranks.before(m.dst, m.used))
        if m.at >= 0 and floor <= target < m.at and not any(x.made == m.at for x in outgoing):
            m.at = target
        floor = m.at


def _emit(
    program: Program, fifo: dict[tuple[int, int], list[Message]]
) -> tuple[tuple[Instr, ...], ...]:
    runs: dict[tuple[int, int], dict[int, list[Instr]]] = defaultdict(lambda: defaultdict(list))
    for queue in fifo.values():
        for m in queue:
            runs[(m.src, m.made)][m.dst].append(send(m.key[0], m.key[1], m.key[2], m.dst))
    for queue in fifo.values():  # RECVs after the SENDs of their group, in sending order
        for m in queue:
            runs[(m.dst, m.at)][m.src].append(recv(m.key[0], m.key[1], m.key[2], m.src))
    out = []
    for r, instrs in enumerate(program.ranks):
        lowered: list[Instr] = []
        for t in range(-1, len(instrs)):
            if t >= 0:
                lowered.append(instrs[t])
            for _, group in sorted(runs.get((r, t), {}).items()):
                lowered.append(group[0])
                lowered.extend(i.join() for i in group[1:])
        out.append(tuple(lowered))
    return tuple(out)
