"""Tied parameters: one value used by several stages, its gradients summed.

``ties={"wte": [(0, "embed.weight"), (3, "head.weight")]}`` names leaves of stages' params
pytrees (a key, a dotted path or a tuple of keys). The first listed value is used for all of
them in one process; over processes the copies must hold the same value (checked at a
Pipeline's first step); a ``REDUCE s tie:NAME`` on every rank holding one sums their gradients (in one process the
values are also made one and the same before the step).

Ties may also be found rather than declared: a model built as one ``nn.Module`` often shares a
parameter between modules (GPT-2's token embedding and LM head). Cut into stages, each stage's
params hold a detached alias of that one tensor. :func:`find_ties` reads the ties from the params
themselves: leaves that view the same storage (same data pointer, offset, shape and strides) in two
or more stages, or under two names in one stage (each name then gets the total gradient).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.ir import Program, reduce
from funcpipe.tree import tree_flatten, tree_unflatten

__all__ = [
    "TiePath",
    "add_tie_reduce",
    "check_ties",
    "describe_ties",
    "find_ties",
    "resolve",
    "tie_values",
]

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


# ------------------------------------------------------------ ties found from shared storage

Key = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.device]


def _key(t: torch.Tensor) -> Key | None:
    if t.device.type == "meta" or t.numel() == 0:
        return None  # no storage to compare
    ptr = t.untyped_storage().data_ptr()
    return (ptr, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()), t.device)


def _paths(tree: Any) -> list[Any]:
    """Each leaf's path as ties take it: the key itself at depth one, else a tuple of keys."""
    out: list[Any] = []
    for accessor in optree.tree_accessors(tree, none_is_leaf=False):
        keys = tuple(entry.entry for entry in accessor)
        out.append(keys[0] if len(keys) == 1 else keys)
    return out


def find_ties(params: Sequence[Any]) -> dict[str, list[tuple[int, Any]]]:
    """Ties between stages, found from shared storage: ``{name: [(stage, path), ...]}``.

    ``params`` holds one params pytree per stage. Two or more leaves that view the same storage
    the same way are one parameter, in different stages or under two names of one stage (each
    leaf is differentiated on its own, so a name the stage reads and one it only holds need the
    tie for both to get the total); each such group is returned under the name of its first
    member (its path in the first stage holding it), in the form ``Pipeline(ties=...)`` and
    ``reference_step(ties=...)`` take. Meta tensors have no storage and are never tied.
    """
    groups: dict[Key, list[tuple[int, Any]]] = {}
    for s, p in enumerate(params):
        leaves, _ = tree_flatten(p)
        paths = _paths(p)
        for path, t in zip(paths, leaves, strict=True):
            if not isinstance(t, torch.Tensor):
                continue
            key = _key(t)
            if key is None:
                continue
            groups.setdefault(key, []).append((s, path))
    ties: dict[str, list[tuple[int, Any]]] = {}
    for members in groups.values():
        if len(members) > 1:
            s0, p0 = members[0]
            name = p0 if isinstance(p0, str) else ".".join(str(k) for k in p0)
            ties[name if name not in ties else f"{name}@{s0}"] = members
    return ties


def describe_ties(ties: dict[str, list[tuple[int, Any]]]) -> str:
    """One line per tie: ``transformer.wte.weight: stage 0 'transformer.wte.weight' = stage 3
    'lm_head.weight'``; ``"no ties"`` when there are none."""
    if not ties:
        return "no ties"
    return "\n".join(
        f"{name}: " + " = ".join(f"stage {s} {p!r}" for s, p in members)
        for name, members in ties.items()
    )
