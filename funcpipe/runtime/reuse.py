"""Gradient memory written again, once nothing outside funcpipe holds it.

A step returns its gradient sums as new tensors (values the caller owns). On CPU a fresh
weight-sized tensor is fresh memory from the C allocator: a 4 MiB gradient is mapped anew and
every one of its 1024 pages faults on first write, inside the first backward of each stage, on
the step's critical path (traced: a stage's first B with 8 MiB of new gradients ran 2.9 ms over
its median, about 1.4 us a page). A training loop drops each step's
gradients soon after the update, so their memory could carry the next step's sums instead.

:class:`GradMemory` keeps the gradients a pipeline returned in its last two steps. Before a step
it offers each parameter leaf a kept tensor of the same shape, dtype and device, but only one
that nothing else refers to: no Python reference other than the pipeline's own, no other tensor
(a view, a ``detach()``, an autograd graph) on its storage. A tensor the caller still holds, in
any form, is never written: the caller sees values, never a mutation. Two steps are kept because
the usual loop (``loss, grads = pipe.step(...)``) still holds the previous step's gradients while
the next step runs.

The offered tensor rides on the step's own parameter leaf (a private, per-step tensor) and is
taken by whichever code writes that leaf's first gradient of the step (:func:`take`), which
writes it entirely (a product with ``out=``, or ``zero_()``). What is not taken is let go.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Mapping, Sequence

import torch

__all__ = ["GradMemory", "offer_to", "take"]

Tensor = torch.Tensor
_ATTR = "_funcpipe_spare"
_KEEP = 2  # steps of returned gradients kept (the caller usually holds the last one)
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # uses of a storage (torch 2.x)
_COUNTABLE = _use_count is not None and hasattr(torch.Tensor, "_use_count")


def _counts(t: Tensor) -> tuple[int, ...]:
    """References to ``t`` and to its storage, uses of its storage and of its tensor."""
    storage = t.untyped_storage()
    uses = int(_use_count(storage._cdata))  # type: ignore[misc]
    mine = int(t._use_count())  # type: ignore[attr-defined]
    return sys.getrefcount(t), sys.getrefcount(storage), uses, mine


def _alone() -> tuple[int, ...]:
    """:func:`_counts` of a tensor that only its caller's local name refers to, reached through
    as many calls as :func:`_unshared` reaches a kept one (the counts depend on the
    interpreter: measured, not assumed)."""
    kept = deque([torch.empty(1)])
    t = kept.popleft()
    return _through(t)


def _through(t: Tensor) -> tuple[int, ...]:
    return _counts(t)


_ALONE: tuple[int, ...] | None = None


def _unshared(t: Tensor) -> bool:
    """Nothing but the caller's one local name refers to ``t``, and nothing but ``t`` to its
    memory (no view, ``detach()``, storage handle, NumPy array or autograd graph)."""
    global _ALONE
    if not _COUNTABLE or t.requires_grad or t._base is not None:
        return False
    if _ALONE is None:
        _ALONE = _alone()
    return _counts(t) == _ALONE


class GradMemory:
    """The gradients a pipeline returned in its last steps, per (owner stage, leaf index)."""

    def __init__(self) -> None:
        self._kept: dict[tuple[int, int], deque[Tensor]] = {}

    def remember(self, grads: Mapping[int, Sequence[Tensor]]) -> None:
        """After a step: the gradient sums it returned, by owner stage."""
        for o, leaves in grads.items():
            for k, g in enumerate(leaves):
                if isinstance(g, Tensor) and g.is_contiguous():
                    self._kept.setdefault((o, k), deque(maxlen=_KEEP)).append(g)

    def offer(self, params: Mapping[int, Sequence[Tensor]]) -> None:
        """Before a step: give each of this step's parameter leaves (by owner stage) a kept
        gradient tensor nothing else holds, if there is one of its shape, dtype and device."""
        for o, leaves in params.items():
            for k, leaf in enumerate(leaves):
                kept = self._kept.get((o, k))
                if not kept or not leaf.requires_grad:
                    continue
                for _ in range(len(kept)):
                    t = kept.popleft()
                    if (
                        t.shape == leaf.shape
                        and t.dtype == leaf.dtype
                        and t.device == leaf.device
                        and _unshared(t)
                    ):
                        offer_to(leaf, t)
                        break
                    kept.append(t)
                del t

    def clear(self) -> None:
        self._kept.clear()


def offer_to(leaf: Tensor, spare: Tensor) -> None:
    """Let the first write of ``leaf``'s gradient this step go into ``spare``."""
    setattr(leaf, _ATTR, spare)


def take(leaf: Tensor) -> Tensor | None:
    """The memory offered for ``leaf``'s first gradient (its contents are stale: the caller
    overwrites all of it), or ``None``."""
    spare = leaf.__dict__.pop(_ATTR, None)
    return spare if isinstance(spare, Tensor) else None
