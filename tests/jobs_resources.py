"""Pool jobs about what Pipelines and meshes hold in a process: threads, descriptors, groups."""

from __future__ import annotations

import os
import time
from typing import Any

from funcpipe.distributed import groups
from funcpipe.parallel.mesh import build_mesh
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.schedule.generators import generate
from tests.jobs_runtime import data, mse, toy


def counts() -> dict[str, int]:
    """This process's threads, open file descriptors and funcpipe process groups."""
    return {
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
        "groups": groups.live(),
    }


def settled(target: dict[str, int] | None = None, wait: float = 3.0) -> dict[str, int]:
    """:func:`counts` once it equals ``target`` (threads end a moment after they are told to)
    or stops changing, giving up after ``wait`` seconds. No garbage collection: what a dropped
    Pipeline holds must go with it (by reference counting), not wait for the collector."""
    last, end = counts(), time.monotonic() + wait
    while time.monotonic() < end:
        time.sleep(0.05)
        now = counts()
        if now == target or (target is None and now == last):
            return now
        last = now
    return last


def ready(rank: int) -> int:
    """Nothing: answers once the pool's processes have started."""
    return rank


def release(rank: int) -> dict[str, int]:
    """Destroy every process group funcpipe keeps in this process (all ranks at once)."""
    groups.destroy_all()
    return settled(wait=1.0)


def _pipeline(tied: bool, mesh: Any = None) -> tuple[Pipeline, list[dict[str, Any]]]:
    program = generate("1f1b", ranks=2, microbatches=4)
    stages, params = toy(2, tied=tied)
    ties = {"E": [(0, "E"), (1, "E")]} if tied else None
    return Pipeline(stages, program, loss_fn=mse, ties=ties, mesh=mesh), params


def pipelines(rank: int, n: int, *, close: bool) -> dict[str, Any]:
    """Build, step and drop (or close) ``n`` tied 2-rank Pipelines; the counts at the start,
    after the first and after the last."""
    start = settled()
    seen = []
    for _ in range(n):
        pipe, params = _pipeline(tied=True)
        x, y = data(8)
        pipe.step(params, x, y)
        if close:
            pipe.close()
        del pipe
        seen.append(settled(start if close else None, wait=3.0 if not seen else 0.0))
    end = settled(start if close else seen[0])
    return {"start": start, "first": seen[0] if seen else start, "end": end}


def meshes(rank: int, n: int) -> dict[str, Any]:
    """``n`` times: a mesh and a Pipeline over it, stepped once, both closed by ``with``."""
    start = settled()
    for _ in range(n):
        with build_mesh({"pipeline": 2, "tensor": 1}) as mesh:
            pipe, params = _pipeline(tied=True, mesh=mesh)
            with pipe:
                x, y = data(8)
                pipe.step(params, x, y)
    closed = settled(start)
    del mesh, pipe
    return {"start": start, "closed": closed, "end": settled(start)}


def grid_meshes(rank: int, n: int) -> dict[str, Any]:
    """``n`` 2D meshes of four ranks (their tensor axis a flattened mesh, which torch's mesh
    keeps in a reference cycle), each summing over its tensor axis, closed by ``with``."""
    import torch
    import torch.distributed as dist

    start = settled()
    for _ in range(n):
        with build_mesh({"tensor": {"size": 4, "mode": "2d"}}) as mesh:
            t = torch.ones(1)
            dist.all_reduce(t, group=mesh["tensor"].group)
            assert float(t) == 4.0
    return {"start": start, "closed": settled(start)}


def closed_step(rank: int) -> str:
    """Stepping a closed Pipeline: the error's text."""
    with _pipeline(tied=False)[0] as pipe:
        pass
    try:
        pipe.step(*_args())
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _args() -> tuple[Any, ...]:
    _, params = toy(2)
    return (params, *data(8))


def group_timeouts(rank: int) -> dict[str, Any]:
    """The timeout of every process group funcpipe holds after a tied 2-rank Pipeline and a
    ``pipeline 2 x tensor 2`` mesh of 4 ranks were built, and the default group's."""
    import torch
    import torch.distributed as dist

    def seconds(pg: Any) -> float:
        return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    with build_mesh({"pipeline": 2, "tensor": 2}) as mesh:
        pipe, params = _pipeline(tied=True, mesh=mesh)
        with pipe:
            x, y = data(8)
            pipe.step(params, x, y)
            held = [seconds(g) for e in groups._REGISTRY[0].entries.values() for g in e.groups]
    return {"world": seconds(dist.group.WORLD), "groups": held}
