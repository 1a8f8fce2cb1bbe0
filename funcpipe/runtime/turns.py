"""Turns: how an overlapped pair's two halves share a rank, one computing while the other's
collective is in flight.

The forward half runs on the rank's thread, the backward half on a second one; they take turns,
and only the half whose turn it is runs. A half gives the turn away only at a collective over a
mesh axis (:func:`complete`, which :mod:`funcpipe.parallel.collectives` calls for each): it
issues the collective without waiting (``async_op=True``), lets the other half run until that
one issues a collective of its own or ends, and then waits for its own. So the forward's all-
to-all moves while the backward computes, and the other way round; on CUDA an asynchronous
collective runs on its process group's own NCCL stream, after an event wait on the stream that
produced its input, and ``wait()`` makes the compute stream, not the host, wait for it: the
other half's kernels are queued between the two.

The order of the calls is fixed by the program: the backward runs until its first collective,
then the forward until its first, then the backward until its second, and so on; once a half
has ended, the other runs alone. The backward goes first because its inputs are in when the
pair starts, while the forward's may still be arriving (a RECV in flight): the forward waits
for them in its own first turn, after the backward's first piece. Every rank of one in-stage
communicator (a tensor, expert or data group) is a copy of one pipeline rank: it runs the same program and the same stages, so
it issues the same calls in the same order, on one process group per axis; nothing depends on
how the two threads are timed, and NCCL's rule (one order of calls per communicator) holds.

Random numbers: a half saves torch's generators (the CPU's and the device's) when it gives the
turn and puts them back when it gets it again, so each half draws the numbers it draws alone
(a ``torch.utils.checkpoint`` recomputing dropout in the backward, a forward under its key),
whatever the other half drew in between.

Faults: a half that raises ends, and the other stops at its next collective
(:class:`OtherHalfFailed`), issuing nothing more. Its peers still call what follows in the
program's order, and the calls of this rank's surviving half would meet other calls of theirs
on the same group (on gloo a size mismatch aborts the peer's process; on NCCL a wrong match or a
hang): so no call is issued past the fault, and the peers' waits end when this rank's error
stops the step (its process groups closed) or at their timeout, as for a fault outside a pair.

Which half calls a collective is the thread it is called on: the rank's thread is the
forward's; any other (the second thread, or on CUDA autograd's thread for the device, where the
backward's nodes run) is the backward's. A call from the half that does not hold the turn (a
forward that runs a backward of its own on a GPU) waits where it is called, as outside a pair.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["OtherHalfFailed", "Turns", "active", "complete", "running", "together"]

T = TypeVar("T")

_ACTIVE: list[Turns] = []  # the pair running in this process (one at a time)


class OtherHalfFailed(RuntimeError):
    """Raised in a half at its next collective once the other half of its pair raised: it
    issues nothing more (module docstring, "Faults"); the other half's error is the one raised."""


class Turns:
    """The turns of one pair's two halves (module docstring): the backward holds the first."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cv = threading.Condition()
        self._forward_thread = threading.get_ident()
        self._holder = "B"
        self._ended: set[str] = set()
        self._failed: str | None = None  # the half that raised
        self.handovers = 0  # how often the turn changed hands at a collective

    def _mine(self) -> str:
        return "F" if threading.get_ident() == self._forward_thread else "B"

    def take(self, half: str) -> None:
        """Wait until ``half`` ("F" or "B") holds the turn (the other gave it or ended)."""
        with self._cv:
            self._cv.wait_for(lambda: self._holder == half)

    def hand_over(self) -> None:
        """From the half holding the turn, at a collective it issued: let the other half run
        until it issues one or ends, then carry on. Nothing where the other half has ended, or
        where the caller does not hold the turn."""
        half = self._mine()
        other = "B" if half == "F" else "F"
        with self._cv:
            if self._holder != half or other in self._ended:
                return
            rng = self._rng()
            self._holder = other
            self.handovers += 1
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._holder == half)
        torch.set_rng_state(rng[0])
        if len(rng) > 1:
            torch.cuda.set_rng_state(rng[1], self._device)

    def _rng(self) -> tuple[torch.Tensor, ...]:
        if self._device.type == "cuda":
            return torch.get_rng_state(), torch.cuda.get_rng_state(self._device)
        return (torch.get_rng_state(),)

    def check(self) -> None:
        """Before a collective is issued: raise :class:`OtherHalfFailed` if the other half
        raised (this rank's peers will not see that half's calls, so this half's next one
        would meet another call of theirs on the same group)."""
        failed = self._failed
        if failed is not None and failed != self._mine():
            name = "forward" if failed == "F" else "backward"
            raise OtherHalfFailed(f"the {name} of this overlapped pair raised: this half stops")

    def end(self, half: str, failed: bool = False) -> None:
        """``half`` ended (returned, or raised: ``failed``): the other runs alone from here."""
        with self._cv:
            if failed and self._failed is None:
                self._failed = half
            self._ended.add(half)
            if self._holder == half:
                self._holder = "B" if half == "F" else "F"
            self._cv.notify_all()


def active() -> Turns | None:
    """The pair running in this process, or None."""
    return _ACTIVE[-1] if _ACTIVE else None


class running:
    """``with running(turns):`` the pair's turns are the process's while it runs."""

    def __init__(self, turns: Turns) -> None:
        self.turns = turns

    def __enter__(self) -> Turns:
        _ACTIVE.append(self.turns)
        return self.turns

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self.turns)


def complete(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Run one ``torch.distributed`` call to its end: in a pair, issued asynchronously
    (``async_op=True``; it returns a work, or a list of them) with the turn handed to the other
    half until then (module docstring); else as a blocking call. Inside a pair every call of a
    communicator is thus asynchronous, so on CUDA all of them run on its one NCCL stream, in
    issue order."""
    turns = active()
    if turns is None:
        call(*args, **kwargs)
        return
    turns.check()
    works = call(*args, async_op=True, **kwargs)
    turns.hand_over()
    for work in works if isinstance(works, list) else [works]:
        work.wait()


def together(forward: Callable[[], Any], backward: Callable[[], T], device: torch.device) -> T:
    """Run ``backward()`` on a second thread and ``forward()`` on this one, taking turns at
    their collectives (module docstring; the backward first), and return what ``backward``
    returned once both ended. An exception ends its half, and the other half stops at its next
    collective (:class:`OtherHalfFailed`); it is raised here once both ended (the first half's
    to raise, not the :class:`OtherHalfFailed` it caused)."""
    turns = Turns(device)
    out: dict[str, Any] = {}

    def second() -> None:
        try:
            out["value"] = backward()
        except BaseException as e:  # (raised on the calling thread, after the forward)
            out["B"] = e
        finally:
            turns.end("B", failed="B" in out)

    helper = threading.Thread(target=second, name="funcpipe-pair-backward", daemon=True)
    with running(turns):
        helper.start()
        try:
            turns.take("F")
            forward()
        except BaseException as e:
            out["F"] = e
        finally:
            turns.end("F", failed="F" in out)
            helper.join()
    errors = [out[h] for h in ("F", "B") if h in out]
    if errors:
        raise next((e for e in errors if not isinstance(e, OtherHalfFailed)), errors[0])
    return out["value"]
