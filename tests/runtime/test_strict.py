"""The strict transports: NCCL's point-to-point rules at run time (one FIFO queue per pair for
both directions, groups posted together, rendezvous for ungrouped sends), in one process and
over gloo processes, and deadlocks reported as errors naming the ranks and operations."""

from __future__ import annotations

import time
import uuid
from collections.abc import Generator, Sequence
from typing import Any

import pytest
import torch

from funcpipe.errors import CommunicationError, InvalidArgument
from funcpipe.runtime import nccl_rules
from funcpipe.runtime.drive import drive_local
from funcpipe.runtime.transport import P2P, Handle, LocalTransport, LocalWorld
from tests import jobs_resources, jobs_strict


def _wait(h: Handle) -> Generator[Handle, None, None]:
    if not h.ready():
        yield h
        h.wait()


def _run(world: LocalWorld, plans: dict[int, Any]) -> None:
    """Drive ``plans[r](transport)`` (generators) for every rank with drive_local."""
    gens = {r: plan(world.transport(r)) for r, plan in plans.items()}
    drive_local(gens, world=world)  # type: ignore[arg-type]


def _send(x: torch.Tensor, peer: int) -> P2P:
    return P2P("send", (x,), peer)


def _recv(x: torch.Tensor, peer: int) -> P2P:
    return P2P("recv", (x,), peer)


# ------------------------------------------------------------------------------ in one process
def test_an_ungrouped_send_completes_only_at_the_receive() -> None:
    world = LocalWorld(2, strict=True)
    a, b = world.transport(0), world.transport(1)
    x, buf = torch.arange(4.0), torch.empty(4)
    (sent,) = a.post([_send(x, 1)])
    assert not sent.ready() and a.held_bytes == 16  # no buffering: it waits for rank 1
    (got,) = b.post([_recv(buf, 0)])
    assert sent.ready() and got.ready() and torch.equal(buf, x)
    a.finish()
    assert a.held_bytes == 0 and a.last_peak_held_bytes == 16


def _exchange(grouped: bool) -> Any:
    def plan(t: LocalTransport) -> Generator[Handle, None, None]:
        other = 1 - t.rank
        buf = torch.empty(3)
        out = torch.full((3,), float(t.rank))
        if grouped:
            h = t.post([_send(out, other), _recv(buf, other)])[1]
        else:
            t.post([P2P("send", (out,), other)])
            h = t.post([P2P("recv", (buf,), other)])[0]
        yield from _wait(h)
        assert torch.equal(buf, torch.full((3,), float(other)))
        t.finish()

    return plan


def test_a_grouped_exchange_runs_where_the_ungrouped_one_deadlocks() -> None:
    _run(LocalWorld(2, strict=True), {0: _exchange(True), 1: _exchange(True)})
    _run(LocalWorld(2, strict=False), {0: _exchange(False), 1: _exchange(False)})  # gloo-like
    with pytest.raises(CommunicationError) as info:
        _run(LocalWorld(2, strict=True), {0: _exchange(False), 1: _exchange(False)})
    text = str(info.value)
    assert "ranks [0, 1]" in text
    assert (
        "rank 0's SEND (to r1) waits for rank 1, whose queue head is its own SEND (to r0)" in text
    )
    assert (
        "rank 1's SEND (to r0) waits for rank 0, whose queue head is its own SEND (to r1)" in text
    )
    assert "rank 0's RECV (from r1) is queued behind its own SEND (to r1)" in text


def test_messages_match_in_fifo_order_per_direction() -> None:
    world = LocalWorld(2, strict=True)
    a, b = world.transport(0), world.transport(1)
    xs = [torch.full((2,), float(k)) for k in range(3)]
    bufs = [torch.empty(2) for _ in range(3)]
    sends = a.post([_send(x, 1) for x in xs])  # one group of three
    recvs = [b.post([_recv(buf, 0)])[0] for buf in bufs]  # three groups of one
    assert all(h.ready() for h in recvs + sends)
    assert [float(buf[0]) for buf in bufs] == [0.0, 1.0, 2.0]


def test_a_group_completes_as_one() -> None:
    """A batch's handles (a group's operations with one peer) are done only once all of them
    have matched."""
    world = LocalWorld(2, strict=True)
    t0, t1 = world.transport(0), world.transport(1)
    h1, h2 = t0.post([_send(torch.ones(2), 1), _recv(torch.empty(2), 1)])
    t1.post([_recv(torch.empty(2), 0)])
    assert not h1.ready() and not h2.ready()  # rank 1 has not posted its send
    t1.post([_send(torch.ones(2), 0)])
    assert h1.ready() and h2.ready()


