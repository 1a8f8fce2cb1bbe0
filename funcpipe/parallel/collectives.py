"""Collectives as autograd pairs, each with its backward stated explicitly, and byte accounting.

Every pair is a ``torch.autograd.Function`` over ``torch.distributed`` (c10d) calls. The backward
of a collective depends on what the ranks do with its output, so each pair names that
assumption. *Replicated* means every rank of the group holds the same logical value (a gradient
of it is the full gradient, on every rank); *varying* means each rank's value is its own (its
gradient is that rank's term):

=======================  ================================  ===============================
pair                     forward                           backward
=======================  ================================  ===============================
``copy_to_group``        identity (replicated -> varying)  all-reduce
``reduce_from_group``    all-reduce (varying -> replicated)  identity
``all_reduce``           all-reduce (varying -> varying)   all-reduce
``all_gather``           all-gather along ``dim``          reduce-scatter along ``dim``
``reduce_scatter``       reduce-scatter along ``dim``      all-gather along ``dim``
``split_to_group``       take own shard (replicated in)    all-gather
``gather_from_group``    all-gather (replicated out)       take own shard
``broadcast``            broadcast from ``src``            reduce to ``src`` (zeros elsewhere)
``reduce_to``            reduce to ``dst`` (zeros elsewhere)  broadcast from ``dst``
``ring_shift``           send to coord+k, receive from coord-k  the reverse shift
``all_to_all``           rows to each coord (uneven sizes)  the same, sizes swapped
=======================  ================================  ===============================

(torch's functional ``all_reduce`` differentiates to another all-reduce: right for varying
outputs, ``t`` times too large for the Megatron row-parallel case, whose output is replicated.)
No pair writes into its input or into an incoming gradient: buffers are fresh tensors. A size-1
axis is the identity and moves nothing.

Byte accounting (``with count_bytes() as c: ...``): each call adds a :class:`Record` to every
active counter of this process. ``nbytes`` is the size of the tensor handed to the collective
(this rank's input); ``volume`` is the bytes this rank sends under the ring model, averaged over
the n ranks of the group (the nccl-tests bus-bandwidth convention):

=================  =====================
kind               volume (per rank)
=================  =====================
all_reduce         2 (n-1)/n * nbytes
all_gather         (n-1) * nbytes  (input is one shard; output is n*nbytes)
reduce_scatter     (n-1)/n * nbytes (input is the full tensor)
broadcast, reduce  (n-1)/n * nbytes (a pipelined chain: n-1 of n ranks send the buffer)
send (ring_shift)  nbytes
all_to_all         the bytes of the rows sent to other ranks (even sizes: (n-1)/n * nbytes)
=================  =====================

``c.total``, ``c.by_kind`` and ``c.by_phase`` sum ``volume``; ``c.payload`` sums ``nbytes``.
If the backend lacks a native reduce-scatter, it runs as all-reduce + slice and is recorded as
``reduce_scatter`` with ``algorithm='all_reduce+slice'`` and the all-reduce's volume.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from funcpipe.errors import InvalidArgument
from funcpipe.parallel.mesh import Axis
from funcpipe.runtime.spans import timed
from funcpipe.runtime.turns import complete

__all__ = [
    "ByteCounter",
    "Record",
    "all_gather",
    "all_reduce",
    "all_reduce_max",
    "all_to_all",
    "broadcast",
    "copy_to_group",
    "count_bytes",
    "exchange_sizes",
    "gather_from_group",
    "reduce_from_group",
    "reduce_scatter",
    "reduce_to",
    "ring_shift",
    "ring_volume",
    "split_to_group",
]


# ------------------------------------------------------------------------------ byte accounting
@dataclass(frozen=True)
class Record:
    """One collective call on this rank."""

    kind: str
    phase: str  # "forward" or "backward"
    axis: str
    group_size: int
    nbytes: int
    volume: float
    algorithm: str = "ring"


def ring_volume(kind: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for collective ``kind`` on ``nbytes`` over ``n`` ranks (ring model)."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n * nbytes
    if kind == "all_gather":
        return float((n - 1) * nbytes)
    if kind in ("reduce_scatter", "broadcast", "reduce"):
        return (n - 1) / n * nbytes
    if kind == "send":
        return float(nbytes)
    if kind == "all_to_all":  # even split sizes (a call records the rows it really sends)
        return (n - 1) / n * nbytes
    raise InvalidArgument(
        f"kind={kind!r}: one of 'all_reduce', 'all_gather', 'reduce_scatter', 'broadcast', "
        "'reduce', 'send', 'all_to_all'."
    )


class ByteCounter:
    """Collects :class:`Record` s; read ``total``, ``by_kind``, ``by_phase``; ``reset()`` to clear."""

    def __init__(self) -> None:
        self.records: list[Record] = []

    def reset(self) -> None:
        self.records.clear()

    @property
    def total(self) -> float:
        return sum(r.volume for r in self.records)

    @property
    def payload(self) -> int:
        return sum(r.nbytes for r in self.records)

    @property
    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for r in self.records:
            out[r.kind] += r.volume
        return dict(out)

    @property
    def by_phase(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for r in self.records:
            out[r.phase] += r.volume
        return dict(out)

    def select(
        self, *, kind: str | None = None, phase: str | None = None, axis: str | None = None
    ) -> list[Record]:
        """The records matching every given field."""
        return [
            r
            for r in self.records
            if (kind is None or r.kind == kind)
            and (phase is None or r.phase == phase)
            and (axis is None or r.axis == axis)
        ]

    def __repr__(self) -> str:
        kinds = ", ".join(f"{k}={v:g}" for k, v in sorted(self.by_kind.items()))
        return f"ByteCounter(total={self.total:g}, {kinds or 'no traffic'})"


_COUNTERS: list[ByteCounter] = []


@contextlib.contextmanager
def count_bytes() -> Iterator[ByteCounter]:
    """Count the bytes of every collective this process runs inside the block (nestable)."""
    counter = ByteCounter()
    _COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _COUNTERS.remove(counter)


def _record(
    kind: str,
    phase: str,
    axis: Axis,
    t: Tensor,
    *,
    algorithm: str = "ring",
    as_kind: str = "",
    volume: float | None = None,
) -> None:
    if not _COUNTERS:
        return
    nbytes = t.numel() * t.element_size()
    sent = ring_volume(as_kind or kind, nbytes, axis.size) if volume is None else volume
    rec = Record(kind, phase, axis.name, axis.size, nbytes, sent, algorithm)
    for c in _COUNTERS:
        c.records.append(rec)


# ------------------------------------------------------------------------------ raw c10d calls
# Each returns a fresh tensor and never writes into its argument.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_NATIVE_REDUCE_SCATTER: dict[str, bool] = {}  # backend name -> has a working reduce-scatter


def _check_dim(x: Tensor, dim: int, what: str) -> int:
    if not -x.dim() <= dim < x.dim():
        raise InvalidArgument(
            f"{what}: dim={dim} is out of range for a tensor of shape {tuple(x.shape)}."
        )
    return dim % x.dim()


def _abstract(x: Tensor) -> bool:
    """A tensor with no data (meta or fake: shape inference); collectives keep its shape."""
    return x.is_meta or is_fake(x)


def _raw_all_reduce(x: Tensor, axis: Axis, phase: str, *, op: Any = None) -> Tensor:
    out = x.contiguous().clone()
    if axis.size > 1 and not _abstract(x):  # meta (shape inference): same shape, no data moves
        _record("all_reduce", phase, axis, out)
        with timed("all_reduce", phase, axis):
            reduce_op = dist.ReduceOp.SUM if op is None else op
            complete(dist.all_reduce, out, op=reduce_op, group=axis.group)
    return out


def _raw_all_gather(x: Tensor, axis: Axis, dim: int, phase: str) -> Tensor:
    if axis.size == 1:
        return x.clone()
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((axis.size * src.shape[0], *src.shape[1:]))
    if _abstract(x):
        return out.movedim(0, dim)
    _record("all_gather", phase, axis, src)
    with timed("all_gather", phase, axis):
        complete(_all_gather_single, out, src, group=axis.group)
    return out.movedim(0, dim)


def _raw_reduce_scatter(x: Tensor, axis: Axis, dim: int, phase: str) -> Tensor:
    if axis.size == 1:
        return x.clone()
    n = x.shape[dim]
    if n % axis.size:
        raise InvalidArgument(
            f"reduce-scatter over axis {axis.name!r} (size {axis.size}) along dim {dim} needs "
            f"that dim divisible by {axis.size}; got shape {tuple(x.shape)}."
        )
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((n // axis.size, *src.shape[1:]))
    if _abstract(x):
        return out.movedim(0, dim)
    backend = str(dist.get_backend(axis.group))
    if _NATIVE_REDUCE_SCATTER.get(backend, True):
        try:
            with timed("reduce_scatter", phase, axis):
                complete(_reduce_scatter_single, out, src, group=axis.group)
        except (RuntimeError, NotImplementedError) as e:  # e.g. an old gloo without it
            if not _unsupported(e):
                raise
            _NATIVE_REDUCE_SCATTER[backend] = False
        else:
            _record("reduce_scatter", phase, axis, src)
            return out.movedim(0, dim)
    _record("reduce_scatter", phase, axis, src, algorithm="all_reduce+slice", as_kind="all_reduce")
    buf = src.clone()  # src may alias x: never all-reduce into the caller's tensor
    complete(dist.all_reduce, buf, group=axis.group)
    return buf.chunk(axis.size, 0)[axis.coord].clone().movedim(0, dim)


def _unsupported(e: BaseException) -> bool:
    text = str(e).lower()
    return any(w in text for w in ("not supported", "unsupported", "not implemented"))


def _raw_broadcast(x: Tensor, axis: Axis, src: int, phase: str) -> Tensor:
    if axis.size == 1 or _abstract(x):
        return x.clone()
    if axis.coord == src:
        out = x.contiguous().clone()
    else:  # only the shape, dtype and device of x matter here
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _record("broadcast", phase, axis, out)
    complete(dist.broadcast, out, group=axis.group, group_src=src)
    return out


def _raw_reduce(x: Tensor, axis: Axis, dst: int, phase: str) -> Tensor:
    if axis.size == 1 or _abstract(x):
        return x.clone()
    out = x.contiguous().clone()
    _record("reduce", phase, axis, out)
    complete(dist.reduce, out, group=axis.group, group_dst=dst)
    return out if axis.coord == dst else torch.zeros_like(out)


def _raw_shift(x: Tensor, axis: Axis, offset: int, phase: str) -> Tensor:
    n = axis.size
    if n == 1 or offset % n == 0 or _abstract(x):
        return x.clone()
    src = x.contiguous()
    out = torch.empty_like(src)
    to = axis.global_rank((axis.coord + offset) % n)
    frm = axis.global_rank((axis.coord - offset) % n)
    _record("send", phase, axis, src)
    ops = [
        dist.P2POp(dist.isend, src, to, axis.group),
        dist.P2POp(dist.irecv, out, frm, axis.group),
    ]
    complete(_batch, ops)
    return out


def _batch(ops: list[Any], *, async_op: bool = False) -> list[Any] | None:
    """``batch_isend_irecv`` as :func:`~funcpipe.runtime.turns.complete` calls a collective."""
    works = dist.batch_isend_irecv(ops)
    if async_op:
        return works
    for work in works:
        work.wait()
    return None


def _own_shard(x: Tensor, axis: Axis, dim: int, what: str) -> Tensor:
    if x.shape[dim] % axis.size:
        raise InvalidArgument(
            f"{what} over axis {axis.name!r} (size {axis.size}) along dim {dim} needs that dim "
            f"divisible by {axis.size}; got shape {tuple(x.shape)}."
        )
    return x.chunk(axis.size, dim)[axis.coord].clone()


# ------------------------------------------------------------------------------ autograd pairs
class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis) -> Tensor:
        ctx.axis = axis
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return _raw_all_reduce(g, ctx.axis, "backward"), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis) -> Tensor:
        return _raw_all_reduce(x, axis, "forward")

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g, None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis) -> Tensor:
        ctx.axis = axis
        return _raw_all_reduce(x, axis, "forward")

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return _raw_all_reduce(g, ctx.axis, "backward"), None


Raw = Callable[[Tensor, Axis, int, str], Tensor]  # (x, axis, dim / rank / offset, what)


def _pair(
    name: str,
    forward: Raw,
    backward: Raw,
    *,
    forward_what: str = "forward",
    backward_what: str = "backward",
    negate: bool = False,
) -> type[torch.autograd.Function]:
    """An autograd Function ``(x, axis, arg)``: ``forward(x, axis, arg)`` going forward and
    ``backward(g, axis, arg)`` (``-arg`` with ``negate``) for the gradient."""

    def fwd(ctx: Any, x: Tensor, axis: Axis, arg: int) -> Tensor:
        ctx.axis, ctx.arg = axis, arg
        return forward(x, axis, arg, forward_what)

    def bwd(ctx: Any, g: Tensor) -> tuple[Tensor, None, None]:
        arg = -ctx.arg if negate else ctx.arg
        return backward(g, ctx.axis, arg, backward_what), None, None

    return type(
        name,
        (torch.autograd.Function,),
        {"forward": staticmethod(fwd), "backward": staticmethod(bwd)},
    )


# forward collective -> its adjoint
_AllGather = _pair("_AllGather", _raw_all_gather, _raw_reduce_scatter)
_ReduceScatter = _pair("_ReduceScatter", _raw_reduce_scatter, _raw_all_gather)
_SplitToGroup = _pair("_SplitToGroup", _own_shard, _raw_all_gather, forward_what="split_to_group")
_GatherFromGroup = _pair(
    "_GatherFromGroup", _raw_all_gather, _own_shard, backward_what="gather_from_group backward"
)
_Broadcast = _pair("_Broadcast", _raw_broadcast, _raw_reduce)
_ReduceTo = _pair("_ReduceTo", _raw_reduce, _raw_broadcast)
_RingShift = _pair("_RingShift", _raw_shift, _raw_shift, negate=True)


def _check_axis(axis: object, what: str) -> Axis:
    if not isinstance(axis, Axis):
        raise InvalidArgument(
            f"{what}: axis={axis!r} must be a funcpipe.parallel.Axis (e.g. mesh['tensor'])."
        )
    return axis


def _check_coord(value: object, axis: Axis, name: str, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < axis.size:
        raise InvalidArgument(
            f"{what}: {name}={value!r} must be a coordinate of axis {axis.name!r}, an int in "
            f"range({axis.size})."
        )
    return value


def copy_to_group(x: Tensor, axis: Axis) -> Tensor:
    """Identity forward; all-reduce of the gradient backward (``x`` replicated, uses diverge)."""
    _check_axis(axis, "copy_to_group")
    return x if axis.size == 1 else _CopyToGroup.apply(x, axis)


def reduce_from_group(x: Tensor, axis: Axis) -> Tensor:
    """All-reduce (sum) forward; identity backward (the sum is used identically on every rank)."""
    _check_axis(axis, "reduce_from_group")
    return x if axis.size == 1 else _ReduceFromGroup.apply(x, axis)


def all_reduce(x: Tensor, axis: Axis) -> Tensor:
    """All-reduce (sum) forward and backward (each rank uses the sum in its own way)."""
    _check_axis(axis, "all_reduce")
    return x if axis.size == 1 else _AllReduce.apply(x, axis)


def all_gather(x: Tensor, axis: Axis, *, dim: int) -> Tensor:
    """Concatenate the shards along ``dim`` forward; reduce-scatter of the gradient backward."""
    _check_axis(axis, "all_gather")
    dim = _check_dim(x, dim, "all_gather")
    return x if axis.size == 1 else _AllGather.apply(x, axis, dim)


def reduce_scatter(x: Tensor, axis: Axis, *, dim: int) -> Tensor:
    """Sum over the group and keep this rank's block of ``dim``; all-gather backward."""
    _check_axis(axis, "reduce_scatter")
    dim = _check_dim(x, dim, "reduce_scatter")
    return x if axis.size == 1 else _ReduceScatter.apply(x, axis, dim)


