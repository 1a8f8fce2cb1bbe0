"""Shards of parameters and gradients over ``d`` data-parallel copies (ZeRO-1), and their
layout in the buffers of one collective per bucket.

**The sharding rule.** Every leaf is flattened and cut with ``torch.tensor_split(leaf.flatten(),
d)``: copy ``c`` holds piece ``c``, a 1-D tensor of ``n // d + 1`` elements for ``c < n % d``
and ``n // d`` for the others (:func:`piece_sizes`), so any leaf size shards, even ones smaller
than ``d``. :func:`shard_leaf` cuts one piece; a leaf is rebuilt by concatenating its pieces in
copy order.

**The buffers.** A :class:`ShardBucket` lays out the leaves of one bucket
(:func:`funcpipe.runtime.buckets.bucket_indices`: same dtype and device, up to 25 MiB) for one
collective over the copies: a buffer of ``d`` segments of ``width`` elements each, segment
``c`` holding piece ``c`` of every leaf of the bucket in order, then zeros up to ``width``
(copy 0's pieces are the largest, so ``width`` is the sum of those). One reduce-scatter of the
full gradients packed this way (:meth:`ShardBucket.pack_full`) leaves on copy ``c`` the sums of
its pieces (:meth:`ShardBucket.pieces`); one all-gather of each copy's pieces packed into its
segment (:meth:`ShardBucket.pack_pieces`) gives every copy the full leaves
(:meth:`ShardBucket.unpack_full`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from funcpipe.runtime.buckets import bucket_indices
from funcpipe.runtime.rank_io import EXPERT_DATA
from funcpipe.runtime.transport_common import Handle, Transport

__all__ = [
    "ShardBucket",
    "gather_pieces",
    "own_pieces",
    "piece_sizes",
    "scatter_grads",
    "shard_leaf",
]

Tensor = torch.Tensor


def piece_sizes(n: int, d: int) -> list[int]:
    """The sizes of ``torch.tensor_split`` of ``n`` elements into ``d`` pieces."""
    q, extra = divmod(n, d)
    return [q + 1 if c < extra else q for c in range(d)]


def shard_leaf(t: Tensor, d: int, c: int) -> Tensor:
    """Piece ``c`` of ``d`` of ``t`` flattened: a 1-D tensor of its own (a copy)."""
    return torch.tensor_split(t.detach().reshape(-1), d)[c].clone()


class ShardBucket:
    """The leaves of one bucket (their element counts ``numels``) laid out over ``d`` copies
    for one reduce-scatter or all-gather (see the module docstring)."""

    def __init__(self, numels: Sequence[int], d: int) -> None:
        self.d = d
        self.sizes = [piece_sizes(n, d) for n in numels]  # [leaf][copy]
        self.width = sum(s[0] for s in self.sizes)

    def pack_full(self, full: Sequence[Tensor]) -> Tensor:
        """``(d * width,)``: segment ``c`` holds piece ``c`` of every full tensor, padded."""
        cut = [torch.tensor_split(t.reshape(-1), self.d) for t in full]
        parts: list[Tensor] = []
        for c in range(self.d):
            parts.extend(pieces[c] for pieces in cut)
            parts.append(self._pad(full[0], c))
        return torch.cat(parts)

    def pack_pieces(self, pieces: Sequence[Tensor], c: int) -> Tensor:
        """``(width,)``: copy ``c``'s pieces in order, padded (what it adds to an all-gather)."""
        return torch.cat([*(t.reshape(-1) for t in pieces), self._pad(pieces[0], c)])

    def pieces(self, segment: Tensor, c: int) -> list[Tensor]:
        """Copy ``c``'s pieces in its ``(width,)`` segment (views of it)."""
        out, at = [], 0
        for sizes in self.sizes:
            out.append(segment[at : at + sizes[c]])
            at += sizes[c]
        return out

    def unpack_full(self, gathered: Tensor, full: Sequence[Tensor]) -> None:
        """Copy the ``(d * width,)`` gathered buffer into the full tensors (in place)."""
        segments = gathered.view(self.d, self.width)
        per_copy = [self.pieces(segments[c], c) for c in range(self.d)]
        for k, t in enumerate(full):
            flat = torch.cat([per_copy[c][k] for c in range(self.d)])
            t.copy_(flat.view(t.shape))

    def _pad(self, like: Tensor, c: int) -> Tensor:
        used = sum(s[c] for s in self.sizes)
        return like.new_zeros(self.width - used)


