"""Forward that keeps what backward needs; backward whole (B) or split into input (I) and weight (W).

Gradients come back as lists aligned with the inputs / parameters, ``None`` meaning zero.

A stage call is differentiated on torch's autograd graph. By default gradients come back as
values (``torch.autograd.grad``). With ``accumulate=True`` (what the interpreter uses) parameter
gradients are summed by autograd itself into the ``.grad`` of the given parameter leaves, which
the caller creates for one step and owns: the engine adds each microbatch's gradient in place,
so no gradient tensor is allocated, returned and freed per microbatch (on CPU that churn made a
small stage's backward 2-3x slower: glibc hands the freed pages back and faults them in again).

The split works without doing the backward twice. ``I`` runs the backward to the stage inputs only;
on the way it records, at every graph node where a parameter-only branch joins the path to the
inputs, the gradient arriving at that node. ``W`` then starts from exactly those nodes with those
gradients and runs only the parameter branches. Outputs that depend on parameters alone (no path
to an input) are kept for ``W`` too. ``B`` is one backward to inputs and parameters at once.

A join node that computes its parameter branches' gradients during ``I`` anyway, as the backward
of a ``torch.compile``d region does (one compiled graph yields all its gradients at once), is not
run again: ``I`` keeps the gradients it passed to its parameter branches and ``W`` starts below
it. For a stage compiled as a whole, ``I`` therefore costs what ``B`` costs and ``W`` only adds
the parameter gradients up; the schedule stays correct, its I/W overlap is lost for that stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._functorch.config as _functorch_config
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = [
    "Saved",
    "backward",
    "backward_input",
    "backward_weight",
    "forward",
    "param_nodes",
    "recompute",
]

Tensor = torch.Tensor
FlatFn = Callable[[Sequence[Tensor], Sequence[Tensor]], Sequence[Tensor]]


def _differentiable(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


@dataclass
class Saved:
    """What F keeps for one (stage, microbatch) until its backward is done."""

    inputs: list[Tensor]  # flat stage inputs (differentiable ones are leaves requiring grad)
    outputs: list[Tensor] | None  # flat outputs still attached to the graph (None: recompute)
    rng: tuple[Tensor, ...] | None = None  # RNG state at F, replayed by recompute
    # filled by backward_input for backward_weight: groups of roots, one backward call each
    roots: list[list[_Root]] = field(default_factory=list)
    direct: list[tuple[int, Tensor]] = field(default_factory=list)  # outputs that are params


def _rng_state(device: torch.device) -> tuple[Tensor, ...]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return tuple(states)


def _set_rng_state(states: tuple[Tensor, ...], device: torch.device) -> None:
    torch.set_rng_state(states[0])
    if device.type == "cuda" and len(states) > 1:
        torch.cuda.set_rng_state(states[1], device)


def forward(
    fn: FlatFn,
    params: Sequence[Tensor],
    inputs: Sequence[Tensor],
    *,
    keep: bool = True,
    grad_inputs: bool = True,
) -> tuple[list[Tensor], Saved]:
    """Run ``fn(params, inputs) -> outputs`` (flat tensor lists).

    ``params`` must be leaves that require grad (created once per step). ``inputs`` are detached
    here and the floating ones made leaves requiring grad, so a stage's backward stops at its own
    inputs; with ``grad_inputs=False`` (the batch of a first stage) none requires grad, so the
    graph has no path to them (and a recomputation, by funcpipe or inside the stage by
    ``torch.utils.checkpoint``, sees the inputs the forward saw). With ``keep=False``
    (recomputation) the forward runs without a graph and only the inputs and the RNG state are
    kept; :func:`recompute` rebuilds the graph before the backward.
    Returns the outputs detached from the graph and the saved state.
    """
    leaves = [t.detach().requires_grad_(grad_inputs and _differentiable(t)) for t in inputs]
    if keep:
        outputs = list(fn(params, leaves))
        return [o.detach() for o in outputs], Saved(leaves, outputs)
    device = leaves[0].device if leaves else torch.device("cpu")
    rng = _rng_state(device)
    with torch.no_grad():
        outputs = list(fn(params, leaves))
    return outputs, Saved(leaves, None, rng=rng)


def recompute(fn: FlatFn, params: Sequence[Tensor], saved: Saved) -> None:
    """Rebuild the graph of a forward run with ``keep=False`` (same RNG stream as the first run)."""
    if saved.outputs is not None:
        return
    device = saved.inputs[0].device if saved.inputs else torch.device("cpu")
    current = _rng_state(device)
    if saved.rng is not None:
        _set_rng_state(saved.rng, device)
    try:
        saved.outputs = list(fn(params, saved.inputs))
    finally:
        _set_rng_state(current, device)


def _pairs(
    outputs: Sequence[Tensor], grads: Sequence[Tensor | None]
) -> tuple[list[Tensor], list[Tensor]]:
    outs, gs = [], []
    for o, g in zip(outputs, grads, strict=True):
        if g is not None and o.requires_grad:
            outs.append(o)
            gs.append(g)
    return outs, gs


def _grad(
    outputs: Sequence[Tensor],
    wrt: Sequence[Tensor],
    grads: Sequence[Tensor],
    *,
    retain: bool,
) -> list[Tensor | None]:
    """Gradients of ``outputs`` w.r.t. ``wrt``; ``None`` where a gradient is zero (unused, or
    nothing requires grad), so no zeros are allocated for them."""
    need = [i for i, t in enumerate(wrt) if t.requires_grad]
    result: list[Tensor | None] = [None] * len(wrt)
    if not outputs or not need:
        return result
    got = torch.autograd.grad(
        list(outputs), [wrt[i] for i in need], list(grads), retain_graph=retain, allow_unused=True
    )
    for i, g in zip(need, got, strict=True):
        result[i] = g
    return result


def _into(
    outputs: Sequence[Tensor] | Sequence[GradientEdge],
    grads: Sequence[Tensor],
    wrt: Sequence[Tensor],
    *,
    retain: bool,
) -> None:
    """Backward from ``outputs``, summing into the ``.grad`` of the leaves ``wrt`` only."""
    targets = [t for t in wrt if t.requires_grad]
    if outputs and targets:
        outs: Any = list(outputs)  # tensors or gradient edges (torch accepts either)
        torch.autograd.backward(outs, list(grads), retain_graph=retain, inputs=targets)


def _take(leaves: Sequence[Tensor]) -> list[Tensor | None]:
    """The ``.grad`` of each leaf (``None``: zero), detached from the leaves."""
    got: list[Tensor | None] = []
    for t in leaves:
        got.append(t.grad)
        t.grad = None
    return got


def backward(
    saved: Saved,
    params: Sequence[Tensor],
    grad_outputs: Sequence[Tensor | None],
    *,
    accumulate: bool = False,
) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """B: input and parameter gradients in one backward. Frees the graph.

    Returns ``(input_grads, param_grads)``; with ``accumulate=True`` the parameter gradients are
    added into ``params[k].grad`` instead and ``param_grads`` is all ``None``.
    """
    if saved.outputs is None:
        raise RuntimeError("backward before recompute: the forward kept no graph")
    outs, gs = _pairs(saved.outputs, grad_outputs)
    if accumulate:
        _into(outs, gs, [*saved.inputs, *params], retain=False)
        saved.outputs = None
        return _take(saved.inputs), [None] * len(params)
    wrt = [*saved.inputs, *params]
    got = _grad(outs, wrt, gs, retain=False)
    saved.outputs = None
    return got[: len(saved.inputs)], got[len(saved.inputs) :]


Kids = dict[Node, tuple[Node, ...]]  # a node's children (next functions), read once per walk


def _kids(node: Node, kids: Kids) -> tuple[Node, ...]:
    got = kids.get(node)
    if got is None:
        got = kids[node] = tuple(n for n, _ in node.next_functions if n is not None)
    return got


def _input_closure(outputs: Sequence[Tensor], inputs: Sequence[Tensor], kids: Kids) -> set[Node]:
    """The graph nodes from which some stage input is reachable (the path of I)."""
    targets = {get_gradient_edge(t).node for t in inputs if t.requires_grad}
    reaches: dict[Node, bool] = {}
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:  # post-order: a node is decided once all its children are (the graph is a DAG)
        node = stack[-1]
        if node in reaches:
            stack.pop()
            continue
        if node in targets:
            reaches[node] = True
            stack.pop()
            continue
        children = _kids(node, kids)
        pending = [n for n in children if n not in reaches]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        reaches[node] = any(reaches[n] for n in children)
    return {n for n, r in reaches.items() if r}


def _param_reach(node: Node, closure: set[Node], params: dict[Node, int], kids: Kids) -> set[int]:
    """Indices of the parameters reachable from ``node`` without re-entering the input path."""
    found: set[int] = set()
    seen: set[Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in params:
            found.add(params[n])
            continue
        for m in _kids(n, kids):
            if m not in closure and m not in seen:
                seen.add(m)
                stack.append(m)
    return found


def param_nodes(params: Sequence[Tensor]) -> dict[Node, int]:
    """Each parameter leaf's gradient accumulator node -> its index (leaves requiring grad).

    Holding the result keeps the nodes alive, so every later graph over the same leaves uses
    these very nodes: a caller running I for many microbatches of one stage computes this once
    (``get_gradient_edge`` costs ~10 us per leaf) and passes it to :func:`backward_input`.
    """
    return {get_gradient_edge(p).node: i for i, p in enumerate(params) if p.requires_grad}


def backward_input(
    saved: Saved,
    params: Sequence[Tensor],
    grad_outputs: Sequence[Tensor | None],
    *,
    nodes: dict[Node, int] | None = None,
) -> list[Tensor | None]:
    """I: input gradients only; records what :func:`backward_weight` starts from.

    ``nodes``: :func:`param_nodes` of ``params``, if the caller keeps it across microbatches.
    """
    if saved.outputs is None:
        raise RuntimeError("backward_input before recompute: the forward kept no graph")
    outs, gs = _pairs(saved.outputs, grad_outputs)
    param_nodes_ = param_nodes(params) if nodes is None else nodes
    kids: Kids = {}
    closure = _input_closure(outs, saved.inputs, kids)
    # join nodes: on the input path, with edges leaving it towards parameters
    joins: dict[Node, list[_Branch]] = {}
    python: list[Node] = []  # Python-defined backwards on the path (compiled regions among them)
    for n in closure:
        if isinstance(n, BackwardCFunction):
            python.append(n)
        branches = []
        for k, (m, nr) in enumerate(n.next_functions):
            if m is not None and m not in closure:
                reach = _param_reach(m, closure, param_nodes_, kids)
                if reach:
                    branches.append(_Branch(k, m, nr, reach))
        if branches:
            joins[n] = branches
    arrived: dict[Node, tuple[Tensor | None, ...]] = {}  # a join's incoming gradients
    made: dict[Node, tuple[Tensor | None, ...]] = {}  # the gradients a join passed on
    handles = [n.register_prehook(_capture(arrived, n)) for n in joins]
    # a Python-defined backward (a compiled region's, an autograd.Function's) may compute every
    # gradient whatever is asked; torch's own nodes compute only those the backward needs
    handles += [n.register_hook(_capture_made(made, n)) for n in python if n in joins]
    try:
        with _retain_compiled(python):
            grads_in = _grad(outs, saved.inputs, gs, retain=True)
    finally:
        for h in handles:
            h.remove()
    roots: list[_Root] = []
    for node, node_grads in arrived.items():
        branches = joins[node]
        passed = made.get(node)
        if passed is not None and (
            _compiled(node) or all(passed[b.index] is not None for b in branches)
        ):
            # the node computed its parameter branches' gradients already (a compiled graph
            # computes all its gradients at once): W starts below it, nothing runs twice
            for b in branches:
                g = passed[b.index]
                if g is None:
                    continue
                if b.node in param_nodes_:
                    saved.direct.append((param_nodes_[b.node], g))
                else:
                    roots.append(_Root(None, [(GradientEdge(b.node, b.nr), g)], b.params))
            continue
        edges = [(GradientEdge(node, k), g) for k, g in enumerate(node_grads) if g is not None]
        if edges:
            roots.append(_Root(node, edges, set().union(*(b.params for b in branches))))
    for o, g in zip(outs, gs, strict=True):  # outputs that depend on parameters only
        if o.grad_fn is not None and o.grad_fn not in closure:
            reach = _param_reach(o.grad_fn, closure, param_nodes_, kids)
            if reach:
                roots.append(_Root(None, [(get_gradient_edge(o), g)], reach))
        elif o.grad_fn is None:
            for k, prm in enumerate(params):
                if prm is o:  # the stage returns a parameter itself: its gradient is g
                    saved.direct.append((k, g))
    saved.roots = _group(roots)
    saved.outputs = None  # W needs only the recorded roots (they keep their branches alive)
    return grads_in


@dataclass
class _Branch:
    """An edge of a join node leaving the input path towards parameters."""

    index: int  # position in the join's next_functions (and in the gradients it passes on)
    node: Node
    nr: int  # the input of ``node`` the edge feeds
    params: set[int]


def _compiled(node: Node) -> bool:
    """A ``torch.compile``d region's backward: one graph computing all its gradients."""
    return type(node).__name__ == "CompiledFunctionBackward"


