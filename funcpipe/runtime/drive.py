"""Drivers: how a rank's generator of waits (:func:`funcpipe.runtime.interpreter.run_rank`) is
run. Over processes, each wait blocks; in one process, every rank runs in this thread and the
driver switches to another rank whenever one has to wait."""

from __future__ import annotations

from collections.abc import Generator, Mapping

from funcpipe.errors import CommunicationError
from funcpipe.runtime.nccl_rules import RULES
from funcpipe.runtime.rank_io import RankResult
from funcpipe.runtime.transport_common import Handle
from funcpipe.runtime.transport_local import LocalWorld

__all__ = ["drive", "drive_local"]


def drive_local(
    gens: Mapping[int, Generator[Handle, None, RankResult]], *, world: LocalWorld | None = None
) -> dict[int, RankResult]:
    """Run every rank's generator in this thread, switching ranks whenever one has to wait.

    ``world`` (found from the ranks' handles if not given) explains a deadlock; in strict mode
    the step also fails if an operation is left unmatched when every rank has ended.
    """
    waiting: dict[int, Handle | None] = dict.fromkeys(gens)
    results: dict[int, RankResult] = {}
    busy: list[int] = []  # the ranks whose generators are running, innermost last

    def advance() -> bool:
        """Run every rank that can go on until it has to wait; True if any moved."""
        nonlocal world
        progressed = False
        for r, gen in gens.items():
            if r in results or r in busy:
                continue
            h = waiting[r]
            if h is not None and not h.ready():
                continue
            progressed = True
            busy.append(r)
            try:
                waiting[r] = next(gen)
            except StopIteration as stop:
                results[r] = stop.value
            finally:
                busy.pop()
            if world is None:
                world = _world_of(waiting[r])
        return progressed

    # (advance must not name itself: a closure holding its own cell is a reference cycle that
    # would keep this step's results alive until a full garbage collection)
    try:
        while len(results) < len(gens):
            if world is not None and world.driver is None:
                world.driver = (advance, busy)  # for LocalWorld.device_sync; let go below
            if not advance():
                blocked = sorted(r for r in gens if r not in results)
                if world is not None and world.strict:
                    raise CommunicationError(
                        f"ranks {blocked} all wait and none can go on under {RULES}: "
                        f"{world.explain(blocked)}"
                    )
                why = f" ({world.explain(blocked)})" if world is not None else ""
                raise CommunicationError(
                    f"ranks {blocked} all wait for data that no rank will send{why} (a deadlock "
                    "the checker did not see; please report this with the program)"
                )
    finally:
        if world is not None:
            world.driver = None
    if world is not None and world.strict:
        left = world.unfinished()
        if left:
            raise CommunicationError(
                f"every rank ended its step, but ranks {left} have point-to-point operations "
                f"that never matched under {RULES}: {world.explain(left)}"
            )
    return results


def _world_of(h: Handle | None) -> LocalWorld | None:
    world = getattr(h, "world", None)
    return world if isinstance(world, LocalWorld) else None


def drive(gen: Generator[Handle, None, RankResult]) -> RankResult:
    """Run one rank's generator, blocking on each wait."""
    try:
        h = next(gen)
        while True:
            h.wait()
            h = gen.send(None)
    except StopIteration as stop:
        return stop.value
