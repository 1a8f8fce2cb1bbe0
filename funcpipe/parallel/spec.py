"""Sharded functions described by an einops pattern and a map from pattern axes to mesh axes.

A spec is an einsum written in einops syntax, plus which pattern axes are split over which mesh
axes::

    column = shard_spec("b s d, (h k) d -> b s (h k)", {"h": "tensor"})
    row = shard_spec("b s (h k), d (h k) -> b s d", {"h": "tensor"}, reduce="all_reduce")

Every operand is laid out on every mesh axis of the map: split along the mapped pattern axis if
it has that axis, replicated otherwise. Axes missing from the output are summed; when a summed
axis is split, the local results are partial sums, and ``reduce`` says how they resolve:
``"all_reduce"`` (to replicated), ``"reduce_scatter"`` (to split along the output axis named by
``scatter``) or ``"partial"`` (left as partial sums). Inputs may arrive in another layout
(``in_shards={0: {"s": "tensor"}}``: input 0 arrives split along ``s``), and a split output may
be gathered (``gather_output=True``). From this the spec derives every collective, forward and
backward, and lists them in :attr:`ShardSpec.collectives`:

- an input replicated over a mesh axis the op splits: identity forward, all-reduce backward;
- an input that arrives split but is needed whole: all-gather forward, reduce-scatter backward;
- an input that arrives whole but is needed split: take own shard forward, all-gather backward;
- a partial output resolved by all-reduce: all-reduce forward, identity backward;
- a partial output resolved by reduce-scatter: reduce-scatter forward, all-gather backward;
- a split output gathered: all-gather forward, take own shard backward.

Only the first (outer) factor of a parenthesised group may be split (``(h k)`` with ``h``): its
shards are then contiguous blocks. Parsing is cached (parse -> cached recipe -> apply, as in
einops), and so is the per-shape recipe. Calls take local shards: ``column(x, w, mesh=mesh)``;
sizes of grouped axes are global (``h=8``), as einops takes them.

This module holds :class:`ShardSpec` (validation, derivation, the call) and :func:`shard_spec`;
the pattern's parsing is in :mod:`~funcpipe.parallel.spec_pattern`, the collectives table in
:mod:`~funcpipe.parallel.spec_table` and the shape solving in
:mod:`~funcpipe.parallel.spec_shapes`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import einops
import torch
import torch.nn.functional as F
from torch import Tensor

from funcpipe.errors import InvalidArgument
from funcpipe.parallel.mesh import Axis
from funcpipe.parallel.sharding import Sharding
from funcpipe.parallel.spec_pattern import (
    ELLIPSIS,
    Group,
    _axes,
    _dim_of,
    _parse_operand,
    _text,
)
from funcpipe.parallel.spec_shapes import _ShapeRecipe, _solve
from funcpipe.parallel.spec_table import CollectiveRow, Collectives, _apply_pair, _Step, _table

__all__ = ["CollectiveRow", "Collectives", "Plan", "PlanRow", "ShardSpec", "shard_spec"]

REDUCE_MODES = ("all_reduce", "reduce_scatter", "partial")
LOWERED_CACHE = 1024  # call signatures a spec keeps the lowering of (__call__)


def _is_linear(equation: str) -> bool:
    """Is ``equation`` ``x[..., i] * w[o, i] -> y[..., o]`` (what ``F.linear`` computes)?"""
    lhs, out = equation.split("->")
    operands = lhs.split(",")
    if len(operands) != 2 or len(operands[1]) != 2:
        return False
    x, w = operands
    o, i, lead = w[0], w[1], x[:-1]
    return x.endswith(i) and out == lead + o and i not in lead and o not in x and o != i


@dataclass(frozen=True)
class _Lowered:
    """How one call signature of a :class:`ShardSpec` runs: the local product's recipe, whether
    any input is rearranged first, whether the product is ``F.linear`` (and the bias fused into
    it), and the collectives that move data (over mesh axes larger than 1) on the inputs and on
    the output."""

    recipe: _ShapeRecipe
    rearrange: bool
    linear: bool
    fused: bool
    arrive: tuple[_Step, ...]  # the inputs' collectives
    moved: tuple[_Step, ...]  # the output's


# the old names of the collectives table (before "plan" meant only the cluster planner)
Plan = Collectives
PlanRow = CollectiveRow


class ShardSpec:
    """A parsed sharded einsum: :attr:`collectives` lists them; call it on local shards.

    Build with :func:`shard_spec` (cached). ``spec(*xs, mesh=mesh, **sizes)`` runs it; ``mesh``
    maps each mesh axis name of the spec to an :class:`~funcpipe.parallel.Axis`.
    """

    def __init__(
        self,
        pattern: str,
        axes: tuple[tuple[str, str], ...],
        reduce: tuple[tuple[str, str], ...],
        scatter: tuple[tuple[str, str], ...],
        in_shards: tuple[tuple[int, tuple[tuple[str, str], ...]], ...],
        gather_output: bool,
    ) -> None:
        self.pattern = pattern
        self.axes = dict(axes)
        self.reduce = dict(reduce)
        self.scatter = dict(scatter)
        self.in_shards = {i: dict(m) for i, m in in_shards}
        self.gather_output = gather_output
        self._args = (axes, reduce, scatter, in_shards, gather_output)
        values = {how for _, how in reduce}
        self._reduce_arg: str | dict[str, str] = (
            next(iter(values)) if len(values) == 1 else dict(reduce)
        )
        if pattern.count("->") != 1:
            raise InvalidArgument(
                f"pattern {pattern!r} must have exactly one '->', as in 'b d, d f -> b f'."
            )
        lhs, rhs = pattern.split("->")
        self.inputs = tuple(_parse_operand(t, pattern) for t in lhs.split(","))
        self.output = _parse_operand(rhs, pattern)
        self._validate()
        self.steps = self._derive()
        self._shape_cache: dict[Any, _ShapeRecipe] = {}  # check_shapes' (global shapes)
        self._mesh_names = tuple(self._mesh_axes())
        self._lowered: dict[Any, _Lowered] = {}  # call signature -> how it runs (__call__)

    # -------------------------------------------------------------------------- validation
    def _fail(self, rule: str) -> InvalidArgument:
        return InvalidArgument(f"pattern {self.pattern!r} with axes {self.axes}: {rule}")

    def _validate(self) -> None:
        in_axes = {a for op in self.inputs for a in _axes(op)}
        if any(not g for g in self.inputs):
            raise self._fail("an input operand is empty; write one axis per dim ('b d, d f').")
        for a in _axes(self.output):
            if a not in in_axes:
                raise self._fail(
                    f"output axis {a!r} appears in no input; every output axis must come from "
                    "an input."
                )
        has_ell = [any(g == (ELLIPSIS,) for g in op) for op in self.inputs]
        if any(g == (ELLIPSIS,) for g in self.output) and not any(has_ell):
            raise self._fail("'...' in the output needs '...' in an input.")
        seen: dict[str, str] = {}
        for a, m in self.axes.items():
            if not isinstance(a, str) or not isinstance(m, str):
                raise self._fail(f"axes must map str to str; got {a!r}: {m!r}.")
            if a not in in_axes:
                raise self._fail(
                    f"mapped axis {a!r} is not in the pattern (its axes: {sorted(in_axes)})."
                )
            if m in seen:
                raise self._fail(
                    f"mesh axis {m!r} is mapped from both {seen[m]!r} and {a!r}; map each mesh "
                    "axis from one pattern axis."
                )
            seen[m] = a
        for i, shards in self.in_shards.items():
            if not 0 <= i < len(self.inputs):
                raise self._fail(f"in_shards names input {i}, but there are {len(self.inputs)}.")
            for a in shards:
                if a not in _axes(self.inputs[i]):
                    raise self._fail(
                        f"in_shards[{i}] splits {a!r}, which input {i} "
                        f"({_text(self.inputs[i])!r}) does not have."
                    )
            if len(set(shards.values())) != len(shards):
                raise self._fail(f"in_shards[{i}] maps two pattern axes to one mesh axis.")
        # only the outer factor of a group may be split
        split = [*self.axes, *(a for s in self.in_shards.values() for a in s)]
        for a in [*split, *self.scatter.values()]:
            for k, op in enumerate((*self.inputs, self.output)):
                d = _dim_of(op, a)
                if d is not None and op[d][0] != a:
                    which = "output" if k == len(self.inputs) else f"input {k}"
                    raise self._fail(
                        f"axis {a!r} is split but is an inner factor of group "
                        f"({' '.join(op[d])}) in {which}; only the first (outer) factor of a "
                        f"group can be split: write ({a} {' '.join(x for x in op[d] if x != a)})."
                    )
        out_axes = set(_axes(self.output))
        contracted = {m for a, m in self.axes.items() if a not in out_axes}
        if contracted and not self.reduce:
            raise self._fail(
                f"summed axes are split over {sorted(contracted)}, so the local results are "
                "partial sums; say how they resolve with reduce='all_reduce', "
                "'reduce_scatter' (with scatter=<output axis>) or 'partial'."
            )
        if set(self.reduce) != contracted:
            raise self._fail(
                f"reduce is given for mesh axes {sorted(self.reduce)} but the partial sums are "
                f"over {sorted(contracted)}; give reduce only when a summed axis is split."
            )
        for m, how in self.reduce.items():
            if how not in REDUCE_MODES:
                raise self._fail(f"reduce={how!r} for {m!r}: use one of {list(REDUCE_MODES)}.")
            if (how == "reduce_scatter") != (m in self.scatter):
                raise self._fail(
                    f"mesh axis {m!r}: scatter=<output axis> goes with reduce='reduce_scatter' "
                    f"(got reduce={how!r}, scatter={self.scatter.get(m)!r})."
                )
        for o in self.scatter.values():
            if o not in out_axes:
                raise self._fail(f"scatter={o!r} is not an output axis ({sorted(out_axes)}).")
            if o in self.axes:
                raise self._fail(
                    f"scatter={o!r} is already split over {self.axes[o]!r}; scatter along an "
                    "output axis that is not in the map."
                )
        if self.gather_output and not any(a in out_axes for a in self.axes):
            raise self._fail("gather_output=True but no output axis is split; drop gather_output.")

    # -------------------------------------------------------------------------- derivation
    def _mesh_axes(self) -> list[str]:
        out = list(self.axes.values())
        for i in sorted(self.in_shards):
            out += [m for m in self.in_shards[i].values() if m not in out]
        return out

    def _derive(self) -> tuple[_Step, ...]:
        out_axes = set(_axes(self.output))
        mapped = {m: a for a, m in self.axes.items()}
        steps: list[_Step] = []
        for i, op in enumerate(self.inputs):
            mine: list[_Step] = []
            for m in self._mesh_axes():
                a = mapped.get(m)
                needs = a if a is not None and a in _axes(op) else None
                if i in self.in_shards:
                    arrived = {mm: b for b, mm in self.in_shards[i].items()}
                    arrives = arrived.get(m)
                else:
                    arrives = needs
                if a is None:  # the op is replicated over m
                    pair = "gather_from_group" if arrives is not None else "none"
                    along = arrives
                elif arrives == needs:
                    pair = "none" if needs is not None else "copy_to_group"
                    along = None
                elif arrives is None:
                    pair, along = "split_to_group", needs
                elif needs is None:
                    pair, along = "all_gather", arrives
                else:
                    raise self._fail(
                        f"input {i} arrives split on {arrives!r} over {m!r} but is needed split "
                        f"on {needs!r}; that needs an all-to-all, which specs do not do. Pass "
                        f"it split on {needs!r}, or replicated."
                    )
                mine.append(_Step(i, m, pair, along, arrives, needs))
            # gather to whole values first, then split: a dim gathered over one mesh axis and
            # split over another must be whole in between
            steps += sorted(mine, key=lambda s: s.pair not in ("all_gather", "gather_from_group"))
        for m in self._mesh_axes():
            a = mapped.get(m)
            if a is None:
                steps.append(_Step(-1, m, "none", None, None, None))
            elif a in out_axes:
                pair = "gather_from_group" if self.gather_output else "none"
                steps.append(_Step(-1, m, pair, a, a, None if self.gather_output else a))
            else:
                how = self.reduce[m]
                if how == "all_reduce":
                    steps.append(_Step(-1, m, "reduce_from_group", None, "+", None))
                elif how == "reduce_scatter":
                    o = self.scatter[m]
                    steps.append(_Step(-1, m, "reduce_scatter", o, "+", o))
                else:
                    steps.append(_Step(-1, m, "none", None, "+", "+"))
        return tuple(steps)

    @property
    def collectives(self) -> Collectives:
        """The derived collectives, one row per operand and mesh axis."""
        return _table(self.pattern, self.steps, self.inputs, self.output)

    plan = collectives  # the old name (before "plan" meant only the cluster planner)

    # -------------------------------------------------------------------------- shardings
    def _no_ellipsis(self, groups: Sequence[Group]) -> None:
        if (ELLIPSIS,) in groups:
            raise InvalidArgument(
                f"pattern {self.pattern!r}: a Sharding needs one entry per dim, and '...' hides "
                "how many there are; name the axes instead of '...' to get shardings."
            )

    def _arrive_dims(self, i: int) -> list[tuple[str, ...]]:
        dims: list[tuple[str, ...]] = [() for _ in self.inputs[i]]
        for s in self.steps:
            if s.operand == i and s.before is not None:
                d = _dim_of(self.inputs[i], s.before)
                if d is not None:
                    dims[d] = (*dims[d], s.mesh_axis)
        return dims

    def _leave_dims(self) -> tuple[list[tuple[str, ...]], list[str]]:
        dims: list[tuple[str, ...]] = [() for _ in self.output]
        partial = []
        for s in self.steps:
            if s.operand == -1 and s.after == "+":
                partial.append(s.mesh_axis)
            elif s.operand == -1 and s.after is not None:
                d = _dim_of(self.output, s.after)
                if d is not None:
                    dims[d] = (*dims[d], s.mesh_axis)
        return dims, partial

    def input_sharding(self, i: int) -> Sharding:
        """How input ``i`` arrives (for :meth:`Sharding.shard` of a full tensor)."""
        self._no_ellipsis(self.inputs[i])
        return Sharding(tuple(self._arrive_dims(i)))

    @property
    def output_sharding(self) -> Sharding:
        """How the output leaves the spec; ``partial`` lists the axes left as partial sums."""
        self._no_ellipsis(self.output)
        dims, partial = self._leave_dims()
        return Sharding(tuple(dims), tuple(partial))

    # the old names (a tensor's layout over the mesh is now its sharding)
    input_layout = input_sharding
    output_layout = output_sharding

    # -------------------------------------------------------------------------- shapes
    def check_shapes(
        self, *shapes: Sequence[int], mesh_sizes: Mapping[str, int], **sizes: int
    ) -> list[tuple[int, ...]]:
        """Validate GLOBAL input shapes on a mesh of ``mesh_sizes``; return the local shapes
        of the inputs (as they arrive) and of the output, last. Pure: no process group."""
        if len(shapes) != len(self.inputs):
            raise InvalidArgument(
                f"pattern {self.pattern!r} has {len(self.inputs)} inputs; got {len(shapes)} "
                f"shapes {list(shapes)}."
            )
        glob = [tuple(int(n) for n in s) for s in shapes]
        key = (tuple(glob), tuple(sorted(mesh_sizes.items())), tuple(sorted(sizes.items())))
        recipe = self._shape_cache.get(key)
        if recipe is None:
            recipe = self._shape_cache[key] = _solve(self, key[0], dict(mesh_sizes), sizes, False)
        return [*recipe.arrive_shapes, recipe.out_shape]

    # -------------------------------------------------------------------------- apply
    def __call__(
        self, *xs: Tensor, mesh: Mapping[str, Axis], bias: Tensor | None = None, **sizes: int
    ) -> Tensor:
        """The spec on local shards, plus ``bias`` (the output's local shape, broadcast) if given.

        The local product lowers to ``F.linear`` (one ``addmm``, the bias fused in the compute
        dtype) when it is ``x[..., i] * w[o, i] -> y[..., o]``, else to ``torch.einsum``; either
        way the collectives are exactly those of :attr:`collectives`. The bias is added after
        the output's collectives (once, after a sum), so it is fused only where those move
        nothing (none, or a mesh axis of size 1). What follows from the shapes, the mesh axes'
        sizes and whether a bias is given is worked out once per such signature (a GPT block
        calls its specs on the same shapes every microbatch)."""
        if len(xs) != len(self.inputs):
            raise InvalidArgument(
                f"pattern {self.pattern!r} has {len(self.inputs)} inputs; got {len(xs)} tensors."
            )
        try:
            axes = {m: mesh[m] for m in self._mesh_names}
        except KeyError:
            raise self._missing_axis(mesh) from None
        for i, x in enumerate(xs):
            if not isinstance(x, Tensor):
                raise InvalidArgument(
                    f"input {i} of pattern {self.pattern!r} is {x!r}, not a Tensor."
                )
        if bias is not None and not isinstance(bias, Tensor):
            raise InvalidArgument(f"bias of pattern {self.pattern!r} is {bias!r}, not a Tensor.")
        key = (  # (list comprehensions: one call each, where a generator is one per item)
            tuple([tuple(x.shape) for x in xs]),
            tuple([a.size if isinstance(a, Axis) else None for a in axes.values()]),  # (_lower)
            bias is None,
            tuple(sorted(sizes.items())) if sizes else (),
        )
        low = self._lowered.get(key)
        if low is None:
            low = self._lower(xs, axes, bias is not None, sizes)
            if not torch.compiler.is_compiling():  # (a store while tracing breaks its own guard)
                if len(self._lowered) >= LOWERED_CACHE:  # many sequence lengths: the oldest goes
                    del self._lowered[next(iter(self._lowered))]
                self._lowered[key] = low
        ins = list(xs)
        for s in low.arrive:
            ins[s.operand] = _apply_pair(
                s, ins[s.operand], axes[s.mesh_axis], self.inputs[s.operand]
            )
        sp = low.recipe
        if low.rearrange:
            ins = [
                einops.rearrange(x, p, **sz) if p else x
                for x, (p, sz) in zip(ins, sp.in_rearrange, strict=True)
            ]
        if low.linear:
            y = F.linear(ins[0], ins[1], bias if low.fused else None)
            if low.fused:
                bias = None
        else:
            y = torch.einsum(sp.equation, *ins)
            if sp.out_rearrange:
                y = einops.rearrange(y, sp.out_rearrange)
        for s in low.moved:
            y = _apply_pair(s, y, axes[s.mesh_axis], self.output)
        return y if bias is None else y + bias

    def _missing_axis(self, mesh: Mapping[str, Axis]) -> InvalidArgument:
        m = next(m for m in self._mesh_names if m not in mesh)
        return InvalidArgument(
            f"pattern {self.pattern!r} uses mesh axis {m!r}, missing from "
            f"mesh (axes {list(mesh)}); pass mesh=mesh or a dict {{{m!r}: mesh[{m!r}]}}."
        )

    def _lower(
        self, xs: Sequence[Tensor], axes: Mapping[str, Axis], bias: bool, sizes: Mapping[str, int]
    ) -> _Lowered:
        """How a call with these shapes, mesh axes' sizes and bias runs (see ``__call__``)."""
        for m, a in axes.items():
            if not isinstance(a, Axis):
                raise InvalidArgument(
                    f"pattern {self.pattern!r}: mesh[{m!r}] is {a!r}, not a "
                    "funcpipe.parallel.Axis (e.g. mesh['tensor'])."
                )
        left = [m for m, how in self.reduce.items() if how == "partial" and axes[m].size > 1]
        if bias and left:
            raise InvalidArgument(
                f"bias= with pattern {self.pattern!r}: the output stays partial sums over mesh "
                f"axes {left} (reduce='partial'), so a bias added here would be counted once "
                "per rank of them; add it after the sums are reduced."
            )
        # (cached with the rest of the lowering, so not in _shape_cache)
        shapes = tuple(tuple(x.shape) for x in xs)
        sp = _solve(self, shapes, {m: a.size for m, a in axes.items()}, sizes, True)
        # a collective over a mesh axis of size 1 is the identity: only the others run
        moves = [s for s in self.steps if s.pair != "none" and axes[s.mesh_axis].size > 1]
        moved = tuple(s for s in moves if s.operand == -1)
        linear = _is_linear(sp.equation) and not sp.out_rearrange
        return _Lowered(
            recipe=sp,
            rearrange=any(p for p, _ in sp.in_rearrange),
            linear=linear,
            fused=linear and bias and not moved,
            arrive=tuple(s for s in moves if s.operand >= 0),
            moved=moved,
        )

    def __repr__(self) -> str:
        axes, reduce, scatter, in_shards, gather = self._args
        parts = [repr(self.pattern), repr(dict(axes))]
        if reduce:
            r = self._reduce_arg
            parts.append(f"reduce={r!r}")
        if scatter:
            sc = dict(scatter)
            one = len(set(sc.values())) == 1 and isinstance(self._reduce_arg, str)
            parts.append(f"scatter={next(iter(sc.values()))!r}" if one else f"scatter={sc!r}")
        if in_shards:
            parts.append(f"in_shards={ {i: dict(m) for i, m in in_shards}!r}")
        if gather:
            parts.append("gather_output=True")
        return f"shard_spec({', '.join(parts)})"


# ------------------------------------------------------------------------------ public builder
def _norm_map(value: object, name: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{name}={value!r} must be a dict of str to str.")
    return tuple(sorted((str(k), v) for k, v in value.items()))


@functools.lru_cache(maxsize=512)
def _cached(
    pattern: str,
    axes: tuple[tuple[str, str], ...],
    reduce: tuple[tuple[str, str], ...],
    scatter: tuple[tuple[str, str], ...],
    in_shards: tuple[tuple[int, tuple[tuple[str, str], ...]], ...],
    gather_output: bool,
) -> ShardSpec:
    return ShardSpec(pattern, axes, reduce, scatter, in_shards, gather_output)


def shard_spec(
    pattern: str,
    axes: Mapping[str, str],
    *,
    reduce: str | Mapping[str, str] | None = None,
    scatter: str | Mapping[str, str] | None = None,
    in_shards: Mapping[int, Mapping[str, str]] | None = None,
    gather_output: bool = False,
) -> ShardSpec:
    """Parse (cached) a sharded einsum; see the module docstring for the language.

    ``axes``: pattern axis -> mesh axis. ``reduce``: how partial sums resolve, one of
    ``'all_reduce'``, ``'reduce_scatter'``, ``'partial'`` (or a dict per mesh axis); required
    exactly when a summed axis is split. ``scatter``: the output axis a reduce-scatter splits.
    ``in_shards``: ``{input index: {pattern axis: mesh axis}}`` for inputs that arrive in another
    layout than the op computes on. ``gather_output``: all-gather split output axes.
    """
    if not isinstance(pattern, str):
        raise InvalidArgument(f"pattern={pattern!r} must be a str such as 'b d, d f -> b f'.")
    ax = _norm_map(axes, "axes")
    if reduce is None:
        red: tuple[tuple[str, str], ...] = ()
    elif isinstance(reduce, str):
        # one mode for every mesh axis whose pattern axis is summed
        out_names = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", pattern.split("->")[-1]))
        red = tuple(sorted((m, reduce) for a, m in ax if a not in out_names))
        if not red:
            raise InvalidArgument(
                f"pattern {pattern!r} with axes {dict(ax)}: reduce={reduce!r} but no summed "
                "axis is split, so there are no partial sums; drop reduce."
            )
    else:
        red = _norm_map(reduce, "reduce")
    if scatter is None:
        sc: tuple[tuple[str, str], ...] = ()
    elif isinstance(scatter, str):
        sc = tuple((m, scatter) for m, how in red if how == "reduce_scatter")
        if not sc:
            raise InvalidArgument(
                f"pattern {pattern!r}: scatter={scatter!r} goes with reduce='reduce_scatter' "
                f"(got reduce={reduce!r})."
            )
    else:
        sc = _norm_map(scatter, "scatter")
    if in_shards is None:
        ins: tuple[tuple[int, tuple[tuple[str, str], ...]], ...] = ()
    else:
        if not isinstance(in_shards, Mapping):
            raise InvalidArgument(
                f"in_shards={in_shards!r} must be a dict {{input index: {{axis: mesh axis}}}}."
            )
        ins = tuple(sorted((int(i), _norm_map(m, f"in_shards[{i}]")) for i, m in in_shards.items()))
    if not isinstance(gather_output, bool):
        raise InvalidArgument(f"gather_output={gather_output!r} must be a bool.")
    # under torch.compile the spec is built while tracing (a constant of the graph); dynamo would
    # trace through the cache wrapper anyway, and warns about it, so call what it wraps
    build = _cached.__wrapped__ if torch.compiler.is_compiling() else _cached
    return build(pattern, ax, red, sc, ins, gather_output)