@contextmanager
def _retain_compiled(joins: Iterable[Node]) -> Iterator[None]:
    """I keeps the graph for W (``retain_graph=True``). A compiled region whose backward was
    first compiled by a plain backward (``reference_step``, a B) may have "donated" its saved
    buffers to that backward, and AOTAutograd refuses a retained backward through it. Nothing
    runs such a region twice here (I takes all its gradients at once, W starts below it), so
    the refusal is switched off for the call."""
    if not any(_compiled(n) for n in joins) or not hasattr(_functorch_config, "donated_buffer"):
        yield
        return
    with _functorch_config.patch(donated_buffer=False):
        yield


@dataclass
class _Root:
    """Where W starts: a join node (or a parameter-only output) with the gradient I saw there."""

    node: Node | None
    edges: list[tuple[GradientEdge, Tensor]]
    params: set[int]


def _group(roots: list[_Root]) -> list[list[_Root]]:
    """Roots whose parameter sets overlap run in one backward call (tied uses within a stage)."""
    groups: list[tuple[set[int], list[_Root]]] = []
    for root in roots:
        merged = [g for g in groups if g[0] & root.params]
        params, members = set(root.params), [root]
        for g in merged:
            params |= g[0]
            members += g[1]
            groups.remove(g)
        groups.append((params, members))
    return [members for _, members in groups]