def gather_pieces(
    transport: Transport,
    pieces: Sequence[Tensor],
    full: Sequence[Tensor],
    d: int,
    c: int,
    group: str,
) -> tuple[Handle, Callable[[], None]]:
    """Start the all-gather of a GATHER: this copy's (``c`` of ``d``) ``pieces`` of the leaves
    ``full`` (one collective per bucket, in the pieces' dtype); the callback, once the handle
    is done, copies the gathered values into ``full`` (in place, outside autograd; cast where
    ``full`` is kept in a wider dtype)."""
    ins, outs, jobs = [], [], []
    # buckets of the pieces' dtype (the full leaves may be kept wider: grad_dtype), sized as
    # the full leaves (zero-stride views: no memory)
    sized = [p.new_empty(()).expand(f.shape) for p, f in zip(pieces, full, strict=True)]
    for idx in bucket_indices(sized):
        b = ShardBucket([full[k].numel() for k in idx], d)
        ins.append(b.pack_pieces([pieces[k] for k in idx], c))
        outs.append(pieces[idx[0]].new_empty(d * b.width))
        jobs.append((b, idx))

    def done() -> None:
        with torch.no_grad():
            for (b, idx), out in zip(jobs, outs, strict=True):
                b.unpack_full(out, [full[k] for k in idx])
        ins.clear()  # (the pending keeps this callback to the step's end: let the buffers go)
        outs.clear()

    return transport.all_gather(ins, outs, group), done


def scatter_grads(
    transport: Transport,
    grads: Sequence[Tensor],
    d: int,
    c: int,
    group: str,
    into: list[Tensor | None] | None = None,
    *,
    keys: Sequence[int] | None = None,
    scale: float | None = None,
) -> tuple[Handle, Callable[[], None], list[Tensor | None]]:
    """Start the reduce-scatter of a SCATTER: the full gradient sums ``grads`` of one stage
    (packed into one buffer per bucket, last leaf first as a backward produces them), summed
    over the group, this copy (``c`` of ``d``) keeping its pieces. Returns the handle, the
    callback that averages them once it is done, and the list of pieces it fills: ``into``
    where an earlier SCATTER of the stage made one (ZeRO-2: the callback adds into its pieces,
    in whatever order the callbacks run), else a new one (zeros, for a leaf that is not
    floating, from the start). ``keys``: only these leaves (the others' pieces are left as they
    are: expert leaves shard over another group); ``scale``: what the sums are multiplied by
    (default ``1 / d``: the average over the group)."""
    floating = [g.is_floating_point() or g.is_complex() for g in grads]
    out_pieces: list[Tensor | None] = (
        into
        if into is not None
        else [
            None if f else g.new_zeros(piece_sizes(g.numel(), d)[c])
            for g, f in zip(grads, floating, strict=True)
        ]
    )
    chosen = range(len(grads)) if keys is None else sorted(keys)
    keys = [k for k in reversed(chosen) if floating[k]]
    ins, outs, jobs = [], [], []
    for idx in bucket_indices([grads[k] for k in keys]):
        ks = [keys[j] for j in idx]
        b = ShardBucket([grads[k].numel() for k in ks], d)
        ins.append(b.pack_full([grads[k] for k in ks]))
        outs.append(grads[ks[0]].new_empty(b.width))
        jobs.append((b, ks))
    factor = 1.0 / d if scale is None else scale

    def done() -> None:
        for (b, ks), out in zip(jobs, outs, strict=True):
            out.mul_(factor)
            for k, piece in zip(ks, b.pieces(out, c), strict=True):
                held = out_pieces[k]
                if held is None:
                    out_pieces[k] = piece
                else:
                    held.add_(piece)
        ins.clear()
        outs.clear()

    return transport.reduce_scatter(ins, outs, group), done, out_pieces


