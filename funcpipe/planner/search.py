"""Search the layouts of a GPU count and global batch for the fastest that fits in memory.

Every candidate is priced with the closed forms (:mod:`funcpipe.planner.pipeline`), those that do
not fit are dropped, and the best few (``refine``, plus any within ``margin`` of the best, up to
``2 * refine``) are priced again with the simulator, which sees uneven stages; the result is
sorted by that price. 3,072 GPUs x 512 microbatches take seconds (benchmarks/plan_search.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from funcpipe.errors import InvalidArgument
from funcpipe.planner.calibration import DEFAULT, Calibration
from funcpipe.planner.cluster import Cluster
from funcpipe.planner.estimate import Estimate, estimate
from funcpipe.planner.layout import RECOMPUTE, ClusterLayout
from funcpipe.planner.model import Transformer

__all__ = ["candidates", "search"]

DEFAULT_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-h2", "zbv")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(
    model: Transformer,
    gpus: int,
    global_batch: int,
    *,
    gpus_per_node: int = 8,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    recompute: Sequence[str] = RECOMPUTE,
    microbatches: Sequence[int] = (1, 2, 4, 8),
    interleaves: Sequence[int] = (2, 3, 4, 6, 8),
    sequence_parallel: Sequence[bool] = (False, True),
    zero1: Sequence[bool] = (False,),
) -> Iterator[ClusterLayout]:
    """Every valid layout: ``tensor`` within a node and dividing the heads, ``pipeline`` and
    ``interleave`` splitting the layers evenly, ``data`` the rest, ``microbatch`` dividing the
    batch of one data rank."""
    for t in _divisors(gpus):
        if t > gpus_per_node or model.heads % t or model.kv % t:
            continue
        for p in _divisors(gpus // t):
            if model.layers % p:
                continue
            d = gpus // (t * p)
            if global_batch % d:
                continue
            for b in microbatches:
                if (global_batch // d) % b:
                    continue
                for sched in schedules if p > 1 else ("1f1b",):
                    if sched == "interleaved":
                        vs = [v for v in interleaves if model.layers % (p * v) == 0]
                    elif sched == "zbv":
                        vs = [2] if model.layers % (2 * p) == 0 else []
                    else:
                        vs = [1]
                    for v in vs:
                        for rc in recompute:
                            for sp in sequence_parallel if t > 1 else (False,):
                                for z in zero1 if d > 1 else (False,):
                                    yield ClusterLayout(t, p, d, b, v, rc, sp, sched, z)


def search(
    model: Transformer,
    cluster: Cluster,
    *,
    gpus: int,
    global_batch: int,
    calibration: Calibration = DEFAULT,
    top: int = 1,
    refine: int = 3,
    margin: float = 0.02,
    simulate: bool = True,
    max_simulated_microbatches: int = 40_000,
    overlap_grad_reduce: bool = True,
    memory_limit: float | None = None,
    **space: Any,
) -> list[Estimate]:
    """The ``top`` fastest layouts that fit, best first (see the module docstring).

    ``space`` narrows :func:`candidates` (``schedules=``, ``recompute=``, ``microbatches=``,
    ``interleaves=``, ``sequence_parallel=``, ``zero1=``). Candidates whose programs would be
    longer than ``max_simulated_microbatches`` (ranks x microbatches x chunks) keep their
    closed-form price.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise InvalidArgument(f"search(gpus={gpus!r}): a positive integer")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgument(f"search(top={top!r}): a positive integer")
    kw: dict[str, Any] = {"calibration": calibration, "overlap_grad_reduce": overlap_grad_reduce}
    fast = []
    for layout in candidates(
        model,
        gpus,
        global_batch,
        gpus_per_node=cluster.gpus_per_node,
        **space,
    ):
        e = estimate(
            model, cluster, layout, global_batch=global_batch, memory_limit=memory_limit, **kw
        )
        if e.fits:
            fast.append(e)
    if not fast:
        raise InvalidArgument(
            f"search: no layout of {gpus} GPUs fits {model} with global_batch={global_batch} "
            f"in {cluster.gpu.memory / 2**30:.0f} GiB per GPU; add GPUs, allow recompute, or "
            "use a GPU with more memory"
        )
    fast.sort(key=lambda e: e.step_time_s)
    if not simulate:
        return fast[:top]
    best = fast[0].step_time_s
    want = max(refine, top)
    chosen = [e for k, e in enumerate(fast) if k < want or e.step_time_s <= best * (1 + margin)]
    chosen = chosen[: 2 * want]
    refined = []
    for e in chosen:
        lay = e.layout
        size = lay.pipeline * min(e.microbatches, 3 * lay.pipeline) * lay.interleave
        if size > max_simulated_microbatches:
            refined.append(e)
            continue
        s = estimate(
            model,
            cluster,
            lay,
            global_batch=global_batch,
            simulate=True,
            memory_limit=memory_limit,
            **kw,
        )
        if s.fits:
            refined.append(s)
    refined.sort(key=lambda e: e.step_time_s)
    return refined[:top] if refined else fast[:top]
