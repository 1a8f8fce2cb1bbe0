"""Transports: how the interpreter moves tensors between ranks.

Two implementations of one small interface:

- :class:`LocalWorld` / :class:`LocalTransport`: every rank in this process. Messages go through
  per-pair FIFO mailboxes and are copied into the receiver's buffers, exactly as over a wire.
- :class:`DistTransport`: ``torch.distributed`` point-to-point (gloo on CPU, NCCL on CUDA) and
  collectives over named process groups; CPU messages between processes of one host can go
  over :class:`funcpipe.runtime.sockets.Channels` instead (measured 7-18 us per message against 0.13-2 ms for gloo).

Point-to-point goes through one call, :meth:`Transport.post`: a sequence of :class:`P2P` sends and
receives posted together, one :class:`Handle` per operation. Both transports have the
communicator layout :data:`funcpipe.schedule.p2p.PAIR` (``.layout``), the one the checker models:
the operations of a group with one peer are one batch on that pair's queue (over
torch.distributed: one ``batch_isend_irecv`` on the pair's process group, even for a single
operation); a group with several peers is one batch per peer, posted in the order of their first
operations. A send's handle is done once its tensors may be released; the transport keeps a send
only until then (``held_bytes``, ``peak_held_bytes``).

Receives fill buffers the receiver allocated from its own shape inference: no metadata and no
pickled objects travel, only tensors.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from funcpipe.errors import CommunicationError, InvalidArgument
from funcpipe.runtime import buckets, nccl_rules
from funcpipe.schedule.p2p import PAIR

__all__ = ["P2P", "DistTransport", "Handle", "LocalTransport", "LocalWorld", "Transport"]

Tensor = torch.Tensor
SEND, RECV = nccl_rules.SEND, nccl_rules.RECV
STRICT_ENV = "FUNCPIPE_STRICT_P2P"


def strict_from_env() -> bool:
    """``FUNCPIPE_STRICT_P2P`` is set (to anything but ``0``): transports enforce NCCL's rules."""
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


class Handle(Protocol):
    """An operation in flight: ``ready()`` without blocking, ``wait()`` until it completes."""

    def ready(self) -> bool: ...

    def wait(self) -> None: ...


@dataclass(frozen=True)
class P2P:
    """One point-to-point operation of a group: ``op`` is ``"send"`` (``tensors`` are what to
    send) or ``"recv"`` (``tensors`` are the buffers to fill); ``peer`` is the program rank of the
    other end. ``label`` (optional, e.g. the instruction's text) names it in error messages."""

    op: str
    tensors: tuple[Tensor, ...]
    peer: int
    label: str = ""

    def __post_init__(self) -> None:
        if self.op not in (SEND, RECV):
            raise InvalidArgument(f"P2P(op={self.op!r}): op is 'send' or 'recv'")
        if isinstance(self.peer, bool) or not isinstance(self.peer, int) or self.peer < 0:
            raise InvalidArgument(f"P2P(peer={self.peer!r}): the program rank of the other end")
        if not isinstance(self.tensors, tuple):
            object.__setattr__(self, "tensors", tuple(self.tensors))


class Transport(Protocol):
    """What the interpreter needs from a transport (``rank`` is the rank in the program;
    ``layout`` the communicator layout its point-to-point operations follow, which the program
    is checked under)."""

    rank: int
    layout: str | None

    def post(self, ops: Sequence[P2P]) -> list[Handle]: ...

    def all_reduce(self, tensors: Sequence[Tensor], group: str) -> Handle: ...

    def finish(self) -> None: ...


class _Done:
    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = _Done()


def by_peer(ops: Sequence[P2P]) -> list[list[int]] | None:
    """The indices of ``ops`` per peer, in the order of each peer's first operation: the batches
    a group is posted as under the pair layout (None when every operation has one peer, the
    common case: one batch)."""
    first = ops[0].peer
    if all(op.peer == first for op in ops):
        return None
    parts: dict[int, list[int]] = {}
    for k, op in enumerate(ops):
        parts.setdefault(op.peer, []).append(k)
    return list(parts.values())


