"""Pytree helpers: thin wrappers over optree with funcpipe's conventions.

``None`` is never a leaf (``none_is_leaf=False``): a ``None`` inside a tuple or dict is an empty
node, so ``(tensor, None)`` has one leaf. Leaf paths in error messages are written the way you
would index the tree in Python, e.g. ``batch['x'][0]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch
from optree import PyTreeSpec

from funcpipe.errors import InvalidArgument

__all__ = [
    "PyTreeSpec",
    "check_tensor_tree",
    "leaf_paths",
    "tree_add",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_structure",
    "tree_to",
    "tree_unflatten",
    "tree_zeros_like",
]


def tree_flatten(tree: Any) -> tuple[list[Any], PyTreeSpec]:
    """``tree -> (leaves, treespec)``; ``None`` is an empty node, not a leaf."""
    return optree.tree_flatten(tree, none_is_leaf=False)


def tree_unflatten(treespec: PyTreeSpec, leaves: Any) -> Any:
    """Inverse of :func:`tree_flatten`."""
    return optree.tree_unflatten(treespec, leaves)


def tree_leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in flattening order."""
    return optree.tree_leaves(tree, none_is_leaf=False)


def tree_structure(tree: Any) -> PyTreeSpec:
    """The treespec of ``tree``."""
    return optree.tree_structure(tree, none_is_leaf=False)


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Apply ``fn`` leafwise over ``tree`` and the trees in ``rest`` (same structure)."""
    return optree.tree_map(fn, tree, *rest, none_is_leaf=False)


def leaf_paths(tree: Any, *, name: str) -> list[str]:
    """Python-syntax paths of the leaves of ``tree``, rooted at ``name`` (``batch['x'][0]``)."""
    return [accessor.codify(name) for accessor in optree.tree_accessors(tree, none_is_leaf=False)]


def check_tensor_tree(tree: Any, *, name: str) -> None:
    """Raise :class:`InvalidArgument` unless every leaf of ``tree`` is a ``torch.Tensor``.

    ``name`` is the argument name used in the message, which also gives the leaf's path.
    """
    leaves = tree_leaves(tree)
    if all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return
    for path, leaf in zip(leaf_paths(tree, name=name), leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            raise InvalidArgument(
                f"{name} must be a pytree whose leaves are torch.Tensor; got {path}={leaf!r} "
                f"(a {type(leaf).__name__}). Convert it with torch.as_tensor(...), or keep "
                f"non-tensor values out of {name} (e.g. close over them in the stage function)."
            )


def tree_to(tree: Any, device: torch.device | str) -> Any:
    """Move every tensor leaf of ``tree`` to ``device``."""
    return tree_map(lambda t: t.to(device), tree)


def tree_zeros_like(tree: Any) -> Any:
    """A tree of zeros with the structure, shapes, dtypes and devices of ``tree``."""
    return tree_map(torch.zeros_like, tree)


def tree_add(a: Any, b: Any) -> Any:
    """Leafwise ``a + b``; both trees must have the same structure."""
    sa, sb = tree_structure(a), tree_structure(b)
    if sa != sb:
        raise InvalidArgument(
            f"tree_add needs two trees of the same structure; got a with structure {sa} and b "
            f"with structure {sb}."
        )
    return tree_map(torch.add, a, b)
