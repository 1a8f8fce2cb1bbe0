"""The collectives a traced step's stages call, timed: what an overlapped pair shows in flight.

:func:`traced` collects, while a traced step runs, ``(name, start, end)`` of every collective
over a mesh axis (:mod:`funcpipe.parallel.collectives` wraps each in :func:`timed`), from any
thread (an overlapped pair's two), on the step's clock (:mod:`funcpipe.runtime.clock`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["timed", "traced"]

Sink = list[tuple[str, Any, Any]]
_SINKS: list[tuple[Sink, Callable[[], Any]]] = []  # the traced steps running in this process


@contextlib.contextmanager
def traced(sink: Sink, stamp: Callable[[], Any]) -> Iterator[None]:
    """While active, each :func:`timed` call appends ``(name, start, end)`` to ``sink``, its
    times from ``stamp``."""
    entry = (sink, stamp)
    _SINKS.append(entry)
    try:
        yield
    finally:
        _SINKS.remove(entry)


_OFF = contextlib.nullcontext()  # (no step traced: one shared no-op, nothing made per call)


def timed(kind: str, phase: str, axis: Any) -> contextlib.AbstractContextManager[Any]:
    """Time the collective inside (``kind`` over ``axis``, in the ``phase`` direction) into the
    innermost traced step's sink; nothing when no step is traced."""
    return _timing(kind, phase, axis) if _SINKS else _OFF


@contextlib.contextmanager
def _timing(kind: str, phase: str, axis: Any) -> Iterator[None]:
    sink, stamp = _SINKS[-1]
    start = stamp()
    try:
        yield
    finally:
        sink.append((f"{kind} {axis.name} ({phase})", start, stamp()))
