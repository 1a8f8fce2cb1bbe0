"""Weight gradients of ``nn.Linear``-shaped products, computed without the autograd engine.

Most weights of a model sit in matrix products that autograd records as ``addmm`` (a Linear
with bias on 2-D rows; N-D inputs are flattened to 2-D first) or ``mm``: ``y = x @ w.T + b``.
Their weight gradient is ``g.T @ x`` and their bias gradient ``g.sum(0)``, where ``g`` is the
gradient arriving at the product and ``x`` its saved input. Computing that directly, rather
than letting the engine run the product's weight branch, buys two things:

- the gradient is summed in place into the parameter's ``.grad`` (``addmm_``): no fresh
  weight-sized tensor per microbatch (:func:`funcpipe.runtime.autodiff.backward_weight`);
- the products of several microbatches can be summed as *one* product over all their rows
  (:func:`backward_deferred` keeps ``(x, g)``, :func:`weight_batch` does the sum): on CPU a
  weight gradient over 8 rows is a skinny, memory-bound product, over 64 rows a real one;
- where the interpreter allows it, a product's rows are only copied into the gradient's own
  memory and summed once per step (:mod:`funcpipe.runtime.staging`): the same one product
  over all rows, with nothing kept alive for it.

A product qualifies when its weight edge leads (directly or through one transpose) to a
parameter leaf, its bias edge (if any) to another, and no other use of those parameters exists
in the stage's graph; anything else stays with the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from funcpipe.runtime import chain, engine, reuse, staging

__all__ = ["Deferred", "Linear", "backward_deferred", "match", "weight_batch"]

Tensor = torch.Tensor


@dataclass(frozen=True)
class Linear:
    """A product node whose weight (and bias) gradients can be computed directly."""

    weight: int  # parameter index of the weight
    transposed: bool  # the product used w.T (nn.Linear): grad = g.T @ x; else x.T @ g
    bias: int | None  # parameter index of addmm's bias, if any
    saved: str  # the node's attribute holding the product's left operand x


def _parts(node: Node) -> tuple[Node | None, Node | None, Node | None, str] | None:
    """(bias child, x child, weight child, saved x attribute) of an addmm / mm node."""
    name = node.name()
    if name == "AddmmBackward0":
        if getattr(node, "_saved_alpha", None) != 1 or getattr(node, "_saved_beta", None) != 1:
            return None
        (bias, _), (x, _), (w, _) = node.next_functions
        return bias, x, w, "_saved_mat1"
    if name == "MmBackward0":
        (x, _), (w, _) = node.next_functions
        return None, x, w, "_saved_self"
    return None


def match(node: Node, param_nodes: dict[Node, int]) -> tuple[Linear, Node | None] | None:
    """The :class:`Linear` form of ``node`` and its transpose node (``None`` if the weight
    edge is the parameter itself), or ``None`` if it has none."""
    parts = _parts(node)
    if parts is None:
        return None
    bias_node, _, w_node, saved = parts
    transpose = None
    if w_node is not None and w_node not in param_nodes and _is_transpose(w_node):
        transpose = w_node
        ((w_node, _),) = w_node.next_functions
    if w_node is None or w_node not in param_nodes:
        return None
    if bias_node is not None and bias_node not in param_nodes:
        return None
    bias = None if bias_node is None else param_nodes[bias_node]
    return Linear(param_nodes[w_node], transpose is not None, bias, saved), transpose


def _is_transpose(node: Node) -> bool:
    """A node swapping the two dims of a matrix: ``w.t()``, ``w.T``, ``w.mT``,
    ``w.transpose(0, 1)``."""
    name = node.name()
    if name == "TBackward0":
        return True
    if name == "PermuteBackward0":
        return tuple(getattr(node, "_saved_dims", ())) == (1, 0)
    if name == "TransposeBackward0":
        dims = {getattr(node, "_saved_dim0", None), getattr(node, "_saved_dim1", None)}
        return dims == {0, 1} or dims == {2**64 - 1, 2**64 - 2}  # (-1, -2), stored unsigned
    return False


def input_child(node: Node) -> Node | None:
    """The child of an addmm / mm node on its x side."""
    parts = _parts(node)
    return None if parts is None else parts[1]


def usable(x: Tensor, g: Tensor, w: Tensor) -> bool:
    """The direct formula applies to these tensors (else a cast sits between: the engine)."""
    return x.dtype == g.dtype == w.dtype and x.device == g.device and x.dim() == 2


def add_product(
    params: Sequence[Tensor],
    lin: Linear,
    x: Tensor,
    g: Tensor,
    accumulate: bool,
    result: list[Tensor | None],
) -> None:
    """Add the product's weight (and bias) gradient for input ``x`` and incoming gradient ``g``
    (their rows may be several microbatches' concatenated) to ``params[k].grad``
    (``accumulate``) or to ``result[k]``; in place where a gradient exists."""
    with torch.no_grad():  # x requires grad when it is on the input path: record nothing
        staged = staging.NONE
        if accumulate:  # its rows (and its bias's) wait in the gradient's own memory for one
            bias = None if lin.bias is None else params[lin.bias]  # product per step
            staged = staging.add(params[lin.weight], lin.transposed, x, g, bias)
        if staged == staging.NONE:
            a, b = (g.t(), x) if lin.transposed else (x.t(), g)
            if (prev := params[lin.weight].grad if accumulate else result[lin.weight]) is not None:
                prev.addmm_(a, b)
            else:  # the step's first: into memory an earlier step's gradient left, if offered
                spare = reuse.take(params[lin.weight]) if accumulate else None
                _put(params, lin.weight, torch.mm(a, b, out=spare), accumulate, result)
        if lin.bias is not None and staged != staging.BOTH:
            gb = g.sum_to_size(params[lin.bias].shape)
            prev = params[lin.bias].grad if accumulate else result[lin.bias]
            if prev is not None:
                prev.add_(gb)
            else:
                spare = reuse.take(params[lin.bias]) if accumulate else None
                if spare is not None:
                    gb = spare.copy_(gb)
                elif gb is g:
                    gb = gb.clone()
                _put(params, lin.bias, gb, accumulate, result)


def _put(
    params: Sequence[Tensor], k: int, value: Tensor, accumulate: bool, result: list[Tensor | None]
) -> None:
    if accumulate:
        params[k].grad = value
    else:
        result[k] = value


@dataclass
class Deferred:
    """What :func:`backward_deferred` left for :func:`weight_batch`: per direct product, its
    input ``x`` and incoming gradient ``g`` for one microbatch."""

    items: list[tuple[Linear, Tensor, Tensor]]


_PRODUCT_TYPES: dict[type, bool] = {}  # node class -> is it addmm / mm (name() per class)


def _product_type(node: Node) -> bool:
    kind = type(node)
    got = _PRODUCT_TYPES.get(kind)
    if got is None:
        got = _PRODUCT_TYPES[kind] = node.name() in ("AddmmBackward0", "MmBackward0")
    return got


def _find(
    outputs: Sequence[Tensor], param_nodes: dict[Node, int]
) -> tuple[list[tuple[Node, Linear]], list[tuple[Node, list[int]]], dict[Node, int]]:
    """The stage's direct products whose parameters nothing else in the graph uses, and its
    chain nodes (:mod:`funcpipe.runtime.chain`) with the parameters they hand over as rows,
    likewise used nowhere else; and how many edges lead to each node."""
    roots = [o.grad_fn for o in outputs if o.grad_fn is not None]
    seen: set[Node] = set(roots)
    stack = list(roots)
    incoming: dict[Node, int] = {}
    found: list[tuple[Node, Linear, Node | None]] = []
    chains: list[tuple[Node, list[int]]] = []
    while stack:
        node = stack.pop()
        if _product_type(node):
            m = match(node, param_nodes)
            if m is not None:
                found.append((node, m[0], m[1]))
        elif chain.is_chain_node(node):
            chains.append((node, chain.chain_params(node)))
        for child, _ in node.next_functions:
            if child is None:
                continue
            incoming[child] = incoming.get(child, 0) + 1
            if child not in seen:
                seen.add(child)
                stack.append(child)
    by_index = {i: n for n, i in param_nodes.items()}
    chains = [
        (node, ks)
        for node, ks in chains
        if ks and all(k in by_index and incoming.get(by_index[k], 0) == 1 for k in ks)
    ]
    while True:  # drop products sharing a parameter with any other use, until none is left
        refs: dict[Node, int] = {}
        for _, lin, _t in found:
            refs[by_index[lin.weight]] = refs.get(by_index[lin.weight], 0) + 1
            if lin.bias is not None:
                refs[by_index[lin.bias]] = refs.get(by_index[lin.bias], 0) + 1
        keep = [
            (node, lin, transpose)
            for node, lin, transpose in found
            if (transpose is None or incoming.get(transpose, 0) == 1)
            and incoming.get(by_index[lin.weight], 0) == refs[by_index[lin.weight]]
            and (
                lin.bias is None or incoming.get(by_index[lin.bias], 0) == refs[by_index[lin.bias]]
            )
        ]
        if len(keep) == len(found):
            return [(node, lin) for node, lin, _ in keep], chains, incoming
        found = keep


def backward_deferred(
    outputs: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    inputs: Sequence[Tensor],
    params: Sequence[Tensor],
    param_nodes: dict[Node, int],
    *,
    linear_only: bool = False,
) -> tuple[list[Tensor | None], Deferred] | None:
    """A whole backward (B) that leaves the direct products' weight gradients for later.

    One engine call computes the input gradients, the gradients of every parameter not in a
    direct product (added into their ``.grad``), and the gradient arriving at each direct
    product; those products' ``(x, g)`` are returned for :func:`weight_batch`. ``None`` if the
    stage has no direct product (the caller runs an ordinary B). Frees the graph.

    ``linear_only``: also ``None`` (nothing run) unless every parameter that needs a gradient
    sits in a direct product: then this is an I whose W needs no graph (the split's cheap case).
    """
    if len(outputs) == 1 and chain.is_chain_node(outputs[0].grad_fn):
        alone = _chain_alone(outputs[0], grad_outputs[0], inputs)
        if alone is not None:
            return alone
    found, chains, incoming = _find(outputs, param_nodes)
    if not found and not chains:
        return None
    if not found and len(chains) == 1:
        after = _chain_after(outputs, grad_outputs, inputs, params, chains[0], incoming)
        if after is not None:
            return after
    fast = {lin.weight for _, lin in found} | {lin.bias for _, lin in found if lin.bias is not None}
    fast |= {k for _, ks in chains for k in ks}
    xs = [getattr(node, lin.saved) for node, lin in found]  # before the engine frees them
    if any(
        x.dtype != params[lin.weight].dtype or x.dim() != 2
        for x, (_, lin) in zip(xs, found, strict=True)
    ):
        return None  # a cast between a parameter and its product: the engine does it all
    want_in = [k for k, t in enumerate(inputs) if t.requires_grad]
    others = [k for k, p in enumerate(params) if p.requires_grad and k not in fast]
    if linear_only and (others or any(o.grad_fn is None for o in outputs)):
        return None
    targets: list[Any] = [inputs[k] for k in want_in]  # tensors and gradient edges
    targets += [params[k] for k in others]
    targets += [GradientEdge(node, 0) for node, _ in found]
    targets += [params[ks[0]] for _, ks in chains]  # runs each chain's backward (rows below)
    with chain.collecting() as rows:
        got = engine.run(outputs, grad_outputs, targets)
    grads_in: list[Tensor | None] = [None] * len(inputs)
    n = len(want_in)
    for k, g in zip(want_in, got[:n], strict=True):
        grads_in[k] = g
    for k, g in zip(others, got[n : n + len(others)], strict=True):
        if g is not None:  # autograd may hand back one tensor for several (or the incoming
            p = params[k]  # gradient itself): own a copy before summing into it in place
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)
    items = []
    for x, (_, lin), g in zip(
        xs, found, got[n + len(others) : n + len(others) + len(found)], strict=True
    ):
        if g is not None:
            items.append((lin, x.detach(), g))
    items += rows
    return grads_in, Deferred(items)


def _chain_input_index(node: Node, inputs: Sequence[Tensor]) -> int | None:
    """Which stage input a chain node was called on: its index, -1 if the chain's input needs
    no gradient, ``None`` if it is not a stage input (something lies between: the engine's)."""
    x = chain.chain_input(node)
    for k, t in enumerate(inputs):
        if t is x:
            return k
    return -1 if not x.requires_grad else None


def _chain_alone(
    y: Tensor, g: Tensor | None, inputs: Sequence[Tensor]
) -> tuple[list[Tensor | None], Deferred] | None:
    """B of a stage that is one chain call on one of its inputs (a chain stage's graph is that
    one node): the chain's backward called directly, with no engine walk and no graph search (its
    parameters are used once, :func:`funcpipe.runtime.chain.of` checks it). ``None`` where the
    engine must do it."""
    node = y.grad_fn
    k = None if node is None else _chain_input_index(node, inputs)
    if (
        node is None
        or k is None
        or g is None
        or g.shape != y.shape
        or g.dtype != y.dtype
        or g.device != y.device
    ):
        return None
    gx, rows = chain.run_node(node, g)
    grads_in: list[Tensor | None] = [None] * len(inputs)
    if k >= 0:
        grads_in[k] = gx
    return grads_in, Deferred(rows)


def _chain_after(
    outputs: Sequence[Tensor],
    grad_outputs: Sequence[Tensor],
    inputs: Sequence[Tensor],
    params: Sequence[Tensor],
    found: tuple[Node, list[int]],
    incoming: dict[Node, int],
) -> tuple[list[Tensor | None], Deferred] | None:
    """B of a stage whose graph ends in one chain call on one of its inputs, with more after
    it (the last stage's loss): the engine runs only the part after the chain, up to the
    gradient arriving at its output, and the chain's backward is called directly. ``None`` if
    anything else needs a gradient (another parameter, another input, another path to the
    chain's input)."""
    node, ks = found
    k = _chain_input_index(node, inputs)
    if k is None:
        return None
    fast = set(ks)  # (never empty: _find keeps only chains handing over parameters)
    if any(p.requires_grad and j not in fast for j, p in enumerate(params)):
        return None
    if any(t.requires_grad and j != k for j, t in enumerate(inputs)):
        return None
    if k >= 0:
        x_node = node.next_functions[0][0]  # (edges for tensor arguments only: x first)
        if x_node is None or incoming.get(x_node, 0) != 1:
            return None
    (g,) = engine.run(outputs, grad_outputs, [GradientEdge(node, 0)])
    grads_in: list[Tensor | None] = [None] * len(inputs)
    if g is None:  # nothing reached the chain: no gradient for its input or parameters
        return grads_in, Deferred([])
    gx, rows = chain.run_node(node, g)
    if k >= 0:
        grads_in[k] = gx
    return grads_in, Deferred(rows)


def weight_batch(deferred: Sequence[Deferred], params: Sequence[Tensor]) -> None:
    """Sum the deferred weight gradients of several microbatches into ``params[k].grad``: per
    product, one matrix product over all the microbatches' rows."""
    groups: dict[Linear, tuple[list[Tensor], list[Tensor]]] = {}
    for d in deferred:
        for lin, x, g in d.items:
            xs, gs = groups.setdefault(lin, ([], []))
            xs.append(x)
            gs.append(g)
    for lin, (xs, gs) in groups.items():
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        g = gs[0] if len(gs) == 1 else torch.cat(gs)
        add_product(params, lin, x, g, True, [])
    for d in deferred:
        d.items = []
