"""Shape solving for a sharding spec: every axis size from the shapes, checked, and the einsum.

:func:`_solve` takes the shapes of the inputs (local shards as they arrive, or global tensors),
infers the global size of every pattern axis, checks that the sizes agree and that every split
axis divides by its mesh axis, and returns a :class:`_ShapeRecipe`: the local shapes in and out,
the rearranges that ungroup and regroup ``(h k)`` dims, and the ``torch.einsum`` equation. Specs
cache one per shape. Used by :mod:`funcpipe.parallel.spec`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from funcpipe.errors import InvalidArgument
from funcpipe.parallel.spec_pattern import ELLIPSIS, Group, _text


class ShardSpec(Protocol):
    """What shape solving reads of a :class:`funcpipe.parallel.spec.ShardSpec` (a protocol,
    so that this module, below the spec, does not import it)."""

    pattern: str
    axes: dict[str, str]
    scatter: dict[str, str]
    in_shards: dict[int, dict[str, str]]
    inputs: tuple[tuple[Group, ...], ...]
    output: tuple[Group, ...]

    def _mesh_axes(self) -> list[str]: ...
    def _arrive_dims(self, i: int) -> Any: ...
    def _leave_dims(self) -> Any: ...


__all__: list[str] = []


@dataclass(frozen=True)
class _ShapeRecipe:
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
) -> _ShapeRecipe:
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
    groups_global, ell_shape = _global_groups(spec, shapes, mesh_sizes, local, where)
    known = _infer_sizes(groups_global, sizes, where)
    _check_divisible(spec, known, mesh_sizes, where)
    in_re, equation, out_re = _einsum(spec, groups_global, known, mesh_sizes, where)
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
    return _ShapeRecipe(tuple(arrive), tuple(out_shape), in_re, equation, out_re)


def _global_groups(
    spec: ShardSpec,
    shapes: tuple[tuple[int, ...], ...],
    mesh_sizes: dict[str, int],
    local: bool,
    where: str,
) -> tuple[list[tuple[Group, int]], tuple[int, ...] | None]:
    """Every named group of the inputs with its global size, and the shape of the ``...``."""
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
    return groups_global, ell_shape


def _infer_sizes(
    groups_global: list[tuple[Group, int]], sizes: Mapping[str, int], where: str
) -> dict[str, int]:
    """The global size of every axis, from the group sizes and the sizes given as keywords."""
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
    return known


def _check_divisible(
    spec: ShardSpec, known: dict[str, int], mesh_sizes: dict[str, int], where: str
) -> None:
    """Every split axis divides by the size of the mesh axis that splits it."""
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


def _einsum(
    spec: ShardSpec,
    groups_global: list[tuple[Group, int]],
    known: dict[str, int],
    mesh_sizes: dict[str, int],
    where: str,
) -> tuple[tuple[tuple[str, dict[str, int]], ...], str, str]:
    """The rearranges that ungroup the inputs, the einsum equation, the output's regroup."""
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
    return tuple(in_re), ",".join(eq_in) + "->" + eq_out, out_re


def _prod(xs: Any) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out
