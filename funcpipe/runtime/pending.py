"""Collectives in flight on one rank, and what to do once each is complete.

The interpreter (:mod:`funcpipe.runtime.interpreter`) is a generator of waits: :func:`wait_for`
yields a handle that is not ready (so the driver can run other ranks, or block on it) before
waiting for it. A :class:`Pending` pairs a collective's handle with its callback (copy the
gathered values in, average the reduced sums, add a reduce-scatter's segment into the
pieces) and runs the callback exactly once: when a later instruction needs the result
(:meth:`Pending.finish`, which may wait) or as soon as the collective is complete
(:meth:`Pending.poll`, which never waits: ZeRO-2's packed gradients go as soon as they can).
Once done it lets go of the handle and the callback, and with them the buffers they hold,
although the step keeps every pending to its end.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

from funcpipe.runtime.transport_common import DONE, Handle

__all__ = ["Pending", "wait_for"]


def wait_for(handle: Handle) -> Generator[Handle, None, None]:
    """Wait for ``handle``, first yielding it to the driver if it is not ready."""
    if not handle.ready():
        yield handle
        handle.wait()


class Pending:
    """A collective in flight and what to do once it is complete (exactly once)."""

    def __init__(self, handle: Handle, done: Callable[[], None]) -> None:
        self.handle, self.done, self.finished = handle, done, False

    def finish(self) -> Generator[Handle, None, None]:
        """Wait for the collective (yielding to the driver) and run the callback."""
        if not self.finished:
            yield from wait_for(self.handle)
            self._close()

    def poll(self) -> bool:
        """Run the callback if the collective is complete (never waits); whether it is."""
        if not self.finished and self.handle.ready():
            self.handle.wait()
            self._close()
        return self.finished

    def _close(self) -> None:
        self.done()
        self.handle, self.done, self.finished = DONE, _nothing, True


def _nothing() -> None:
    pass
