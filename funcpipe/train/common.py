"""What the training modules share: which floating dtypes count as low precision, and the sum
of a scalar tensor over a process group.

:mod:`funcpipe.train.optimizers` (master weights), :mod:`funcpipe.train.clip` (the global norm)
and :mod:`funcpipe.train.loss_scale` (unscaling, the finite flag) use them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from funcpipe.errors import InvalidArgument

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["all_reduce_sum", "low_precision"]

Tensor = torch.Tensor


def low_precision(t: Any) -> bool:
    """Whether ``t`` is a floating tensor narrower than float32 (bfloat16, float16, ...)."""
    return isinstance(t, Tensor) and t.is_floating_point() and torch.finfo(t.dtype).bits < 32


def all_reduce_sum(total: Tensor, group: ProcessGroup) -> Tensor:
    """``total`` (a scalar tensor) summed over the ranks of ``group``, on ``total``'s device;
    an :class:`InvalidArgument` when ``torch.distributed`` is not initialised."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise InvalidArgument(
            f"group={group!r} was given but torch.distributed is not initialised; pass "
            "group=None on a single process"
        )
    comm = total
    if dist.get_backend(group) == "nccl" and total.device.type != "cuda":
        comm = total.to(torch.device("cuda", torch.cuda.current_device()))
    else:
        comm = total.clone()
    dist.all_reduce(comm, op=dist.ReduceOp.SUM, group=group)
    return comm.to(total.device)
