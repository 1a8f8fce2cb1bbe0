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
backward, and lists them in :attr:`ShardSpec.plan`:

- an input replicated over a mesh axis the op splits: identity forward, all-reduce backward;
- an input that arrives split but is needed whole: all-gather forward, reduce-scatter backward;
- an input that arrives whole but is needed split: take own shard forward, all-gather backward;
- a partial output resolved by all-reduce: all-reduce forward, identity backward;
- a partial output resolved by reduce-scatter: reduce-scatter forward, all-gather backward;
- a split output gathered: all-gather forward, take own shard backward.

Only the first (outer) factor of a parenthesised group may be split (``(h k)`` with ``h``): its
shards are then contiguous blocks. Parsing is cached (parse -> cached recipe -> apply, as in
einops), and so is the per-shape plan. Calls take local shards: ``column(x, w, mesh=mesh)``;
sizes of grouped axes are global (``h=8``), as einops takes them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import einops
import torch
from torch import Tensor

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import collectives as C
from funcpipe.parallel.layout import Layout
from funcpipe.parallel.mesh import Axis

__all__ = ["Plan", "PlanRow", "ShardSpec", "shard_spec"]

ELLIPSIS = "..."
REDUCE_MODES = ("all_reduce", "reduce_scatter", "partial")
Group = tuple[str, ...]
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


# ------------------------------------------------------------------------------ parsing
def _parse_operand(text: str, pattern: str) -> tuple[Group, ...]:
    groups: list[Group] = []
    tokens = re.findall(r"\(|\)|\.\.\.|[^\s()]+", text)
    current: list[str] | None = None
    for tok in tokens:
        if tok == "(":
            if current is not None:
                raise InvalidArgument(f"pattern {pattern!r}: nested parentheses in {text!r}.")
            current = []
        elif tok == ")":
            if current is None:
                raise InvalidArgument(f"pattern {pattern!r}: unbalanced ')' in {text!r}.")
            if not current:
                raise InvalidArgument(
                    f"pattern {pattern!r}: empty group '()' in {text!r}; drop it (a spec has "
                    "no unit axes)."
                )
            groups.append(tuple(current))
            current = None
        elif tok == ELLIPSIS:
            if current is not None:
                raise InvalidArgument(
                    f"pattern {pattern!r}: '...' inside a group in {text!r} is not supported."
                )
            groups.append((ELLIPSIS,))
        elif _NAME.match(tok):
            if current is not None:
                current.append(tok)
            else:
                groups.append((tok,))
        else:
            raise InvalidArgument(
                f"pattern {pattern!r}: {tok!r} in {text!r} is not an axis name (use "
                "identifiers such as 'b', 'seq', 'h'; numbers and unit axes are not supported)."
            )
    if current is not None:
        raise InvalidArgument(f"pattern {pattern!r}: unbalanced '(' in {text!r}.")
    flat = [a for g in groups for a in g]
    dup = sorted({a for a in flat if flat.count(a) > 1})
    if dup:
        raise InvalidArgument(
            f"pattern {pattern!r}: axis {dup[0]!r} appears twice in operand {text.strip()!r}; "
            "each axis may appear once per operand."
        )
    return tuple(groups)


def _text(groups: Sequence[Group]) -> str:
    return " ".join(g[0] if len(g) == 1 else "(" + " ".join(g) + ")" for g in groups)


def _axes(groups: Sequence[Group]) -> list[str]:
    return [a for g in groups for a in g if a != ELLIPSIS]


def _dim_of(groups: Sequence[Group], axis: str) -> int | None:
    for i, g in enumerate(groups):
        if axis in g:
            return i
    return None


# ------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class PlanRow:
    """One operand on one mesh axis: its layout before/after and the collectives it needs."""

    operand: str
    pattern: str
    mesh_axis: str
    before: str
    after: str
    forward: str
    backward: str


def _layout_text(layout: str | None) -> str:
    if layout is None:
        return "replicated"
    if layout == "+":
        return "partial sum"
    return f"split on {layout}"


@dataclass(frozen=True)
class _Step:
    """One conversion on one mesh axis: which pair, along which pattern axis."""

    operand: int  # input index, or -1 for the output
    mesh_axis: str
    pair: str  # copy_to_group, split_to_group, all_gather, gather_from_group, ...
    along: str | None  # the pattern axis whose dim the collective works on
    before: str | None
    after: str | None