def _capture(store: dict[Node, tuple[Tensor | None, ...]], node: Node) -> Callable[..., None]:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
        store[node] = tuple(grad_outputs)

    return hook


def _capture_made(store: dict[Node, tuple[Tensor | None, ...]], node: Node) -> Callable[..., None]:
    def hook(grad_inputs: tuple[Tensor | None, ...], grad_outputs: Any) -> None:
        store[node] = tuple(grad_inputs)

    return hook


def _clamp(grads: tuple[Tensor | None, ...]) -> Callable[..., tuple[Tensor | None, ...]]:
    def hook(grad_outputs: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
        return grads

    return hook


def backward_weight(
    saved: Saved, params: Sequence[Tensor], *, accumulate: bool = False
) -> list[Tensor | None]:
    """W: parameter gradients from what :func:`backward_input` recorded. Frees the graph.

    With ``accumulate=True`` they are added into ``params[k].grad`` and the result is all ``None``.

    One backward call per group of join nodes sharing parameters; each call asks only for its
    group's parameters, so the engine runs just their branches. Within a group (a parameter used
    at several places of the stage) the engine may pass through one join on the way from another:
    a pre-hook pins each join's incoming gradient to what I recorded, so nothing counts twice.
    """
    result: list[Tensor | None] = [None] * len(params)
    last = len(saved.roots) - 1
    for k_group, group in enumerate(saved.roots):
        retain = k_group < last  # the groups may share nodes; the last call frees the graph
        idx = sorted(set().union(*(r.params for r in group)))
        outs = [e for r in group for e, _ in r.edges]
        gs = [g for r in group for _, g in r.edges]
        handles = []
        if len(group) > 1:
            for r in group:
                if r.node is not None:
                    pinned: list[Tensor | None] = [None] * (
                        max(e.output_nr for e, _ in r.edges) + 1
                    )
                    for e, g in r.edges:
                        pinned[e.output_nr] = g
                    handles.append(r.node.register_prehook(_clamp(tuple(pinned))))
        try:
            with _retain_compiled([e.node for e in outs] if retain else []):
                if accumulate:
                    _into(outs, gs, [params[i] for i in idx], retain=retain)
                    continue
                got = torch.autograd.grad(
                    outs, [params[i] for i in idx], gs, retain_graph=retain, allow_unused=True
                )
        finally:
            for h in handles:
                h.remove()
        for i, gi in zip(idx, got, strict=True):
            if gi is not None:
                prev = result[i]
                result[i] = gi if prev is None else prev + gi
    for k, g in saved.direct:
        if accumulate:
            prm = params[k]
            prm.grad = g.detach().clone() if prm.grad is None else prm.grad.add_(g)
            continue
        prev = result[k]
        result[k] = g if prev is None else prev + g
    saved.roots, saved.direct = [], []
    return result
