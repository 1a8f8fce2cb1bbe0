"""NCCL's point-to-point rules, enforced at run time: the model behind the strict transports.

gloo buffers sends, so a program whose ranks both send before they receive runs on a CPU and
hangs on GPUs. In strict mode (``LocalWorld(strict=True)``, ``DistTransport(strict=True)``,
``FUNCPIPE_STRICT_P2P=1``) a transport moves messages only as PyTorch's NCCL backend would:

1. One ordered queue (stream) per pair of ranks, carrying both directions: funcpipe's
   communicator layout, a process group per pair of ranks (:data:`funcpipe.schedule.p2p.PAIR`).
   A rank's groups (one operation posted alone, or several posted together by
   ``Transport.post``; the transports split a group with several peers into one per peer, as a
   batch is one process group's) enter the queues of the pairs they touch in the order the rank
   posts them.
2. A group is *active* once it is at the head of this rank's side of every queue it touches: every
   earlier group of the rank on those pairs has completed.
3. Messages match in FIFO order per direction (a rank's k-th send to a peer is the peer's k-th
   receive from it) once both their groups are active. Nothing is buffered: an ungrouped send
   waits until the peer's receive reaches the head of the peer's side of their queue.
4. A group completes, and leaves the heads, when all its operations have matched; all its
   handles are done then (NCCL completes a fused group as one).

The state is a few counters per pair: each side counts, per peer, the sends and receives of its
active (or completed) groups. The k-th send from a to b has matched iff k is below a's active
sends to b and below b's active receives from a. Both only grow, so ranks that read each other's
counters at different times still agree, which is what lets processes share them through the
process group's store (:class:`Shared`).

A deadlock is a set of ranks that all wait (blocked on a handle, or in ``finish``) for groups
that cannot complete, each only for operations of the others: :func:`stuck` finds it and
:func:`explain` says which operation waits for which.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from funcpipe.errors import CommunicationError

__all__ = ["Group", "Op", "Shared", "Side", "explain", "settle", "stuck"]

SEND, RECV = "send", "recv"
RULES = (
    "NCCL's point-to-point rules (strict mode): one FIFO queue per pair of ranks for both "
    "directions, an ungrouped send completes only when the peer's matching receive is at the "
    "head of its side; post the operations that must progress together as one group"
)


class Op:
    """One operation of a group: the ``index``-th ``kind`` with ``peer`` (per direction)."""

    __slots__ = ("index", "kind", "label", "peer")

    def __init__(self, kind: str, peer: int, index: int, label: str = "") -> None:
        self.kind, self.peer, self.index, self.label = kind, peer, index, label

    def __str__(self) -> str:
        if self.label:  # e.g. the instruction's text (a joined one's "+ " dropped)
            return self.label.removeprefix("+").strip()
        way = "to" if self.kind == SEND else "from"
        return f"{self.kind.upper()} ({way} r{self.peer})"


class Group:
    """Operations posted together; ``complete`` once all of them have matched."""

    __slots__ = ("active", "complete", "ops", "peers", "seq")

    def __init__(self, seq: int, ops: list[Op]) -> None:
        self.seq, self.ops = seq, ops
        self.peers = frozenset(op.peer for op in ops)
        self.active = self.complete = False

    def __str__(self) -> str:
        return " + ".join(str(op) for op in self.ops)


Counts = Callable[[int, int], tuple[int, int]]  # (of, toward) -> of's active (sends, receives)


class Side:
    """One rank's side of every queue it shares: its groups not yet complete, in posting order."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.groups: list[Group] = []
        self.posted: dict[int, list[int]] = {}  # peer -> [sends, receives] posted
        self.active: dict[int, list[int]] = {}  # peer -> [sends, receives] of active groups
        self.seq = 0  # groups posted

    def post(self, ops: Sequence[tuple[str, int, str]]) -> Group:
        """Post ``(kind, peer, label)`` operations as one group."""
        members = []
        for kind, peer, label in ops:
            n = self.posted.setdefault(peer, [0, 0])
            k = int(kind == RECV)
            members.append(Op(kind, peer, n[k], label))
            n[k] += 1
        g = Group(self.seq, members)
        self.seq += 1
        self.groups.append(g)
        return g

    def counts(self, peer: int) -> tuple[int, int]:
        s, r = self.active.get(peer, (0, 0))
        return s, r

    def activate(self) -> bool:
        """Activate the groups now at the head of every queue they touch."""
        changed, busy = False, set[int]()
        for g in self.groups:
            if not g.active and not (g.peers & busy):
                g.active = changed = True
                for op in g.ops:
                    self.active.setdefault(op.peer, [0, 0])[int(op.kind == RECV)] += 1
            busy |= g.peers
        return changed

    def matched(self, op: Op, counts: Counts) -> bool:
        sends, recvs = counts(op.peer, self.rank)
        return op.index < (recvs if op.kind == SEND else sends)

    def waiting(self, counts: Counts) -> list[Op]:
        """The operations of active groups that have not matched (what this side waits for)."""
        return [op for g in self.groups if g.active for op in g.ops if not self.matched(op, counts)]

    def settle(self, counts: Counts) -> list[Group]:
        """Complete (and drop) the active groups whose operations have all matched."""
        done = [
            g for g in self.groups if g.active and all(self.matched(op, counts) for op in g.ops)
        ]
        for g in done:
            g.complete = True
        if done:
            self.groups = [g for g in self.groups if not g.complete]
        return done

    def head(self, peer: int) -> Group | None:
        """This side's head of the queue with ``peer`` (its first group touching it)."""
        return next((g for g in self.groups if peer in g.peers), None)

    # ------------------------------------------------------------------ sharing
    def snapshot(self, blocked: tuple[int, bool] | None, version: int) -> str:
        return json.dumps(
            {
                "v": version,
                "blocked": blocked,
                "active": {str(p): c for p, c in self.active.items()},
                "groups": [
                    [g.seq, g.active, [[op.kind, op.peer, op.index, op.label] for op in g.ops]]
                    for g in self.groups
                ],
            }
        )

    @classmethod
    def restore(cls, rank: int, state: Mapping[str, Any]) -> Side:
        side = cls(rank)
        side.active = {int(p): list(c) for p, c in state["active"].items()}
        for seq, active, ops in state["groups"]:
            g = Group(seq, [Op(k, p, i, label) for k, p, i, label in ops])
            g.active = active
            side.groups.append(g)
        return side