def post_by_peer(
    ops: Sequence[P2P], parts: list[list[int]], post: Callable[[Sequence[P2P]], list[Handle]]
) -> list[Handle]:
    """Post each peer's operations as its own batch; the handles in the order of ``ops``."""
    handles: list[Handle | None] = [None] * len(ops)
    for part in parts:
        for k, h in zip(part, post([ops[k] for k in part]), strict=True):
            handles[k] = h
    return handles  # type: ignore[return-value]


def _nbytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Send(Protocol):
    nbytes: int

    def ready(self) -> bool: ...

    def wait(self) -> None: ...


class _Held:
    """The sends a transport keeps until they are known complete, and their bytes."""

    def __init__(self) -> None:
        self.sends: list[_Send] = []
        self.bytes = 0  # bytes of sends not yet known complete
        self.peak = 0  # the most at once since the last finish()
        self.last_peak = 0  # ``peak`` of the step that finish() ended

    def add(self, send: _Send) -> None:
        self.sends.append(send)
        self.bytes += send.nbytes
        self.peak = max(self.peak, self.bytes)

    def reap(self) -> None:
        """Drop the sends that have completed (their tensors go with them)."""
        if self.sends:
            self.sends = [s for s in self.sends if not s.ready()]
            self.bytes = sum(s.nbytes for s in self.sends)

    def step_done(self) -> None:
        self.last_peak, self.peak = self.peak, self.bytes


class _Counters:
    """``held_bytes``, ``peak_held_bytes`` and ``last_peak_held_bytes`` of a transport."""

    held: _Held

    @property
    def held_bytes(self) -> int:
        """Bytes of sends not yet known complete (kept alive by the transport)."""
        return self.held.bytes

    @property
    def peak_held_bytes(self) -> int:
        """The most ``held_bytes`` at once in this step (so far)."""
        return self.held.peak

    @property
    def last_peak_held_bytes(self) -> int:
        """``peak_held_bytes`` of the last step that :meth:`finish` ended."""
        return self.held.last_peak

    def post(self, ops: Sequence[P2P]) -> list[Handle]:
        raise NotImplementedError


# ---------------------------------------------------------------------------------- in process
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
        # (group, members) -> contributions of the collective being assembled
        self.pending: dict[tuple[str, tuple[int, ...]], list[_Contribution]] = {}
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
    def __init__(self, rank: int, tensors: Sequence[Tensor]) -> None:
        self.rank = rank
        self.tensors = list(tensors)
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
        self.held.reap()
        members = self.world.members(group, self.me)
        if len(members) == 1:
            return DONE
        key = (group, members)
        parts = self.world.pending.setdefault(key, [])
        me = _Contribution(self.me, tensors)
        parts.append(me)
        self.world.collectives.setdefault(self.me, []).append(me)
        if len(parts) == len(members):
            del self.world.pending[key]
            parts.sort(key=lambda c: c.rank)  # a fixed order: deterministic sums
            for i in range(len(me.tensors)):
                total = parts[0].tensors[i].clone()
                for c in parts[1:]:
                    total += c.tensors[i].to(total.device)
                for c in parts:
                    c.tensors[i].copy_(total)
            for c in parts:
                c.done = True
        return me

    def finish(self) -> None:
        # a rank may end its step before its peers received: the mailboxes keep those messages
        self.held.reap()
        self.held.step_done()


