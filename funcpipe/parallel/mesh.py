"""Parallel configuration (pure) and the device mesh built from it.

A config in the spirit of ``dict(pipeline=2, tensor=dict(size=4, mode="2d"))`` is validated by
:meth:`ParallelConfig.from_dict` without any process group: every impossible config raises
:class:`~funcpipe.errors.InvalidArgument` saying what was given and what would work. The
data-parallel size is what is left of the world size.

Mesh axes, outermost first (tensor axes innermost, so one tensor group is a block of adjacent
ranks)::

    pipe, data, <tensor axes of the mode>

With ``expert=ep`` (mixture-of-experts layers, :mod:`funcpipe.models.moe`) the expert axis spans
``ep`` of the data-parallel copies, as in DeepSeek-V3: the data dim splits into
``expert_data`` (``data / ep``: the copies holding the same experts) and ``expert`` (``ep``,
inner), and ``data`` names their flattening (all copies, coordinate ``expert_data * ep +
expert``: the dense layers' data parallelism, as without experts)::

    pipe, expert_data, expert, <tensor axes of the mode>

In mode ``1d`` ``mesh["expert_tensor"]`` is the ``ep x t`` ranks of one ``expert_data`` copy
group and pipeline stage (coordinate ``expert * t + tensor``), over which an MoE block that
splits its tokens over ``tensor`` spreads its experts (:mod:`funcpipe.models.moe`): its own
group (listed among the axes) where both are above 1, else ``tensor`` or ``expert`` renamed.

=========== ============================================ =========================
mode        tensor axes (sizes)                          rule on ``size``
=========== ============================================ =========================
``1d``      ``tensor`` (t)                               any t >= 1
``sequence``  ``sequence`` (t), also named ``tensor``    any t >= 1
``2d``      ``tensor_row`` (q), ``tensor_col`` (q)       t = q*q
``2.5d``    ``tensor_dep`` (d), ``tensor_row``, ``tensor_col`` (q)   t = d*q*q, d = ``depth``
``3d``      ``tensor_in``, ``tensor_wt``, ``tensor_out`` (c)          t = c*c*c
=========== ============================================ =========================

For several tensor axes, ``tensor`` also names their flattened group (all t ranks, coordinate
in row-major order). An axis named by a coordinate indexes that coordinate: the process group of
``tensor_row`` holds the q ranks of one grid *column* (they differ only in their row).

:class:`Mesh` (built with :func:`build_mesh`, inside a process group) exposes each named axis as
an :class:`Axis`: its process group, this rank's coordinate and its size. :class:`Place` is the
same geometry as plain numbers (coordinates and sizes of one rank), available without processes
from :meth:`ParallelConfig.place`; the sharding helpers take a ``Place``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from funcpipe.errors import InvalidArgument, check_int

__all__ = ["MODES", "Axis", "Mesh", "ParallelConfig", "Place", "build_mesh"]

MODES = ("1d", "2d", "2.5d", "3d", "sequence")
_TOP_KEYS = ("pipeline", "tensor", "data", "expert")
_TENSOR_KEYS = ("size", "mode", "depth")
_POSITIVE = "must be a positive int (1 means 'no parallelism on this axis')."


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _iroot(n: int, k: int) -> int | None:
    """The integer r with r**k == n, or None."""
    r = round(n ** (1.0 / k))
    for c in (r - 1, r, r + 1):
        if c >= 1 and c**k == n:
            return c
    return None


def _near_powers(n: int, k: int) -> list[int]:
    """The perfect k-th powers just below and just above n (for suggestions)."""
    r = 1
    while (r + 1) ** k <= n:
        r += 1
    below = [r**k] if r**k < n else ([(r - 1) ** k] if r > 1 else [])
    return [*below, (r + 1) ** k]


@dataclass(frozen=True)
class Place:
    """Where one rank sits in the mesh: ``coords[axis]`` in ``range(sizes[axis])``, by axis name.

    Pure data (no process group); the sharding helpers (:mod:`funcpipe.parallel.sharding`) use it.
    ``derived`` maps an axis that merely renames or flattens mesh dims (``tensor`` in the 2D,
    2.5D, 3D and sequence modes) to those dims.
    """

    rank: int
    coords: Mapping[str, int]
    sizes: Mapping[str, int]
    derived: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __repr__(self) -> str:
        alone = self.sizes.get("expert", 1) == 1  # (its aliases then say nothing)
        flat = self.sizes.get("tensor", 1) == 1 or alone  # (expert_tensor then renames one)
        hidden = {
            *(("expert", "expert_data") if alone else ()),
            *(("expert_tensor",) if flat else ()),
        }
        shown = [a for a in self.coords if a not in hidden]
        inner = ", ".join(f"{a}={self.coords[a]}/{self.sizes[a]}" for a in shown)
        return f"Place(rank={self.rank}, {inner})"


@dataclass(frozen=True)
class ParallelConfig:
    """A validated parallel layout: ``world_size = pipeline * data * tensor``.

    Build it with :meth:`from_dict`; ``depth`` is the 2.5D depth (1 for every other mode);
    ``expert`` the expert-parallel size, which divides ``data`` (its ranks are data-parallel
    copies that hold different experts).
    """

    world_size: int
    pipeline: int
    data: int
    tensor: int
    mode: str
    depth: int = 1
    expert: int = 1

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, world_size: int) -> ParallelConfig:
        """Validate ``config`` (keys ``pipeline``, ``tensor``, optional ``data``) for ``world_size``.

        ``tensor`` is an int (1D) or a dict with ``size``, ``mode`` (default ``'1d'``) and, for
        ``mode='2.5d'``, ``depth``. ``data`` defaults to ``world_size // (pipeline * tensor)``.
        ``expert`` (default 1) divides ``data``: the copies among which each MoE layer's experts
        are split.
        """
        world = check_int("world_size", world_size, 1, _POSITIVE)
        if not isinstance(config, Mapping):
            raise InvalidArgument(
                f"config={config!r}: must be a dict such as "
                "dict(pipeline=2, tensor=dict(size=4, mode='2d'))."
            )
        unknown = sorted(set(config) - set(_TOP_KEYS), key=str)
        if unknown:
            raise InvalidArgument(
                f"config has unknown key(s) {unknown}; the keys are {list(_TOP_KEYS)} "
                "(data-parallel size is inferred when 'data' is left out)."
            )
        pipeline = check_int("pipeline", config.get("pipeline", 1), 1, _POSITIVE)
        size, mode, depth = _tensor_part(config.get("tensor", 1))
        if world % (pipeline * size):
            raise InvalidArgument(
                f"world_size={world} is not divisible by pipeline ({pipeline}) x tensor "
                f"({size}) = {pipeline * size}; use a world size that is a multiple of "
                f"{pipeline * size}, or sizes whose product divides {world}."
            )
        inferred = world // (pipeline * size)
        data = check_int("data", config.get("data", inferred), 1, _POSITIVE)
        if data != inferred:
            raise InvalidArgument(
                f"data={data} does not fit: pipeline ({pipeline}) x tensor ({size}) x data "
                f"({data}) = {pipeline * size * data} != world_size={world}; leave 'data' out "
                f"to infer it ({inferred})."
            )
        expert = check_int("expert", config.get("expert", 1), 1, _POSITIVE)
        if data % expert:
            fits = [e for e in range(1, data + 1) if data % e == 0]
            raise InvalidArgument(
                f"expert={expert} does not divide the data-parallel copies ({data} = world_size "
                f"{world} / (pipeline {pipeline} x tensor {size})): the expert axis spans "
                f"{expert} copies, each holding 1/{expert} of the experts; use expert in "
                f"{fits}, or a world size with data a multiple of {expert}."
            )
        return cls(world, pipeline, data, size, mode, depth, expert)

    # --------------------------------------------------------------------------- geometry
    @property
    def tensor_axes(self) -> tuple[tuple[str, int], ...]:
        """The mode's tensor axes as ``(name, size)``, outermost first."""
        t, m = self.tensor, self.mode
        if m == "1d":
            return (("tensor", t),)
        if m == "sequence":
            return (("sequence", t),)
        if m == "2d":
            q = _iroot(t, 2) or 1
            return (("tensor_row", q), ("tensor_col", q))
        if m == "2.5d":
            q = _iroot(t // self.depth, 2) or 1
            return (("tensor_dep", self.depth), ("tensor_row", q), ("tensor_col", q))
        c = _iroot(t, 3) or 1
        return (("tensor_in", c), ("tensor_wt", c), ("tensor_out", c))

    @property
    def data_axes(self) -> tuple[tuple[str, int], ...]:
        """The data dim's axes as ``(name, size)``: ``data``, or with experts ``expert_data``
        and ``expert``."""
        if self.expert == 1:
            return (("data", self.data),)
        return (("expert_data", self.data // self.expert), ("expert", self.expert))

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        data = (s for _, s in self.data_axes)
        return (self.pipeline, *data, *(s for _, s in self.tensor_axes))

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        data = (n for n, _ in self.data_axes)
        return ("pipe", *data, *(n for n, _ in self.tensor_axes))

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Every axis name (mesh dims plus the ``tensor`` and ``data`` aliases or
        flattenings) -> size."""
        sizes = dict(zip(self.mesh_dim_names, self.mesh_shape, strict=True))
        sizes["tensor"] = self.tensor
        sizes["data"] = self.data
        if self.mode == "1d" and self.tensor > 1 and self.expert > 1:  # a group of its own
            sizes["expert_tensor"] = self.expert * self.tensor
        return sizes

    def place(self, rank: int) -> Place:
        """The coordinates of ``rank`` on every axis (row-major over :attr:`mesh_shape`)."""
        if not _is_int(rank) or not 0 <= rank < self.world_size:
            raise InvalidArgument(f"rank={rank!r}: must be an int in range({self.world_size}).")
        coords: dict[str, int] = {}
        rest = rank
        for name, size in reversed(list(zip(self.mesh_dim_names, self.mesh_shape, strict=True))):
            coords[name] = rest % size
            rest //= size
        coords = {n: coords[n] for n in self.mesh_dim_names}
        coords["tensor"] = rank % self.tensor  # tensor axes are innermost and contiguous
        coords["data"] = (rank // self.tensor) % self.data  # and the data axes next to them
        coords["expert"], coords["expert_data"] = divmod(coords["data"], self.expert)[::-1]
        names = tuple(n for n, _ in self.tensor_axes)
        derived = {} if names == ("tensor",) else {"tensor": names}
        if self.expert > 1:
            derived["data"] = tuple(n for n, _ in self.data_axes)
        else:  # one expert rank: expert_data renames data, expert spans no mesh dim
            derived |= {"expert_data": ("data",), "expert": ()}
        # (without experts too, in a Place: a sharding over the expert axis is then whole)
        sizes = {**self.axis_sizes, "expert": self.expert, "expert_data": self.data // self.expert}
        # the expert x tensor ranks of a copy group (Mesh's expert_tensor axis), expert outer
        coords["expert_tensor"] = coords["expert"] * self.tensor + coords["tensor"]
        sizes["expert_tensor"] = self.expert * self.tensor
        derived["expert_tensor"] = derived.get("expert", ("expert",)) + derived.get(
            "tensor", ("tensor",)
        )
        return Place(rank, coords, sizes, derived)

    def places(self) -> list[Place]:
        """:meth:`place` of every rank, in rank order."""
        return [self.place(r) for r in range(self.world_size)]


def _tensor_part(tensor: object) -> tuple[int, str, int]:
    if _is_int(tensor):
        return check_int("tensor", tensor, 1, _POSITIVE), "1d", 1
    if not isinstance(tensor, Mapping):
        raise InvalidArgument(
            f"tensor={tensor!r}: must be an int (1D) or a dict such as dict(size=4, mode='2d')."
        )
    unknown = sorted(set(tensor) - set(_TENSOR_KEYS), key=str)
    if unknown:
        raise InvalidArgument(
            f"tensor has unknown key(s) {unknown}; the keys are {list(_TENSOR_KEYS)}."
        )
    if "size" not in tensor:
        raise InvalidArgument(f"tensor={dict(tensor)!r} has no 'size'; add e.g. size=4.")
    size = check_int("tensor size", tensor["size"], 1, _POSITIVE)
    mode = tensor.get("mode", "1d")
    if mode not in MODES:
        raise InvalidArgument(f"tensor mode={mode!r} is unknown; use one of {list(MODES)}.")
    if mode != "2.5d":
        if "depth" in tensor:
            raise InvalidArgument(
                f"tensor depth={tensor['depth']!r} is only meaningful with mode='2.5d' "
                f"(got mode={mode!r}); drop 'depth' or use mode='2.5d'."
            )
        depth = 1
    else:
        if "depth" not in tensor:
            raise InvalidArgument(
                f"tensor mode='2.5d' needs a depth d with size = d*q*q; got size={size} and no "
                f"depth; e.g. {_depths_hint(size)}."
            )
        depth = check_int("tensor depth", tensor["depth"], 1, _POSITIVE)
    if mode == "2d" and _iroot(size, 2) is None:
        squares = _near_powers(size, 2)
        raise InvalidArgument(
            f"tensor size {size} with mode '2d' must be a square q*q (1, 4, 9, 16...); use "
            f"size={' or size='.join(str(s) for s in squares if s != size)} or mode='1d'."
        )
    if mode == "3d" and _iroot(size, 3) is None:
        cubes = _near_powers(size, 3)
        raise InvalidArgument(
            f"tensor size {size} with mode '3d' must be a cube c*c*c (1, 8, 27, 64...); use "
            f"size={' or size='.join(str(s) for s in cubes if s != size)} or mode='1d'."
        )
    if mode == "2.5d" and (size % depth or _iroot(size // depth, 2) is None):
        valid = [depth * s for s in _near_powers(max(1, size // depth), 2) if depth * s != size]
        raise InvalidArgument(
            f"tensor size {size} with mode '2.5d' and depth {depth} must be depth*q*q "
            f"({depth}, {4 * depth}, {9 * depth}...); with depth={depth} use size="
            f"{' or size='.join(str(v) for v in valid if v != size)}; {_depths_hint(size)}."
        )
    return size, mode, depth


def _depths_hint(size: int) -> str:
    depths = [d for d in range(1, size + 1) if size % d == 0 and _iroot(size // d, 2)]
    return f"for size={size} the depths that work are {depths}"


@dataclass(frozen=True)
class Axis:
    """One named mesh axis as seen from this rank: ``group`` (a process group), ``size``, ``coord``.

    ``coord`` is this rank's index in ``group`` (``0 <= coord < size``). A size-1 axis moves no
    data: every collective over it is the identity.
    """

    name: str
    size: int
    coord: int
    group: Any = field(repr=False, compare=False)

    @classmethod
    def from_group(cls, name: str, group: Any) -> Axis:
        """An axis over an existing process group (``None``: the default group)."""
        import torch.distributed as dist

        return cls(name, dist.get_world_size(group), dist.get_rank(group), group)

    def global_rank(self, coord: int) -> int:
        """The global rank of the member at ``coord`` of this axis's group."""
        import torch.distributed as dist

        return int(dist.get_global_rank(self.group, coord)) if self.group is not None else coord


class Mesh(Mapping[str, Axis]):
    """The device mesh of a :class:`ParallelConfig`, with every axis by name: ``mesh['tensor']``.

    ``device_mesh`` is the underlying ``torch.distributed.device_mesh.DeviceMesh``; ``place`` is
    this rank's :class:`Place`.
    """

    def __init__(
        self,
        config: ParallelConfig,
        device_mesh: Any,
        axes: Mapping[str, Axis],
        rank: int,
        *,
        claim: Any = None,
    ) -> None:
        self.config = config
        self.device_mesh = device_mesh
        self._axes = dict(axes)
        self.place = config.place(rank)
        self._claim = claim  # funcpipe.distributed.groups.Claim on the shared process groups
        self.closed = False

    def close(self) -> None:
        """Release this mesh's process groups, unless another open mesh of the same
        configuration uses them (collective: every process closes its meshes in the same order;
        see :mod:`funcpipe.distributed.groups`). The mesh cannot communicate afterwards."""
        # drop the references too: a process group's threads and connections end with its last
        self.device_mesh, self._axes, self.closed = None, {}, True
        if self._claim is not None:
            self._claim.close()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, name: str) -> Axis:
        try:
            return self._axes[name]
        except KeyError:
            alias = self._expert_tensor() if name == "expert_tensor" else None
            if alias is not None:
                return alias
            if self.closed:
                raise InvalidArgument(
                    f"mesh[{name!r}]: this mesh was closed (close() or the end of its with "
                    "block); build a new one with build_mesh"
                ) from None
            raise InvalidArgument(
                f"mesh has no axis {name!r}; its axes are {list(self._axes)} "
                f"(mode {self.config.mode!r})."
            ) from None

    def _expert_tensor(self) -> Axis | None:
        """``expert_tensor`` where one of its two axes has size 1: the other one, renamed (not
        listed among the axes: it is no group of its own)."""
        c = self.config
        if c.mode != "1d" or self.closed or (c.tensor > 1 and c.expert > 1):
            return None
        only = self._axes["tensor" if c.tensor > 1 or c.expert == 1 else "expert"]
        return Axis("expert_tensor", only.size, only.coord, only.group)

    def __iter__(self) -> Iterator[str]:
        return iter(self._axes)

    def __len__(self) -> int:
        return len(self._axes)

    def __repr__(self) -> str:
        axes = ", ".join(f"{a.name}={a.coord}/{a.size}" for a in self._axes.values())
        return f"Mesh(rank={self.place.rank}, {axes})"


def build_mesh(
    config: ParallelConfig | Mapping[str, Any], *, device_type: str | None = None
) -> Mesh:
    """Build the process groups of ``config`` with ``init_device_mesh`` (call on every rank).

    Needs an initialised default process group. ``device_type`` defaults to ``'cuda'`` under
    NCCL and ``'cpu'`` otherwise.

    Meshes of one configuration share their process groups: a second ``build_mesh`` with the
    same ``config`` and ``device_type`` creates none. :meth:`Mesh.close` (or a ``with`` block)
    gives them back, and the last close destroys them (:mod:`funcpipe.distributed.groups`).
    """
    import torch.distributed as dist

    from funcpipe.distributed.groups import Claim

    if not dist.is_initialized():
        raise InvalidArgument(
            "build_mesh needs torch.distributed to be initialised; call it inside "
            "funcpipe.launch.launch(fn, nprocs) or under torchrun."
        )
    world = dist.get_world_size()
    if not isinstance(config, ParallelConfig):
        config = ParallelConfig.from_dict(config, world_size=world)
    elif config.world_size != world:
        raise InvalidArgument(
            f"config.world_size={config.world_size} but the process group has {world} ranks; "
            f"rebuild it with ParallelConfig.from_dict(..., world_size={world})."
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    claim = Claim()
    key = ("mesh", config, device_type)
    dm, axes = claim.shared(key, lambda: _make_mesh(config, device_type), forget=_forget_mesh)
    mesh = Mesh(config, dm, axes, dist.get_rank(), claim=claim)
    for name, axis in axes.items():
        if axis.coord != mesh.place.coords[name]:
            raise RuntimeError(  # the mesh and ParallelConfig.place must agree; a bug otherwise
                f"internal: axis {name!r} coordinate {axis.coord} != {mesh.place.coords[name]}"
            )
    return mesh


def _forget_mesh(value: tuple[Any, dict[str, Axis]]) -> None:
    """torch's DeviceMesh and the flattened meshes it keeps refer to each other: a cycle that
    would keep their process groups (and gloo's threads) until the garbage collector runs."""
    with contextlib.suppress(AttributeError):
        value[0]._flatten_mapping.clear()


def _make_mesh(
    config: ParallelConfig, device_type: str
) -> tuple[tuple[Any, dict[str, Axis]], list[Any]]:
    """``((device mesh, axes), the process groups created)`` for ``config``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from funcpipe.distributed.timeouts import group_options, job_timeout

    names = config.mesh_dim_names
    # every axis's group takes the job's timeout (torch would give it the backend's default)
    limit, backend = job_timeout(), dist.get_backend()
    options = group_options(backend, limit) if limit is not None else None
    over: Any = {n: (backend, options) for n in names} if options is not None else None
    dm = init_device_mesh(
        device_type, config.mesh_shape, mesh_dim_names=names, backend_override=over
    )
    axes = {
        n: Axis(n, dm.size(i), dm.get_local_rank(n), dm.get_group(n)) for i, n in enumerate(names)
    }
    tensor_names = [n for n, _ in config.tensor_axes]
    extra: list[Any] = []
    if len(tensor_names) == 1:
        only = axes[tensor_names[0]]
        axes["tensor"] = Axis("tensor", only.size, only.coord, only.group)
    else:
        sub = dm[tuple(tensor_names)]
        if hasattr(sub, "_flatten"):
            flat = (
                sub._flatten("tensor")
                if options is None
                else sub._flatten("tensor", backend_override=(backend, options))
            )
        else:  # a torch without DeviceMesh._flatten: a second mesh with the tensor axes merged
            shape = (config.pipeline, config.data, config.tensor)
            whole = init_device_mesh(device_type, shape, mesh_dim_names=("pipe", "data", "tensor"))
            extra += whole.get_all_groups()
            flat = whole["tensor"]
        axes["tensor"] = Axis("tensor", flat.size(), flat.get_local_rank(), flat.get_group())

    def flattened(name: str, dims: tuple[str, ...]) -> Axis:
        """The mesh dims ``dims`` flattened into one axis (its group with the job's timeout)."""
        sub = dm[dims]
        over = {} if options is None else {"backend_override": (backend, options)}
        flat = sub._flatten(name, **over)
        return Axis(name, flat.size(), flat.get_local_rank(), flat.get_group())

    if config.expert > 1:  # the data axis: expert_data and expert flattened (all the copies)
        axes["data"] = flattened("data", tuple(n for n, _ in config.data_axes))
    if config.mode == "1d" and config.tensor > 1 and config.expert > 1:
        # the expert and tensor ranks of one copy group, flattened (coord expert * t + tensor):
        # an MoE block that splits its tokens over tensor sends them over it (models.moe)
        axes["expert_tensor"] = flattened("expert_tensor", ("expert", "tensor"))
    # the default group among these is left out when they are destroyed (funcpipe.distributed.groups)
    return (dm, axes), [*dm.get_all_groups(), *extra, *(a.group for a in axes.values())]
