"""Rows sent where they are needed and brought back: the all-to-all pair of expert parallelism.

:func:`dispatch` sends each row of ``x`` to the coordinate of ``axis`` that ``dest`` names
(tokens by data rank in, tokens by expert rank out), grouped by source coordinate, each
source's rows in their order; :func:`combine` returns rows of the same shape back to where they
came from, in their original order. Both are differentiable: the gradient of each is the
other's exchange (:func:`funcpipe.parallel.collectives.all_to_all`, whose backward is its
transpose), and the reorderings are index selections. The split sizes may be uneven, zero,
and different at every call; they cost one small exchange of counts (the all-to-all's one host
sync) per dispatch, and none for the combine, which reuses them.

    y, routed = dispatch(x, dest, axis, extras=(expert_ids,))   # rows for this rank's experts
    z = experts(y, routed.extras[0])                            # any row-wise computation
    out = combine(z, routed)                                    # back, in x's row order
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from funcpipe.errors import InvalidArgument
from funcpipe.parallel.collectives import _abstract, all_to_all, exchange_sizes
from funcpipe.parallel.mesh import Axis

__all__ = ["Routed", "combine", "dispatch"]


@dataclass(frozen=True)
class Routed:
    """What :func:`dispatch` did, for :func:`combine`: the row order that grouped ``x`` by
    destination, the rows sent to and received from each coordinate, and the ``extras``
    routed with the rows (received, in the order of the rows received)."""

    axis: Axis
    order: Tensor
    send: list[int]
    recv: list[int]
    extras: tuple[Tensor, ...] = ()

    @property
    def rows(self) -> int:
        """How many rows this coordinate received."""
        return sum(self.recv)


def dispatch(
    x: Tensor, dest: Tensor, axis: Axis, *, extras: Sequence[Tensor] = ()
) -> tuple[Tensor, Routed]:
    """Each row ``i`` of ``x`` to coordinate ``dest[i]`` of ``axis``; returns the rows this
    coordinate receives (grouped by source coordinate, each source's in its order) and the
    :class:`Routed` that :func:`combine` takes. ``extras``: tensors with one row per row of
    ``x`` (an expert index, a routing weight) sent along, without gradient."""
    if not isinstance(axis, Axis):
        raise InvalidArgument(f"dispatch: axis={axis!r} must be a funcpipe.parallel.Axis")
    if not isinstance(x, Tensor) or x.dim() == 0:
        raise InvalidArgument("dispatch: x must be a tensor with a dim 0 of rows")
    n = axis.size
    if (
        not isinstance(dest, Tensor)
        or dest.dim() != 1
        or dest.dtype not in (torch.int64, torch.int32)
        or dest.shape[0] != x.shape[0]
    ):
        raise InvalidArgument(
            f"dispatch: dest must be a 1-D int64 (or int32) tensor with one destination per row "
            f"of x ({x.shape[0]}); got {_show(dest)}"
        )
    for k, e in enumerate(extras):
        if not isinstance(e, Tensor) or e.dim() == 0 or e.shape[0] != x.shape[0]:
            raise InvalidArgument(
                f"dispatch: extras[{k}] must be a tensor with one row per row of x "
                f"({x.shape[0]}); got {_show(e)}"
            )
    dest = dest.to(torch.int64)
    order = torch.argsort(dest, stable=True)
    if _abstract(x):  # shape inference: the rows stay (a stand-in for sizes only data gives)
        send = recv = [x.shape[0] if c == axis.coord else 0 for c in range(n)]
    else:
        # one read of the counts (the host sync the sizes need), out-of-range ones included:
        # bin 0 counts the negative destinations, bins past n the ones too large
        counts = [int(k) for k in torch.bincount(dest.clamp(min=-1) + 1, minlength=n + 1).tolist()]
        if counts[0] or len(counts) > n + 1:
            raise InvalidArgument(
                f"dispatch: dest holds {counts[0] + sum(counts[n + 1 :])} destination(s) outside "
                f"the coordinates of axis {axis.name!r}, 0..{n - 1}"
            )
        send = counts[1:]
        recv = exchange_sizes(send, axis)
    rows = all_to_all(x.index_select(0, order), axis, send, recv)
    sent = tuple(all_to_all(e.detach().index_select(0, order), axis, send, recv) for e in extras)
    return rows, Routed(axis, order, send, recv, sent)


def combine(y: Tensor, routed: Routed) -> Tensor:
    """Rows received by :func:`dispatch` (or rows computed from them, one per row) back to the
    coordinates they came from, in the order of the ``x`` dispatched there."""
    if not isinstance(routed, Routed):
        raise InvalidArgument(f"combine: routed must be what dispatch returned; got {routed!r}")
    if not isinstance(y, Tensor) or y.dim() == 0 or y.shape[0] != routed.rows:
        raise InvalidArgument(
            f"combine: y must have one row per row dispatch delivered here ({routed.rows}); "
            f"got {_show(y)}"
        )
    back = all_to_all(y, routed.axis, routed.recv, routed.send)
    inverse = torch.empty_like(routed.order)
    inverse[routed.order] = torch.arange(routed.order.numel(), device=routed.order.device)
    return back.index_select(0, inverse)


def _show(t: object) -> str:
    if isinstance(t, Tensor):
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    return repr(t)