def split_to_group(x: Tensor, axis: Axis, *, dim: int) -> Tensor:
    """This rank's block of a replicated ``x`` along ``dim``; all-gather backward."""
    _check_axis(axis, "split_to_group")
    dim = _check_dim(x, dim, "split_to_group")
    return x if axis.size == 1 else _SplitToGroup.apply(x, axis, dim)


def gather_from_group(x: Tensor, axis: Axis, *, dim: int) -> Tensor:
    """All-gather to a replicated tensor forward; take this rank's block of the gradient backward."""
    _check_axis(axis, "gather_from_group")
    dim = _check_dim(x, dim, "gather_from_group")
    return x if axis.size == 1 else _GatherFromGroup.apply(x, axis, dim)


def broadcast(x: Tensor, axis: Axis, *, src: int) -> Tensor:
    """Everyone gets ``x`` of the rank at coordinate ``src`` (other ranks' ``x`` gives the shape
    only); backward sums the gradients into ``src`` and gives the others zeros."""
    src = _check_coord(src, _check_axis(axis, "broadcast"), "src", "broadcast")
    return x if axis.size == 1 else _Broadcast.apply(x, axis, src)


def reduce_to(x: Tensor, axis: Axis, *, dst: int) -> Tensor:
    """The sum over the group on ``dst``, zeros elsewhere; backward broadcasts from ``dst``."""
    dst = _check_coord(dst, _check_axis(axis, "reduce_to"), "dst", "reduce_to")
    return x if axis.size == 1 else _ReduceTo.apply(x, axis, dst)


