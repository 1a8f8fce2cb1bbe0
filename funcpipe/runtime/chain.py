"""Module stages that are chains of ``nn.Linear`` and elementwise activations, run as one node.

When a stage is an ``nn.Sequential`` of layers whose derivatives are written out here, the
runtime runs it as a :class:`Chain`: one :class:`torch.autograd.Function` whose forward calls
the modules' own kernels (``F.linear``, ``F.gelu``, ...) and whose backward calls the
derivative kernels autograd would (``gelu_backward``, ``threshold_backward``,
``tanh_backward``, ``sigmoid_backward``, ``silu_backward``, ``mm`` with the weight). Outputs
and input gradients are the module's bit for bit, weight gradients equal up to rounding.

What that buys is the choice of kernel. On CPU, float32 exact GELU goes to oneDNN by default,
whose fixed cost per call dominates small inputs (8 x 512: 9.0 / 18.1 us forward / backward
against ATen's own vectorized kernel's 3.9 / 6.8, and more inside a pipeline step); a chain
runs GELU on at most :data:`SMALL_GELU` elements with ATen's kernel (results agree to float32
rounding, about 1e-6 relative; float64 never uses oneDNN). Recording one node instead of two
per layer measured neither faster nor slower on its own (docs/benchmarks.md).

The backward hands each Linear's weight gradient to the runtime as rows, the same
``(Linear, x, g)`` items :func:`funcpipe.runtime.linear.backward_deferred` finds for recorded
products: so they are summed in place, batched over microbatches or staged exactly like those.
Where the chain node is all there is between a stage's outputs (or the gradient arriving at
the chain's output) and its input, the runtime calls that backward itself (:func:`run_node`),
with no engine call and no graph search; elsewhere the engine runs it while the runtime
collects the rows (:func:`collecting`). Outside a collection (a plain
``torch.autograd.backward``) it returns every gradient, as any autograd function does.

Admitted: an ``nn.Sequential`` (or :func:`funcpipe.partition`'s) of exact ``nn.Linear``,
``nn.GELU``, ``nn.ReLU``, ``nn.Tanh``, ``nn.Sigmoid``, ``nn.SiLU`` and ``nn.Identity`` modules,
each weight used once, no hooks or parametrizations, called with one tensor of the weights'
dtype and device, no side inputs, no autocast. Anything else runs the module through autograd.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from funcpipe.partition import _Chain
from funcpipe.runtime import linear  # (linear imports this module: used at call time only)
from funcpipe.tree import PyTreeSpec, tree_unflatten

__all__ = ["Chain", "collecting", "of"]

Tensor = torch.Tensor
Items = list[tuple["linear.Linear", Tensor, Tensor]]

_aten = torch.ops.aten


@dataclass(frozen=True)
class _Layer:
    kind: str  # "linear" or an activation name
    weight: int = -1  # parameter index (linear)
    bias: int | None = None
    approximate: str = "none"  # GELU's


# Exact GELU on at most this many elements runs ATen's own vectorized kernel rather than
# oneDNN's. On CPU, float32 exact GELU goes to oneDNN by default, whose per-call cost dominates
# small inputs: 9.0 / 18.1 us forward / backward on 8 x 512 against ATen's 3.9 / 6.8 (equal at
# 64 x 512; oneDNN's forward is faster from 256 x 1024 on). Results agree to float rounding
# (1e-6 relative); float64 never uses oneDNN.
SMALL_GELU = 65536


def _aten_gelu(t: Tensor) -> bool:
    """Whether small exact GELUs on tensors like ``t`` should switch oneDNN off around their
    kernel (CPU, while oneDNN is on; the switch is process-wide: set and restored around one
    kernel). Asked once per chain call, then only the size is checked per layer."""
    return t.is_cpu and torch._C._get_mkldnn_enabled()


def gelu(a: Tensor, approximate: str = "none") -> Tensor:
    """``F.gelu`` as a chain computes it (the kernel chosen by size, see :data:`SMALL_GELU`)."""
    if approximate != "none" or a.numel() > SMALL_GELU or not _aten_gelu(a):
        return torch.nn.functional.gelu(a, approximate=approximate)
    return _gelu_aten(a)  # (the tanh form never goes to oneDNN)


def _gelu_aten(a: Tensor) -> Tensor:
    torch._C._set_mkldnn_enabled(False)
    try:
        return torch.nn.functional.gelu(a)
    finally:
        torch._C._set_mkldnn_enabled(True)


def gelu_backward(g: Tensor, a: Tensor, approximate: str = "none") -> Tensor:
    """GELU's derivative kernel as a chain calls it."""
    if approximate != "none" or a.numel() > SMALL_GELU or not _aten_gelu(a):
        return _aten.gelu_backward(g, a, approximate=approximate)
    return _gelu_backward_aten(g, a)


def _gelu_backward_aten(g: Tensor, a: Tensor) -> Tensor:
    torch._C._set_mkldnn_enabled(False)
    try:
        return _aten.gelu_backward(g, a)
    finally:
        torch._C._set_mkldnn_enabled(True)