_PAIRS: dict[str, tuple[str, str]] = {
    "copy_to_group": ("identity", "all_reduce"),
    "split_to_group": ("take shard", "all_gather"),
    "all_gather": ("all_gather", "reduce_scatter"),
    "gather_from_group": ("all_gather", "take shard"),
    "reduce_from_group": ("all_reduce", "identity"),
    "reduce_scatter": ("reduce_scatter", "all_gather"),
    "none": ("-", "-"),
}


class ShardSpec:
    """A parsed sharded einsum: :attr:`plan` lists its collectives; call it on local shards.

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
        self._shape_cache: dict[Any, _ShapePlan] = {}

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
    def plan(self) -> Plan:
        """The derived collectives, one row per operand and mesh axis."""
        rows = []
        for s in self.steps:
            name = "out" if s.operand < 0 else f"in{s.operand}"
            groups = self.output if s.operand < 0 else self.inputs[s.operand]
            fwd, bwd = _PAIRS[s.pair]
            if s.pair in ("all_gather", "gather_from_group", "split_to_group", "reduce_scatter"):
                d = _tensor_dim(groups, s.along or "")
                where = f" on {s.along} (dim {d})" if d is not None else ""
                fwd = fwd + where if fwd not in ("identity",) else fwd
                bwd = bwd + where if bwd not in ("identity",) else bwd
            rows.append(
                PlanRow(
                    name,
                    _text(groups),
                    s.mesh_axis,
                    _layout_text(s.before),
                    _layout_text(s.after),
                    fwd,
                    bwd,
                )
            )
        return Plan(self.pattern, tuple(rows))

    # -------------------------------------------------------------------------- layouts
    def _no_ellipsis(self, groups: Sequence[Group]) -> None:
        if (ELLIPSIS,) in groups:
            raise InvalidArgument(
                f"pattern {self.pattern!r}: a Layout needs one entry per dim, and '...' hides "
                "how many there are; name the axes instead of '...' to get layouts."
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

    def input_layout(self, i: int) -> Layout:
        """How input ``i`` arrives (for :meth:`Layout.shard` of a full tensor)."""
        self._no_ellipsis(self.inputs[i])
        return Layout(tuple(self._arrive_dims(i)))

    @property
    def output_layout(self) -> Layout:
        """How the output leaves the spec; ``partial`` lists the axes left as partial sums."""
        self._no_ellipsis(self.output)
        dims, partial = self._leave_dims()
        return Layout(tuple(dims), tuple(partial))

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
        plan = self._shape_plan(tuple(glob), tuple(sorted(mesh_sizes.items())), sizes, local=False)
        return [*plan.arrive_shapes, plan.out_shape]

    def _shape_plan(
        self,
        shapes: tuple[tuple[int, ...], ...],
        mesh_sizes: tuple[tuple[str, int], ...],
        sizes: Mapping[str, int],
        *,
        local: bool,
    ) -> _ShapePlan:
        key = (shapes, mesh_sizes, tuple(sorted(sizes.items())), local)
        plan = self._shape_cache.get(key)
        if plan is None:
            plan = self._shape_cache[key] = _solve(self, shapes, dict(mesh_sizes), sizes, local)
        return plan

    # -------------------------------------------------------------------------- apply
    def __call__(self, *xs: Tensor, mesh: Mapping[str, Axis], **sizes: int) -> Tensor:
        if len(xs) != len(self.inputs):
            raise InvalidArgument(
                f"pattern {self.pattern!r} has {len(self.inputs)} inputs; got {len(xs)} tensors."
            )
        axes: dict[str, Axis] = {}
        for m in self._mesh_axes():
            if m not in mesh:
                raise InvalidArgument(
                    f"pattern {self.pattern!r} uses mesh axis {m!r}, missing from "
                    f"mesh (axes {list(mesh)}); pass mesh=mesh or a dict {{{m!r}: mesh[{m!r}]}}."
                )
            axes[m] = mesh[m]
        for i, x in enumerate(xs):
            if not isinstance(x, Tensor):
                raise InvalidArgument(
                    f"input {i} of pattern {self.pattern!r} is {x!r}, not a Tensor."
                )
        sp = self._shape_plan(
            tuple(tuple(x.shape) for x in xs),
            tuple(sorted((m, a.size) for m, a in axes.items())),
            sizes,
            local=True,
        )
        ins = list(xs)
        for s in self.steps:
            if s.operand >= 0:
                ins[s.operand] = _apply_pair(
                    s, ins[s.operand], axes[s.mesh_axis], self.inputs[s.operand]
                )
        flat = [
            einops.rearrange(x, p, **sz) if p else x
            for x, (p, sz) in zip(ins, sp.in_rearrange, strict=True)
        ]
        y = torch.einsum(sp.equation, *flat)
        if sp.out_rearrange:
            y = einops.rearrange(y, sp.out_rearrange)
        for s in self.steps:
            if s.operand == -1:
                y = _apply_pair(s, y, axes[s.mesh_axis], self.output)
        return y

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


_APPLY: dict[str, Callable[..., Tensor]] = {
    "copy_to_group": lambda x, ax, d: C.copy_to_group(x, ax),
    "split_to_group": lambda x, ax, d: C.split_to_group(x, ax, dim=d),
    "all_gather": lambda x, ax, d: C.all_gather(x, ax, dim=d),
    "gather_from_group": lambda x, ax, d: C.gather_from_group(x, ax, dim=d),
    "reduce_from_group": lambda x, ax, d: C.reduce_from_group(x, ax),
    "reduce_scatter": lambda x, ax, d: C.reduce_scatter(x, ax, dim=d),
}


def _tensor_dim(groups: Sequence[Group], axis: str) -> int | None:
    """The tensor dim holding ``axis`` (negative when it comes after a ``...``)."""
    d = _dim_of(groups, axis)
    ell = _dim_of(groups, ELLIPSIS)
    if d is not None and ell is not None and d > ell:
        return d - len(groups)
    return d


def _apply_pair(step: _Step, x: Tensor, axis: Axis, groups: Sequence[Group]) -> Tensor:
    if step.pair == "none":
        return x
    dim = _tensor_dim(groups, step.along) if step.along is not None else None
    return _APPLY[step.pair](x, axis, dim)


@dataclass(frozen=True)
class Plan:
    """The derived collectives of a spec; ``str(plan)`` is a markdown table."""

    pattern: str
    rows: tuple[PlanRow, ...]

    def table(self) -> str:
        head = ("operand", "pattern", "mesh axis", "layout in", "layout out", "forward", "backward")
        body = [
            (r.operand, r.pattern, r.mesh_axis, r.before, r.after, r.forward, r.backward)
            for r in self.rows
        ]
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]

        def line(cells: Sequence[str]) -> str:
            return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

        sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
        return "\n".join([line(head), sep, *(line(b) for b in body)])

    def __str__(self) -> str:
        return self.table()


# ------------------------------------------------------------------------------ shape solving
@dataclass(frozen=True)
class _ShapePlan:
    arrive_shapes: tuple[tuple[int, ...], ...]
    out_shape: tuple[int, ...]
    in_rearrange: tuple[tuple[str, dict[str, int]], ...]
    equation: str
    out_rearrange: str


def _solve(
    spec: ShardSpec,
    shapes: tuple[tuple[int, ...], ...],
    mesh_sizes: dict[str, int],
    sizes: Mapping[str, int],
    local: bool,
) -> _ShapePlan:
    where = (
        f"pattern {spec.pattern!r} with axes {spec.axes}, "
        f"{'local' if local else 'global'} shapes {list(shapes)}, mesh sizes {mesh_sizes}"
    )
    for m in spec._mesh_axes():
        if m not in mesh_sizes:
            raise InvalidArgument(f"{where}: no size for mesh axis {m!r}.")
    for name, v in sizes.items():
        if not isinstance(v, int) or v < 1:
            raise InvalidArgument(f"{where}: axis size {name}={v!r} must be a positive int.")
    ell_shape: tuple[int, ...] | None = None
    groups_global: list[tuple[Group, int]] = []
    for i, (groups, shape) in enumerate(zip(spec.inputs, shapes, strict=True)):
        has_ell = (ELLIPSIS,) in groups
        named = len(groups) - has_ell
        if len(shape) < named or (not has_ell and len(shape) != named):
            raise InvalidArgument(
                f"{where}: input {i} ({_text(groups)!r}) has {len(shape)} dims; the pattern "
                f"gives it {named}{' or more' if has_ell else ''}."
            )
        k = 0
        for g, lay in zip(groups, spec._arrive_dims(i), strict=True):
            if g == (ELLIPSIS,):
                n_ell = len(shape) - named
                es = shape[k : k + n_ell]
                if ell_shape is not None and es != ell_shape:
                    raise InvalidArgument(
                        f"{where}: the '...' dims differ between inputs ({ell_shape} vs {es}); "
                        "they must be equal (no broadcasting)."
                    )
                ell_shape = es
                k += n_ell
                continue
            n = shape[k] * (_prod(mesh_sizes[m] for m in lay) if local else 1)
            groups_global.append((g, n))
            k += 1
    known: dict[str, int] = {a: int(v) for a, v in sizes.items()}
    unknown_names = [a for a in known if a not in {x for g, _ in groups_global for x in g}]
    if unknown_names:
        raise InvalidArgument(f"{where}: sizes given for {unknown_names}, not axes of the pattern.")
    changed = True
    while changed:
        changed = False
        for g, n in groups_global:
            missing = [a for a in g if a not in known]
            prod_known = _prod(known[a] for a in g if a in known)
            if len(missing) == 1:
                if n % prod_known:
                    raise InvalidArgument(
                        f"{where}: dim ({' '.join(g)}) has size {n}, not divisible by "
                        f"{prod_known} (the known factors)."
                    )
                known[missing[0]] = n // prod_known
                changed = True
            elif not missing and prod_known != n:
                raise InvalidArgument(
                    f"{where}: axis sizes disagree: ({' '.join(g)}) = {n} but the sizes give "
                    f"{' * '.join(str(known[a]) for a in g)} = {prod_known}; every axis must "
                    "have one size across operands."
                )
    for g, _ in groups_global:
        missing = [a for a in g if a not in known]
        if missing:
            raise InvalidArgument(
                f"{where}: cannot infer the size of {missing} in group ({' '.join(g)}); pass "
                f"it as a keyword, e.g. {missing[0]}=<global size>."
            )
    # divisibility of every split axis
    split_by: list[tuple[str, str, str]] = [
        (a, m, "the op splits it") for a, m in spec.axes.items()
    ]
    for i, sh in spec.in_shards.items():
        split_by += [(a, m, f"input {i} arrives split on it") for a, m in sh.items()]
    split_by += [(o, m, "reduce_scatter scatters along it") for m, o in spec.scatter.items()]
    for a, m, why in split_by:
        if known[a] % mesh_sizes[m]:
            raise InvalidArgument(
                f"{where}: axis {a!r} has global size {known[a]}, not divisible by mesh axis "
                f"{m!r} of size {mesh_sizes[m]} ({why}); use a multiple of {mesh_sizes[m]}."
            )
    # local sizes during the computation
    comp = dict(known)
    for a, m in spec.axes.items():
        comp[a] = known[a] // mesh_sizes[m]
    letters = {
        a: chr(ord("a") + i) if i < 26 else chr(ord("A") + i - 26)
        for i, a in enumerate(sorted({x for g, _ in groups_global for x in g}))
    }
    if len(letters) > 52:
        raise InvalidArgument(f"{where}: more than 52 axes.")
    in_re = []
    eq_in = []
    for groups in spec.inputs:
        if any(len(g) > 1 for g in groups):  # ungroup: 'd (h k)' -> 'd h k' with local sizes
            flat = " ".join(a for g in groups for a in g)
            grouped = {a: comp[a] for g in groups if len(g) > 1 for a in g}
            in_re.append((f"{_text(groups)} -> {flat}", grouped))
        else:
            in_re.append(("", {}))
        eq_in.append("".join("..." if a == ELLIPSIS else letters[a] for g in groups for a in g))
    eq_out = "".join("..." if a == ELLIPSIS else letters[a] for g in spec.output for a in g)
    out_re = ""
    if any(len(g) > 1 for g in spec.output):
        out_re = f"{' '.join(a for g in spec.output for a in g)} -> {_text(spec.output)}"
    # shapes as they arrive (inputs) and leave (output)
    arrive = []
    for i, groups in enumerate(spec.inputs):
        shp: list[int] = []
        for g, lay in zip(groups, spec._arrive_dims(i), strict=True):
            if g == (ELLIPSIS,):
                shp += list(ell_shape or ())
            else:
                shp.append(_prod(known[a] for a in g) // _prod(mesh_sizes[m] for m in lay))
        arrive.append(tuple(shp))
    out_shape: list[int] = []
    for g, lay in zip(spec.output, spec._leave_dims()[0], strict=True):
        if g == (ELLIPSIS,):
            out_shape += list(ell_shape or ())
        else:
            out_shape.append(_prod(known[a] for a in g) // _prod(mesh_sizes[m] for m in lay))
    return _ShapePlan(
        tuple(arrive),
        tuple(out_shape),
        tuple(in_re),
        ",".join(eq_in) + "->" + eq_out,
        out_re,
    )


def _prod(xs: Any) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


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