# ---------------------------------------------------------------------------------- torch.distributed
class _Works:
    """Works of torch.distributed (and socket receives): ``ready()`` polls them without
    blocking, ``wait()`` waits for all; then rebuilds scatter-gathered buffers from their
    slices (a collective over the tensor ranks, so only in ``wait``)."""

    nbytes = 0  # what a send keeps alive (receives: nothing)

    def __init__(
        self,
        works: Sequence[Any],
        what: str,
        on_error: Callable[[BaseException, str], BaseException],
        *,
        gathers: Sequence[tuple[Tensor, Tensor]] = (),
        split: tuple[Any, int, int] | None = None,
        reap: Callable[[], None] | None = None,
    ) -> None:
        self.works, self.what, self.on_error = list(works), what, on_error
        self.gathers, self.split, self.reap = list(gathers), split, reap
        self.done = False

    def ready(self) -> bool:
        if self.reap is not None:
            self.reap()
        if self.done:
            return True
        if self.gathers:
            return False  # the all-gather blocks: wait() does it
        try:
            if not all(_completed(w) for w in self.works):
                return False
        except RuntimeError as e:
            raise self.on_error(e, self.what) from e
        self.wait()  # complete: raises a failure, if any
        return True

    def wait(self) -> None:
        if self.done:
            return
        try:
            for w in self.works:
                w.wait()
        except RuntimeError as e:
            raise self.on_error(e, self.what) from e
        if self.gathers and self.split is not None:
            import torch.distributed as dist

            group, size, _ = self.split
            for part, full in self.gathers:
                dist.all_gather(list(full.view(-1).chunk(size)), part, group=group)
        self.done = True
        self.works, self.gathers = [], []


def _completed(work: Any) -> bool:
    """A torch.distributed work, or a socket send or receive, is complete (never blocks)."""
    if hasattr(work, "is_completed"):
        return bool(work.is_completed())
    return bool(work.ready())  # a socket handle


class _DistSend(_Works):
    """A send over torch.distributed or sockets; keeps its tensors until complete."""

    def __init__(
        self,
        works: Sequence[Any],
        tensors: Sequence[Tensor],
        what: str,
        on_error: Callable[[BaseException, str], BaseException],
        pump: Callable[[], None] | None,
    ) -> None:
        super().__init__(works, what, on_error)
        self.tensors: list[Tensor] = list(tensors)
        self.nbytes = _nbytes(self.tensors)
        self.pump = pump
        self.settled: threading.Event | None = None  # set by a _Waiter watching this send
        self.error: BaseException | None = None

    def ready(self) -> bool:
        if self.settled is not None:
            if not self.settled.is_set():
                return False
            self.wait()  # at once: raises the waiter's error, if any
            return True
        if not self.done and self.pump is not None:
            self.pump()  # move queued socket bytes forward
        done = super().ready()
        if done:
            self.tensors = []
        return done

    def wait(self) -> None:
        if self.settled is not None and not self.done:
            self.settled.wait()
            if self.error is not None:
                raise self.on_error(self.error, self.what) from self.error
            self.done, self.works = True, []
        super().wait()
        self.tensors = []


class _Waiter:
    """Waits for gloo's sends to one peer in a background thread, in posting order.

    gloo's point-to-point works say they are complete only to ``wait()`` (``is_completed()``
    stays False, and they have no future), so polling cannot tell when a send's tensors may be
    released; a thread blocked in ``wait()`` can (it holds no lock while it waits).
    """

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[tuple[_DistSend, threading.Event] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=_wait_loop, args=(self.queue,), daemon=True)
        self.thread.start()
        self._end = weakref.finalize(self, self.queue.put, None)  # it ends with its waiter

    def stop(self) -> None:
        """End the thread now (once the sends it watches are done)."""
        self._end()
        self.thread.join(timeout=1.0)

    def watch(self, send: _DistSend) -> None:
        send.settled = settled = threading.Event()
        self.queue.put((send, settled))


def _wait_loop(jobs: queue.SimpleQueue[tuple[_DistSend, threading.Event] | None]) -> None:
    while (job := jobs.get()) is not None:
        send, settled = job
        try:
            for w in send.works:
                w.wait()
        except BaseException as e:  # handed to the rank's thread, which raises it
            send.error = e
        settled.set()
        del send, settled, job