def _gelu_fwd(layer: _Layer, a: Tensor) -> Tensor:
    return gelu(a, layer.approximate)


def _gelu_bwd(layer: _Layer, g: Tensor, a: Tensor) -> Tensor:
    return gelu_backward(g, a, layer.approximate)


def _silu_bwd(layer: _Layer, g: Tensor, a: Tensor) -> Tensor:
    return _aten.silu_backward(g, a)


def _relu_bwd(layer: _Layer, g: Tensor, y: Tensor) -> Tensor:
    return _aten.threshold_backward(g, y, 0)


def _tanh_bwd(layer: _Layer, g: Tensor, y: Tensor) -> Tensor:
    return _aten.tanh_backward(g, y)


def _sigmoid_bwd(layer: _Layer, g: Tensor, y: Tensor) -> Tensor:
    return _aten.sigmoid_backward(g, y)


_Act = tuple[Callable[[_Layer, Tensor], Tensor], bool, Callable[[_Layer, Tensor, Tensor], Tensor]]
_ACTS: dict[str, _Act] = {
    # name: (forward, derivative reads the output (else the input), derivative)
    "gelu": (_gelu_fwd, False, _gelu_bwd),
    "silu": (lambda _, a: torch.nn.functional.silu(a), False, _silu_bwd),
    "relu": (lambda _, a: torch.relu(a), True, _relu_bwd),
    "tanh": (lambda _, a: torch.tanh(a), True, _tanh_bwd),
    "sigmoid": (lambda _, a: torch.sigmoid(a), True, _sigmoid_bwd),
}
_MODULES: dict[type, str] = {
    nn.GELU: "gelu",
    nn.SiLU: "silu",
    nn.ReLU: "relu",
    nn.Tanh: "tanh",
    nn.Sigmoid: "sigmoid",
}

_items: Items | None = None  # the collection in progress (see collecting)


@contextmanager
def collecting() -> Iterator[Items]:
    """While active, a chain's backward leaves its Linear weight gradients as ``(Linear, x,
    g)`` rows in the yielded list (bias gradients too: the runtime sums them with the weight's)
    instead of returning them. A plain global, not thread-local: the autograd engine may run a
    backward on its device thread."""
    global _items
    prev, _items = _items, []
    try:
        yield _items
    finally:
        _items = prev


def _hooked(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or hasattr(module, "parametrizations")
    )


def _global_hooks() -> bool:
    m = torch.nn.modules.module
    return bool(
        m._global_forward_hooks
        or m._global_forward_pre_hooks
        or m._global_backward_hooks
        or m._global_backward_pre_hooks
    )


def of(fn: Any, ptree: PyTreeSpec, n_params: int) -> Chain | None:
    """The chain form of a stage function, or ``None`` if it has none. ``fn`` is a
    :class:`funcpipe.Stage`'s function; ``ptree`` and ``n_params`` describe the flat
    parameter leaves the runtime passes (a module stage's params dict, flattened)."""
    module = getattr(fn, "module", None)
    names = getattr(fn, "param_names", None)
    if not isinstance(module, nn.Sequential) or names is None or getattr(fn, "buffers", None):
        return None
    if type(module) not in (nn.Sequential, _Chain):  # a subclass may have a forward of its own
        return None
    try:
        index = tree_unflatten(ptree, list(range(n_params)))
    except Exception:
        return None
    if not isinstance(index, dict) or set(index) != set(names):
        return None
    if _hooked(module):
        return None
    layers: list[_Layer] = []
    for key, child in module._modules.items():
        if child is None or _hooked(child) or child._modules:
            return None
        kind = type(child)
        if kind is nn.Linear:
            w = index.get(f"{key}.weight")
            b = index.get(f"{key}.bias")
            if w is None or (child.bias is not None) != (b is not None):
                return None
            layers.append(_Layer("linear", w, b))
        elif kind is nn.GELU:
            layers.append(_Layer("gelu", approximate=str(child.approximate)))
        elif kind in _MODULES:
            layers.append(_Layer(_MODULES[kind]))
        elif kind is nn.Identity:
            continue
        else:
            return None
    got = Chain(tuple(layers))
    if not layers or len(got.params) != len(set(got.params)):  # a weight used twice: autograd's
        return None
    return got


