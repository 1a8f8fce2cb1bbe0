"""The turns of an overlapped pair's two halves (funcpipe.runtime.turns): one runs at a time, the
turn changes hands at each collective issued, the order of the calls is the program's, each half
keeps its own random numbers, and a fault ends only its half."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from funcpipe.runtime.turns import active, complete, together

CPU = torch.device("cpu")


class _Work:
    """What an asynchronous c10d call returns: ``wait()`` logs when it is waited for."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self) -> bool:
        self.log.append(f"wait {self.name}")
        return True


def _call(log: list[str]) -> Any:
    """A stand-in for a ``torch.distributed`` collective: logs its issue, and what it was asked."""

    def call(name: str, *, async_op: bool = False) -> _Work | None:
        log.append(f"issue {name}" + ("" if async_op else " (blocking)"))
        return _Work(log, name) if async_op else None

    return call


def _half(log: list[str], half: str, calls: int, work: list[str]) -> Any:
    def run() -> str:
        for k in range(calls):
            work.append(f"{half} computes before #{k}")
            complete(_call(log), f"{half}{k}")
        work.append(f"{half} computes after its last")
        return half

    return run


def test_the_halves_take_turns_at_each_collective_in_the_programs_order() -> None:
    """The backward runs until its first call, the forward until its first, the backward waits
    for its first and goes on to its second, ...; once a half ended the other runs alone: one
    order of calls, whatever the threads' timing (repeated with either thread slowed)."""
    for slow in ("", "B", "F"):
        log: list[str] = []
        work: list[str] = []
        halves = {h: _half(log, h, n, work) for h, n in (("F", 2), ("B", 3))}

        def delayed(half: str, slow: str = slow, halves: Any = halves) -> Any:
            def run() -> str:
                time.sleep(0.01 if slow == half else 0.0)
                return str(halves[half]())

            return run

        got = together(delayed("F"), delayed("B"), CPU)
        assert got == "B"
        assert log == [
            "issue B0",
            "issue F0",
            "wait B0",
            "issue B1",
            "wait F0",
            "issue F1",
            "wait B1",
            "issue B2",
            "wait F1",
            "wait B2",  # (the forward ended: the backward runs on alone)
        ]
        assert work.index("B computes before #0") < work.index("F computes before #0")
        assert active() is None


def test_a_call_that_returns_several_works_waits_for_each_after_the_turn() -> None:
    """batch_isend_irecv (a ring shift) returns a list: each is waited for once the turn comes
    back, and after a fault of the other half it is not issued either."""
    log: list[str] = []

    def batch(name: str, *, async_op: bool = False) -> Any:
        log.append(f"issue {name}")
        return [_Work(log, f"{name}.send"), _Work(log, f"{name}.recv")] if async_op else None

    together(lambda: complete(batch, "F0"), lambda: complete(batch, "B0"), CPU)
    waits = ["wait B0.send", "wait B0.recv", "wait F0.send", "wait F0.recv"]
    assert log == ["issue B0", "issue F0", *waits]
    log.clear()

    def failing() -> None:
        raise ValueError("the forward failed")

    with pytest.raises(ValueError, match="the forward failed"):
        together(failing, lambda: [complete(batch, f"B{k}") for k in range(2)], CPU)
    assert log == ["issue B0", "wait B0.send", "wait B0.recv"], log


def test_outside_a_pair_a_collective_blocks_and_a_pair_without_collectives_runs_in_sequence() -> (
    None
):
    log: list[str] = []
    complete(_call(log), "alone")
    assert log == ["issue alone (blocking)"]
    order: list[str] = []
    together(lambda: order.extend(["F start", "F end"]), lambda: order.extend(["B"]), CPU)
    assert order == ["B", "F start", "F end"]


def test_each_half_draws_the_random_numbers_it_draws_alone() -> None:
    """A half's generator state is its own across the other's turns: the forward's draws
    around its collectives, and a backward that reseeds and draws (a checkpoint recomputing
    dropout) between two of the forward's, equal what each draws alone."""

    def drawer(seed: int, calls: int, out: list[torch.Tensor]) -> Any:
        def run() -> None:
            torch.manual_seed(seed)
            for k in range(calls):
                out.append(torch.rand(3))
                complete(_call([]), f"{seed}-{k}")
            out.append(torch.rand(3))

        return run

    alone_f: list[torch.Tensor] = []
    alone_b: list[torch.Tensor] = []
    drawer(1, 2, alone_f)()
    drawer(2, 3, alone_b)()
    got_f: list[torch.Tensor] = []
    got_b: list[torch.Tensor] = []
    together(drawer(1, 2, got_f), drawer(2, 3, got_b), CPU)
    for a, b in zip(alone_f + alone_b, got_f + got_b, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("failing", ["F", "B"])
def test_after_a_fault_the_other_half_issues_nothing_more(failing: str) -> None:
    """The peers of a rank whose half raised go on calling the program's collectives, which
    the surviving half's next ones would meet (a gloo size mismatch aborted a peer's process):
    it stops at its next call (OtherHalfFailed), and the first error is the one raised."""
    log: list[str] = []

    def half(name: str) -> Any:
        def run() -> None:
            complete(_call(log), f"{name}0")
            if name == failing:
                raise ValueError(f"{name} failed")
            complete(_call(log), f"{name}1")
            complete(_call(log), f"{name}2")

        return run

    with pytest.raises(ValueError, match=f"{failing} failed"):
        together(half("F"), half("B"), CPU)
    # (what was issued before the fault is waited for: the peers issue it too)
    if failing == "B":  # the forward's F1 is never issued
        assert log == ["issue B0", "issue F0", "wait B0", "wait F0"], log
    else:  # B1 went before the forward raised; B2 never does
        assert log == ["issue B0", "issue F0", "wait B0", "issue B1", "wait F0", "wait B1"], log
    assert active() is None
