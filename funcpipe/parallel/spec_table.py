"""The collectives a sharding spec derives, and the table that lists them.

A spec turns into steps, one per operand and mesh axis (:class:`_Step`): which forward/backward
pair of :mod:`funcpipe.parallel.collectives` converts the operand, along which pattern axis.
:func:`_table` lists them as :class:`Collectives` (``str()`` is a markdown table, one
:class:`CollectiveRow` per step) and :func:`_apply_pair` runs one. Used by
:mod:`funcpipe.parallel.spec`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor

from funcpipe.parallel import collectives as C
from funcpipe.parallel.mesh import Axis
from funcpipe.parallel.spec_pattern import Group, _tensor_dim, _text

__all__ = ["CollectiveRow", "Collectives"]


@dataclass(frozen=True)
class CollectiveRow:
    """One operand on one mesh axis: how it is split before/after and the collectives it needs."""

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


_APPLY: dict[str, Callable[..., Tensor]] = {
    "copy_to_group": lambda x, ax, d: C.copy_to_group(x, ax),
    "split_to_group": lambda x, ax, d: C.split_to_group(x, ax, dim=d),
    "all_gather": lambda x, ax, d: C.all_gather(x, ax, dim=d),
    "gather_from_group": lambda x, ax, d: C.gather_from_group(x, ax, dim=d),
    "reduce_from_group": lambda x, ax, d: C.reduce_from_group(x, ax),
    "reduce_scatter": lambda x, ax, d: C.reduce_scatter(x, ax, dim=d),
}


def _apply_pair(step: _Step, x: Tensor, axis: Axis, groups: Sequence[Group]) -> Tensor:
    if step.pair == "none":
        return x
    dim = _tensor_dim(groups, step.along) if step.along is not None else None
    return _APPLY[step.pair](x, axis, dim)


@dataclass(frozen=True)
class Collectives:
    """The derived collectives of a spec; ``str(collectives)`` is a markdown table."""

    pattern: str
    rows: tuple[CollectiveRow, ...]

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


def _table(
    pattern: str,
    steps: Sequence[_Step],
    inputs: Sequence[Sequence[Group]],
    output: Sequence[Group],
) -> Collectives:
    """The derived collectives, one row per operand and mesh axis."""
    rows = []
    for s in steps:
        name = "out" if s.operand < 0 else f"in{s.operand}"
        groups = output if s.operand < 0 else inputs[s.operand]
        fwd, bwd = _PAIRS[s.pair]
        if s.pair in ("all_gather", "gather_from_group", "split_to_group", "reduce_scatter"):
            d = _tensor_dim(groups, s.along or "")
            where = f" on {s.along} (dim {d})" if d is not None else ""
            fwd = fwd + where if fwd not in ("identity",) else fwd
            bwd = bwd + where if bwd not in ("identity",) else bwd
        rows.append(
            CollectiveRow(
                name,
                _text(groups),
                s.mesh_axis,
                _layout_text(s.before),
                _layout_text(s.after),
                fwd,
                bwd,
            )
        )
    return Collectives(pattern, tuple(rows))
