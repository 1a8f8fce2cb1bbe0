"""What every transport shares: the interface the interpreter posts through and the
bookkeeping of the sends a transport keeps.

:class:`P2P` (one point-to-point operation), :class:`Handle` (an operation in flight) and
:class:`Transport` (what the interpreter needs) are the interface;
:func:`by_peer` / :func:`post_by_peer` split a group into the batches the pair layout
(:data:`funcpipe.schedule.p2p.PAIR`) posts; ``_Held`` and ``_Counters`` keep a send until it is
known complete and count its bytes (``held_bytes``, ``peak_held_bytes``). The two
implementations are :mod:`funcpipe.runtime.transport_local` and
:mod:`funcpipe.runtime.transport_dist`; :mod:`funcpipe.runtime.transport` names them all.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from funcpipe.errors import InvalidArgument
from funcpipe.runtime import nccl_rules

__all__ = [
    "DONE",
    "P2P",
    "RECV",
    "SEND",
    "STRICT_ENV",
    "Handle",
    "Transport",
    "by_peer",
    "post_by_peer",
    "strict_from_env",
]

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
    blocking: bool  # a handle's wait blocks the thread (over processes), or the driver switches

    def post(self, ops: Sequence[P2P]) -> list[Handle]: ...

    def all_reduce(self, tensors: Sequence[Tensor], group: str) -> Handle: ...

    def reduce_scatter(
        self, inputs: Sequence[Tensor], outputs: Sequence[Tensor], group: str
    ) -> Handle: ...

    def all_gather(
        self, inputs: Sequence[Tensor], outputs: Sequence[Tensor], group: str
    ) -> Handle: ...

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