def _counts(sides: Mapping[int, Side]) -> Counts:
    def counts(of: int, toward: int) -> tuple[int, int]:
        side = sides.get(of)
        return side.counts(toward) if side is not None else (0, 0)

    return counts


def settle(sides: Mapping[int, Side]) -> list[Group]:
    """Run the rules to a fixed point over these sides; the groups that completed."""
    counts = _counts(sides)
    done: list[Group] = []
    while True:
        progressed = False
        for side in sides.values():
            progressed |= side.activate()
        for side in sides.values():
            got = side.settle(counts)
            done.extend(got)
            progressed |= bool(got)
        if not progressed:
            return done


def _still_waiting(side: Side, blocked: tuple[int, bool]) -> bool:
    seq, every = blocked
    return any(g.seq <= seq if every else g.seq == seq for g in side.groups)


def stuck(sides: Mapping[int, Side], blocked: Mapping[int, tuple[int, bool]]) -> set[int]:
    """The ranks in a deadlock: each is ``blocked`` on ``(seq, every)`` (its group ``seq``, or
    with ``every`` all its groups up to it), which cannot complete however the others go on.

    Settles ``sides`` first. Sound: a blocked rank posts nothing new, so a set of blocked ranks
    whose unmatched operations all have peers in the set can never match any of them.
    """
    settle(sides)
    counts = _counts(sides)
    ranks = {r for r, b in blocked.items() if r in sides and _still_waiting(sides[r], b)}
    while True:
        drop = {r for r in ranks if any(op.peer not in ranks for op in sides[r].waiting(counts))}
        if not drop:
            return ranks
        ranks -= drop


def explain(sides: Mapping[int, Side], ranks: Sequence[int] | set[int]) -> str:
    """What each unmatched operation of ``ranks`` waits for, with the head of the peer's side of
    their queue: ``rank 0's SEND (to r1) waits for rank 1, whose queue head is its own SEND (to
    r0)``."""
    counts = _counts(sides)
    lines = []
    for r in sorted(ranks):
        side = sides[r]
        for g in side.groups:
            if not g.active:
                continue
            for op in g.ops:
                if side.matched(op, counts):
                    continue
                grouped = f" (in group {g})" if len(g.ops) > 1 else ""
                lines.append(
                    f"rank {r}'s {op}{grouped} waits for rank {op.peer}, " + _why(sides, r, op)
                )
        for g in side.groups:
            if not g.active:
                ahead = next(h for h in side.groups if h.peers & g.peers)
                lines.append(f"rank {r}'s {g} is queued behind its own {ahead}")
                break
    return "; ".join(lines)


def _why(sides: Mapping[int, Side], r: int, op: Op) -> str:
    want, way = (RECV, "from") if op.kind == SEND else (SEND, "to")
    peer = sides.get(op.peer)
    head = peer.head(r) if peer is not None else None
    if peer is None or head is None:
        return f"which has not posted its {want.upper()} #{op.index} ({way} r{r})"
    first = next(o for o in head.ops if o.peer == r)
    if head.active:
        return f"whose queue head is its own {first}" + (
            f" (in group {head})" if len(head.ops) > 1 else ""
        )
    ahead = next(h for h in peer.groups if h.peers & head.peers)
    return f"whose queue head {first} waits behind its own {ahead}"


