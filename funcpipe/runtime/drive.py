"""Drivers: how a rank's generator of waits (:func:`funcpipe.runtime.interpreter.run_rank`) is
run. Over processes, each wait blocks; in one process, every rank runs in this thread and the
driver switches to another rank whenever one has to wait."""

from __future__ import annotations

from collections.abc import Generator, Mapping

from funcpipe.errors import CommunicationError
from funcpipe.runtime.interpreter import RankResult
from funcpipe.runtime.transport import Handle

__all__ = ["drive", "drive_local"]


def drive_local(gens: Mapping[int, Generator[Handle, None, RankResult]]) -> dict[int, RankResult]:
    """Run every rank's generator in this thread, switching ranks whenever one has to wait."""
    waiting: dict[int, Handle | None] = dict.fromkeys(gens)
    results: dict[int, RankResult] = {}
    while len(results) < len(gens):
        progressed = False
        for r, gen in gens.items():
            if r in results:
                continue
            h = waiting[r]
            if h is not None and not h.ready():
                continue
            progressed = True
            try:
                waiting[r] = next(gen)
            except StopIteration as stop:
                results[r] = stop.value
        if not progressed:
            blocked = sorted(r for r in gens if r not in results)
            raise CommunicationError(
                f"ranks {blocked} all wait for data that no rank will send (a deadlock the "
                "checker did not see; please report this with the program)"
            )
    return results


def drive(gen: Generator[Handle, None, RankResult]) -> RankResult:
    """Run one rank's generator, blocking on each wait."""
    try:
        h = next(gen)
        while True:
            h.wait()
            h = gen.send(None)
    except StopIteration as stop:
        return stop.value
