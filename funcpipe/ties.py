"""Tied parameters: one value used by several stages, its gradients summed.

``ties={"wte": [(0, "embed.weight"), (3, "head.weight")]}`` names leaves of stages' params
pytrees (a key, a dotted path or a tuple of keys). The first listed value is used for all of
them; a ``REDUCE s tie:NAME`` on every rank holding one sums their gradients (in one process the
values are also made one and the same before the step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optree

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.ir import Program, reduce
from funcpipe.tree import tree_flatten, tree_unflatten

__all__ = ["TiePath", "add_tie_reduce", "check_ties", "resolve", "tie_values"]

TiePath = tuple[int, Any]  # (stage, key or dotted path or tuple of keys)


def check_ties(ties: Mapping[str, Sequence[TiePath]] | None, n_stages: int) -> dict[str, list]:
    """``ties`` validated and normalised to ``{name: [(stage, path), ...]}``."""
    out = {str(k): list(v) for k, v in (ties or {}).items()}
    for name, members in out.items():
        if len(members) < 2 or any(not (isinstance(m, tuple) and len(m) == 2) for m in members):
            raise InvalidArgument(
                f"ties[{name!r}]={members!r}: list at least two (stage, path) pairs"
            )
        for st, _ in members:
            if not (isinstance(st, int) and 0 <= st < n_stages):
                raise InvalidArgument(
                    f"ties[{name!r}] names stage {st!r}; stages are 0..{n_stages - 1}"
                )
    return out


def resolve(params: Any, path: Any, where: str) -> int:
    """Index among the flattened leaves of ``params`` of the leaf at ``path``."""
    node = params
    keys: Sequence[Any]
    if isinstance(path, tuple):
        keys = path
    elif isinstance(params, Mapping) and path in params:
        keys = (path,)
    elif isinstance(path, str):
        keys = path.split(".")
    else:
        keys = (path,)
    walked: list[Any] = []
    try:
        for k in keys:
            if isinstance(node, (list, tuple)):
                k = int(k)
            node = node[k]
            walked.append(k)
    except (KeyError, IndexError, TypeError, ValueError):
        raise InvalidArgument(
            f"{where}: path {path!r} does not name a leaf of that stage's params"
        ) from None
    # by position, not by identity: two paths may hold one tensor object (a tie inside a stage)
    for i, leaf_path in enumerate(optree.tree_paths(params, none_is_leaf=False)):
        if leaf_path == tuple(walked):
            return i
    raise InvalidArgument(f"{where}: path {path!r} names a subtree, not one tensor")


def tie_values(params: tuple[Any, ...], ties: Mapping[str, Sequence[TiePath]]) -> tuple[Any, ...]:
    """``params`` with every tied leaf replaced by the first listed one (same shape and dtype)."""
    out = list(params)
    for name, members in ties.items():
        (s0, path0), rest = members[0], members[1:]
        leaves0, _ = tree_flatten(out[s0])
        value = leaves0[resolve(out[s0], path0, f"ties[{name!r}]")]
        for s, path in rest:
            leaves, tree = tree_flatten(out[s])
            k = resolve(out[s], path, f"ties[{name!r}]")
            if leaves[k].shape != value.shape or leaves[k].dtype != value.dtype:
                raise InvalidArgument(
                    f"ties[{name!r}]: stage {s} {path!r} is {leaves[k].dtype}{list(leaves[k].shape)} "
                    f"but stage {s0} {path0!r} is {value.dtype}{list(value.shape)}; tied "
                    "parameters must have one shape and dtype"
                )
            leaves[k] = value
            out[s] = tree_unflatten(tree, leaves)
    return tuple(out)


def add_tie_reduce(program: Program, ties: Mapping[str, Sequence[TiePath]]) -> Program:
    """One ``REDUCE s tie:name`` per rank holding a tied stage, at the end of that rank, in name
    order (every rank meets its tie groups in the same order). The interpreter sums the tied
    gradients of all the rank's stages in the tie before the collective."""
    owners = program.replica_of or tuple(range(program.n_stages))
    ranks = [list(r) for r in program.ranks]
    for name in sorted(ties):
        stages = {s for s, _ in ties[name]}
        held: dict[int, int] = {}
        for slot, o in enumerate(owners):
            if o in stages:
                r = program.placement[slot]
                held[r] = max(held.get(r, slot), slot)
        for r, slot in sorted(held.items()):
            ranks[r].append(reduce(slot, f"tie:{name}"))
    return program.replace(ranks=tuple(tuple(r) for r in ranks))
