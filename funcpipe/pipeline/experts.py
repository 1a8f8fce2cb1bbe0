"""The parameter leaves a :class:`~funcpipe.Pipeline` reduces over the expert axis.

A mixture-of-experts layer split over the mesh's ``expert`` axis (:mod:`funcpipe.models.moe`,
``ParallelConfig(expert=ep)``) holds on each copy only its ``1/ep`` of the experts' weights. The
data-parallel REDUCE must then sum those leaves over the copies that hold the *same* experts
(the mesh's ``expert_data`` axis), while the dense leaves (attention, norms, the router, shared
experts) sum over every copy as before. ``Pipeline(experts=[(stage, path), ...])`` names them,
in the form ``ties`` uses; :func:`funcpipe.models.gpt.expert_paths` lists a GPT's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from funcpipe.errors import InvalidArgument
from funcpipe.stages.ties import TiePath, resolve

__all__ = ["check_experts", "expert_leaves", "expert_size"]


def expert_size(mesh: Any) -> int:
    """The mesh's expert-parallel size (1 without a mesh or without experts)."""
    return 1 if mesh is None else int(getattr(mesh.config, "expert", 1))


def check_experts(
    experts: Sequence[TiePath] | None,
    n_stages: int,
    *,
    mesh: Any,
    transport: str,
    ties: Any,
) -> tuple[TiePath, ...]:
    """``experts`` as a tuple of ``(stage, path)``, refused where it cannot be honoured."""
    if experts is None:
        experts = ()
    if isinstance(experts, str | bytes) or not isinstance(experts, Sequence):
        raise InvalidArgument(
            f"experts={experts!r}: a list of (stage, path) pairs naming the parameter leaves "
            "split over the expert axis, e.g. [(1, 'blocks.0.moe.w_in')] "
            "(funcpipe.models.gpt.expert_paths(config, stages) lists a GPT's)"
        )
    out: list[TiePath] = []
    for k, item in enumerate(experts):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int)):
            raise InvalidArgument(
                f"experts[{k}]={item!r}: each entry is a (stage, path) pair, e.g. "
                "(1, 'blocks.0.moe.w_in')"
            )
        if not 0 <= item[0] < n_stages:
            raise InvalidArgument(
                f"experts[{k}]={item!r}: stage {item[0]} is not one of the {n_stages} stages"
            )
        out.append(item)
    ep = expert_size(mesh)
    if ep > 1 and not out:
        raise InvalidArgument(
            f"the mesh splits experts over {ep} copies (expert={ep}) but experts= names no "
            "parameter leaves: the data REDUCE would average different experts' weights "
            "together. Pass experts=gpt.expert_paths(config, stages) (or your layers' "
            "(stage, path) pairs)"
        )
    if ep > 1 and transport != "dist":
        raise InvalidArgument("expert parallelism needs transport='dist' (one rank a process)")
    tied = {(s, str(p)) for members in (ties or {}).values() for s, p in members}
    for s, p in out:
        if (s, str(p)) in tied:
            raise InvalidArgument(
                f"experts names ({s}, {p!r}), which ties= also names: an expert's weights are "
                "held by one expert rank, a tie's by every rank it spans; name it in one"
            )
    return tuple(out)


def expert_leaves(
    params: Sequence[Any], experts: Sequence[TiePath], ep: int
) -> dict[int, frozenset[int]]:
    """Per stage, the indices (among its flattened leaves) of the leaves ``experts`` names,
    checked against ``params``; none at ``ep == 1`` (one expert rank: every copy holds every
    expert, and the leaves reduce and shard over every copy like the dense ones)."""
    found: dict[int, set[int]] = {}
    for k, (s, path) in enumerate(experts):
        found.setdefault(s, set()).add(resolve(params[s], path, f"experts[{k}]"))
    return {s: frozenset(v) for s, v in found.items()} if ep > 1 else {}
