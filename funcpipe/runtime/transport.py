"""Transports: how the interpreter moves tensors between ranks.

Two implementations of one small interface:

- :class:`LocalWorld` / :class:`LocalTransport`: every rank in this process. Messages go through
  per-pair FIFO mailboxes and are copied into the receiver's buffers, exactly as over a wire.
- :class:`DistTransport`: ``torch.distributed`` point-to-point (gloo on CPU, NCCL on CUDA) and
  collectives over named process groups; CPU messages between processes of one host can go
  over :class:`funcpipe.runtime.sockets.Channels` instead (measured 7-18 us per message against 0.13-2 ms for gloo).

Receives fill buffers the receiver allocated from its own shape inference: no metadata and no
pickled objects travel, only tensors.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from funcpipe.errors import CommunicationError, InvalidArgument

__all__ = ["DistTransport", "Handle", "LocalTransport", "LocalWorld", "Transport"]

Tensor = torch.Tensor


class Handle(Protocol):
    """An operation in flight: ``ready()`` without blocking, ``wait()`` until it completes."""

    def ready(self) -> bool: ...

    def wait(self) -> None: ...


class Transport(Protocol):
    """What the interpreter needs from a transport (``rank`` is the rank in the program)."""

    rank: int

    def send(self, tensors: Sequence[Tensor], peer: int) -> None: ...

    def recv(self, buffers: Sequence[Tensor], peer: int) -> Handle: ...

    def all_reduce(self, tensors: Sequence[Tensor], group: str) -> Handle: ...

    def finish(self) -> None: ...


class _Done:
    def ready(self) -> bool:
        return True

    def wait(self) -> None:
        return None


DONE = _Done()


# ---------------------------------------------------------------------------------- in process
class LocalWorld:
    """Shared state of ``size`` ranks living in one process (mailboxes and collectives).

    ``groups`` names collectives: ``{"data": [[0, 2], [1, 3]], "tie:wte": [[0, 1]]}`` — each name
    maps to disjoint lists of ranks; a rank reducing over ``name`` meets the others of its list.
    """

    def __init__(self, size: int, *, groups: Mapping[str, Sequence[Sequence[int]]] | None = None):
        if not isinstance(size, int) or size < 1:
            raise InvalidArgument(f"LocalWorld(size={size!r}): size is the number of ranks, >= 1")
        self.size = size
        self.mail: dict[tuple[int, int], deque[list[Tensor]]] = {}
        self.groups: dict[str, dict[int, tuple[int, ...]]] = {}
        for name, lists in (groups or {}).items():
            members: dict[int, tuple[int, ...]] = {}
            for ranks in lists:
                for r in ranks:
                    members[r] = tuple(ranks)
            self.groups[name] = members
        # (group, members) -> contributions of the collective being assembled
        self.pending: dict[tuple[str, tuple[int, ...]], list[_Contribution]] = {}

    def transport(self, rank: int, ranks: Sequence[int] | None = None) -> LocalTransport:
        """The transport of program rank ``rank``; ``ranks[r]`` is the world rank of program
        rank ``r`` (default: the identity, one program filling the world)."""
        return LocalTransport(self, rank, ranks)

    def members(self, group: str, rank: int) -> tuple[int, ...]:
        try:
            return self.groups[group][rank]
        except KeyError:
            return (rank,)  # a group this rank shares with no one: a local no-op


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


class _LocalRecv:
    def __init__(self, world: LocalWorld, src: int, dst: int, buffers: Sequence[Tensor]) -> None:
        self.box = world.mail.setdefault((src, dst), deque())
        self.src, self.dst, self.buffers = src, dst, list(buffers)
        self.done = False

    def ready(self) -> bool:
        if not self.done and self.box:
            tensors = self.box.popleft()
            if len(tensors) != len(self.buffers) or any(
                t.shape != b.shape or t.dtype != b.dtype
                for t, b in zip(tensors, self.buffers, strict=False)
            ):
                raise CommunicationError(
                    f"rank {self.dst} expected from rank {self.src} tensors "
                    f"{[(tuple(b.shape), b.dtype) for b in self.buffers]} but got "
                    f"{[(tuple(t.shape), t.dtype) for t in tensors]}"
                )
            for b, t in zip(self.buffers, tensors, strict=True):
                b.copy_(t)
            self.done = True
        return self.done

    def wait(self) -> None:
        if not self.ready():
            raise CommunicationError(
                f"rank {self.dst} waits for a message from rank {self.src} that was never sent"
            )


class LocalTransport:
    """One rank's view of a :class:`LocalWorld` (``rank`` in the program, ``ranks`` to the world)."""

    def __init__(self, world: LocalWorld, rank: int, ranks: Sequence[int] | None = None) -> None:
        self.world, self.rank = world, rank
        self.ranks = list(ranks) if ranks is not None else list(range(world.size))
        self.me = self.ranks[rank]

    def send(self, tensors: Sequence[Tensor], peer: int) -> None:
        box = self.world.mail.setdefault((self.me, self.ranks[peer]), deque())
        box.append([t.detach() for t in tensors])

    def recv(self, buffers: Sequence[Tensor], peer: int) -> Handle:
        return _LocalRecv(self.world, self.ranks[peer], self.me, buffers)

    def all_reduce(self, tensors: Sequence[Tensor], group: str) -> Handle:
        members = self.world.members(group, self.me)
        if len(members) == 1:
            return DONE
        key = (group, members)
        parts = self.world.pending.setdefault(key, [])
        me = _Contribution(self.me, tensors)
        parts.append(me)
        if len(parts) == len(members):
            del self.world.pending[key]
            parts.sort(key=lambda c: c.rank)  # a fixed order: deterministic sums
            for i in range(len(me.tensors)):
                total = parts[0].tensors[i].clone()
                for c in parts[1:]:
                    total += c.tensors[i]
                for c in parts:
                    c.tensors[i].copy_(total)
            for c in parts:
                c.done = True
        return me

    def finish(self) -> None:
        return None


