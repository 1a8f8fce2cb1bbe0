"""The in-process transport: every rank of a program in this process.

:class:`LocalWorld` holds what the ranks share (per-pair FIFO mailboxes, the collectives being
assembled, strict mode's sides of the queues); :class:`LocalTransport` is one rank's view of it.
Messages are copied into the receiver's buffers, exactly as over a wire. With ``strict=True``
they move only under NCCL's point-to-point rules (:mod:`funcpipe.runtime.nccl_rules`), so a
program that would hang on GPUs stops with :class:`~funcpipe.errors.CommunicationError`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch

from funcpipe.errors import CommunicationError, InvalidArgument
from funcpipe.runtime import nccl_rules
from funcpipe.runtime.transport_common import (
    DONE,
    P2P,
    SEND,
    STRICT_ENV,
    Handle,
    _Counters,
    _Held,
    _nbytes,
    by_peer,
    post_by_peer,
    strict_from_env,
)
from funcpipe.schedule.p2p import PAIR

__all__ = ["LocalTransport", "LocalWorld"]

Tensor = torch.Tensor


class LocalWorld:
    """Shared state of ``size`` ranks living in one process (mailboxes and collectives).

    ``groups`` names collectives: ``{"data": [[0, 2], [1, 3]], "tie:wte": [[0, 1]]}`` — each name
    maps to disjoint lists of ranks; a rank reducing over ``name`` meets the others of its list.

    ``strict=True`` moves messages only under NCCL's point-to-point rules on funcpipe's
    communicator layout (:data:`~funcpipe.schedule.p2p.PAIR`, :mod:`funcpipe.runtime.nccl_rules`):
    one FIFO queue per pair for both directions, a group's operations with one peer posted
    together as one batch, an ungrouped send done only when the peer's receive is at the head
    of its side (no buffering). A program that would hang on GPUs then stops with :class:`CommunicationError`
    (from :func:`funcpipe.runtime.drive.drive_local`, with :meth:`explain`). Default: on when the
    environment variable ``FUNCPIPE_STRICT_P2P`` is set (to anything but ``0``).
    Collectives are unaffected.
    """

    def __init__(
        self,
        size: int,
        *,
        groups: Mapping[str, Sequence[Sequence[int]]] | None = None,
        strict: bool | None = None,
    ):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgument(f"LocalWorld(size={size!r}): size is the number of ranks, >= 1")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidArgument(
                f"LocalWorld(strict={strict!r}): True, False, or None (read {STRICT_ENV})"
            )
        self.size = size
        self.layout = PAIR
        self.strict = strict_from_env() if strict is None else strict
        self.mail: dict[tuple[int, int], deque[_LocalMessage]] = {}
        self.posted: dict[tuple[int, int], deque[_LocalRecv]] = {}  # receives not yet matched
        # strict mode: every rank's side of the queues, and the buffers of posted receives
        self.sides: dict[int, nccl_rules.Side] = {}
        self.wanted: dict[tuple[int, int], deque[list[Tensor]]] = {}
        self.groups: dict[str, dict[int, tuple[int, ...]]] = {}
        for name, lists in (groups or {}).items():
            members: dict[int, tuple[int, ...]] = {}
            for ranks in lists:
                for r in ranks:
                    members[r] = tuple(ranks)
            self.groups[name] = members
        # (group, members, call number) -> contributions of the collective being assembled
        self.pending: dict[tuple[str, tuple[int, ...], int], list[_Contribution]] = {}
        self.calls: dict[tuple[str, int], int] = {}  # (group, world rank) -> calls so far
        # world rank -> its collectives not yet complete (for device_sync)
        self.collectives: dict[int, list[_Contribution]] = {}
        # set by drive_local while it runs: (run every rank that can go on until it waits, the
        # ranks whose generators are running, innermost last: those are skipped)
        self.driver: tuple[Callable[[], bool], list[int]] | None = None

    def transport(self, rank: int, ranks: Sequence[int] | None = None) -> LocalTransport:
        """The transport of program rank ``rank``; ``ranks[r]`` is the world rank of program
        rank ``r`` (default: the identity, one program filling the world)."""
        return LocalTransport(self, rank, ranks)

    def members(self, group: str, rank: int) -> tuple[int, ...]:
        try:
            return self.groups[group][rank]
        except KeyError:
            return (rank,)  # a group this rank shares with no one: a local no-op

    def side(self, rank: int) -> nccl_rules.Side:
        side = self.sides.get(rank)
        if side is None:
            side = self.sides[rank] = nccl_rules.Side(rank)
        return side

    def progress(self) -> None:
        """Strict mode: match what the rules allow and copy those messages."""
        nccl_rules.settle(self.sides)
        for (src, dst), want in self.wanted.items():
            if not want:
                continue
            matched = min(self.side(src).counts(dst)[0], self.side(dst).counts(src)[1])
            box = self.mail[(src, dst)]
            done = self.side(src).posted.get(dst, [0, 0])[0] - len(box)  # copied so far
            for _ in range(matched - done):
                msg = box.popleft()
                _copy_into(want.popleft(), msg.tensors, src, dst)
                msg.tensors, msg.done = [], True

    def device_sync(self) -> None:
        """A stand-in, for tests, of a device-wide synchronisation in the middle of a step
        (``torch.cuda.synchronize()`` in a stage, inductor's autotuning, the caching
        allocator's free-and-retry on out-of-memory) by the rank running now: its host is held
        until every operation it has enqueued has completed, its collectives and (strict mode)
        its point-to-point groups, while the other ranks go on. Call it from a stage function
        while :func:`funcpipe.runtime.drive.drive_local` runs the step.

        Raises :class:`CommunicationError` if those operations can never complete: on a GPU the
        step would hang there.
        """
        if self.driver is None or not self.driver[1]:
            raise InvalidArgument(
                "LocalWorld.device_sync: call it from a stage while drive_local runs the step"
            )
        advance, running = self.driver
        rank = running[-1]
        while True:
            left = self._enqueued(rank)
            if not left:
                return
            if not advance():
                raise CommunicationError(
                    f"rank {rank} synchronises its device mid-step while {left} cannot "
                    "complete until it goes on: on a GPU the step hangs here"
                )

    def _enqueued(self, rank: int) -> str:
        """What world rank ``rank`` has enqueued that has not completed ('' if nothing)."""
        mine = [c for c in self.collectives.get(rank, []) if not c.done]
        self.collectives[rank] = mine
        what = [f"{len(mine)} collective(s)"] if mine else []
        if self.strict:
            self.progress()
            groups = self.side(rank).groups
            if groups:
                what.append("point-to-point group(s) " + ", ".join(str(g) for g in groups))
        return " and ".join(what)

    def unfinished(self) -> list[int]:
        """Strict mode: the ranks with groups not yet complete."""
        self.progress()
        return sorted(r for r, side in self.sides.items() if side.groups)

    def explain(self, ranks: Sequence[int] | None = None) -> str:
        """What the point-to-point operations of ``ranks`` (world ranks; default all) wait for:
        in strict mode each one's peer and the head of the peer's side of their queue."""
        if self.strict:
            self.progress()
            chosen = set(self.sides) if ranks is None else set(ranks) & set(self.sides)
            return nccl_rules.explain(self.sides, chosen) or "no operation is waiting"
        lines = []
        for (src, dst), box in sorted(self.mail.items()):
            if box and (ranks is None or src in ranks or dst in ranks):
                lines.append(f"{len(box)} message(s) from rank {src} to rank {dst} not received")
        return "; ".join(lines) or "no message is in flight"


class _StrictLocal:
    """A handle in a strict :class:`LocalWorld`: done once its group has completed."""

    def __init__(self, world: LocalWorld, group: nccl_rules.Group, rank: int, nbytes: int) -> None:
        self.world, self.group, self.rank, self.nbytes = world, group, rank, nbytes

    def ready(self) -> bool:
        if not self.group.complete:
            self.world.progress()
        return self.group.complete

    def wait(self) -> None:
        if not self.ready():
            raise CommunicationError(
                f"rank {self.rank}: {self.group} cannot complete yet ({nccl_rules.RULES}): "
                + self.world.explain([self.rank])
            )


class _LocalMessage:
    """A send in a mailbox; ``ready()`` once the receiver has copied it (then it lets go)."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.tensors = [t.detach() for t in tensors]
        self.nbytes = _nbytes(self.tensors)
        self.done = False

    def ready(self) -> bool:
        return self.done

    def wait(self) -> None:
        if not self.done:
            raise CommunicationError("a message was never received (no rank posted its receive)")


class _Contribution:
    def __init__(
        self, rank: int, tensors: Sequence[Tensor], outputs: Sequence[Tensor] = ()
    ) -> None:
        self.rank = rank
        self.tensors = list(tensors)
        self.outputs = list(outputs)
        self.done = False

    def ready(self) -> bool:
        return self.done

    def wait(self) -> None:
        if not self.done:
            raise CommunicationError(
                f"rank {self.rank}: waited on a collective whose other members never arrived"
            )


def _copy_into(buffers: Sequence[Tensor], tensors: Sequence[Tensor], src: int, dst: int) -> None:
    if len(tensors) != len(buffers) or any(
        t.shape != b.shape or t.dtype != b.dtype for t, b in zip(tensors, buffers, strict=False)
    ):
        raise CommunicationError(
            f"rank {dst} expected from rank {src} tensors "
            f"{[(tuple(b.shape), b.dtype) for b in buffers]} but got "
            f"{[(tuple(t.shape), t.dtype) for t in tensors]}"
        )
    for b, t in zip(buffers, tensors, strict=True):
        b.copy_(t)


class _LocalRecv:
    """A receive matched to messages in the order receives are posted (FIFO per pair, as over
    a wire), whichever of them is waited for first."""

    def __init__(self, world: LocalWorld, src: int, dst: int, buffers: Sequence[Tensor]) -> None:
        self.box = world.mail.setdefault((src, dst), deque())
        self.queue = world.posted.setdefault((src, dst), deque())
        self.queue.append(self)
        self.src, self.dst, self.buffers = src, dst, list(buffers)
        self.done = False

    def ready(self) -> bool:
        while not self.done and self.box:
            msg, first = self.box.popleft(), self.queue.popleft()
            _copy_into(first.buffers, msg.tensors, self.src, self.dst)
            msg.tensors, msg.done, first.done = [], True, True
        return self.done

    def wait(self) -> None:
        if not self.ready():
            raise CommunicationError(
                f"rank {self.dst} waits for a message from rank {self.src} that was never sent"
            )


class LocalTransport(_Counters):
    """One rank's view of a :class:`LocalWorld` (``rank`` in the program, ``ranks`` to the world).

    A send stays in the receiver's mailbox (and in ``held_bytes``) until the receiver copies it.
    """

    blocking = False  # (drive_local switches to another rank at each wait)

    def __init__(self, world: LocalWorld, rank: int, ranks: Sequence[int] | None = None) -> None:
        self.world, self.rank = world, rank
        self.layout: str | None = world.layout
        self.ranks = list(ranks) if ranks is not None else list(range(world.size))
        self.me = self.ranks[rank]
        self.held = _Held()

    def post(self, ops: Sequence[P2P]) -> list[Handle]:
        self.held.reap()
        if not ops:
            return []
        if self.world.strict:
            parts = by_peer(ops)
            if parts is not None:  # one batch per peer (the pair layout)
                return post_by_peer(ops, parts, self._post_strict)
            return self._post_strict(ops)
        handles: list[Handle] = []
        for op in ops:
            peer = self.ranks[op.peer]
            if op.op == SEND:
                msg = _LocalMessage(op.tensors)
                self.world.mail.setdefault((self.me, peer), deque()).append(msg)
                self.held.add(msg)
                handles.append(msg)
            else:
                handles.append(_LocalRecv(self.world, peer, self.me, op.tensors))
        return handles

    def _post_strict(self, ops: Sequence[P2P]) -> list[Handle]:
        world = self.world
        peers = [self.ranks[op.peer] for op in ops]
        group = world.side(self.me).post(
            [(op.op, peer, op.label) for op, peer in zip(ops, peers, strict=True)]
        )
        handles: list[Handle] = []
        for op, peer in zip(ops, peers, strict=True):
            if op.op == SEND:
                msg = _LocalMessage(op.tensors)
                world.mail.setdefault((self.me, peer), deque()).append(msg)
                world.wanted.setdefault((self.me, peer), deque())
                h = _StrictLocal(world, group, self.me, msg.nbytes)
                self.held.add(h)
            else:
                world.mail.setdefault((peer, self.me), deque())
                world.wanted.setdefault((peer, self.me), deque()).append(list(op.tensors))
                h = _StrictLocal(world, group, self.me, 0)
            handles.append(h)
        world.progress()
        return handles

    def all_reduce(self, tensors: Sequence[Tensor], group: str) -> Handle:
        def total(parts: list[_Contribution]) -> None:
            for i in range(len(parts[0].tensors)):
                t = parts[0].tensors[i].clone()
                for c in parts[1:]:
                    t += c.tensors[i].to(t.device)
                for c in parts:
                    c.tensors[i].copy_(t)

        return self._collective(group, tensors, (), total)

    def reduce_scatter(
        self, inputs: Sequence[Tensor], outputs: Sequence[Tensor], group: str
    ) -> Handle:
        """Member ``c`` of the group (in rank order) gets in ``outputs[k]`` the sum over the
        members of their ``inputs[k]``'s ``c``-th slice of ``outputs[k].numel()`` elements."""

        def scatter(parts: list[_Contribution]) -> None:
            for k in range(len(parts[0].tensors)):
                w = parts[0].outputs[k].numel()
                for c, mine in enumerate(parts):
                    t = parts[0].tensors[k][c * w : (c + 1) * w].clone()
                    for q in parts[1:]:
                        t += q.tensors[k][c * w : (c + 1) * w].to(t.device)
                    mine.outputs[k].copy_(t)

        return self._collective(group, inputs, outputs, scatter)

    def all_gather(self, inputs: Sequence[Tensor], outputs: Sequence[Tensor], group: str) -> Handle:
        """Every member gets in ``outputs[k]`` the members' ``inputs[k]`` one after the other
        (in rank order)."""

        def gather(parts: list[_Contribution]) -> None:
            for k in range(len(parts[0].tensors)):
                whole = torch.cat([q.tensors[k].reshape(-1) for q in parts])
                for q in parts:
                    q.outputs[k].copy_(whole.to(q.outputs[k].device).view(q.outputs[k].shape))

        return self._collective(group, inputs, outputs, gather)

    def _collective(
        self,
        group: str,
        tensors: Sequence[Tensor],
        outputs: Sequence[Tensor],
        complete: Callable[[list[_Contribution]], None],
    ) -> Handle:
        """This rank's part in its next collective over ``group``: the ``n``-th call of each
        member meets the others' ``n``-th (as NCCL matches one communicator's calls in issue
        order), completed by ``complete`` (over the parts in rank order) once all are in."""
        self.held.reap()
        members = self.world.members(group, self.me)
        me = _Contribution(self.me, tensors, outputs)
        if len(members) == 1:
            if outputs:  # (an all-reduce of one is a no-op)
                complete([me])
            return DONE
        n = self.world.calls.get((group, self.me), 0)
        self.world.calls[(group, self.me)] = n + 1
        key = (group, members, n)
        parts = self.world.pending.setdefault(key, [])
        parts.append(me)
        self.world.collectives.setdefault(self.me, []).append(me)
        if len(parts) == len(members):
            del self.world.pending[key]
            parts.sort(key=lambda c: c.rank)  # a fixed order: deterministic sums
            complete(parts)
            for c in parts:  # (done: the world's list of them keeps no buffers to the end)
                c.done, c.tensors, c.outputs = True, [], []
        return me

    def finish(self) -> None:
        # a rank may end its step before its peers received: the mailboxes keep those messages
        self.held.reap()
        self.held.step_done()
