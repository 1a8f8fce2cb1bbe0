"""Gradient buckets: one all-reduce per ~25 MB of same-dtype, same-device tensors.

A REDUCE hands the transport a stage's gradient leaves, last layer's first (the order a backward
produces them, as DDP reduces). :func:`bucket_indices` groups them into buckets, in that order, of at most
:data:`BUCKET_BYTES` each; a tensor larger than that is a bucket alone, and tensors of another
dtype or device go to a bucket of their own kind. :class:`Bucket` flattens its tensors into one
buffer (a tensor alone is reduced in place, without a copy) and copies the reduced buffer back
into them, as views.

Every rank of a group calls this with tensors of the same shapes and dtypes in the same order
(the same stage's gradients), so every rank forms the same buckets and posts the same
collectives in the same order, as NCCL requires. The sums are exact in the sense that matters:
each element is still the sum of the same per-rank values; only its position in the buffer
changes. With two ranks that sum is ``a + b`` whatever the position, bit for bit; with more, an
all-reduce algorithm may add the ranks' values in an order that depends on where an element
falls in the buffer (gloo's and NCCL's rings start each chunk at another rank), so a bucketed
sum may differ from a per-tensor one in the last bit, as two DDP runs with other bucket sizes do.

The buffers cost one extra copy of the reduced gradients while the reduction is in flight,
freed when it completes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["BUCKET_BYTES", "Bucket", "bucket_indices"]

Tensor = torch.Tensor

# 25 MiB: DDP's bucket_cap_mb. On GPUs one NCCL all-reduce per bucket replaces one per leaf
# (a launch and a synchronisation each); on the CPU (gloo) measured in docs/benchmarks.md.
# 0 reduces every tensor alone (the per-leaf reduction, kept for comparisons).
BUCKET_BYTES = 25 * 2**20


def bucket_indices(tensors: Sequence[Tensor], cap: int | None = None) -> list[list[int]]:
    """The buckets of ``tensors``: lists of their indices, each of one dtype and device and at
    most ``cap`` bytes (default :data:`BUCKET_BYTES`) unless it holds one tensor. Buckets are
    ordered by their first tensor, and tensors keep their order within a bucket."""
    limit = BUCKET_BYTES if cap is None else cap
    done: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        kind = (t.dtype, t.device)
        size = t.numel() * t.element_size()
        current = open_.get(kind)
        if current is not None and current[1] + size > limit:
            current = None  # full: the next tensor starts another
        if current is None:
            bucket: list[int] = []
            done.append(bucket)
            current = (bucket, 0)
        current[0].append(i)
        open_[kind] = (current[0], current[1] + size)
    return done


class Bucket:
    """The tensors of one bucket as one flat buffer (``flat``); :meth:`unflatten` copies the
    buffer back into them. One tensor alone is its own buffer (reduced in place)."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.tensors = list(tensors)
        if len(self.tensors) == 1 and self.tensors[0].is_contiguous():
            self.flat = self.tensors[0]
        else:
            self.flat = torch.cat([t.reshape(-1) for t in self.tensors])

    def unflatten(self) -> None:
        if len(self.tensors) == 1 and self.flat is self.tensors[0]:
            return
        offset = 0
        for t in self.tensors:
            n = t.numel()
            t.copy_(self.flat[offset : offset + n].view(t.shape))
            offset += n


def buckets(tensors: Sequence[Tensor], cap: int | None = None) -> list[Bucket]:
    """:func:`bucket_indices`'s buckets of ``tensors``, flattened."""
    return [Bucket([tensors[i] for i in idx]) for idx in bucket_indices(tensors, cap)]