def test_an_ungrouped_operation_waits_for_the_head_of_its_own_queue() -> None:
    """Rank 1's receive from rank 0 sits behind its unmatched send to rank 0 (same queue), but a
    receive from rank 2 (another queue) is not held up."""
    world = LocalWorld(3, strict=True)
    t0, t1, t2 = (world.transport(r) for r in range(3))
    t1.post([_send(torch.ones(1), 0)])
    (behind,) = t1.post([_recv(torch.empty(1), 0)])
    (other,) = t1.post([_recv(torch.empty(1), 2)])
    t2.post([_send(torch.ones(1), 1)])
    assert other.ready() and not behind.ready()
    assert "rank 1's RECV (from r0) is queued behind its own SEND (to r0)" in world.explain([1])
    t0.post([_recv(torch.empty(1), 1)])  # rank 1's send matches: its receive is at the head
    assert not behind.ready()
    assert "rank 1's RECV (from r0) waits for rank 0, which has not posted its SEND #0" in (
        world.explain([1])
    )
    t0.post([_send(torch.ones(1), 1)])
    assert behind.ready()


def test_a_group_with_two_peers_is_one_batch_per_peer() -> None:
    """A batch is one process group's, and each pair of ranks has its own (the pair layout):
    a group with two peers is posted as two batches, each completing on its own queue. Rank 0's
    receive from rank 1 is not held up by its queue with rank 2, whose head waits for rank 2."""
    world = LocalWorld(3, strict=True)
    t0, t1, t2 = (world.transport(r) for r in range(3))
    (first,) = t0.post([_send(torch.ones(1), 2)])  # head of queue (0, 2) until rank 2 receives
    h = t0.post([_recv(torch.empty(1), 1), _recv(torch.empty(1), 2), _send(torch.ones(1), 1)])
    t1.post([_send(torch.ones(1), 0), _recv(torch.empty(1), 0)])
    t2.post([_send(torch.ones(1), 0)])
    assert h[0].ready() and h[2].ready()  # the batch with rank 1 completed
    assert not first.ready() and not h[1].ready()  # queue (0, 2): both heads are SENDs
    text = world.explain()
    assert (
        "rank 0's SEND (to r2) waits for rank 2, whose queue head is its own SEND (to r0)" in text
    )
    assert "rank 0's RECV (from r2) is queued behind its own SEND (to r2)" in text
    with pytest.raises(CommunicationError, match=r"cannot complete yet"):
        h[1].wait()
    world2 = LocalWorld(3, strict=True)
    u0, u1, u2 = (world2.transport(r) for r in range(3))
    (first,) = u0.post([_send(torch.ones(1), 2)])
    h = u0.post([_recv(torch.empty(1), 1), _recv(torch.empty(1), 2)])
    u1.post([_send(torch.ones(1), 0)])
    u2.post([_recv(torch.empty(1), 0), _send(torch.ones(1), 0)])  # grouped on rank 2's side
    assert first.ready() and h[0].ready() and h[1].ready()


def test_a_reduction_is_not_held_up_by_point_to_point() -> None:
    world = LocalWorld(2, groups={"data": [[0, 1]]}, strict=True)
    a, b = world.transport(0), world.transport(1)
    (pending,) = a.post([_send(torch.ones(4), 1)])  # never received yet
    ga, gb = torch.ones(3), torch.full((3,), 2.0)
    ha, hb = a.all_reduce([ga], "data"), b.all_reduce([gb], "data")
    assert ha.ready() and hb.ready() and torch.equal(ga, torch.full((3,), 3.0))
    assert not pending.ready()


def test_a_send_no_rank_receives_is_reported_when_the_step_ends() -> None:
    def sender(t: LocalTransport) -> Generator[Handle, None, None]:
        t.post([P2P("send", (torch.ones(2),), 1)])
        yield from _wait(t.all_reduce([torch.ones(1)], "g"))
        t.finish()

    def idle(t: LocalTransport) -> Generator[Handle, None, None]:
        yield from _wait(t.all_reduce([torch.ones(1)], "g"))
        t.finish()

    world = LocalWorld(2, groups={"g": [[0, 1]]}, strict=True)
    with pytest.raises(CommunicationError, match=r"ranks \[0\] have point-to-point operations"):
        _run(world, {0: sender, 1: idle})


def test_a_shape_mismatch_is_named() -> None:
    world = LocalWorld(2, strict=True)
    world.transport(0).post([_send(torch.ones(3), 1)])
    with pytest.raises(CommunicationError, match=r"rank 1 expected from rank 0 tensors \[\(\(4,\)"):
        world.transport(1).post([_recv(torch.empty(4), 0)])


def test_labels_name_the_operations() -> None:
    world = LocalWorld(2, strict=True)
    world.transport(0).post([P2P("send", (torch.ones(1),), 1, "SEND act s0>s1 m3 to r1")])
    world.transport(1).post([P2P("send", (torch.ones(1),), 0, "+ SEND grad s0>s1 m0 to r0")])
    text = world.explain()
    assert (
        "rank 0's SEND act s0>s1 m3 to r1 waits for rank 1, whose queue head is its own "
        "SEND grad s0>s1 m0 to r0;"
    ) in text


