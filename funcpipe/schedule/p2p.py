"""How SEND and RECV complete: the point-to-point models the simulator and the checker run.

A rank *posts* its communication in program order, one group at a time (:func:`ir.groups`: a
SEND/RECV and the ones joined to it with ``+``), and never waits to post; a compute instruction
waits for the RECVs whose data it reads. Two models say when a posted message completes:

``gloo`` (buffered sends)
    A SEND completes when it is posted; its data reaches the peer ``comm`` later and completes
    the matching RECV (or at its posting, when the data came first). Groups change nothing.

``nccl`` (NCCL's rules on the communicator layout ``layout``)
    The layout funcpipe's transports build is :data:`PAIR` (the only one): one process group,
    so one NCCL communicator and one stream per rank of it, for every pair of ranks that
    exchange messages, and every message between them posted on it through one call
    (``batch_isend_irecv``, even alone). So each pair of ranks has one FIFO stream with one side
    per rank, and a program group joining messages to several peers is posted as one batch per
    peer, in the order of the peers (a batch is one process group's). A rank's batch is
    appended to its side of its pair's stream; it is *active* at the head of that side. A SEND
    and its RECV match when both their batches are active (the data takes ``comm``). A batch
    completes when *all* its members have matched, as one (NCCL runs a fused group as one
    kernel): only then are its RECVs' data there and does the next entry of the side move up.
    So two ranks whose next entries on their shared stream are both SENDs, each to a RECV
    queued behind the other's SEND, wait forever: gloo's buffering hides that, NCCL hangs (a
    send larger than NCCL's buffers completes only when the peer's receive runs). A batch is
    posted at once: a SEND and a RECV in one batch can match in either order, but an
    instruction reading one RECV of a batch waits for the whole batch. Streams of different
    pairs are independent.

:class:`Network` is that state for one run; the simulator calls :meth:`Network.post` when a rank
reaches a group and :meth:`Network.progress` until nothing moves. When a run is stuck,
:meth:`Network.explain` follows who waits for whom to the cycle and names both ends.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.analysis import Analysis
from funcpipe.schedule.ir import Op

__all__ = ["LAYOUTS", "P2P", "PAIR", "Network", "Why", "check_layout", "check_p2p"]

P2P = ("gloo", "nccl")

#: The communicator layout of funcpipe's transports (:mod:`funcpipe.distributed.world` builds it, the
#: transports report it as ``.layout``, :class:`funcpipe.Pipeline` checks its program under it):
#: one process group per pair of ranks that exchange messages, every message group of the pair
#: posted on it as one ``batch_isend_irecv``, a program group split into one batch per peer.
PAIR = "pair"
LAYOUTS = (PAIR,)

Step = tuple[int, int]  # (rank, step)


def check_p2p(p2p: object, fn: str) -> str:
    if p2p not in P2P:
        raise InvalidArgument(
            f"{fn}: p2p={p2p!r}; the point-to-point models are 'gloo' (buffered sends) and "
            "'nccl' (one stream per pair of ranks: groups must be posted so that it cannot hang)"
        )
    return str(p2p)


def check_layout(layout: object, fn: str) -> str:
    if layout not in LAYOUTS:
        raise InvalidArgument(
            f"{fn}: layout={layout!r}; the communicator layout funcpipe's transports build is "
            f"{PAIR!r} (one process group per pair of ranks that exchange messages)"
        )
    return str(layout)


@dataclass(frozen=True)
class Why:
    """Why a run is stuck: one sentence naming both ends of a cycle of waits (empty when the
    chain ends without one), every link of the chain, and the instruction to mark."""

    headline: str
    chain: tuple[str, ...]
    mark: Step


@dataclass
class _Entry:
    """One group's members on one side of one pair's stream."""

    group: int
    members: list[Step]
    posted: float
    head: float | None = None  # when it reached the head of its side


@dataclass
class _Group:
    rank: int
    steps: tuple[int, ...]
    posted: float
    pairs: list[tuple[int, int]] = field(default_factory=list)
    unmatched: int = 0
    done: float | None = None


class Network:
    """The posted communication of one run under ``p2p`` (``"gloo"`` or ``"nccl"``).

    ``finish`` is the simulator's table of finished instructions: the network writes the time a
    SEND or RECV completes (a RECV: when its data is there).
    """

    def __init__(
        self,
        analysis: Analysis,
        comm: float,
        p2p: str,
        finish: dict[Step, float],
        layout: str = PAIR,
    ) -> None:
        self.layout = layout
        self.a = analysis
        self.p = analysis.program
        self.comm = comm
        self.nccl = p2p == "nccl"
        self.finish = finish
        self.posted: dict[Step, float] = {}
        self.groups: list[_Group] = []
        self.group_of: dict[Step, int] = {}
        # (low rank, high rank) -> {rank: its side of that pair's stream}
        self.sides: dict[tuple[int, int], dict[int, deque[_Entry]]] = {}
        self.entry_of: dict[Step, _Entry] = {}
        # (pair, rank) -> when that side's last completed entry completed (the run retires
        # entries in the order it finds them, not in time order)
        self.free: dict[tuple[tuple[int, int], int], float] = {}
        self.matched: dict[Step, float] = {}  # when a SEND/RECV met its other end

    # ------------------------------------------------------------------ posting
    def post(self, rank: int, steps: tuple[int, ...], time: float) -> None:
        """Rank ``rank`` posts the group made of ``steps`` at ``time``."""
        for t in steps:
            self.posted[(rank, t)] = time
        if not self.nccl:
            for t in steps:
                self._gloo(rank, t)
            return
        # the pair layout: one batch per peer, each on its pair's stream (a program group that
        # joins several peers is several batches, posted in the order of their first members)
        by_pair: dict[tuple[int, int], list[Step]] = {}
        for t in steps:
            peer = self.p.ranks[rank][t].peer
            by_pair.setdefault((min(rank, peer), max(rank, peer)), []).append((rank, t))
        for pair, members in by_pair.items():
            g = len(self.groups)
            group = _Group(rank, tuple(t for _, t in members), time, unmatched=len(members))
            group.pairs.append(pair)
            self.groups.append(group)
            side = self.sides.setdefault(pair, {pair[0]: deque(), pair[1]: deque()})[rank]
            entry = _Entry(g, members, time)
            if not side:
                entry.head = max(time, self.free.get((pair, rank), time))
            side.append(entry)
            for m in members:
                self.group_of[m] = g
                self.entry_of[m] = entry

    def _gloo(self, rank: int, t: int) -> None:
        me = (rank, t)
        other = self.a.partner.get(me)
        if self.p.ranks[rank][t].op is Op.SEND:
            self.finish[me] = self.posted[me]
            if other is not None and other in self.posted and other not in self.finish:
                self.finish[other] = max(self.posted[other], self.posted[me] + self.comm)
        elif other is not None and other in self.posted:
            self.finish[me] = max(self.posted[me], self.posted[other] + self.comm)

    # ------------------------------------------------------------------ matching (nccl)
    def progress(self) -> bool:
        """Match every SEND/RECV pair at the heads of their sides, retire finished groups;
        True if anything moved."""
        if not self.nccl:
            return False
        moved = False
        changed = True
        while changed:
            changed = False
            for pair, sides in self.sides.items():
                lo, hi = sides[pair[0]], sides[pair[1]]
                if not lo or not hi:
                    continue
                a, b = lo[0], hi[0]
                start_a, start_b = self._active(a.group), self._active(b.group)
                if start_a is None or start_b is None:
                    continue
                for m in a.members:
                    if m in self.matched:
                        continue
                    other = self.a.partner[m]
                    if self.entry_of.get(other) is b:
                        self.matched[m] = self.matched[other] = max(start_a, start_b) + self.comm
                        for x in (m, other):
                            self.groups[self.group_of[x]].unmatched -= 1
                        changed = moved = True
            for g in list(self._heads()):
                group = self.groups[g]
                if group.unmatched == 0 and group.done is None:
                    # NCCL completes a fused group as one: every member's handle at once
                    group.done = max(self.matched[(group.rank, t)] for t in group.steps)
                    for t in group.steps:
                        self.finish[(group.rank, t)] = group.done
                    for pair in group.pairs:
                        side = self.sides[pair][group.rank]
                        side.popleft()
                        self.free[(pair, group.rank)] = group.done
                        if side:
                            side[0].head = max(side[0].posted, group.done)
                    changed = moved = True
        return moved

    def _active(self, g: int) -> float | None:
        """When group ``g`` became active: at the head of its rank's side of every pair it
        touches (None: not yet)."""
        group = self.groups[g]
        heads = []
        for pair in group.pairs:
            side = self.sides[pair][group.rank]
            if not side or side[0].group != g:
                return None
            heads.append(side[0].head or 0.0)
        return max(heads)

    def _heads(self) -> set[int]:
        return {side[0].group for sides in self.sides.values() for side in sides.values() if side}

    @property
    def pending(self) -> bool:
        """Whether some posted group has not completed (nccl) or some RECV has no data."""
        return any(s not in self.finish for s in self.posted)

    # ------------------------------------------------------------------ why it is stuck
    def explain(self, start: Step, blocked: Callable[[int], Step | None]) -> Why:
        """Why posted SEND/RECV ``start`` never completes: the chain of waits, followed until it
        closes a cycle. ``blocked(rank)`` is the instruction a rank is stuck at (None: done)."""
        seen: list[Step] = []
        stuck: dict[Step, Step] = {}  # link -> the blocked instruction it leads through
        lines: list[str] = []
        x = start
        while x not in seen:
            seen.append(x)
            line, nxt, at = self._why(x, blocked)
            lines.append(line)
            if at is not None:
                stuck[x] = at
            if nxt is None:
                break
            x = nxt
        if x in seen and len(seen) > 1:
            cycle = seen[seen.index(x) :]
            through = [stuck[c] for c in cycle if c in stuck]
            if not through:  # every link is a stream's head
                head = self._headline(cycle)
                if head:
                    return Why(head, tuple(lines), cycle[0])
            else:  # the cycle passes through instructions that wait for data
                ends = [through[-1], *[b for b in through if b[0] != through[-1][0]][:1]]
                if len(ends) < 2:
                    ends += [c for c in cycle if c[0] != ends[0][0]][:1]
                if len(ends) == 2:
                    mixed = len(through) < len(cycle)
                    return Why(self._blocked_headline(ends, mixed), tuple(lines), ends[0])
        return Why("", tuple(lines), start)

    def _blocked_headline(self, ends: list[Step], streams: bool) -> str:
        a, b = (self._text(e) for e in ends)
        if streams:
            return (
                f"{a} and {b} wait for each other through the point-to-point streams (see who "
                "waits for whom); post the messages between two instructions in one group per "
                "peer (add_communication does)"
            )
        return (
            f"{a} and {b} each wait for data the other rank sends only after it; reorder the "
            "ranks' instructions so that every message is sent before its receiver needs it "
            "(check the compute-only program)"
        )

    def _text(self, x: Step) -> str:
        r, t = x
        return f"rank {r} step {t} `{self.p.ranks[r][t]}`"

    def _why(
        self, x: Step, blocked: Callable[[int], Step | None]
    ) -> tuple[str, Step | None, Step | None]:
        """One link: what posted SEND/RECV ``x`` waits for, the next SEND/RECV to follow, and the
        blocked instruction the link goes through (if the partner is not posted yet)."""
        p = self.p
        r, t = x
        i = p.ranks[r][t]
        other = self.a.partner[x]
        q, u = other
        stream = f"r{min(r, q)}-r{max(r, q)}"
        mine = self.entry_of.get(x)
        side = self.sides.get((min(r, q), max(r, q)), {}).get(r)
        if self.nccl and mine is not None and side and side[0] is not mine:
            return (
                f"  {self._text(x)} is queued on the {stream} stream behind {self._front(side[0])}",
                self._stuck_member(side[0]),
                None,
            )
        if other not in self.posted:
            at = blocked(q)
            where = (
                "has finished" if at is None else f"is stuck at step {at[1]} `{p.ranks[q][at[1]]}`"
            )
            line = (
                f"  {self._text(x)} waits for rank {q} step {u} `{p.ranks[q][u]}`, which rank {q} "
                f"has not posted: rank {q} {where}"
            )
            return line, None if at is None else self._waited(at), at
        theirs = self.entry_of.get(other)
        side = self.sides.get((min(r, q), max(r, q)), {}).get(q)
        if self.nccl and theirs is not None and side and side[0] is not theirs:
            kind = "RECV" if i.op is Op.SEND else "SEND"
            return (
                f"  {self._text(x)} waits for its {kind} {self._text(other)}, queued on the "
                f"{stream} stream behind {self._front(side[0])}",
                self._stuck_member(side[0]),
                None,
            )
        if not self.nccl:  # gloo: a RECV waits only for its SEND to be posted
            return f"  {self._text(x)} waits for {self._text(other)}", None, None
        group = self.groups[self.group_of[x]]
        rest = [s for s in group.steps if (r, s) not in self.matched]
        return (
            f"  {self._text(x)} has matched but its group waits for {self._text((r, rest[0]))}"
            if rest
            else f"  {self._text(x)} is stuck",
            (r, rest[0]) if rest else None,
            None,
        )

    def _front(self, entry: _Entry) -> str:
        """The entry at the head of a side, and what its group still waits for."""
        first = entry.members[0]
        stuck = self._stuck_member(entry)
        if stuck == first:
            return self._text(first)
        return f"{self._text(first)}, whose group still waits for {self._text(stuck)}"

    def _stuck_member(self, entry: _Entry) -> Step:
        """A member of ``entry``'s group that has not matched (the reason it holds the head)."""
        group = self.groups[entry.group]
        for m in entry.members:
            if m not in self.matched:
                return m
        return next((group.rank, t) for t in group.steps if (group.rank, t) not in self.matched)

    def _waited(self, at: Step) -> Step | None:
        """The posted SEND/RECV a blocked compute instruction or REDUCE waits for, if any."""
        for d in self.a.deps.get(at, ()):
            dep = (d.rank, d.step)
            if dep not in self.finish and dep in self.posted:
                return dep
        return None

    def _headline(self, cycle: list[Step]) -> str:
        """One sentence for a cycle of stream waits that no pair's heads explain alone."""
        ends = [cycle[0], *[x for x in cycle[1:] if x[0] != cycle[0][0]][:1]]
        if len(ends) < 2:
            return ""
        return (
            f"{self._text(ends[0])} and {self._text(ends[1])} wait for each other through the "
            "point-to-point streams (see who waits for whom); post the messages between two "
            "instructions in one group per peer (add_communication does)"
        )

    def crossed(self) -> Why | None:
        """A pair of ranks whose two heads cannot match each other: a certain hang (what each
        head waits for is queued behind the other head, or will be when it is posted)."""
        if not self.nccl:
            return None
        for (a, b), sides in sorted(self.sides.items()):
            if not sides[a] or not sides[b]:
                continue
            ea, eb = sides[a][0], sides[b][0]
            if self._active(ea.group) is None or self._active(eb.group) is None:
                continue
            ua = [m for m in ea.members if m not in self.matched]
            ub = [m for m in eb.members if m not in self.matched]
            if not ua or not ub:
                continue
            if any(self.a.partner[m] in eb.members for m in ua) or any(
                self.a.partner[m] in ea.members for m in ub
            ):
                continue
            x, y = ua[0], ub[0]
            i, j = self.p.ranks[x[0]][x[1]], self.p.ranks[y[0]][y[1]]
            both = f"{self._text(x)} and {self._text(y)}"
            if i.op is Op.SEND and j.op is Op.SEND:
                head = (
                    f"{both} both wait on the r{a}-r{b} stream for a RECV queued behind the "
                    "other's SEND; post them in one group (add_communication does), or post the "
                    "RECV first on one of the ranks"
                )
            elif i.op is Op.RECV and j.op is Op.RECV:
                head = (
                    f"{both} both wait on the r{a}-r{b} stream for a SEND queued behind the "
                    "other's RECV; post the SEND first on one of the ranks, or both in one group "
                    "(add_communication does)"
                )
            else:
                head = (
                    f"{both} hold the heads of the r{a}-r{b} stream and neither can match the "
                    "other; post the messages of both ranks in the same order, or in one group"
                )
            return Why(head, (), x)
        return None
