"""Which part of which model tensor each leaf of a rank's state holds (regions and naming).

A checkpoint written by :func:`funcpipe.train.checkpoint.save_model` is keyed by the model's own
parameter names (``"blocks/3/attn/qkv/weight"`` for the GPT, ``"model.layers.0.weight"`` for a
:func:`funcpipe.split_module` model), not by where a leaf sits in this run's per-stage pytrees.
A rank holds a :class:`Region` of each full tensor:

- ``shape``: the full tensor's shape;
- ``box``: per dim, the ``(start, stop)`` range held (a tensor-parallel shard is a box; a whole
  tensor is the box of its shape);
- ``flat``: optionally, a ``(start, stop)`` range of the box's elements in row-major order: a
  ZeRO-style shard ``torch.tensor_split(block.flatten(), d)[c]`` of a tensor-parallel block is
  the region ``Region.of(...).flat_shard(d, c)``.

The stored pieces are keyed ``"<kind>/<name>@<box>"`` with an optional ``"~<flat>"``, e.g.
``"params/wte@0:16,0:16"`` or ``"opt/mu/wte@0:16,0:16~0:128"``, and a load reads the pieces
that overlap what each of its leaves needs (:func:`assemble`), so the stage split, the tensor
and data-parallel sizes and the optimizer-state sharding may all differ from the save.

A :class:`Naming` says how this run's per-stage pytrees map to those names and regions (it is
not a :class:`funcpipe.parallel.Sharding`, whose old name is ``Layout``: it holds them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch

from funcpipe.errors import InvalidArgument
from funcpipe.parallel.mesh import Place
from funcpipe.parallel.sharding import Sharding

__all__ = [
    "SCALAR_DTYPES",
    "Naming",
    "Region",
    "assemble",
    "coverage",
    "path_key",
    "state_keys",
    "tree_paths",
]

Tensor = torch.Tensor
Span = tuple[int, int]
SCALAR_DTYPES: dict[type, torch.dtype] = {bool: torch.bool, int: torch.int64, float: torch.float64}
"""The non-tensor leaves a checkpoint stores, as 0-dim tensors of these dtypes."""


def path_key(accessor: Any) -> str:
    """A leaf's path joined with ``/`` (dict keys, indices, NamedTuple field names)."""
    parts = []
    for entry in accessor:
        field = getattr(entry, "field", None)  # a NamedTuple field: use its name
        parts.append(str(field if field is not None else entry.entry))
    return "/".join(parts)


def state_keys(state: Any, *, name: str = "state") -> dict[str, Any]:
    """The flat ``{key: leaf}`` view of ``state`` that checkpoints store.

    Keys are the leaves' paths joined with ``/``: dict keys, sequence indices and NamedTuple
    field names (``{"opt": AdamWState(step, mu, nu)}`` gives ``"opt/step"``, ``"opt/mu/..."``).
    ``None`` is an empty subtree and has no key. Leaves must be tensors or ``int``, ``float``,
    ``bool``; two leaves whose paths give the same key (``{"a/b": x}`` and ``{"a": {"b": y}}``)
    are an error.
    """
    out: dict[str, Any] = {}
    accessors = optree.tree_accessors(state, none_is_leaf=False)
    leaves = optree.tree_leaves(state, none_is_leaf=False)
    for acc, leaf in zip(accessors, leaves, strict=True):
        key = path_key(acc)
        if not isinstance(leaf, Tensor) and type(leaf) not in SCALAR_DTYPES:
            raise InvalidArgument(
                f"{acc.codify(name)}={leaf!r} is a {type(leaf).__name__}; a checkpoint holds "
                "tensors and int, float or bool values. Convert it (torch.as_tensor) or keep it "
                "out of the checkpointed state."
            )
        if key in out:
            raise InvalidArgument(
                f"{acc.codify(name)} has the checkpoint key {key!r}, which another leaf of "
                f"{name} has too (keys join the path with '/'); rename the dict keys so that "
                "paths stay distinct."
            )
        out[key] = leaf
    return out


