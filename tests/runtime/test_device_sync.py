"""Collectives are enqueued only once their data exists (issue 32): a rank whose host waits for
its device mid-step (``torch.cuda.synchronize()``, inductor's autotuning, the caching allocator's
retry on out-of-memory) must not wait for a collective that another rank can only join after
this rank goes on. On the CPU, :meth:`LocalWorld.device_sync` stands in for that wait."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import torch

import funcpipe as fp
from funcpipe.errors import CommunicationError
from funcpipe.pipeline import pipeline as pipeline_module
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.runtime.drive import drive_local
from funcpipe.runtime.transport import P2P, Handle, LocalTransport, LocalWorld
from funcpipe.schedule.generators import GENERATORS, generate
from funcpipe.stages.stage import Stage
from funcpipe.testing import assert_trees_close
from tests.jobs_runtime import data, mse, toy


def _wait(h: Handle) -> Generator[Handle, None, None]:
    if not h.ready():
        yield h
        h.wait()


def _two_ranks(loss_early: bool) -> None:
    """Rank 0 sends its activation, rank 1 computes a loss from it and both sum the loss; rank 0
    synchronises its device between enqueueing the sum and sending. Enqueued early (at the start
    of rank 0's step, where the old interpreter posted it on ranks without the loss), the sum
    waits for rank 1, which waits for the send behind the synchronisation: a hang."""
    world = LocalWorld(2, groups={"loss": [[0, 1]]}, strict=True)

    def rank0(t: LocalTransport) -> Generator[Handle, None, None]:
        total = torch.zeros(1)
        early = t.all_reduce([total], "loss") if loss_early else None
        world.device_sync()  # in the middle of the step, before the send
        (sent,) = t.post([P2P("send", (torch.ones(3),), 1)])
        late = early or t.all_reduce([total], "loss")
        yield from _wait(sent)
        yield from _wait(late)
        assert float(total) == 3.0

    def rank1(t: LocalTransport) -> Generator[Handle, None, None]:
        buf = torch.empty(3)
        (got,) = t.post([P2P("recv", (buf,), 0)])
        yield from _wait(got)
        total = buf.sum().reshape(1)
        yield from _wait(t.all_reduce([total], "loss"))
        assert float(total) == 3.0

    gens = {0: rank0(world.transport(0)), 1: rank1(world.transport(1))}
    drive_local(gens, world=world)  # type: ignore[arg-type]


def test_a_collective_enqueued_before_its_data_exists_hangs_a_device_sync() -> None:
    _two_ranks(loss_early=False)
    with pytest.raises(CommunicationError, match=r"rank 0 synchronises its device mid-step"):
        _two_ranks(loss_early=True)


def test_device_sync_is_only_for_a_running_step() -> None:
    with pytest.raises(fp.InvalidArgument, match="drive_local"):
        LocalWorld(2).device_sync()


def _sync_rank(program: fp.schedule.Program) -> int:
    """A rank that does not hold the last stage (so it has no loss of its own), or rank 0."""
    sinks = {program.placement[s] for s in range(program.n_stages) if not program.consumers(s)}
    return next((r for r in range(program.n_ranks) if r not in sinks), 0)


@pytest.mark.parametrize("name", sorted(set(GENERATORS) - {"forward"}))
@pytest.mark.parametrize("ranks", [2, 3])
def test_every_schedule_survives_a_device_sync_mid_step(
    monkeypatch: pytest.MonkeyPatch, name: str, ranks: int
) -> None:
    """A rank without the loss synchronises its device in its second forward, with the strict
    transport: every point-to-point group and collective it has enqueued by then completes
    while it is held (the loss reduction is enqueued after each rank's last instruction), and
    the step matches the reference."""
    program = generate(name, ranks=ranks, microbatches=2 * ranks)
    me = _sync_rank(program)
    n = len(set(program.replica_of or range(program.n_stages)))
    stages, params = toy(n)
    mine = min(program.replica_of[s] if program.replica_of else s for s in program.stages_on(me))
    worlds: list[LocalWorld] = []
    calls = {"n": 0, "on": False}
    inner = stages[mine]

    def syncing(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        if calls["on"] and torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 2:
                worlds[-1].device_sync()
        return inner.fn(p, h)

    stages[mine] = Stage(syncing, name=inner.name)

    class Recording(LocalWorld):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            worlds.append(self)

    monkeypatch.setattr(pipeline_module, "LocalWorld", Recording)
    monkeypatch.setenv("FUNCPIPE_STRICT_P2P", "1")
    pipe = Pipeline(stages, program, loss_fn=mse)
    x, y = data(4 * ranks)
    pipe.step(params, x, y)  # shapes inferred (the stage runs without data there)
    calls["on"] = True
    got = pipe.step(params, x, y)
    calls["on"] = False
    assert calls["n"] >= 2
    ref = fp.reference_step(stages, params, x, mse, targets=y, microbatches=program.microbatches)
    assert_trees_close((got.loss, got.grads), ref)