class Shared:
    """This process's side under the rules, shared with the program's other ranks through the
    process group's store (strict :class:`funcpipe.runtime.transport_dist.DistTransport`).

    ``keys[r]`` is where program rank ``r`` publishes its side (counters, groups not yet complete,
    and what it is blocked on); every process of the program must use the same keys.
    Waiting polls the peers' counters; a rank that has waited without progress looks for a
    deadlock (:func:`stuck`) over every rank's published side and raises
    :class:`CommunicationError` once it has seen the same one twice (``check`` seconds apart), so
    a deadlock is reported within about a second, never after the process group's timeout.
    """

    def __init__(
        self,
        rank: int,
        store: Any,
        keys: Sequence[str],
        *,
        timeout: float = 1800.0,
        check: float = 0.1,
    ) -> None:
        self.rank, self.store, self.keys = rank, store, list(keys)
        self.timeout, self.check = timeout, check
        self.side = Side(rank)
        self.version = 0
        self.blocked: tuple[int, bool] | None = None
        self.peers: dict[int, tuple[int, int]] = {}  # peer -> its counts toward this rank
        self.publish()

    def publish(self) -> None:
        self.version += 1
        self.store.set(self.keys[self.rank], self.side.snapshot(self.blocked, self.version))

    def read(self, r: int) -> dict[str, Any] | None:
        key = self.keys[r]
        if not self.store.check([key]):
            return None
        state: dict[str, Any] = json.loads(self.store.get(key))
        return state

    def post(self, ops: Sequence[tuple[str, int, str]]) -> Group:
        g = self.side.post(ops)
        self.side.activate()
        self.publish()
        return g

    def _counts(self, of: int, toward: int) -> tuple[int, int]:
        return self.peers.get(of, (0, 0))

    def progress(self) -> None:
        """Read the counters of the peers this side waits for; complete what has matched."""
        side = self.side
        changed = side.activate()
        for q in {op.peer for op in side.waiting(self._counts)}:
            state = self.read(q)
            if state is not None:
                s, r = state["active"].get(str(self.rank), (0, 0))
                self.peers[q] = (s, r)
        while side.settle(self._counts):
            changed = True
            if not side.activate():
                break
        if changed:
            self.publish()

    def done(self, group: Group | None) -> bool:
        """``group`` has completed (``None``: every group posted so far)."""
        return not self.side.groups if group is None else group.complete

    def wait(self, group: Group | None, what: str) -> None:
        """Block until ``group`` (``None``: every group) completes; raise on a deadlock."""
        self.progress()
        if self.done(group):
            return
        last = self.side.groups[-1].seq if group is None else group.seq
        self.blocked = (last, group is None)
        self.publish()
        start = time.monotonic()
        seen: tuple[tuple[int, int], ...] | None = None
        next_check = start + self.check / 2
        pause = 0.0005
        try:
            while not self.done(group):
                self.progress()
                now = time.monotonic()
                if now - start > self.timeout:
                    waits = ", ".join(str(op) for op in self.side.waiting(self._counts))
                    raise CommunicationError(
                        f"{what}: did not complete within {self.timeout:.0f} s (the process "
                        f"group's timeout); rank {self.rank} still waits for "
                        f"{waits or 'nothing'} ({RULES}). No deadlock was found: if a peer is "
                        "only slow (compiling, loading data), raise pg_timeout= of "
                        "funcpipe.launch or funcpipe.Pool"
                    )
                if now >= next_check:
                    seen = self._deadlock(what, seen)
                    next_check = now + self.check
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
        except CommunicationError:
            raise  # stay blocked in the store: the other ranks of a deadlock must still see it
        except BaseException:
            self.blocked = None
            self.publish()
            raise
        self.blocked = None
        self.publish()

    def _deadlock(
        self, what: str, seen: tuple[tuple[int, int], ...] | None
    ) -> tuple[tuple[int, int], ...] | None:
        """Look for a deadlock this rank is part of; raise if it is the one ``seen`` before."""
        states = {r: self.read(r) for r in range(len(self.keys))}
        sides = {r: Side.restore(r, s) for r, s in states.items() if s is not None}
        blocked = {
            r: (s["blocked"][0], s["blocked"][1])
            for r, s in states.items()
            if s is not None and s["blocked"] is not None
        }
        ranks = stuck(sides, blocked)
        if self.rank not in ranks:
            return None
        key = tuple(sorted((r, int(states[r]["v"])) for r in ranks))  # type: ignore[index]
        if key != seen:
            return key  # confirm on the next look: the same ranks, none of them changed
        raise CommunicationError(
            f"{what}: can never complete: ranks {sorted(ranks)} wait for each other under "
            f"{RULES}. {explain(sides, ranks)}"
        )