def ring_shift(x: Tensor, axis: Axis, *, offset: int = 1) -> Tensor:
    """Receive the ``x`` of coordinate ``coord - offset`` (send ours to ``coord + offset``);
    backward shifts the gradient the other way."""
    _check_axis(axis, "ring_shift")
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise InvalidArgument(f"ring_shift: offset={offset!r} must be an int.")
    return x if axis.size == 1 or offset % axis.size == 0 else _RingShift.apply(x, axis, offset)


def all_reduce_max(x: Tensor, axis: Axis) -> Tensor:
    """Elementwise max over the group (not differentiable: use it on detached values)."""
    _check_axis(axis, "all_reduce_max")
    return _raw_all_reduce(x.detach(), axis, "forward", op=dist.ReduceOp.MAX)


# ------------------------------------------------------------------------------ all-to-all
def _sizes(sizes: Any, axis: Axis, name: str, what: str) -> list[int]:
    if isinstance(sizes, Tensor):
        if sizes.dim() != 1 or sizes.is_floating_point() or sizes.is_complex():
            raise InvalidArgument(f"{what}: {name} must be a 1-D integer tensor or a list of ints")
        sizes = sizes.tolist()  # (a host sync where the sizes live on a device)
    if not isinstance(sizes, list | tuple) or len(sizes) != axis.size:
        raise InvalidArgument(
            f"{what}: {name}={sizes!r} must give one row count per coordinate of axis "
            f"{axis.name!r} ({axis.size})"
        )
    if not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in sizes):
        raise InvalidArgument(f"{what}: {name}={list(sizes)!r} must be ints >= 0")
    return [int(k) for k in sizes]


