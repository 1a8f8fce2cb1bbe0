"""Clocks for a traced step: when each instruction starts and ends, on CPU and on CUDA.

A traced step takes two timestamps per instruction (start, end) and turns them into seconds
once, at the end of the step:

* on the CPU (and the meta device) a timestamp is ``time.perf_counter()``: the work is done
  when the call returns, so the host's clock times it. Resolving is the identity.
* on CUDA a call returns as soon as its kernels are queued; ``perf_counter`` would time the
  launches. A :class:`CudaClock` records a ``torch.cuda.Event`` (``enable_timing=True``) on the
  device's current stream at each timestamp instead, without synchronising, and resolves them
  at the end: one wait for the last event, then ``anchor.elapsed_time(event)`` for each. The
  anchor is an event recorded when the clock is made, right after a ``synchronize`` (the stream
  is idle, so it fires as it is recorded) and paired with a ``perf_counter`` reading; every
  event's time is that reading plus its distance from the anchor.

Both give seconds on the host's ``perf_counter`` scale, so the timelines of ranks in one
process, or in processes of one machine, merge as they are (:func:`funcpipe.distributed.world.gather_times`
moves those of other machines through the wall clock). An instruction's interval means the same
on both: from when its inputs are in and the work queued before it is done, to when its own work
is done. A traced CUDA step synchronises twice (when its clock is made and when it is
resolved); an untraced step never does.

:func:`timer` is the clock for timing a few calls in isolation (profiling): it synchronises the
device before reading the host's clock.
"""

from __future__ import annotations

from collections.abc import Callable
from time import perf_counter
from typing import Any, Protocol

import torch

__all__ = ["Clock", "CudaClock", "HostClock", "step_clock", "timer"]


class Clock(Protocol):
    """Takes cheap timestamps during a step and turns them into seconds after it."""

    def stamp(self) -> Any:
        """A timestamp of now (what :meth:`resolve` reads)."""
        ...

    def resolve(self, stamps: list[Any]) -> list[float]:
        """The stamps as ``perf_counter`` seconds, in order (waits for the device once)."""
        ...


class HostClock:
    """``time.perf_counter``: stamps are already seconds."""

    __slots__ = ()

    stamp = staticmethod(perf_counter)  # as cheap as calling perf_counter itself

    def resolve(self, stamps: list[Any]) -> list[float]:
        return stamps

    def __repr__(self) -> str:
        return "HostClock()"


class CudaClock:
    """CUDA events on ``device``'s current stream (the stream current when the clock is made),
    anchored to ``perf_counter``. Making one synchronises the device."""

    __slots__ = ("anchor", "device", "origin", "stream")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.current_stream(device)
        torch.cuda.synchronize(device)  # the stream is idle: the anchor fires as it is recorded
        self.anchor = self.stamp()
        self.origin = perf_counter()

    def stamp(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def resolve(self, stamps: list[Any]) -> list[float]:
        if not stamps:
            return []
        stamps[-1].synchronize()  # one stream: the last event done means all of them are
        a, t0 = self.anchor, self.origin
        return [t0 + a.elapsed_time(e) / 1e3 for e in stamps]  # elapsed_time: milliseconds

    def __repr__(self) -> str:
        return f"CudaClock({str(self.device)!r})"


def step_clock(device: torch.device | str | None) -> Clock:
    """The clock for a step whose work runs on ``device``: a :class:`CudaClock` on CUDA, the
    :class:`HostClock` on anything else (CPU, meta, ``None``)."""
    if device is not None and torch.device(device).type == "cuda":
        return CudaClock(torch.device(device))
    return _HOST


def timer(device: torch.device | str | None) -> Callable[[], float]:
    """A clock for timing calls one at a time on ``device``: ``perf_counter``, after waiting for
    the device's queued work when it is a CUDA device."""
    if device is None or torch.device(device).type != "cuda":
        return perf_counter
    dev = torch.device(device)

    def now() -> float:
        torch.cuda.synchronize(dev)
        return perf_counter()

    return now


_HOST = HostClock()