class DistTransport(_Counters):
    """Point-to-point and collectives over ``torch.distributed``.

    ``ranks[r]`` is the global rank running program rank ``r``; ``groups`` maps a REDUCE group
    name to the process group this rank reduces over (``None``: a group of its own, no-op).
    ``on_error(exc, what)`` turns a communication failure into the error to raise (the pipeline
    uses it to name the rank that failed first).

    ``pairs`` maps a peer's program rank to the process group of this rank and that peer alone
    (:func:`funcpipe.distributed.world.join` creates one per pair of ranks that exchange messages): the
    layout :data:`~funcpipe.schedule.p2p.PAIR`. A group's operations with one peer are posted as
    one ``batch_isend_irecv`` on that pair's process group, even a single one: ProcessGroupNCCL
    runs a batch on the group's own communicator, while a lone ``isend``/``irecv`` may get a
    second, lazily created communicator for the pair, and the two would not match each other.
    A group with several peers is one batch per peer. Without ``pairs`` every peer is reached
    over the default process group (one communicator for all ranks: right in a world of two
    processes, and what tests of hand-posted groups use; ``layout`` is then ``None``).
    Sends to a peer reached over ``channels`` (:class:`funcpipe.runtime.sockets.Channels`, CPU
    tensors) are queued at once with the group's receives: sockets buffer, they need no
    rendezvous.

    ``split=(group, size, coord)`` turns on scatter-gather for tensor-parallel program ranks:
    a message's tensors are the same on every rank of ``group`` (replicated activations and
    their gradients), so each of them sends only its ``1/size`` slice to its peer with the same
    coordinate, and the receivers all-gather the slices. Point-to-point bytes drop by ``size``.
    ``bytes_sent`` counts what this rank handed to point-to-point sends.

    ``all_reduce`` posts one all-reduce per bucket of its tensors (:mod:`funcpipe.runtime.buckets`:
    same dtype and device, up to 25 MiB, in the order given) and copies the sums back into them
    when it completes; a tensor alone is reduced in place.

    ``strict=True`` (for tests) adds NCCL's rules (:mod:`funcpipe.runtime.nccl_rules`) on top: the
    messages still travel over gloo or sockets, but a handle is done only once its group has
    completed under the rules, each rank publishing its side of every queue in ``store`` (default:
    the process group's) under ``key`` (default: a fresh key, the same on every process that
    builds its transports in the same order). A deadlock raises :class:`CommunicationError`
    naming the ranks and operations within about a second; ``timeout`` bounds other waits.
    """

    def __init__(
        self,
        rank: int,
        ranks: Sequence[int],
        *,
        groups: Mapping[str, Any] | None = None,
        on_error: Callable[[BaseException, str], BaseException] | None = None,
        split: tuple[Any, int, int] | None = None,
        channels: Any = None,
        pairs: Mapping[int, Any] | None = None,
        strict: bool = False,
        store: Any = None,
        key: str | None = None,
        timeout: float = 1800.0,
    ) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.pairs = dict(pairs) if pairs is not None else None
        self.layout: str | None = PAIR if pairs is not None else None
        self.channels = channels  # sockets.Channels to some peers (CPU tensors only), or None
        self.rank = rank
        self.ranks = list(ranks)
        self.groups = dict(groups or {})
        self.on_error = on_error or (lambda e, what: CommunicationError(f"{what}: {e}"))
        self.held = _Held()
        self.split = split if split is not None and split[1] > 1 else None
        self.bytes_sent = 0
        # gloo's works say they are complete only to wait(): a thread per peer waits for them
        self.gloo = "gloo" in str(dist.get_backend()) if dist.is_initialized() else False
        self.waiters: dict[int, _Waiter] = {}  # peer -> waiter of gloo sends to it
        self.strict: nccl_rules.Shared | None = None
        if strict:
            if store is None:
                store = dist.distributed_c10d._get_default_store()
            if key is None:
                _STRICT_KEYS[0] += 1
                key = f"funcpipe/strict-transport/{_STRICT_KEYS[0]}"
            keys = [f"{key}/{g}" for g in self.ranks]
            self.strict = nccl_rules.Shared(rank, store, keys, timeout=timeout)

    def _pump(self) -> Callable[[], None] | None:
        return self.channels.progress if self.channels is not None else None

    def _slice(self, t: Tensor) -> Tensor | None:
        """This rank's slice of ``t`` under scatter-gather (None: send it whole)."""
        if self.split is None or t.numel() % self.split[1]:
            return None
        _, size, coord = self.split
        return t.contiguous().view(-1).chunk(size)[coord]

    def _socket(self, peer: int, tensors: Sequence[Tensor]) -> bool:
        return (
            self.channels is not None
            and self.channels.has(peer)
            and all(t.device.type == "cpu" for t in tensors)
        )

    def post(self, ops: Sequence[P2P]) -> list[Handle]:
        self.held.reap()
        if not ops:
            return []
        parts = by_peer(ops)
        if parts is not None:  # one batch per peer: a batch is one process group's
            return post_by_peer(ops, parts, self._post)
        return self._post(ops)

    def _post(self, ops: Sequence[P2P]) -> list[Handle]:
        """Post ``ops`` (all with one peer) as one batch."""
        dist = self.dist
        group = None
        if self.strict is not None:
            group = self.strict.post([(op.op, op.peer, op.label) for op in ops])
        # per op: (what it moves, works it waits for, scatter-gather pairs)
        plans: list[tuple[list[Tensor], list[Any], list[tuple[Tensor, Tensor]]]] = []
        batch: list[tuple[int, Any, Tensor, int]] = []  # (op index, isend/irecv, tensor, peer)
        for k, op in enumerate(ops):
            other = self.ranks[op.peer]
            moved: list[Tensor] = []
            gathers: list[tuple[Tensor, Tensor]] = []
            for t in op.tensors:
                part = self._slice(t)
                if op.op == SEND:
                    moved.append(t.contiguous() if part is None else part.clone())
                elif part is None:
                    moved.append(t)
                else:
                    moved.append(torch.empty_like(part))
                    gathers.append((moved[-1], t))
            works: list[Any] = []
            if self._socket(other, moved):
                if op.op == SEND:
                    works = [self.channels.send(t, other, self._what(op)) for t in moved]
                else:
                    works = [self.channels.recv(moved, other, self._what(op))]
            else:
                fn = dist.isend if op.op == SEND else dist.irecv
                batch.extend((k, fn, t, other) for t in moved)
            if op.op == SEND:
                self.bytes_sent += _nbytes(moved)
            plans.append((moved, works, gathers))
        if batch:
            # always a batch, on the pair's process group: never split across communicators
            pg = None if self.pairs is None else self.pairs[ops[0].peer]
            got = dist.batch_isend_irecv([dist.P2POp(fn, t, p, pg) for _, fn, t, p in batch])
            if len(got) == len(batch):
                for (k, *_), w in zip(batch, got, strict=True):
                    plans[k][1].append(w)
            else:  # one work for the whole group (NCCL's coalesced batch)
                for k in {k for k, *_ in batch}:
                    plans[k][1].extend(got)
        handles: list[Handle] = []
        pump = self._pump()
        for op, (moved, works, gathers) in zip(ops, plans, strict=True):
            what = self._what(op)
            h: _Works | _StrictDist
            if op.op == SEND:
                h = _DistSend(works, moved, what, self.on_error, pump)
                gloo = self.gloo and all(t.device.type == "cpu" for t in moved)
                if works and gloo and not self._socket(self.ranks[op.peer], moved):
                    waiter = self.waiters.get(op.peer)
                    if waiter is None:
                        waiter = self.waiters[op.peer] = _Waiter()
                    waiter.watch(h)
            else:
                h = _Works(
                    works,
                    what,
                    self.on_error,
                    gathers=gathers,
                    split=self.split,
                    reap=self.held.reap,
                )
            if self.strict is not None and group is not None:
                h = _StrictDist(h, self.strict, group, pump)
            if op.op == SEND:
                self.held.add(h)
            handles.append(h)
        return handles

    def _what(self, op: P2P) -> str:
        way = "send to" if op.op == SEND else "receive from"
        return f"rank {self.rank}: {way} rank {op.peer}" + (f" ({op.label})" if op.label else "")

    def all_reduce(self, tensors: Sequence[Tensor], group: str) -> Handle:
        self.held.reap()
        pg = self.groups.get(group)
        if pg is None:
            return DONE
        # one all-reduce per bucket of same-dtype tensors (funcpipe.runtime.buckets), in the
        # order given: every rank of the group forms the same buckets from the same leaves
        parts = buckets.buckets(tensors)
        works = [self.dist.all_reduce(b.flat, group=pg, async_op=True) for b in parts]
        done: Handle = _Works(
            works, f"rank {self.rank}: REDUCE over group {group!r}", self.on_error
        )
        if self.strict is not None:
            done = _StrictCollective(done, works, self.strict, self._pump())
        if all(b.flat is b.tensors[0] for b in parts):
            return done  # reduced in place
        return _Unflatten(done, parts)

    def finish(self) -> None:
        """Wait for this step's sends (a rank's last sends may still be in flight)."""
        if self.strict is not None:
            self.strict.wait(None, f"rank {self.rank}: the step's last messages", self._pump())
        if self.channels is not None:
            self.channels.flush(f"rank {self.rank}: send")
        for send in self.held.sends:
            send.wait()
        self.held.reap()
        self.held.step_done()

    def close(self) -> None:
        """Stop the waiter threads and close the sockets (after the last step, with nothing in
        flight). Dropping the transport does the same, later."""
        waiters, self.waiters = list(self.waiters.values()), {}
        for w in waiters:
            w.stop()
        if self.channels is not None:
            self.channels.close()
        # a process group's threads and connections end with its last reference
        self.groups, self.split = {}, None
        if self.pairs is not None:
            self.pairs = {}


