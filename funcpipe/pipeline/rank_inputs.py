"""A rank's share of a step, as its interpreter receives it: the parameter leaves of the stages
it runs, and its part of the batch on its device.

The parameters are detached from the caller's tensors (the step is pure), require grad when the
program trains, and are kept in ``grad_dtype`` where that is wider than their own dtype; the
batch, side inputs and targets go where the rank's stages run, once per microbatch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from funcpipe.distributed.world import transport_device
from funcpipe.errors import InvalidArgument
from funcpipe.pipeline.microbatch import split
from funcpipe.stages.shapes import stage_device
from funcpipe.stages.stage import as_inputs
from funcpipe.tree import tree_map

__all__ = ["INPUTS", "kept_dtype", "param_leaves", "place", "split_batch", "to_device"]

INPUTS = "inputs"  # with side_inputs: the batch field the entry stage takes

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


def split_batch(
    batch: Any, side_inputs: Mapping[int, Sequence[str]], m: int, dim: Any
) -> tuple[list[tuple[Any, ...]], list[dict[int, dict[str, Any]]], Any]:
    """The batch as ``m`` microbatches: the entry stage's positional inputs and, with
    ``side_inputs``, each stage's keyword inputs; and the batch the targets are split beside
    (the fields the stages read)."""
    if not side_inputs:
        return [as_inputs(pc) for pc in split(batch, m, dim=dim)], [{} for _ in range(m)], batch
    if not isinstance(batch, Mapping) or INPUTS not in batch:
        raise InvalidArgument(
            f"with side_inputs the batch must be a dict holding the first stage's input "
            f"under {INPUTS!r}; got {type(batch).__name__}"
            + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
        )
    needed = {k for names in side_inputs.values() for k in names}
    missing = sorted(needed - set(batch))
    if missing:
        raise InvalidArgument(
            f"side_inputs need batch keys {missing} that the batch lacks (it has {sorted(batch)})"
        )
    batch = {k: batch[k] for k in (needed | {INPUTS})}
    pieces = split(batch, m, dim=dim)
    entry = [as_inputs(pc[INPUTS]) for pc in pieces]
    side = [{s: {k: pc[k] for k in names} for s, names in side_inputs.items()} for pc in pieces]
    return entry, side, batch


def place(
    device: torch.device | None,
    params: Sequence[Any],
    local: Sequence[int] | None,
    dist: bool,
) -> torch.device:
    """Where a rank's tensors live (received activations and gradients, the batch, the
    loss): ``device``, else where its stages' parameters are (``local``: the owner stages
    it runs; default all), else, for a rank whose stages have no parameters, the device of
    the process group's backend (CUDA under NCCL; ``dist``: over processes), else the CPU."""
    if device is not None:
        return device
    held = params if local is None else [params[o] for o in local]
    return stage_device(held, transport_device(None) if dist else None)