class Chain:
    """A stage's layers as one differentiable call (see the module docstring)."""

    def __init__(self, layers: tuple[_Layer, ...]) -> None:
        self.layers = layers
        self.first = next((k for k, layer in enumerate(layers) if layer.kind == "linear"), None)
        # the parameter indices its backward hands over as rows (weights and biases)
        self.params = [
            x
            for layer in layers
            if layer.kind == "linear"
            for x in (layer.weight, layer.bias)
            if x is not None
        ]
        self._linears: dict[int, linear.Linear] | None = None  # see _records

    def accepts(self, params: Sequence[Tensor], x: Any) -> bool:
        """Whether this call can run as a chain (else: the module, through autograd)."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
            return False
        if self.first is None:
            return False
        w = params[self.layers[self.first].weight]
        return (
            x.dtype == w.dtype
            and x.device == w.device
            and x.shape[-1] == w.shape[-1]
            and not torch.is_autocast_enabled(x.device.type)
            and not _global_hooks()  # (nn.Module hooks for every module: only the modules run them)
        )

    def __call__(self, params: Sequence[Tensor], x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _ChainFn.apply(self, x, *params)
        with torch.no_grad():
            return self.forward(params, x)[0]

    def forward(self, params: Sequence[Tensor], x: Tensor) -> tuple[Tensor, list[Tensor]]:
        """The output and, per layer, the tensor its derivative reads."""
        saved: list[Tensor] = []
        h = x
        aten_gelu = _aten_gelu(x)
        for layer in self.layers:
            kind = layer.kind
            if kind == "linear":
                saved.append(h)
                b = None if layer.bias is None else params[layer.bias]
                h = torch.nn.functional.linear(h, params[layer.weight], b)
            elif kind == "gelu" and layer.approximate == "none":  # (inline: per-call cost)
                saved.append(h)
                if aten_gelu and h.numel() <= SMALL_GELU:
                    h = _gelu_aten(h)
                else:
                    h = torch.nn.functional.gelu(h)
            else:
                fwd, reads_out, _ = _ACTS[kind]
                y = fwd(layer, h)
                saved.append(y if reads_out else h)
                h = y
        return h, saved

    def backward(
        self,
        params: Sequence[Tensor],
        saved: Sequence[Tensor],
        g: Tensor,
        need_input: bool,
    ) -> tuple[Tensor | None, Items]:
        """The input gradient (``None`` unless ``need_input``) and each Linear's ``(x, g)`` rows
        (2-D), last layer first."""
        items: Items = []
        stop = 0 if need_input else (self.first or 0)
        records = self._records()
        aten_gelu = _aten_gelu(g)
        rows = g.dim() == 2  # (every tensor of a chain call has the input's leading dims)
        for k in range(len(self.layers) - 1, -1, -1):
            layer, t = self.layers[k], saved[k]
            kind = layer.kind
            if kind == "linear":
                w = params[layer.weight]
                x2, g2 = (
                    (t, g) if rows else (t.reshape(-1, t.shape[-1]), g.reshape(-1, g.shape[-1]))
                )
                items.append((records[k], x2, g2))
                if k == stop and not need_input:
                    return None, items
                g = g2.mm(w) if rows else g2.mm(w).view(*g.shape[:-1], w.shape[1])
            elif kind == "gelu" and layer.approximate == "none":
                if aten_gelu and t.numel() <= SMALL_GELU:
                    g = _gelu_backward_aten(g, t)
                else:
                    g = _aten.gelu_backward(g, t)
            else:
                g = _ACTS[kind][2](layer, g, t)
        return (g if need_input else None), items

    def _records(self) -> dict[int, linear.Linear]:
        """Per Linear layer, the record its rows are handed over with (made once)."""
        if self._linears is None:
            self._linears = {
                k: linear.Linear(layer.weight, True, layer.bias, "")
                for k, layer in enumerate(self.layers)
                if layer.kind == "linear"
            }
        return self._linears


class _ChainFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, chain: Chain, x: Tensor, *params: Tensor) -> Tensor:
        y, saved = chain.forward(params, x)
        # the input itself, to read whether it still needs a gradient when the backward runs
        # (the runtime turns that off for a first stage's batch after the forward)
        ctx.chain, ctx.n, ctx.x = chain, len(params), x
        ctx.save_for_backward(*params, *saved)
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, ...]:
        gx, items = run_node(ctx, g)
        grads: list[Tensor | None] = [None] * ctx.n
        if _items is not None:
            _items.extend(items)
        else:
            for lin, x2, g2 in items:
                grads[lin.weight] = g2.t().mm(x2)
                if lin.bias is not None:
                    grads[lin.bias] = g2.sum(0)
        return (None, gx, *grads)


def run_node(node: Any, g: Tensor) -> tuple[Tensor | None, Items]:
    """A chain node's backward for the gradient ``g`` of its output: the input gradient (``None``
    if its input needs none) and its Linears' rows. What the engine runs through
    :class:`_ChainFn`; the runtime calls it directly where the node is all that lies between a
    stage's outputs (or the gradient arriving at it) and its input
    (:func:`funcpipe.runtime.linear.backward_deferred`)."""
    tensors = node.saved_tensors
    params, saved = tensors[: node.n], tensors[node.n :]
    chain: Chain = node.chain
    need = bool(node.needs_input_grad[1]) and node.x.requires_grad
    with torch.no_grad():  # (the engine runs it so; called directly, nothing may be recorded)
        return chain.backward(params, saved, g, need)


def chain_input(node: Any) -> Tensor:
    """The tensor a chain node was called on."""
    x: Tensor = node.x
    return x


def is_chain_node(node: Any) -> bool:
    """Whether a graph node is a chain's (its weights are found through :func:`collecting`)."""
    return type(node) is _ChainFn._backward_cls


def chain_params(node: Any) -> list[int]:
    """The parameter indices a chain node's backward hands over as rows."""
    chain: Chain = node.chain
    return chain.params
