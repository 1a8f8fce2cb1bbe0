"""Search the layouts of a GPU count and global batch for the fastest that fits in memory.

Every candidate is priced with the closed forms (:mod:`funcpipe.planner.pipeline`); those whose
memory cannot fit are dropped (by ``Estimate.memory_floor_bytes``, a lower bound of the simulated
memory, where the simulator will price them; by the closed form where it will not), and the best
few (``refine``, plus any within ``margin`` of the best, up to ``2 * refine``) are priced again
with the simulator, which sees uneven stages, then every other whose lower bound of the simulated
time is below the ``top``-th price so far; a simulated price that does not fit is dropped. The
result is sorted by that price. 3,072 GPUs x 512 microbatches take seconds
(benchmarks/plan_search.py).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Iterator, Sequence
from itertools import islice, product
from typing import Any

from funcpipe.errors import InvalidArgument
from funcpipe.planner.calibration import DEFAULT, Calibration
from funcpipe.planner.cluster import Cluster
from funcpipe.planner.estimate import Estimate, estimate
from funcpipe.planner.layout import (
    MAX_STAGES,
    PAIRING,
    RECOMPUTE,
    ZERO,
    ClusterLayout,
    check_gpus,
)
from funcpipe.planner.model import Transformer
from funcpipe.planner.pipeline import MAX_SIMULATED, simulable

__all__ = ["MAX_LAYOUTS", "candidates", "search"]

DEFAULT_SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zb-h2", "zbv")
"""The schedules searched by default; a mixture of experts' search adds ``dualpipev``, whose
overlapped pairs hide the expert all-to-all (:data:`MOE_SCHEDULES`)."""

MOE_SCHEDULES = (*DEFAULT_SCHEDULES, "dualpipev")

MAX_LAYOUTS = 20_000
"""The most layouts :func:`search` prices: seconds of work (the 1T GPT on 3,072 GPUs has 10,440
with its three sharding levels). A GPU count, layer count and batch with many common divisors
can give more (720,720 of each: 157,680, 52,560 without sharding); such a search is refused,
saying how to narrow it (issue 42: bound the work)."""


def _divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, by trial up to its square root."""
    small, large = [], []
    k = 1
    while k * k <= n:
        if n % k == 0:
            small.append(k)
            if k * k != n:
                large.append(n // k)
        k += 1
    return small + large[::-1]


def _splits(model: Transformer, gpus: int, gpus_per_node: int) -> Iterator[tuple[int, int]]:
    """(tensor, pipeline) pairs: tensor within a node dividing the (kv) heads, pipeline dividing
    the layers, at most :data:`~funcpipe.planner.layout.MAX_STAGES` of them."""
    for t in _divisors(gpus):
        if t > gpus_per_node or model.heads % t or model.kv % t:
            continue
        for p in _divisors(gpus // t):
            if p <= MAX_STAGES and model.layers % p == 0:
                yield t, p


def candidates(
    model: Transformer,
    gpus: int,
    global_batch: int,
    *,
    gpus_per_node: int = 8,
    schedules: Sequence[str] | None = None,
    recompute: Sequence[str] = RECOMPUTE,
    microbatches: Sequence[int] = (1, 2, 4, 8),
    interleaves: Sequence[int] = (2, 3, 4, 6, 8),
    sequence_parallel: Sequence[bool] = (False, True),
    zero: Sequence[int] | None = None,
    zero1: Sequence[bool] | None = None,
    expert: Sequence[int] | None = None,
    overlap: Sequence[bool] | None = None,
) -> Iterator[ClusterLayout]:
    """Every valid layout: ``tensor`` within a node and dividing the heads, ``pipeline`` and
    ``interleave`` splitting the layers evenly, ``data`` the rest, ``microbatch`` dividing the
    batch of one data rank; at most :data:`~funcpipe.planner.layout.MAX_STAGES` stages; every
    sharding level of ``zero`` (default :data:`~funcpipe.planner.layout.ZERO`, all three) where
    ``data > 1``, none where ``data`` is 1. ``zero1=(False, True)``, the old spelling, is
    ``zero=(0, 1)``. A mixture of experts also gets every expert size dividing both ``data``
    and the experts (``expert``: only those of these sizes), and under ``tensor > 1`` only
    sequence parallelism (Megatron-Core's rule for MoE); a dense model keeps ``expert=1``.
    ``schedules`` default :data:`DEFAULT_SCHEDULES` (:data:`MOE_SCHEDULES` for a mixture of
    experts). ``overlap`` (default both): with and without overlapped pairs, where a layout
    may have them (an expert axis, a schedule of :data:`~funcpipe.planner.layout.PAIRING`,
    ``pipeline > 1``); ``(True,)`` only those with."""
    levels = _zero_levels(zero, zero1)
    wanted = _expert_sizes(expert)
    if schedules is None:
        schedules = MOE_SCHEDULES if model.experts else DEFAULT_SCHEDULES
    pairs = _overlaps(model, schedules, overlap)
    for t, p in _splits(model, gpus, gpus_per_node):
        d = gpus // (t * p)
        if global_batch % d:
            continue
        eps = [e for e in _divisors(d) if model.experts % e == 0] if model.experts else [1]
        eps = [e for e in eps if wanted is None or e in wanted]
        for b in microbatches:
            if (global_batch // d) % b:
                continue
            for sched in schedules if p > 1 else ("1f1b",):
                for v in _chunks(model, sched, p, interleaves):
                    inner = product(
                        recompute,
                        sequence_parallel if t > 1 else (False,),
                        levels if d > 1 else (0,),
                        eps,
                    )
                    for rc, sp, z, e in inner:
                        can = e > 1 and sched in PAIRING and p > 1  # may have pairs
                        # an MoE under tensor: each expert's width over it, or its tokens
                        splits = ("width", "tokens") if t > 1 and model.experts else ("width",)
                        for ov in pairs if can else (False,) if False in pairs else ():
                            for mt in splits:
                                if mt == "tokens" and (model.experts % (e * t) or sp):
                                    continue
                                yield ClusterLayout(
                                    t, p, d, b, v, rc, sp, sched, zero=z, expert=e, overlap=ov,
                                    moe_tensor=mt,
                                )  # fmt: skip


def _overlaps(
    model: Transformer, schedules: Sequence[str], overlap: Sequence[bool] | None
) -> tuple[bool, ...]:
    """The overlap settings to search (``None``: both)."""
    if overlap is None:
        return (False, True)
    if _not_a_sequence(overlap) or not overlap or any(not isinstance(o, bool) for o in overlap):
        raise InvalidArgument(
            f"search(overlap={overlap!r}): a sequence of True/False, e.g. (False, True)"
        )
    if False not in overlap:  # only overlapped layouts: say where there can be none
        if not model.experts:
            raise InvalidArgument(
                f"search(overlap={tuple(overlap)!r}): overlapped pairs hide the expert "
                "all-to-all, and the model has no experts; leave overlap out for a dense model"
            )
        if not set(schedules) & set(PAIRING):
            raise InvalidArgument(
                f"search(overlap={tuple(overlap)!r}, schedules={tuple(schedules)!r}): only "
                f"{', '.join(PAIRING)} pair; add one of them to schedules, or leave overlap out"
            )
    return tuple(dict.fromkeys(overlap))


def _expert_sizes(expert: Sequence[int] | None) -> tuple[int, ...] | None:
    """The expert sizes to search (``None``: every one that fits)."""
    if expert is None:
        return None
    if _not_a_sequence(expert) or any(
        isinstance(e, bool) or not isinstance(e, int) or e < 1 for e in expert
    ):
        raise InvalidArgument(
            f"search(expert={expert!r}): a sequence of expert-parallel sizes (positive "
            "integers), e.g. (1, 8)"
        )
    return tuple(expert)


def _zero_levels(zero: Sequence[int] | None, zero1: Sequence[bool] | None) -> tuple[int, ...]:
    """The sharding levels to search: ``zero``, or the old ``zero1`` flags as levels 0 and 1."""
    if zero is not None and zero1 is not None:
        raise InvalidArgument(
            f"search(zero={zero!r}, zero1={zero1!r}): give the sharding levels once, as zero= "
            "(zero1=(False, True) is the old spelling of zero=(0, 1))"
        )
    if zero1 is not None:
        if _not_a_sequence(zero1) or any(z not in (False, True) for z in zero1):
            raise InvalidArgument(
                f"search(zero1={zero1!r}): a sequence of True/False, e.g. (False, True)"
            )
        return tuple(dict.fromkeys(int(bool(z)) for z in zero1))
    if zero is None:
        return ZERO
    if _not_a_sequence(zero) or any(isinstance(z, bool) or z not in ZERO for z in zero):
        raise InvalidArgument(
            f"search(zero={zero!r}): a sequence of sharding levels out of 0, 1, 2 "
            "(none, ZeRO-1, ZeRO-2), e.g. (0, 1, 2) or (0,)"
        )
    return tuple(zero)


def _not_a_sequence(value: object) -> bool:
    return isinstance(value, (str, bytes)) or not hasattr(value, "__iter__")


def _chunks(model: Transformer, sched: str, p: int, interleaves: Sequence[int]) -> list[int]:
    """The chunks per rank ``sched`` may run on ``p`` ranks: stages dividing the layers."""
    if sched == "interleaved":
        vs = list(interleaves)
    elif sched in ("zbv", "dualpipev"):
        vs = [2]
    else:
        return [1]
    return [v for v in vs if model.layers % (p * v) == 0 and p * v <= MAX_STAGES]


def _no_layout(
    model: Transformer, gpus: int, global_batch: int, gpus_per_node: int, space: dict[str, Any]
) -> str:
    """Why no layout of ``gpus`` GPUs splits ``global_batch``: the data sizes they can have."""
    sizes = sorted({gpus // (t * p) for t, p in _splits(model, gpus, gpus_per_node)})
    shown = ", ".join(map(str, sizes[:-1])) + (" or " if len(sizes) > 1 else "") + str(sizes[-1])
    if all(global_batch % d for d in sizes):
        least = sizes[0]
        return (
            f"search: global_batch={global_batch} is not a multiple of any data size a layout of "
            f"{gpus} GPUs can have: data = gpus / (tensor x pipeline) is {shown} (tensor within "
            f"a node of {gpus_per_node} dividing heads={model.heads}, pipeline dividing "
            f"layers={model.layers}), and every data rank takes an equal share of the batch. "
            f"Use a global batch that is a multiple of {least} (e.g. "
            f"{-(-global_batch // least) * least}), or fewer GPUs"
        )
    narrowed = ", ".join(f"{k}={v!r}" for k, v in sorted(space.items())) or "nothing"
    return (
        f"search: no layout of {gpus} GPUs splits global_batch={global_batch} in the space "
        f"searched (narrowed by {narrowed}): a microbatch size must divide a data rank's batch, "
        f"and a schedule's stages must divide layers={model.layers}; widen the space"
    )


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
    max_simulated_microbatches: int = MAX_SIMULATED,
    overlap_grad_reduce: bool = True,
    memory_limit: float | None = None,
    **space: Any,
) -> list[Estimate]:
    """The ``top`` fastest layouts that fit, best first (see the module docstring).

    ``space`` narrows :func:`candidates` (``schedules=``, ``recompute=``, ``microbatches=``,
    ``interleaves=``, ``sequence_parallel=``, ``zero=``, ``expert=``, ``overlap=``; ``zero1=``
    the old spelling of ``zero=``). Candidates whose programs would be
    longer than ``max_simulated_microbatches`` (ranks x microbatches x chunks) keep their
    closed-form price.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise InvalidArgument(f"search(gpus={gpus!r}): a positive integer")
    check_gpus(gpus, "search")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise InvalidArgument(f"search(top={top!r}): a positive integer")
    kw: dict[str, Any] = {"calibration": calibration, "overlap_grad_reduce": overlap_grad_reduce}
    # the limit counts layouts apart from their sharding level: the levels of one layout share
    # its simulation and memory floor (cached), so they add little to the search's time
    most = MAX_LAYOUTS * len(_zero_levels(space.get("zero"), space.get("zero1")))
    layouts = list(
        islice(
            candidates(model, gpus, global_batch, gpus_per_node=cluster.gpus_per_node, **space),
            most + 1,
        )
    )
    if len(layouts) > most:
        raise InvalidArgument(
            f"search: more than {MAX_LAYOUTS:,} layouts of {gpus} GPUs (each at its sharding "
            f"levels) to price for "
            f"layers={model.layers} and global_batch={global_batch} (they have many divisors in "
            "common), more than the search prices in seconds; narrow it (search or plan with "
            "schedules=, recompute=, microbatches=, interleaves=, sequence_parallel=, zero=), or "
            "price one layout (funcpipe plan with --tensor, --pipeline, ...)"
        )

    def simulates(e: Estimate) -> bool:
        lay = e.layout
        small = simulable(lay.pipeline, e.microbatches, lay.interleave, max_simulated_microbatches)
        return simulate and lay.pipeline > 1 and small

    def may_fit(e: Estimate) -> bool:  # the simulated memory is never below the floor
        return e.memory_floor_bytes <= limit if simulates(e) else e.fits

    limit = cluster.gpu.memory if memory_limit is None else memory_limit
    fast = []
    for layout in layouts:
        e = estimate(
            model, cluster, layout, global_batch=global_batch, memory_limit=memory_limit, **kw
        )
        if may_fit(e):
            fast.append(e)
    if not layouts:
        raise InvalidArgument(_no_layout(model, gpus, global_batch, cluster.gpus_per_node, space))
    no_fit = (
        f"search: no layout of {gpus} GPUs fits {model} with global_batch={global_batch} "
        f"in {limit / 2**30:.0f} GiB per GPU; add GPUs, allow recompute or sharding (zero=), "
        "or use a GPU with more memory"
    )
    if not fast:
        raise InvalidArgument(no_fit)
    fast.sort(key=lambda e: e.step_time_s)
    if not simulate:
        return fast[:top]
    priced: list[Estimate] = []
    prices: list[float] = []  # sorted

    def price(e: Estimate) -> None:
        if simulates(e):
            e = estimate(
                model,
                cluster,
                e.layout,
                global_batch=global_batch,
                simulate=True,
                memory_limit=memory_limit,
                **kw,
            )
            if not e.fits:
                return
        priced.append(e)
        insort(prices, e.step_time_s)

    # the closed form's favourites first, for a good price to prune by; then, by their floors
    # (the closed form where the simulator does not run, else a lower bound of the simulated
    # time: never above the candidate's final price), each whose floor is below the top-th
    # price so far. Exact: no candidate left out could have made the top.
    best = fast[0].step_time_s
    want = max(refine, top)
    first = [e for k, e in enumerate(fast) if k < want or e.step_time_s <= best * (1 + margin)]
    first = first[: 2 * want]
    for e in first:
        price(e)
    rest = sorted(
        (
            (e.bound_s if simulates(e) else e.step_time_s, k, e)
            for k, e in enumerate(fast[len(first) :])
        ),
        key=lambda x: x[:2],
    )
    for low, _, e in rest:
        if len(prices) >= top and low >= prices[top - 1]:
            break
        price(e)
    if not priced:  # every candidate was priced (none gave a price to stop at): none fits
        raise InvalidArgument(no_fit)
    priced.sort(key=lambda e: e.step_time_s)
    return priced[:top]
