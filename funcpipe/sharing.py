"""Ties found from storage: parameters of different stages that are one and the same tensor.

A model built as one ``nn.Module`` often shares a parameter between modules (GPT-2's token
embedding and LM head). Cut into stages, each stage's params hold a detached alias of that one
tensor, and the pipeline must be told they are tied (``ties=``) or each stage would update its own
copy. :func:`find_ties` reads that from the params themselves: leaves that view the same storage
(same data pointer, offset, shape and strides) in two or more stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from funcpipe.tree import tree_flatten

__all__ = ["describe_ties", "find_ties"]

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

    ``params`` holds one params pytree per stage. Leaves of two or more *different* stages that
    view the same storage the same way are one parameter; each such group is returned under the
    name of its first member (its path in the first stage holding it), in the form
    ``Pipeline(ties=...)`` and ``reference_step(ties=...)`` take. A tensor shared inside one
    stage needs no tie (the stage sees one value) and is not listed. Meta tensors have no
    storage and are never tied.
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
            members = groups.setdefault(key, [])
            if all(ms != s for ms, _ in members):
                members.append((s, path))
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
