"""Where ``split_module(model, n)`` cuts: ``n`` stages with balanced parameter counts.

A *candidate* cut is the first call of a block of a run of repeated blocks: a child of an
``nn.ModuleList``, or of an ``nn.Sequential``, whose children are all of one type (every such
run: a T5's ``encoder.block.*`` and ``decoder.block.*``, a ResNet's ``layer1.*`` .. ``layer4.*``).
It is kept only where every value live across it is a tensor (only tensors cross stages).

A stage's *cost* is the number of parameter elements its part of the traced graph reads: what
runs before, between and after the runs counts for the stage that runs it, and a parameter read
in two stages (a tied embedding and head) counts in both. The ``n - 1`` cuts minimise the
largest stage's cost, then the sum of the squared costs (a dynamic programme over the
candidates in graph order: deterministic, with no dependence on the modules' names).
Parameters, not FLOPs: they are exact from the graph and the module alone, need no shapes of
intermediate values, and bound each stage's weight and optimizer memory, which is what
a pipeline stage must fit; for blocks of one width the two agree.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn

from funcpipe.errors import InvalidArgument

__all__ = ["balanced_points", "stage_count"]


def stage_count(points: Any) -> int | None:
    """``points`` as a number of stages (checked), or ``None`` when it names the points."""
    if not isinstance(points, int) or isinstance(points, bool):
        return None
    if points < 1:
        raise InvalidArgument(f"points={points!r} stages; ask for 1 or more stages.")
    return points


def _runs(module: nn.Module) -> list[tuple[str, list[str]]]:
    """``(name, its children's names)`` of every nn.ModuleList / nn.Sequential whose children
    are one type (``""``: the module itself is one; a Sequential of named children keeps their
    names)."""
    out = []
    for name, m in module.named_modules():
        kinds = {type(c) for c in m.children()}
        if isinstance(m, nn.ModuleList | nn.Sequential) and len(kinds) == 1:
            out.append((name, [child for child, _ in m.named_children()]))
    return out


def _positions(nodes: Sequence[fx.Node]) -> dict[fx.Node, int]:
    """Where each computed node runs: its index, or for ``getitem`` its source's (it goes with
    the node whose result it unpacks, as ``split_module`` assigns stages)."""
    pos: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if node.op in ("call_function", "call_method", "call_module", "get_attr"):
            src = node.args[0] if node.target is operator.getitem and node.args else None
            pos[node] = pos.get(src, i) if isinstance(src, fx.Node) else i
    return pos


def _blocked(nodes: Sequence[fx.Node], pos: dict[fx.Node, int]) -> list[tuple[int, int]]:
    """``(lo, hi)``: a cut before index ``b`` with ``lo < b <= hi`` would pass on a value that is
    not a tensor (a Python number, a tuple used whole)."""
    end = len(nodes)
    spans = []
    for node, p in pos.items():
        if isinstance(node.meta.get("val"), torch.Tensor | torch.SymInt):
            continue
        last = max((end if u.op == "output" else pos.get(u, p) for u in node.users), default=p)
        if last > p:
            spans.append((p, last))
    return spans


def _candidates(module: nn.Module, nodes: Sequence[fx.Node]) -> list[tuple[int, str]]:
    """``(index of the first node, block name)`` of each block a stage may begin at."""
    blocks = [f"{name}.{c}".lstrip(".") for name, children in _runs(module) for c in children]
    wanted = set(blocks)
    first: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if node.op != "call_function":
            continue
        for path, _ in (node.meta.get("nn_module_stack") or {}).values():
            parts = path.split(".")
            for k in range(1, len(parts) + 1):
                prefix = ".".join(parts[:k])
                if prefix in wanted and prefix not in first:
                    first[prefix] = i
    pos = _positions(nodes)
    begin = min(pos.values(), default=0)
    spans = _blocked(nodes, pos)
    seen: dict[int, str] = {}
    for name in blocks:  # named_modules order: an outer block before one it holds
        at = first.get(name)
        if at is None or at <= begin or at in seen:
            continue  # never called, at the very start, or where another block begins
        if any(lo < at <= hi for lo, hi in spans):
            continue
        seen[at] = name
    return sorted(seen.items())


def _uses(ep: Any, nodes: Sequence[fx.Node]) -> list[tuple[int, list[int]]]:
    """``(numel, [index of each node reading it])`` for each parameter of the graph."""
    from torch.export.graph_signature import InputKind

    params = {s.arg.name for s in ep.graph_signature.input_specs if s.kind == InputKind.PARAMETER}
    pos = _positions(nodes)
    out = []
    for node in nodes:
        if node.op == "placeholder" and node.name in params:
            val = node.meta.get("val")
            numel = int(val.numel()) if isinstance(val, torch.Tensor) else 0
            out.append((numel, sorted({pos[u] for u in node.users if u in pos})))
    return out


def _segment_costs(uses: Sequence[tuple[int, Sequence[int]]], starts: Sequence[int]) -> list:
    """``cost[a][b]``: parameter elements read by the nodes of atomic segments ``a..b``
    (segment 0 runs up to ``starts[0]``, segment ``j`` from ``starts[j - 1]``)."""
    m = len(starts) + 1
    segs = [sorted({sum(1 for b in starts if i >= b) for i in at}) for _, at in uses]
    cost = [[0] * m for _ in range(m)]
    for a in range(m):
        added = [0] * m
        for (numel, _), ss in zip(uses, segs, strict=True):
            first = next((s for s in ss if s >= a), None)
            if first is not None:
                added[first] += numel
        total = 0
        for b in range(a, m):
            total += added[b]
            cost[a][b] = total
    return cost


def _best(cost: list, m: int, n: int, key: Any) -> list[int]:
    """The atomic segments where stages 1..n-1 begin, minimising ``key`` summed (or maxed) over
    stages: ``key(prev, c)`` combines the best of the earlier stages with this one's cost."""
    inf = float("inf")
    best = [[inf] * m for _ in range(n)]
    back = [[0] * m for _ in range(n)]
    for b in range(m):
        best[0][b] = key(None, cost[0][b])
    for k in range(1, n):
        for b in range(k, m):
            for a in range(k, b + 1):
                v = key(best[k - 1][a - 1], cost[a][b])
                if v < best[k][b]:
                    best[k][b], back[k][b] = v, a
    cuts, b = [], m - 1
    for k in range(n - 1, 0, -1):
        a = back[k][b]
        cuts.append(a)
        b = a - 1
    return cuts[::-1]


