"""A rank's share of a step, as its interpreter receives it: the parameter leaves of the stages
it runs, and its part of the batch on its device.

The parameters are detached from the caller's tensors (the step is pure), require grad when the
program trains, and are kept in ``grad_dtype`` where that is wider than their own dtype; the
batch, side inputs and targets go where the rank's stages run, once per microbatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from funcpipe.tree import tree_map

__all__ = ["kept_dtype", "param_leaves", "to_device"]

Tensor = torch.Tensor


def kept_dtype(t: Tensor, grad_dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a parameter leaf is kept (and its gradient summed) in for the step, when
    not its own: ``grad_dtype`` for floating leaves of fewer bits."""
    g = grad_dtype
    if g is None or not t.is_floating_point() or t.dtype.itemsize >= g.itemsize:
        return None
    return g


def param_leaves(
    leaves: Sequence[Tensor], *, training: bool, grad_dtype: torch.dtype | None
) -> tuple[list[Tensor], tuple[torch.dtype | None, ...] | None]:
    """One stage's parameter leaves as the step uses them (detached, in their kept dtype,
    requiring grad if floating and training), and the leaves' own dtypes where one was kept
    in another (``None`` at the others; ``None`` in all when none was)."""
    kept = [kept_dtype(t, grad_dtype) if training else None for t in leaves]
    held = [
        (t.detach() if k is None else t.detach().to(k)).requires_grad_(_diff(t) and training)
        for t, k in zip(leaves, kept, strict=True)
    ]
    if not any(k is not None for k in kept):
        return held, None
    return held, tuple(None if k is None else t.dtype for t, k in zip(leaves, kept, strict=True))


def _diff(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree``'s tensors on ``device`` (no copy when they are there; asynchronous from pinned
    memory)."""

    def move(t: Any) -> Any:
        if not isinstance(t, Tensor) or t.device == device:
            return t
        return t.to(device, non_blocking=t.is_pinned())

    return tree_map(move, tree)
