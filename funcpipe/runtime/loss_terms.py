"""What a ``loss_fn`` (or ``metric_fn``) returns, and how a step turns microbatches into one loss.

Two conventions, told apart by what the function returns for each microbatch:

- **a scalar tensor** (e.g. ``F.cross_entropy(...)``, mean-reduced): the step's loss is the mean
  over microbatches (and data-parallel copies) of the per-microbatch values. That equals the
  full batch's mean only when every microbatch counts the same number of items;
- **a pair** ``(sum, count)``: the sum of the per-item losses and how many items it counts
  (e.g. the tokens whose label is not ``ignore_index``). The step's loss is then
  ``sum over all microbatches and copies / total count``, exactly the full batch's mean, and
  the gradients are those of that loss, however the items fall into microbatches.

:func:`loss_and_count` checks a ``loss_fn`` result and splits it; :func:`metric_terms` does the
same for a metric (its pair packed into one float64 tensor ``[sum, count]``);
:func:`count_factor` is the one multiplication that turns the gradients a step summed (each
microbatch seeded like a mean: ``1 / microbatches``, copies averaged) into the gradients of the
token-weighted loss. Every function here is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from funcpipe.errors import InvalidArgument
from funcpipe.tree import tree_leaves

__all__ = ["count_factor", "loss_and_count", "metric_terms", "scale_grads"]

Tensor = torch.Tensor


def _count(value: Any, where: str, device: torch.device) -> Tensor:
    """A count as a detached float64 scalar on ``device``."""
    if isinstance(value, bool) or not isinstance(value, int | float | Tensor):
        raise InvalidArgument(
            f"{where} returned (sum, count) with count of type {type(value).__name__}; the "
            "count is the number of items the sum adds up: an int or a one-element tensor, "
            "e.g. (labels != -100).sum()."
        )
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex():
            raise InvalidArgument(
                f"{where} returned (sum, count) with a count of shape {tuple(value.shape)}; "
                "it must be one number: the number of items the sum adds up."
            )
        return value.detach().reshape(()).to(device=device, dtype=torch.float64)
    if not value >= 0 or value == float("inf"):  # (NaN fails the first test)
        raise InvalidArgument(
            f"{where} returned a count of {value}; a count is the number of items the sum adds "
            "up: >= 0 and finite."
        )
    return torch.tensor(float(value), dtype=torch.float64, device=device)


def loss_and_count(value: Any, where: str) -> tuple[Tensor, Tensor | None]:
    """``loss_fn``'s result for one microbatch as ``(loss, count)``: ``count`` is ``None`` for a
    scalar loss (the mean convention) and a float64 scalar for a ``(sum, count)`` pair."""
    if isinstance(value, tuple | list):
        if len(value) != 2 or not isinstance(value[0], Tensor):
            raise InvalidArgument(
                f"{where} returned a {type(value).__name__} of {len(value)} items; return a "
                "scalar tensor (the microbatch's mean loss) or a pair (sum, count): the "
                "summed loss over the items and how many items it counts, e.g. "
                "(F.cross_entropy(logits, labels, ignore_index=-100, reduction='sum'), "
                "(labels != -100).sum())."
            )
        loss, count = value
        _scalar(loss, where, "the sum of the pair")
        return loss.reshape(()), _count(count, where, loss.device)
    _scalar(value, where, "the loss")
    return value.reshape(()), None


def _scalar(value: Any, where: str, what: str) -> None:
    if not isinstance(value, Tensor) or value.numel() != 1:
        got = (
            f"a tensor of shape {tuple(value.shape)}"
            if isinstance(value, Tensor)
            else type(value).__name__
        )
        raise InvalidArgument(
            f"loss_fn must return a scalar tensor or a (sum, count) pair; {what} from {where} "
            f"is {got}. Reduce it (.mean() for the mean convention, or return (loss.sum(), "
            "count) to weight microbatches by their counts)."
        )


def metric_terms(value: Any, where: str) -> Tensor:
    """``metric_fn``'s result as float64: a scalar (the mean convention) or ``[sum, count]``."""
    if isinstance(value, tuple | list):
        if len(value) != 2:
            raise InvalidArgument(
                f"{where} returned {len(value)} items; return a scalar or a pair (sum, count)."
            )
        s = torch.as_tensor(value[0]).detach()
        if s.numel() != 1:
            raise InvalidArgument(f"{where}: the sum of (sum, count) must be one number.")
        s = s.reshape(()).to(torch.float64)
        return torch.stack([s, _count(value[1], where, s.device)])
    return torch.as_tensor(value, dtype=torch.float64).detach().reshape(())


def count_factor(count: float, microbatches: int, copies: int) -> float:
    """What the gradients a step summed are multiplied by for the token-weighted loss.

    The interpreter seeds each microbatch's backward with ``1 / microbatches`` and averages the
    data-parallel copies, so it holds ``sum_items grad / (microbatches * copies)``; the
    token-weighted loss wants ``sum_items grad / count``."""
    if count <= 0:
        raise InvalidArgument(
            f"loss_fn counted {count:g} items over the whole batch (the counts of its "
            "(sum, count) results add up to that): a batch with nothing to learn from has no "
            "mean loss. Check the labels (all ignore_index?) or skip such batches."
        )
    return microbatches * copies / count


def scale_grads(trees: Sequence[Any], factor: float) -> None:
    """Multiply every gradient tensor of ``trees`` (one pytree or None per stage) in place,
    each once (a tied parameter's total may stand under several names)."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for tree in trees:
        if tree is None:
            continue
        for t in tree_leaves(tree):
            if not isinstance(t, Tensor) or not (t.is_floating_point() or t.is_complex()):
                continue
            key = (t.untyped_storage().data_ptr(), int(t.storage_offset()), tuple(t.shape))
            if t.numel() and key in seen:
                continue
            seen.add(key)
            by_kind.setdefault((t.device, t.dtype), []).append(t)
    for ts in by_kind.values():
        torch._foreach_mul_(ts, factor)
