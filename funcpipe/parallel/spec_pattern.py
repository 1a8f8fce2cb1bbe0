"""Parsing of a sharding spec's pattern: operands as groups of axis names (einops syntax).

``"b s (h k), d (h k) -> b s d"``: each operand is a sequence of groups, one per tensor dim; a
group is one axis name, a parenthesised run of names (one dim, the product of their sizes), or
``...`` (any number of dims). Used by :mod:`funcpipe.parallel.spec`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from funcpipe.errors import InvalidArgument

ELLIPSIS = "..."
Group = tuple[str, ...]
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


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


def _tensor_dim(groups: Sequence[Group], axis: str) -> int | None:
    """The tensor dim holding ``axis`` (negative when it comes after a ``...``)."""
    d = _dim_of(groups, axis)
    ell = _dim_of(groups, ELLIPSIS)
    if d is not None and ell is not None and d > ell:
        return d - len(groups)
    return d
