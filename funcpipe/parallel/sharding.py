"""How a full tensor is sharded over mesh axes, and the pure shard / gather helpers.

A :class:`Sharding` says, for each dim of a tensor, which mesh axes split it (outermost first), and
over which axes the local values are partial sums. Every other axis holds replicas. Examples::

    Sharding.of("tensor", None)                   # W[out/t, in]: dim 0 split over 'tensor'
    Sharding.of(("tensor_dep", "tensor_row"), None, "tensor_col")   # X[b/(d q), s, h/q]
    Sharding.of(None, None, partial=("tensor",))  # each rank holds a term of a sum

With several axes on one dim, the block index is mixed-radix, outer axis first: on
``("tensor_dep", "tensor_row")`` the rank at dep=a, row=i holds block ``a*q + i``.

:class:`OpSharding` bundles the shardings of an op's inputs, params and output; every op in
:mod:`funcpipe.parallel.ops` and :mod:`funcpipe.parallel.summa` has a ``*_sharding(...)`` function
returning one, whose ``shard_params`` / ``gather_params`` turn full weights into one rank's params
and per-rank params (or grads) back into full tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from funcpipe.errors import InvalidArgument
from funcpipe.parallel.mesh import Place
from funcpipe.tree import tree_map

__all__ = ["OpSharding", "Sharding", "gather_tree", "shard_tree"]

DimSpec = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Sharding:
    """Per dim, the mesh axes that split it (outer first); ``partial``: axes holding partial sums."""

    dims: tuple[tuple[str, ...], ...]
    partial: tuple[str, ...] = ()

    @classmethod
    def of(cls, *dims: DimSpec, partial: Sequence[str] = ()) -> Sharding:
        """``Sharding.of('tensor', None)``: one entry per dim (``None``, an axis, or a tuple)."""
        out: list[tuple[str, ...]] = []
        for d in dims:
            if d is None:
                out.append(())
            elif isinstance(d, str):
                out.append((d,))
            else:
                out.append(tuple(d))
        return cls(tuple(out), tuple(partial))

    def __repr__(self) -> str:
        parts = []
        for d in self.dims:
            parts.append("None" if not d else repr(d[0]) if len(d) == 1 else repr(d))
        if self.partial:
            parts.append(f"partial={self.partial!r}")
        return f"Sharding.of({', '.join(parts)})"

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this sharding splits or sums over."""
        return tuple(a for d in self.dims for a in d) + self.partial

    def _check(self, shape: Sequence[int], sizes: Mapping[str, int], what: str) -> None:
        if len(shape) != len(self.dims):
            raise InvalidArgument(
                f"{what} has shape {tuple(shape)} ({len(shape)} dims) but {self!r} describes "
                f"{len(self.dims)} dims."
            )
        for axis in self.axes:
            if axis not in sizes:
                raise InvalidArgument(
                    f"{self!r} names mesh axis {axis!r}, not one of {sorted(sizes)}."
                )

    def local_shape(self, shape: Sequence[int], sizes: Mapping[str, int]) -> tuple[int, ...]:
        """The shape of one shard of a full tensor of ``shape``; checks divisibility."""
        self._check(shape, sizes, "tensor")
        out = []
        for i, (n, axes) in enumerate(zip(shape, self.dims, strict=True)):
            parts = _prod(sizes[a] for a in axes)
            if n % parts:
                raise InvalidArgument(
                    f"dim {i} of shape {tuple(shape)} has size {n}, not divisible by the "
                    f"{parts} shards of mesh axes {axes} (sizes {[sizes[a] for a in axes]}); "
                    f"use a size that is a multiple of {parts}."
                )
            out.append(n // parts)
        return tuple(out)

    def _block(self, dim: int, place: Place) -> tuple[int, int]:
        idx, parts = 0, 1
        for a in self.dims[dim]:
            idx = idx * place.sizes[a] + place.coords[a]
            parts *= place.sizes[a]
        return idx, parts

    def shard(self, full: Tensor, place: Place) -> Tensor:
        """This place's shard of ``full`` (a copy). A partial sharding puts the whole value on
        coordinate 0 of the partial axes and zeros elsewhere (one valid way to split a sum)."""
        self.local_shape(full.shape, place.sizes)
        out = full
        for dim in range(full.dim()):
            idx, parts = self._block(dim, place)
            if parts > 1:
                out = out.chunk(parts, dim)[idx]
        out = out.clone()
        if any(place.coords[a] for a in self.partial):
            out = torch.zeros_like(out)
        return out

    def gather(self, shards: Sequence[Tensor], places: Sequence[Place]) -> Tensor:
        """The full tensor from one shard per rank (``shards[k]`` lives at ``places[k]``).

        Blocks come from the ranks at coordinate 0 of every axis the sharding does not name
        (replicas are not compared here); partial terms are summed.
        """
        if len(shards) != len(places) or not shards:
            raise InvalidArgument(
                f"gather needs one shard per place; got {len(shards)} shards and "
                f"{len(places)} places."
            )
        sizes = places[0].sizes
        derived = places[0].derived
        mine = {base for a in self.axes for base in derived.get(a, (a,))}
        first = shards[0]
        if first.dim() != len(self.dims):
            raise InvalidArgument(
                f"shard of shape {tuple(first.shape)} does not match {self!r} "
                f"({len(self.dims)} dims)."
            )
        full_shape = [
            n * _prod(sizes[a] for a in axes)
            for n, axes in zip(first.shape, self.dims, strict=True)
        ]
        full = first.new_zeros(full_shape)
        for shard, place in zip(shards, places, strict=True):
            if any(c for a, c in place.coords.items() if a not in derived and a not in mine):
                continue  # a replica: the block comes from coordinate 0 of the other axes
            index: list[slice] = []
            for dim, n in enumerate(shard.shape):
                idx, _ = self._block(dim, place)
                index.append(slice(idx * n, (idx + 1) * n))
            full[tuple(index)] += shard.to(full.dtype)
        return full


def _prod(xs: Any) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def shard_tree(full: Any, shardings: Any, place: Place) -> Any:
    """Shard every leaf of ``full`` with the :class:`Sharding` at the same position of
    ``shardings``."""
    return tree_map(lambda lay, t: lay.shard(t, place), shardings, full)


def gather_tree(per_rank: Sequence[Any], shardings: Any, places: Sequence[Place]) -> Any:
    """Gather per-rank trees (one per place) back into full tensors, leaf by leaf."""
    return tree_map(lambda lay, *shards: lay.gather(shards, places), shardings, *per_rank)


@dataclass(frozen=True)
class OpSharding:
    """The shardings of an op's positional ``inputs``, its ``params`` tree and its ``output``."""

    inputs: tuple[Sharding, ...]
    params: Any = field(default_factory=dict)
    output: Sharding = field(default_factory=Sharding.of)

    def shard_params(self, full: Any, place: Place) -> Any:
        """One rank's params from the full (single-device) params."""
        return shard_tree(full, self.params, place)

    def gather_params(self, per_rank: Sequence[Any], places: Sequence[Place]) -> Any:
        """Full params (or grads of params) from one params tree per rank."""
        return gather_tree(per_rank, self.params, places)

    def shard_inputs(self, full: Sequence[Tensor], place: Place) -> tuple[Tensor, ...]:
        return tuple(lay.shard(t, place) for lay, t in zip(self.inputs, full, strict=True))