# ---------------------------------------------------------------------------------- torch.distributed
class _Work:
    def __init__(
        self,
        work: Any,
        describe: Callable[[], str],
        on_error: Callable[[BaseException, str], BaseException],
    ):
        self.work, self.describe, self.on_error = work, describe, on_error
        self.done = False

    def ready(self) -> bool:
        return self.done

    def wait(self) -> None:
        if self.done:
            return
        try:
            self.work.wait()
        except RuntimeError as e:
            raise self.on_error(e, self.describe()) from e
        self.done = True


class DistTransport:
    """Point-to-point and collectives over ``torch.distributed``.

    ``ranks[r]`` is the global rank running program rank ``r``; ``groups`` maps a REDUCE group
    name to the process group this rank reduces over (``None``: a group of its own, no-op).
    ``on_error(exc, what)`` turns a communication failure into the error to raise (the pipeline
    uses it to name the rank that failed first).

    ``split=(group, size, coord)`` turns on scatter-gather for tensor-parallel program ranks:
    a message's tensors are the same on every rank of ``group`` (replicated activations and
    their gradients), so each of them sends only its ``1/size`` slice to its peer with the same
    coordinate, and the receivers all-gather the slices. Point-to-point bytes drop by ``size``.
    ``bytes_sent`` counts what this rank handed to point-to-point sends.
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
    ) -> None:
        import torch.distributed as dist

        self.dist = dist
        self.channels = channels  # sockets.Channels to some peers (CPU tensors only), or None
        self.rank = rank
        self.ranks = list(ranks)
        self.groups = dict(groups or {})
        self.on_error = on_error or (lambda e, what: CommunicationError(f"{what}: {e}"))
        self.sends: list[Any] = []
        self.split = split if split is not None and split[1] > 1 else None
        self.bytes_sent = 0

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

    def send(self, tensors: Sequence[Tensor], peer: int) -> None:
        dst = self.ranks[peer]
        outs = []
        for t in tensors:
            part = self._slice(t)
            out = t.contiguous() if part is None else part.clone()
            self.bytes_sent += out.numel() * out.element_size()
            outs.append(out)
        if self._socket(dst, outs):
            for out in outs:
                self.channels.send(out, dst)
            return
        for out in outs:
            self.sends.append((self.dist.isend(out, dst), out))

    def recv(self, buffers: Sequence[Tensor], peer: int) -> Handle:
        src = self.ranks[peer]
        what = f"rank {self.rank}: receive from rank {peer}"
        targets, gathers = [], []
        for b in buffers:
            part = self._slice(b)
            if part is None:
                targets.append(b)
            else:
                tmp = torch.empty_like(part)
                targets.append(tmp)
                gathers.append((tmp, b))
        if self._socket(src, targets):
            works: list[Any] = [self.channels.recv(targets, src, what)]
            if not gathers:
                return works[0]
        else:
            works = [self.dist.irecv(t, src) for t in targets]
        return _Work(_All(works, gathers, self.split), lambda: what, self.on_error)

    def all_reduce(self, tensors: Sequence[Tensor], group: str) -> Handle:
        pg = self.groups.get(group)
        if pg is None:
            return DONE
        works = [self.dist.all_reduce(t, group=pg, async_op=True) for t in tensors]
        return _Work(
            _All(works), lambda: f"rank {self.rank}: REDUCE over group {group!r}", self.on_error
        )

    def finish(self) -> None:
        if self.channels is not None:
            self.channels.flush(f"rank {self.rank}: send")
        sends, self.sends = self.sends, []
        for work, _ in sends:
            try:
                work.wait()
            except RuntimeError as e:
                raise self.on_error(e, f"rank {self.rank}: send") from e


class _All:
    """Wait for every work; then rebuild scatter-gathered buffers from their slices."""

    def __init__(
        self,
        works: Sequence[Any],
        gathers: Sequence[tuple[Tensor, Tensor]] = (),
        split: tuple[Any, int, int] | None = None,
    ) -> None:
        self.works, self.gathers, self.split = list(works), list(gathers), split

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        if self.gathers and self.split is not None:
            import torch.distributed as dist

            group, size, _ = self.split
            for part, full in self.gathers:
                dist.all_gather(list(full.view(-1).chunk(size)), part, group=group)
