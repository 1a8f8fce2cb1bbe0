"""What a Pipeline or a mesh holds in a rank process is given back: 50 Pipelines built, stepped and
dropped (or closed) leave the threads, file descriptors and process groups where they started.

Each process group costs gloo a TCP event loop and two worker threads per member, and the loop
wakes up while idle, so groups that pile up in the session's long-lived pool processes cost every
later test CPU time (funcpipe.distributed.groups; the jobs are in tests/jobs_resources.py).
"""

from __future__ import annotations

import pytest

from tests import jobs_resources

N = 50


@pytest.mark.timeout(180)
def test_fifty_closed_pipelines_give_everything_back(pool) -> None:
    """Closed: threads (waiters), descriptors (gloo connections) and process groups
    (ties, loss sum) return exactly to their start on every rank."""
    for rank, got in enumerate(pool(2).run(jobs_resources.pipelines, N, close=True)):
        assert got["end"] == got["start"], f"rank {rank}: {got}"
        assert got["first"] == got["start"], f"rank {rank}: {got}"


@pytest.mark.timeout(180)
def test_fifty_dropped_pipelines_share_one_set_of_groups(pool) -> None:
    """Dropped without close: the waiter threads go with each Pipeline; the process groups stay
    for the next Pipeline of the same layout, so the counts stay at those after the first, and
    destroy_all brings them back to the start."""
    p = pool(2)
    runs = p.run(jobs_resources.pipelines, N, close=False)
    for rank, got in enumerate(runs):
        assert got["end"] == got["first"], f"rank {rank}: {got}"
        assert got["first"]["groups"] == 3, f"rank {rank}: the tie, loss and pair (0, 1) groups"
    for rank, (got, released) in enumerate(zip(runs, p.run(jobs_resources.release), strict=True)):
        assert released == got["start"], f"rank {rank}: {released} after destroy_all; {got}"


@pytest.mark.timeout(180)
def test_ten_meshes_and_their_pipelines_close(pool) -> None:
    """Closed by ``with`` blocks: the mesh's groups (and the Pipeline's) are gone at once, while
    the last mesh and Pipeline objects are still referenced."""
    for rank, got in enumerate(pool(2).run(jobs_resources.meshes, 10)):
        assert got["closed"] == got["start"], f"rank {rank}: {got}"
        assert got["end"] == got["start"], f"rank {rank}: {got}"


@pytest.mark.timeout(180)
def test_closed_grid_meshes_give_everything_back(pool) -> None:
    """A 2D mesh's flattened tensor axis: torch's meshes refer to each other, and closing must
    not leave their groups to the garbage collector."""
    for rank, got in enumerate(pool(4).run(jobs_resources.grid_meshes, 5)):
        assert got["closed"] == got["start"], f"rank {rank}: {got}"


@pytest.mark.timeout(60)
def test_a_closed_pipeline_refuses_to_step(pool) -> None:
    for text in pool(2).run(jobs_resources.closed_step):
        assert text.startswith("InvalidArgument: this Pipeline was closed"), text


def test_claims_share_groups_and_the_last_close_destroys_them() -> None:
    """In one process (a world of one): two claims on one layout share its group; the group
    goes with the last close; a claim from before destroy_all does not release a newer one."""
    import torch.distributed as dist

    from funcpipe.distributed import groups

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        a, b = groups.Claim(), groups.Claim()
        assert a.subgroups([[0]]) is b.subgroups([[0]])
        assert groups.live() == 1
        a.close()
        assert groups.live() == 1  # b still holds it
        b.close()
        assert groups.live() == 0
        old = groups.Claim()
        old.group([0])
        groups.destroy_all()
        new = groups.Claim()
        new.group([0])
        old.close()
        assert groups.live() == 1, "a claim on a destroyed registry released a newer group"
        new.close()
        assert groups.live() == 0
    finally:
        groups.destroy_all()
        dist.destroy_process_group()