def exchange_sizes(send: Sequence[int], axis: Axis) -> list[int]:
    """The row counts each coordinate of ``axis`` sends this one, given what this one sends
    each (``send``): a small all-to-all of ints, the one host sync an uneven all-to-all needs."""
    counts = torch.tensor(list(send), dtype=torch.int64)
    if axis.size == 1:
        return [int(k) for k in counts.tolist()]
    if dist.get_backend(axis.group) == "nccl":
        counts = counts.cuda()
    out = torch.empty_like(counts)
    with timed("split sizes", "forward", axis):
        complete(dist.all_to_all_single, out, counts, group=axis.group)
    return [int(k) for k in out.tolist()]


def _raw_all_to_all(x: Tensor, axis: Axis, send: list[int], recv: list[int], phase: str) -> Tensor:
    src = x.contiguous()
    out = src.new_empty((sum(recv), *src.shape[1:]))
    if _abstract(x):
        return out
    row = math.prod(src.shape[1:]) * src.element_size()
    _record("all_to_all", phase, axis, src, volume=float((sum(send) - send[axis.coord]) * row))
    with timed("all_to_all", phase, axis):
        complete(dist.all_to_all_single, out, src, recv, send, group=axis.group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: Axis, send: list[int], recv: list[int]) -> Tensor:
        ctx.axis, ctx.send, ctx.recv = axis, send, recv
        return _raw_all_to_all(x, axis, send, recv, "forward")

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None, None, None]:
        return _raw_all_to_all(g, ctx.axis, ctx.recv, ctx.send, "backward"), None, None, None