def tree_paths(tree: Any) -> dict[str, Any]:
    """``{path: leaf}`` of a pytree (``None`` is an empty subtree; any other object a leaf)."""
    accessors = optree.tree_accessors(tree, none_is_leaf=False)
    leaves = optree.tree_leaves(tree, none_is_leaf=False)
    return {path_key(a): leaf for a, leaf in zip(accessors, leaves, strict=True)}


def _span(text: str) -> Span:
    a, _, b = text.partition(":")
    return int(a), int(b)


@dataclass(frozen=True)
class Region:
    """The part of a full tensor of ``shape`` one leaf holds: the block ``box`` (per dim
    ``(start, stop)``), and of that block, when ``flat`` is given, the elements
    ``flat[0]:flat[1]`` in row-major order (the leaf is then 1-D)."""

    shape: tuple[int, ...]
    box: tuple[Span, ...]
    flat: Span | None = None

    def __post_init__(self) -> None:
        ok = len(self.box) == len(self.shape) and all(
            0 <= a <= b <= n for (a, b), n in zip(self.box, self.shape, strict=True)
        )
        size = math.prod(b - a for a, b in self.box)
        if ok and self.flat is not None:
            ok = 0 <= self.flat[0] <= self.flat[1] <= size
        if not ok:
            raise InvalidArgument(
                f"{self!r}: box needs one (start, stop) per dim of shape with 0 <= start <= "
                "stop <= size, and flat a (start, stop) within the box's element count"
            )

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Region:
        """All of a tensor of ``shape``."""
        return cls(tuple(shape), tuple((0, int(n)) for n in shape))

    @classmethod
    def of(cls, sharding: Sharding, local_shape: Sequence[int], place: Place) -> Region:
        """The block a rank at ``place`` holds of a tensor sharded by ``sharding`` (the
        tensor-parallel shard :meth:`Sharding.shard` gives), from the shard's shape."""
        if sharding.partial:
            raise InvalidArgument(
                f"{sharding!r} holds partial sums over {sharding.partial}: a partial value is "
                "not a slice of the full tensor; checkpoint the summed value instead"
            )
        if len(sharding.dims) != len(local_shape):
            raise InvalidArgument(
                f"{sharding!r} describes {len(sharding.dims)} dims, the leaf has shape "
                f"{tuple(local_shape)}"
            )
        full, box = [], []
        for n, axes in zip(local_shape, sharding.dims, strict=True):
            idx, parts = 0, 1
            for a in axes:
                if a not in place.sizes or a not in place.coords:
                    raise InvalidArgument(
                        f"{sharding!r} names mesh axis {a!r}, not one of {sorted(place.sizes)} "
                        f"of {place!r}"
                    )
                idx, parts = idx * place.sizes[a] + place.coords[a], parts * place.sizes[a]
            full.append(n * parts)
            box.append((idx * n, (idx + 1) * n))
        return cls(tuple(full), tuple(box))

    def flat_shard(self, parts: int, index: int) -> Region:
        """Piece ``index`` of ``parts`` of this block flattened, as ``torch.tensor_split``
        cuts it (the first ``numel % parts`` pieces one element longer)."""
        if self.flat is not None:
            raise InvalidArgument(f"{self!r} is already a flat range")
        if not (isinstance(parts, int) and parts >= 1 and isinstance(index, int)):
            raise InvalidArgument(f"flat_shard(parts={parts!r}, index={index!r}): ints, parts >= 1")
        if not 0 <= index < parts:
            raise InvalidArgument(f"flat_shard: index={index} not in range(parts={parts})")
        base, extra = divmod(math.prod(b - a for a, b in self.box), parts)
        start = index * base + min(index, extra)
        return Region(self.shape, self.box, (start, start + base + (index < extra)))

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box)

    @property
    def held_shape(self) -> tuple[int, ...]:
        """The shape of the leaf that holds this region."""
        if self.flat is None:
            return self.block_shape
        return (self.flat[1] - self.flat[0],)

    def take(self, full: Tensor) -> Tensor:
        """This region of the full tensor (a view where possible)."""
        block = full[tuple(slice(a, b) for a, b in self.box)]
        if self.flat is None:
            return block
        return block.reshape(-1)[self.flat[0] : self.flat[1]]

    def text(self) -> str:
        """``"0:16,0:16"`` (``"~0:128"`` appended for a flat range); :meth:`parse` reads it."""
        box = ",".join(f"{a}:{b}" for a, b in self.box)
        return box if self.flat is None else f"{box}~{self.flat[0]}:{self.flat[1]}"

    @classmethod
    def parse(cls, text: str, shape: Sequence[int]) -> Region:
        box, _, flat = text.partition("~")
        spans = tuple(_span(s) for s in box.split(",")) if box else ()
        return cls(tuple(shape), spans, _span(flat) if flat else None)