def test_strict_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FUNCPIPE_STRICT_P2P", raising=False)
    assert not LocalWorld(2).strict
    monkeypatch.setenv("FUNCPIPE_STRICT_P2P", "1")
    assert LocalWorld(2).strict and not LocalWorld(2, strict=False).strict
    monkeypatch.setenv("FUNCPIPE_STRICT_P2P", "0")
    assert not LocalWorld(2).strict
    with pytest.raises(InvalidArgument, match="strict="):
        LocalWorld(2, strict="yes")  # type: ignore[arg-type]


def test_a_pipeline_in_one_process_runs_strict_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pipeline(transport="local") gets its strictness from LocalWorld, which reads the
    environment; an evaluation program (forward only) runs under the rules as it is posted."""
    monkeypatch.setenv("FUNCPIPE_STRICT_P2P", "1")
    assert jobs_strict.forward_vs_reference(0, 3, "local") < 1e-10


def test_hand_posted_1f1b_runs_strict_in_one_process() -> None:
    world = LocalWorld(4, strict=True)
    ts = [world.transport(r) for r in range(4)]

    def plan(t: LocalTransport) -> Generator[Handle, None, None]:
        yield from jobs_strict.run_steps(t, jobs_strict.one_f_one_b(t.rank, 4, 8), 16)
        t.finish()

    drive_local({r: plan(t) for r, t in enumerate(ts)}, world=world)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ the model itself
def _sides(posts: dict[int, Sequence[Sequence[tuple[str, int]]]]) -> dict[int, nccl_rules.Side]:
    sides = {r: nccl_rules.Side(r) for r in posts}
    for r, groups in posts.items():
        for g in groups:
            sides[r].post([(kind, peer, "") for kind, peer in g])
    return sides


def test_stuck_finds_only_ranks_that_wait_on_each_other() -> None:
    # ranks 0 and 1 both send first (ungrouped); rank 2 waits for rank 3, which is not blocked
    sides = _sides(
        {
            0: [[("send", 1)], [("recv", 1)]],
            1: [[("send", 0)], [("recv", 0)]],
            2: [[("recv", 3)]],
            3: [],
        }
    )
    blocked = {0: (1, False), 1: (1, False), 2: (0, False)}
    assert nccl_rules.stuck(sides, blocked) == {0, 1}
    grouped = _sides({0: [[("send", 1), ("recv", 1)]], 1: [[("send", 0), ("recv", 0)]]})
    assert nccl_rules.stuck(grouped, {0: (0, False), 1: (0, False)}) == set()
    assert not grouped[0].groups and not grouped[1].groups  # settled: both completed


def test_a_side_survives_its_snapshot() -> None:
    side = nccl_rules.Side(0)
    side.post([("send", 1, "SEND a 0>1 m0")])
    side.post([("recv", 1, ""), ("send", 2, "")])
    side.activate()
    back = nccl_rules.Side.restore(0, __import__("json").loads(side.snapshot((1, False), 3)))
    assert back.active == side.active
    assert [(g.seq, g.active, str(g)) for g in back.groups] == [
        (g.seq, g.active, str(g)) for g in side.groups
    ]


# ------------------------------------------------------------------------------ over processes
@pytest.mark.timeout(120)
def test_an_ungrouped_exchange_over_processes_raises_naming_both_ranks(pool) -> None:
    p = pool(2)
    p.run(jobs_resources.ready)  # started before the clock: a pool's start is not what is timed
    start = time.monotonic()
    results = p.run(jobs_strict.exchange, False, f"x/{uuid.uuid4().hex}")
    assert time.monotonic() - start < 10
    for rank, (text, took) in enumerate(results):
        assert took < 10
        assert "can never complete: ranks [0, 1] wait for each other" in text, text
        assert "rank 0's SEND (to r1) waits for rank 1, whose queue head is its own SEND" in text
        assert "rank 1's SEND (to r0) waits for rank 0, whose queue head is its own SEND" in text
        assert text.startswith(f"rank {rank}:")


@pytest.mark.timeout(120)
def test_a_grouped_exchange_over_processes_passes(pool) -> None:
    results = pool(2).run(jobs_strict.exchange, True, f"x/{uuid.uuid4().hex}")
    assert [text for text, _ in results] == ["ok", "ok"]


@pytest.mark.timeout(120)
def test_a_pipeline_over_processes_runs_strict_from_the_environment(pool) -> None:
    for strict, worst in pool(2).run(jobs_strict.strict_pipeline):
        assert strict and worst < 1e-10


def test_a_wait_past_the_timeout_names_pg_timeout() -> None:
    """A peer that is only slow (it never publishes here): no deadlock is found, and the error
    after the timeout says which knob raises it."""
    from torch.distributed import HashStore

    shared = nccl_rules.Shared(0, HashStore(), ["r0", "r1"], timeout=0.2, check=0.05)
    group = shared.post([(nccl_rules.RECV, 1, "activation")])
    with pytest.raises(CommunicationError) as info:
        shared.wait(group, "step")
    assert "did not complete within 0 s (the process group's timeout)" in str(info.value)
    assert "raise pg_timeout= of funcpipe.launch or funcpipe.Pool" in str(info.value)