def all_to_all(x: Tensor, axis: Axis, send_sizes: Any, recv_sizes: Any = None) -> Tensor:
    """Rows to every coordinate of ``axis`` and rows from every one, in uneven sizes.

    ``x``'s rows (dim 0) are grouped by destination: the first ``send_sizes[0]`` go to
    coordinate 0, the next ``send_sizes[1]`` to coordinate 1, ... (zeros allowed); the result
    holds the rows received, grouped by source coordinate. ``recv_sizes``: how many rows each
    coordinate sends this one; ``None`` exchanges them first (:func:`exchange_sizes`). The
    backward is the same exchange with the sizes swapped (its transpose). On tensors without
    data (meta, fake: shape inference) no sizes are exchanged, and ``recv_sizes`` defaults to
    ``send_sizes``."""
    _check_axis(axis, "all_to_all")
    if x.dim() == 0:
        raise InvalidArgument("all_to_all: x must have a dim 0 of rows; got a 0-dim tensor")
    send = _sizes(send_sizes, axis, "send_sizes", "all_to_all")
    if sum(send) != x.shape[0]:
        raise InvalidArgument(
            f"all_to_all: send_sizes={send} sum to {sum(send)}, but x has {x.shape[0]} rows "
            "(dim 0): give each coordinate's row count, in the order the rows are grouped"
        )
    if recv_sizes is None:
        recv = send if _abstract(x) else exchange_sizes(send, axis)
    else:
        recv = _sizes(recv_sizes, axis, "recv_sizes", "all_to_all")
    if axis.size == 1:
        return x.clone()
    out: Tensor = _AllToAll.apply(x, axis, send, recv)
    return out
