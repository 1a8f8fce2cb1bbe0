"""The arguments of :func:`funcpipe.schedule.auto.auto` checked and made a :class:`Problem`.

:func:`_problem` reads the sizes, the placement, the costs and the limit (a count of
activations, or bytes with ``max_memory`` and ``memory``: :func:`_memory_limit`) into the
:class:`~funcpipe.schedule.problem.Problem` the heuristic and the exact solver both solve;
:func:`minimum_activations` is the least limit any schedule can keep. Every error message is
``auto``'s own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.gen_common import check_int, placement_loop, placement_v
from funcpipe.schedule.problem import Problem
from funcpipe.schedule.simulate import Costs

__all__ = ["minimum_activations"]


def minimum_activations(*, chunks: int) -> int:
    """The fewest activations any training schedule keeps on a rank holding ``chunks`` stages.

    One microbatch's forward passes through every stage of the rank before the backward of the
    deepest of them, and each activation lives until its own backward, so all ``chunks`` are
    alive at once on every rank.
    """
    return check_int("minimum_activations", "chunks", chunks)


def _problem(
    ranks: object,
    microbatches: object,
    chunks: object,
    placement: object,
    costs: object,
    max_activations: object,
    max_memory: object = None,
    memory: object = None,
) -> Problem:
    p = check_int("auto", "ranks", ranks)
    m = check_int("auto", "microbatches", microbatches)
    kind = placement.lower() if isinstance(placement, str) else None
    if kind not in ("loop", "v"):
        raise InvalidArgument(
            f"auto: placement={placement!r}; use 'loop' (stage s on rank s % ranks) or 'v' "
            "(two chunks per rank in a V, as ZB-V)"
        )
    if kind == "v":
        v = 2 if chunks is None else check_int("auto", "chunks", chunks)
        if v != 2:
            raise InvalidArgument(
                f"auto: chunks={chunks!r} with placement='v'; the V placement holds exactly 2 "
                "chunks per rank (pass chunks=2 or leave it out, or use placement='loop')"
            )
        stage_rank = placement_v(p)
    else:
        v = 1 if chunks is None else check_int("auto", "chunks", chunks)
        stage_rank = placement_loop(p, v)
    n = p * v
    if costs is None:
        costs = Costs()
    if not isinstance(costs, Costs):
        raise InvalidArgument(
            f"auto: costs={costs!r}; pass a funcpipe.schedule.Costs (e.g. Costs(f=1, b=2, w=1), "
            "or the result of funcpipe.profile_stages)"
        )
    per: dict[str, tuple[float, ...]] = {}
    for name in ("f", "b", "w", "full"):
        value = getattr(costs, name)
        if value is None:  # full: b + w
            per[name] = tuple(x + y for x, y in zip(per["b"], per["w"], strict=True))
            continue
        if isinstance(value, Sequence):
            if len(value) != n:
                raise InvalidArgument(
                    f"auto: costs.{name} has {len(value)} value(s) but {p} ranks x {v} chunk(s) "
                    f"make {n} stages; give one value per stage (stage s in model order) or one "
                    "number for all"
                )
            per[name] = tuple(float(x) for x in value)
        else:
            per[name] = (float(value),) * n
    # the communication inside a stage (Costs.f_comm, b_comm): alone, it adds to the stage's
    # F (and R) and to its B and I; auto prices pairs after the search (auto._paired)
    for name, into in (("f_comm", ("f",)), ("b_comm", ("b", "full"))):
        value = getattr(costs, name)
        extra = (
            tuple(float(x) for x in value) if isinstance(value, Sequence) else (float(value),) * n
        )
        if len(extra) != n:
            raise InvalidArgument(
                f"auto: costs.{name} has {len(extra)} value(s) but the program has {n} stages; "
                "give one value per stage or one number for all"
            )
        for k in into:
            per[k] = tuple(a + e for a, e in zip(per[k], extra, strict=True))
    least = minimum_activations(chunks=v)
    if max_activations is None:
        cap = (m * v,) * p
    elif isinstance(max_activations, Sequence) and not isinstance(max_activations, str):
        if len(max_activations) != p:
            raise InvalidArgument(
                f"auto: max_activations={list(max_activations)!r} has {len(max_activations)} "
                f"value(s) for ranks={p}; give one limit per rank, or one int for all"
            )
        cap = tuple(
            _limit(x, least, f"max_activations[{r}]") for r, x in enumerate(max_activations)
        )
    else:
        limit = _limit(max_activations, least, "max_activations")
        cap = (limit,) * p
    caps: tuple[float, ...] = tuple(min(c, m * v) for c in cap)
    weights: tuple[float, ...] = ()
    kept: tuple[float, ...] = ()
    if max_memory is not None or memory is not None:
        if max_activations is not None:
            raise InvalidArgument(
                "auto: give max_activations (a count of activations) or max_memory (bytes, with "
                "memory=), not both"
            )
        weights, kept, caps = _memory_limit(max_memory, memory, p, stage_rank)
    return Problem(
        p,
        m,
        v,
        kind,
        stage_rank,
        per["f"],
        per["b"],
        per["w"],
        costs.comm,
        caps,
        per["full"],
        weights,
        kept,
    )


def _memory_limit(
    max_memory: object, memory: object, p: int, placement: Sequence[int]
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Each stage's weight (what its F holds until its I: max(activation, for_w)), what stays
    from its I to its W (for_w), and each rank's cap, from ``auto(max_memory=...,
    memory=...)``."""
    n = len(placement)
    if memory is None:
        raise InvalidArgument(
            "auto: max_memory needs memory=, each stage's activation bytes in model order (e.g. "
            "funcpipe.measure_memory(stages, params, example))"
        )
    if max_memory is None:
        raise InvalidArgument(
            "auto: memory= is used with max_memory=, the most activation bytes a rank may keep; "
            "pass both (or max_activations alone)"
        )
    if hasattr(memory, "activation") and hasattr(memory, "for_w"):
        act, kept = list(memory.activation), list(memory.for_w)
    elif isinstance(memory, Sequence) and not isinstance(memory, str):
        act = kept = list(memory)
    else:
        raise InvalidArgument(
            f"auto: memory={memory!r}; pass a StageMemory (funcpipe.measure_memory) or "
            "one number of bytes per stage"
        )
    for name, values in (("activation", act), ("for_w", kept)):
        if len(values) != n or not all(_size(x) for x in values):
            raise InvalidArgument(
                f"auto: memory {name}={values!r}; give one number >= 0 per stage ({n} stages, "
                "model order)"
            )
    weights = tuple(max(float(a), float(k)) for a, k in zip(act, kept, strict=True))
    if isinstance(max_memory, Sequence) and not isinstance(max_memory, str):
        limits = list(max_memory)
        if len(limits) != p:
            raise InvalidArgument(
                f"auto: max_memory={limits!r} has {len(limits)} value(s) for ranks={p}; give "
                "one limit per rank, or one number for all"
            )
    else:
        limits = [max_memory] * p
    caps = []
    for r, x in enumerate(limits):
        if not _size(x):
            raise InvalidArgument(f"auto: max_memory={max_memory!r}; a limit is a number >= 0")
        least = sum(weights[s] for s, q in enumerate(placement) if q == r)
        if float(x) < least:
            raise InvalidArgument(
                f"auto: max_memory={max_memory!r} leaves rank {r} {x}, below what any schedule "
                f"needs there: one microbatch through all of its stages keeps {least:g} (each "
                "stage's max(activation, for_w)); pass at least that"
            )
        caps.append(float(x))
    return weights, tuple(float(k) for k in kept), tuple(caps)


def _size(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x) and x >= 0


def _limit(value: object, least: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(
            f"auto: {name}={value!r}; a limit is a whole number of (stage, microbatch) "
            "activations per rank (as peak_activations counts them)"
        )
    if value < least:
        raise InvalidArgument(
            f"auto: {name}={value!r} is below what any schedule needs: a rank holding {least} "
            f"stage(s) keeps the activation(s) of all {least} alive at once for each "
            f"microbatch, before the first of their backwards; pass {name} >= {least}"
        )
    return value