def _blocked(
    region: Region, flat: tuple[int, int], data: Tensor | None
) -> tuple[Tensor | None, Tensor]:
    """A flat ``region`` (elements ``flat`` of its block) spread over its block: (the block's
    values or None, a mask of those held)."""
    mask = torch.zeros(region.block_shape, dtype=torch.bool)
    lo, hi = flat
    mask.view(-1)[lo:hi] = True
    if data is None:
        return None, mask
    block = data.new_zeros(region.block_shape)
    block.view(-1)[lo:hi] = data
    return block, mask


def _overlap(a: Region, b: Region) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """The intersection of two boxes, as indices into ``a``'s block and into ``b``'s."""
    ia, ib = [], []
    for (a0, a1), (b0, b1) in zip(a.box, b.box, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        ia.append(slice(lo - a0, hi - a0))
        ib.append(slice(lo - b0, hi - b0))
    return tuple(ia), tuple(ib)


def _fill(
    want: Region, pieces: Sequence[tuple[Region, Tensor | None]], out: Tensor | None
) -> tuple[Tensor, list[int]]:
    """Copy what ``pieces`` hold of ``want`` into ``out`` (its block, when given); the mask of
    what they cover (over the block) and the indices of the pieces that hold any element
    ``want`` holds (a flat ``want``: of its range, so a rank reads its own ZeRO pieces only)."""
    covered = torch.zeros(want.block_shape, dtype=torch.bool)
    wanted = None if want.flat is None else _blocked(want, want.flat, None)[1]
    used = []
    for k, (region, data) in enumerate(pieces):
        if region.shape != want.shape:
            continue
        if region.box == want.box and region.flat is not None and want.flat is not None:
            # one block cut flat both ways (ZeRO pieces): intersect the ranges, no masks
            lo, hi = max(region.flat[0], want.flat[0]), min(region.flat[1], want.flat[1])
            if lo >= hi:
                continue
            used.append(k)
            covered.view(-1)[lo:hi] = True
            if out is not None and data is not None:
                start = lo - region.flat[0]
                out.view(-1)[lo:hi] = data[start : start + hi - lo].to(out.dtype)
            continue
        hit = _overlap(want, region)
        if hit is None:
            continue
        mine, theirs = hit
        if region.flat is None and wanted is None:  # a whole block into a whole block
            used.append(k)
            if out is not None and data is not None:
                out[mine] = data[theirs]
            covered[mine] = True
            continue
        if region.flat is None:
            values, mask = data, wanted[mine]  # type: ignore[index]
        else:
            values, mask = _blocked(region, region.flat, data)
            mask = mask[theirs] if wanted is None else mask[theirs] & wanted[mine]
        if not bool(mask.any()):
            continue
        used.append(k)
        if out is not None and values is not None:
            out[mine] = torch.where(mask, values[theirs].to(out.dtype), out[mine])
        covered[mine] |= mask
    return covered, used


def _needed(want: Region, covered: Tensor) -> Tensor:
    return covered if want.flat is None else covered.reshape(-1)[want.flat[0] : want.flat[1]]


def coverage(want: Region, pieces: Sequence[Region]) -> tuple[int, list[int]]:
    """How many elements of ``want`` the ``pieces`` do not cover, and which pieces overlap it."""
    covered, used = _fill(want, [(p, None) for p in pieces], None)
    return int((~_needed(want, covered)).sum()), used


def assemble(want: Region, pieces: Sequence[tuple[Region, Tensor]]) -> Tensor:
    """The values of ``want`` from stored ``(region, tensor)`` pieces of the same full tensor
    (they must cover it: check with :func:`coverage` first)."""
    dtype = pieces[0][1].dtype if pieces else torch.float32
    out = torch.zeros(want.block_shape, dtype=dtype)
    covered, _ = _fill(want, pieces, out)
    missing = int((~_needed(want, covered)).sum())
    if missing:
        raise InvalidArgument(f"{want!r}: {missing} element(s) are in no stored piece")
    return out if want.flat is None else out.reshape(-1)[want.flat[0] : want.flat[1]].clone()


Names = Callable[[int, str], str]


@dataclass(frozen=True)
class Naming:
    """How this rank's per-stage pytrees (``params[s]``, and the optimizer state's trees shaped
    like them) map to the model's full tensors.

    ``shardings``: per stage, a pytree like ``params[s]`` whose leaves are :class:`Sharding`
    (e.g. ``gpt.shardings(config, n)``); ``None``: every leaf is a whole tensor. ``place``:
    this rank's :class:`Place` (``mesh.place``), needed with ``shardings``. ``names``:
    ``(stage, path) -> name``; by default the leaf's path inside its stage, which is the model's
    own name for :func:`gpt.split` (``"blocks/3/mlp/fc1/weight"``) and for
    :func:`funcpipe.split_module` (the ``state_dict`` names). ``opt_shard``: ``(d, c)`` when the
    optimizer state's tensors are flat shards ``torch.tensor_split(leaf.flatten(), d)[c]`` of
    the params' leaves (ZeRO-1; a leaf sharded over the mesh's ``expert`` axis: piece
    ``expert_data`` of ``d // expert``, as the copies holding its experts cut it); ``None``: they
    are shaped like the params.
    """

    shardings: Sequence[Any] | None = None
    place: Place | None = None
    names: Names | None = None
    opt_shard: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        paths = None if self.shardings is None else [tree_paths(t) for t in self.shardings]
        object.__setattr__(self, "_paths", paths)
        if self.shardings is not None and self.place is None:
            raise InvalidArgument(
                "Naming(shardings=...) needs place= (this rank's mesh.place): a sharding says "
                "which block a rank holds from its coordinates"
            )
        if self.opt_shard is not None:
            d, c = self.opt_shard
            Region.whole((1,)).flat_shard(d, c)  # validates d and c

    def name(self, stage: int, path: str) -> str:
        name = path if self.names is None else self.names(stage, path)
        if not isinstance(name, str) or not name or "@" in name:
            raise InvalidArgument(
                f"names({stage}, {path!r}) gave {name!r}: a non-empty str without '@'"
            )
        return name

    def region(self, stage: int, path: str, shape: Sequence[int], *, opt: bool) -> Region:
        """The region of the leaf at ``path`` of stage ``stage``, given the shape of the params'
        leaf there; for an optimizer-state leaf (``opt=True``) flat-sharded by ``opt_shard``."""
        sharding = None
        paths: list[dict[str, Any]] | None = getattr(self, "_paths", None)
        if paths is not None:
            if not 0 <= stage < len(paths):
                raise InvalidArgument(
                    f"Naming has shardings for {len(paths)} stage(s); the state has a "
                    f"stage {stage}: pass the shardings of this run's stage split"
                )
            sharding = paths[stage].get(path)
            if not isinstance(sharding, Sharding):
                raise InvalidArgument(
                    f"Naming.shardings[{stage}] has no Sharding at {path!r} (found "
                    f"{sharding!r}); it must have the structure of params[{stage}]"
                )
        if sharding is None:
            block = Region.whole(shape)
        elif self.place is None:  # (refused at construction: shardings need a place)
            raise RuntimeError("funcpipe internal error: a Naming with shardings has no place")
        else:
            block = Region.of(sharding, shape, self.place)
        if opt and self.opt_shard is not None:
            d, c = self.opt_shard
            ep = 1 if self.place is None else self.place.sizes.get("expert", 1)
            if sharding is not None and "expert" in sharding.axes and ep > 1:
                # an expert leaf's state is cut over the copies holding the same experts
                return block.flat_shard(d // ep, self.place.coords["expert_data"])  # type: ignore[union-attr]
            return block.flat_shard(d, c)
        return block