def check_count(module: nn.Module, n: int) -> None:
    """Refuse ``n`` stages before any tracing where ``module``'s runs of repeated blocks have
    fewer than ``n - 1`` blocks to cut before (the cuts :func:`balanced_points` can make are
    some of those)."""
    blocks = sum(len(children) for _, children in _runs(module))
    if blocks < n - 1:
        _too_many(module, n, f"in at most {blocks} places, so into at most {blocks + 1} stages")
    # (the exact count needs the traced graph: balanced_points)


def _too_many(module: nn.Module, n: int, places: str) -> None:
    runs = _runs(module)
    what = ", ".join(
        f"{name or type(module).__name__ + ' itself'!r} ({len(k)})" for name, k in runs[:6]
    ) + (", ..." * (len(runs) > 6))
    raise InvalidArgument(
        f"points={n} stages, but {type(module).__name__} can be cut {places}: a "
        "number of stages cuts before blocks "
        "of its runs of repeated blocks (an nn.ModuleList or nn.Sequential of one block "
        f"type: {what or 'it has none'}), where the forward first calls them and only "
        "tensors are live. Ask for fewer stages, or name the submodules to cut before."
    )


def balanced_points(module: nn.Module, ep: Any, n: int) -> list[str]:
    """The ``n - 1`` block names where stages 1.. begin (see the module docstring)."""
    if n == 1:
        return []
    nodes = list(ep.graph_module.graph.nodes)
    cands = _candidates(module, nodes)
    if len(cands) < n - 1:
        _too_many(module, n, f"at only {len(cands)} places, so into 1..{len(cands) + 1} stages")
    starts = [i for i, _ in cands]
    cost = _segment_costs(_uses(ep, nodes), starts)
    m = len(starts) + 1
    cuts = _best(cost, m, n, lambda prev, c: c if prev is None else max(prev, c))
    bounds = [0, *cuts, m]
    top = max(cost[bounds[k]][bounds[k + 1] - 1] for k in range(n))

    def squares(prev: Any, c: int) -> float:  # among the cuts as good, the most even
        return float("inf") if c > top else (prev or 0) + c * c

    return [cands[a - 1][1] for a in _best(cost, m, n, squares)]