class _Unflatten:
    """A bucketed all-reduce: once it is complete, its buffers are copied back into the
    tensors they were flattened from (once)."""

    def __init__(self, inner: Handle, parts: Sequence[buckets.Bucket]) -> None:
        self.inner, self.parts = inner, list(parts)

    def ready(self) -> bool:
        if not self.inner.ready():
            return False
        self._copy_back()
        return True

    def wait(self) -> None:
        self.inner.wait()
        self._copy_back()

    def _copy_back(self) -> None:
        for b in self.parts:
            b.unflatten()
        self.parts = []  # done; the buffers are freed


class _StrictCollective:
    """A collective of a strict :class:`DistTransport`: waiting for it keeps this rank's side of
    the point-to-point queues moving (NCCL's streams progress while the host waits; a rank
    blocked in gloo's wait would stall its peers' groups, and so itself)."""

    def __init__(self, inner: Any, works: Sequence[Any], shared: Any, pump: Any) -> None:
        self.inner, self.works, self.shared, self.pump = inner, list(works), shared, pump

    def ready(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        pause = 0.0005
        while not self.ready():
            if self.pump is not None:
                self.pump()
            self.shared.progress()
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        self.inner.wait()


_STRICT_KEYS = [0]  # strict transports built by this process (their default store keys)


class _StrictDist:
    """A handle of a strict :class:`DistTransport`: done once its group has completed under
    NCCL's rules and its own message has moved."""

    def __init__(
        self,
        inner: _Works,
        shared: nccl_rules.Shared,
        group: nccl_rules.Group,
        pump: Callable[[], None] | None,
    ) -> None:
        self.inner, self.shared, self.group, self.pump = inner, shared, group, pump
        self.nbytes = inner.nbytes

    def ready(self) -> bool:
        if not self.group.complete:
            if self.pump is not None:
                self.pump()
            self.shared.progress()
            if not self.group.complete:
                return False
        return self.inner.ready()

    def wait(self) -> None:
        self.shared.wait(self.group, self.inner.what, self.pump)
        self.inner.wait()
