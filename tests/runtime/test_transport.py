"""The posting API (``Transport.post`` of :class:`P2P` groups) and sends freed when done: a 1F1B
step keeps about p boundary tensors in flight per rank, not m."""

from __future__ import annotations

import uuid
from collections.abc import Generator

import pytest
import torch

from funcpipe.errors import InvalidArgument
from funcpipe.runtime.drive import drive_local
from funcpipe.runtime.transport import P2P, Handle, LocalTransport, LocalWorld
from tests import jobs_strict

P, M = 4, 16  # ranks and microbatches of the held-bytes tests
NUMEL = 1 << 14  # a boundary tensor: 16384 float32, 64 KiB
A = NUMEL * 4


def test_p2p_states_its_rules() -> None:
    with pytest.raises(InvalidArgument, match="op is 'send' or 'recv'"):
        P2P("isend", (torch.ones(1),), 1)
    with pytest.raises(InvalidArgument, match="peer="):
        P2P("send", (torch.ones(1),), -1)
    assert P2P("send", [torch.ones(1)], 1).tensors[0].shape == (1,)  # type: ignore[arg-type]


def test_the_transport_module_names_both_transports_and_their_interface() -> None:
    """``funcpipe.runtime.transport`` names what its three modules define (the path others
    import from)."""
    from funcpipe.runtime import transport, transport_common, transport_dist, transport_local

    for name in transport.__all__:
        defined = [
            m
            for m in (transport_common, transport_dist, transport_local)
            if name in m.__all__ and getattr(m, name) is getattr(transport, name)
        ]
        assert len(defined) == 1, name
    assert transport.LocalWorld is transport_local.LocalWorld
    assert transport.DistTransport is transport_dist.DistTransport
    assert transport.P2P is transport_common.P2P


@pytest.mark.parametrize("strict", [False, True])
def test_post_gives_one_handle_per_operation(strict: bool) -> None:
    world = LocalWorld(2, strict=strict)
    a, b = world.transport(0), world.transport(1)
    x, y = torch.arange(3.0), torch.arange(5.0)
    bx, by = torch.empty(3), torch.empty(5)
    ha = a.post([P2P("send", (x,), 1), P2P("recv", (by,), 1)])
    hb = b.post([P2P("send", (y,), 0), P2P("recv", (bx,), 0)])
    assert len(ha) == len(hb) == 2
    assert all(h.ready() for h in [ha[1], hb[1], ha[0], hb[0]])  # receives copy, sends are done
    assert torch.equal(bx, x) and torch.equal(by, y)
    b.post([P2P("send", (y,), 0)])  # the one-op wrappers
    a.post([P2P("recv", (by,), 1)])[0].wait()
    assert a.post([]) == []


@pytest.mark.parametrize("strict", [False, True])
def test_held_bytes_follow_the_sends(strict: bool) -> None:
    world = LocalWorld(2, strict=strict)
    a, b = world.transport(0), world.transport(1)
    a.post([P2P("send", (torch.ones(4),), 1)])
    a.post([P2P("send", (torch.ones(2),), 1)])
    assert a.held_bytes == a.peak_held_bytes == 24
    b.post([P2P("recv", (torch.empty(4),), 0)])[0].wait()
    a.post([])  # posting drops the sends known complete
    assert a.held_bytes == 8 and a.peak_held_bytes == 24
    b.post([P2P("recv", (torch.empty(2),), 0)])[0].wait()
    a.finish()
    assert (a.held_bytes, a.peak_held_bytes, a.last_peak_held_bytes) == (0, 0, 24)


@pytest.mark.parametrize("strict", [False, True])
def test_1f1b_in_one_process_keeps_p_boundary_tensors_not_m(strict: bool) -> None:
    world = LocalWorld(P, strict=strict)
    ts = [world.transport(r) for r in range(P)]

    def plan(t: LocalTransport) -> Generator[Handle, None, None]:
        yield from jobs_strict.run_steps(t, jobs_strict.one_f_one_b(t.rank, P, M), NUMEL)
        t.finish()

    drive_local({r: plan(t) for r, t in enumerate(ts)}, world=world)  # type: ignore[arg-type]
    peaks = [t.last_peak_held_bytes for t in ts]
    # the driver runs rank 0 until it blocks: its p sends of the warm-up and first steady step
    # are all in flight at once, which is also what a GPU rank keeps
    assert peaks[0] == P * A
    assert all(0 < peak <= P * A for peak in peaks[:-1]), peaks
    for t in ts:  # a rank may end its step before its last send was received: now it has been
        t.post([])
        assert t.held_bytes == 0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strict", [False, True])
def test_1f1b_over_processes_keeps_p_boundary_tensors_not_m(pool, strict: bool) -> None:
    """Hand-posted 1F1B over 4 gloo processes (gloo's isend; strict:
    sends complete only at the rendezvous, so the bound is not a buffered send's luck)."""
    key = f"held/{uuid.uuid4().hex}"
    results = pool(P).run(jobs_strict.held_bytes_1f1b, M, NUMEL, strict, key)
    for rank, (peak, after) in enumerate(results):
        assert peak <= P * A, (rank, peak / A)
        assert after == 0


@pytest.mark.timeout(180)
def test_a_1f1b_pipeline_step_over_processes_keeps_p_boundary_tensors(pool) -> None:
    """A send counts until it is known done: over gloo, until the waiter thread's ``wait()``
    returns, which on a loaded machine comes a send late now and then (5 boundaries seen in 4 of
    25 runs; at most 4 in 90 steps of every rank run alone or beside two busy processes, at
    6889d0b as at fdd70b8: not the overlapped pairs' doing). So: p in the quietest of three
    steps, and never near m (16 here, 32 for the middle ranks' two directions) in any."""
    for peaks, boundary, after in pool(P).run(jobs_strict.pipeline_held_bytes, M, 3):
        assert min(peaks) <= P * boundary, [p / boundary for p in peaks]
        assert max(peaks) <= 2 * P * boundary, [p / boundary for p in peaks]
        assert after == 0


def test_local_receives_match_in_posting_order_whatever_is_waited_first() -> None:
    """Two receives from one peer posted before the data arrives: waiting for the second first
    still gives each the message sent in its position (FIFO per pair, as over a wire)."""
    world = LocalWorld(2, strict=False)
    a, b = world.transport(0), world.transport(1)
    first, second = torch.empty(2), torch.empty(3)
    h1, h2 = b.post([P2P("recv", (first,), 0), P2P("recv", (second,), 0)])
    a.post([P2P("send", (torch.ones(2),), 1)])
    a.post([P2P("send", (torch.full((3,), 2.0),), 1)])
    h2.wait()
    assert h1.ready() and torch.equal(first, torch.ones(2))
    assert torch.equal(second, torch.full((3,), 2.0))