def own_pieces(
    pieces: Sequence[Tensor | None] | None,
    leaves: Sequence[Tensor],
    layout: Sequence[tuple[int, int]],
) -> list[Tensor]:
    """A sharded owner's gradients as a step returns them: its SCATTERed ``pieces``, and
    where there is none (no SCATTER ran: a stage no microbatch visits) piece ``c`` of ``d``
    (``layout[k]``: :func:`leaf_layout`) of the leaf's gradient sum (zeros if it has none). The
    leaves let go of their sums."""
    out = []
    for k, leaf in enumerate(leaves):
        p = None if pieces is None else pieces[k]
        d, c = layout[k]
        if p is None:
            g = leaf.grad
            p = (
                leaf.new_zeros(piece_sizes(leaf.numel(), d)[c])
                if g is None
                else shard_leaf(g, d, c)
            )
        leaf.grad = None
        out.append(p)
    return out


# ------------------------------------------------------------------ experts shard apart
def leaf_layout(n: int, experts: frozenset[int], d: int, c: int, ep: int) -> list[tuple[int, int]]:
    """Per leaf of a stage, ``(pieces, this copy's piece)``: ``(d, c)``, but for the leaves
    split over the expert axis ``(d // ep, c // ep)``: those shard over the ``d // ep`` copies
    holding the same experts (the mesh's ``expert_data`` axis), where this copy is ``c // ep``."""
    return [(d // ep, c // ep) if k in experts else (d, c) for k in range(n)]


class _Joined:
    """Handles in flight together: ready when all are, waited in order."""

    def __init__(self, handles: Sequence[Handle]) -> None:
        self.handles = list(handles)

    def ready(self) -> bool:
        return all(h.ready() for h in self.handles)

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


def _parts(
    n: int, experts: frozenset[int], d: int, c: int, ep: int, group: str
) -> list[tuple[list[int], int, int, str]]:
    """The leaves of a stage by how they shard: ``(indices, d, c, group)``."""
    dense = [k for k in range(n) if k not in experts]
    if not experts or ep == 1:
        return [(list(range(n)), d, c, group)]
    return [(dense, d, c, group), (sorted(experts), d // ep, c // ep, EXPERT_DATA)]


def gather_stage(
    transport: Transport,
    pieces: Sequence[Tensor],
    full: Sequence[Tensor],
    d: int,
    c: int,
    group: str,
    experts: frozenset[int] = frozenset(),
    ep: int = 1,
) -> tuple[Handle, Callable[[], None]]:
    """:func:`gather_pieces` of one stage's leaves, its expert leaves over their own group."""
    started = [
        gather_pieces(transport, [pieces[k] for k in ks], [full[k] for k in ks], pd, pc, pg)
        for ks, pd, pc, pg in _parts(len(full), experts, d, c, ep, group)
        if ks
    ]
    if len(started) == 1:
        return started[0]

    def done() -> None:
        for _, then in started:
            then()

    return _Joined([h for h, _ in started]), done


def scatter_stage(
    transport: Transport,
    grads: Sequence[Tensor],
    d: int,
    c: int,
    group: str,
    into: list[Tensor | None] | None = None,
    experts: frozenset[int] = frozenset(),
    ep: int = 1,
) -> tuple[Handle, Callable[[], None], list[Tensor | None]]:
    """:func:`scatter_grads` of one stage's gradients, its expert leaves reduce-scattered over
    the copies holding the same experts; every piece averaged over all ``d`` copies."""
    parts = _parts(len(grads), experts, d, c, ep, group)
    if len(parts) == 1:
        return scatter_grads(transport, grads, d, c, group, into)
    if into is None:  # one list for both parts (a floating leaf's piece: set by its callback)
        into = [
            None if (g.is_floating_point() or g.is_complex()) else g.new_zeros(piece_sizes(
                g.numel(), pd)[pc])
            for g, (pd, pc) in zip(grads, leaf_layout(len(grads), experts, d, c, ep), strict=True)
        ]  # fmt: skip
    handles, dones = [], []
    for ks, pd, pc, pg in parts:
        if ks:
            h, then, into = scatter_grads(transport, grads, pd, pc, pg, into, keys=ks, scale=1 / d)
            handles.append(h)
            dones.append(then)

    def done() -> None:
        for then in dones:
            then()

    return _Joined(handles), done, into
