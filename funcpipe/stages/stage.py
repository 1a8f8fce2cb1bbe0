"""Stages: pure functions ``stage(params, *inputs) -> outputs`` over an explicit params pytree.

A :class:`Stage` wraps a function that is called as ``fn(params, *inputs)``. Build one from an
``nn.Module`` with :func:`from_module` (it uses ``torch.func.functional_call``; the module is never
mutated) or from any function you write yourself.

The chaining convention, used everywhere stages are run one after the other: a stage's outputs
become the next stage's positional inputs. A ``tuple`` output is unpacked into several positional
inputs; any other pytree (a tensor, a dict, a list, a named tuple) is passed as one input. See
:func:`as_inputs`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from funcpipe.errors import InvalidArgument

__all__ = ["Stage", "as_inputs", "compose", "from_module"]

ConstFn = Callable[[Tensor], Tensor]


def as_inputs(outputs: Any) -> tuple[Any, ...]:
    """The positional inputs of the next stage, given this stage's ``outputs``.

    A plain ``tuple`` is unpacked (``(h, mask) -> (h, mask)``); anything else, including a named
    tuple, a list or a dict, is one input (``h -> (h,)``).
    """
    if type(outputs) is tuple:
        return outputs
    return (outputs,)


@runtime_checkable
class _HasConsts(Protocol):
    """A stage function that captures constant tensors (see :meth:`Stage.map_consts`)."""

    def map_consts(self, f: ConstFn) -> Callable[..., Any]: ...


def _describe_fn(fn: Callable[..., Any]) -> str:
    if isinstance(fn, _ModuleFn | _Composed) or getattr(fn, "_funcpipe_repr", False):
        return repr(fn)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return name if name is not None else type(fn).__name__


@dataclass(frozen=True, repr=False)
class Stage:
    """A slice of the model as a pure function: ``stage(params, *inputs) -> outputs``.

    ``fn`` is called as ``fn(params, *inputs)``; ``name`` is used in reprs and error messages.
    """

    fn: Callable[..., Any]
    name: str = "stage"

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise InvalidArgument(
                f"Stage needs a callable fn(params, *inputs); got fn={self.fn!r}. "
                "Pass a function, or build the stage with funcpipe.from_module(module)."
            )
        if not isinstance(self.name, str):
            raise InvalidArgument(f"Stage name must be a str; got name={self.name!r}.")

    def __call__(self, params: Any, *inputs: Any, **side: Any) -> Any:
        """``fn(params, *inputs, **side)``; ``side`` holds the batch fields the stage declared
        as side inputs (see :class:`funcpipe.Pipeline`)."""
        return self.fn(params, *inputs, **side)

    def map_consts(self, f: ConstFn) -> Stage:
        """A stage whose captured constant tensors (e.g. module buffers) are mapped by ``f``.

        Used to move constants to the meta device for shape inference. A plain user function
        captures nothing funcpipe can see, so the stage is returned unchanged.
        """
        if isinstance(self.fn, _HasConsts):
            return Stage(self.fn.map_consts(f), self.name)
        return self

    def __repr__(self) -> str:
        return f"Stage(name={self.name!r}, fn={_describe_fn(self.fn)})"


def module_of(fn: Any) -> nn.Module | None:
    """The module a stage function calls (through wrappers that keep it as ``.fn``), if any."""
    for _ in range(16):
        if isinstance(fn, _ModuleFn):
            return fn.module
        fn = getattr(fn, "fn", None)
    return None


@contextlib.contextmanager
def evaluating(module: nn.Module | None) -> Iterator[None]:
    """Outside a keyed call (an evaluation program, a stage called by hand) a module in
    training mode runs in eval mode, its mode restored after: evaluation draws nothing, as
    funcpipe's own models do (before, an evaluation over a model split in training mode kept
    its dropout on, and two evaluations differed). Inside one (a training step) it runs as
    it is, drawing under the stage's key."""
    from funcpipe.stages.keys import current_key

    # (inside a compiled stage the switch was made outside it, by compile_stage's wrapper:
    # dynamo then guards on the mode and traces the eval one once)
    busy = torch.compiler.is_compiling() or current_key() is not None
    if module is None or not module.training or busy:
        yield
        return
    trained = [m for m in module.modules() if m.training]
    for m in trained:
        m.training = False
    try:
        yield
    finally:
        for m in trained:
            m.training = True


class _ModuleFn:
    """``(params, *inputs) -> module(*inputs)`` with ``params`` swapped in functionally.

    ``buffers`` are constants captured at construction (detached aliases of the module's
    buffers). Modules that update buffers in their forward (BatchNorm in training mode) are not
    pure functions: use eval mode, or keep such state in params.
    """

    def __init__(self, module: nn.Module, buffers: Mapping[str, Tensor]) -> None:
        self.module = module
        self.buffers = dict(buffers)
        self.param_names = frozenset(name for name, _ in module.named_parameters())
        self.slots = _slots(module)

    def __call__(self, params: Any, *inputs: Any, **side: Any) -> Any:
        if not isinstance(params, Mapping):
            raise InvalidArgument(
                f"a module stage takes params as a dict of parameter name -> tensor; got "
                f"params of type {type(params).__name__}. Pass the dict from from_module(...)."
            )
        given = set(params)
        if given != self.param_names:
            missing = sorted(self.param_names - given)
            unexpected = sorted(given - self.param_names)
            raise InvalidArgument(
                f"params must have exactly the parameter names of "
                f"{type(self.module).__name__}; missing={missing!r}, unexpected={unexpected!r}. "
                "Use the params dict returned with this stage (from_module / partition)."
            )
        with evaluating(self.module):
            return self._call(params, inputs, side)

    def _call(self, params: Any, inputs: tuple[Any, ...], side: dict[str, Any]) -> Any:
        if self.slots is None:
            return torch.func.functional_call(
                self.module, (dict(params), self.buffers), inputs, side
            )
        # the same as functional_call, with the attribute slots found once: swap the values in,
        # call, swap the module's own tensors back
        values = {**params, **self.buffers}
        saved = []
        try:
            for name, places in self.slots:
                value = values[name]
                for table, attr in places:
                    saved.append((table, attr, table[attr]))
                    table[attr] = value
            return self.module(*inputs, **side)
        finally:
            for table, attr, old in reversed(saved):
                table[attr] = old

    def map_consts(self, f: ConstFn) -> _ModuleFn:
        return _ModuleFn(self.module, {name: f(b) for name, b in self.buffers.items()})

    def __repr__(self) -> str:
        return f"functional_call({_short_module_repr(self.module)}, {len(self.param_names)} params)"


Slot = tuple[str, list[tuple[dict[str, Any], str]]]


def _slots(module: nn.Module) -> list[Slot] | None:
    """For each parameter and buffer name (as ``named_parameters`` / ``named_buffers`` give
    them), the module dicts and keys that hold that tensor, aliases included (a tensor shared by
    two submodules is swapped at both places, as ``functional_call(tie_weights=True)`` does).
    ``None`` where a plain swap would be wrong (parametrized modules): use functional_call."""
    if any(hasattr(m, "parametrizations") for m in module.modules()):
        return None
    found: dict[int, list[tuple[dict[str, Any], str]]] = {}
    for kind in ("_parameters", "_buffers"):
        for m in module.modules():
            for attr, t in getattr(m, kind).items():
                if t is not None:
                    found.setdefault(id(t), []).append((getattr(m, kind), attr))
    slots: list[Slot] = []
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        slots.append((name, found[id(t)]))
    return slots


def _short_module_repr(module: nn.Module) -> str:
    """``Sequential(0: Linear, 1: Tanh)``: one line, the children's types only."""
    kind = "Sequential" if isinstance(module, nn.Sequential) else type(module).__name__
    children = list(module._modules.items())
    if not children:
        return kind
    shown = ", ".join(f"{name}: {type(child).__name__}" for name, child in children[:8])
    return f"{kind}({shown}{', ...' if len(children) > 8 else ''})"


class _Composed:
    """Layers run one after the other with the chaining convention; params keyed per layer."""

    def __init__(self, layers: Sequence[tuple[Stage, str]]) -> None:
        self.layers = tuple(layers)
        self.keys = frozenset(key for _, key in self.layers)

    def __call__(self, params: Any, *inputs: Any, **side: Any) -> Any:
        if not isinstance(params, Mapping) or set(params) != self.keys:
            got = sorted(params) if isinstance(params, Mapping) else type(params).__name__
            raise InvalidArgument(
                f"a composed stage takes params as a dict keyed by layer key; expected keys "
                f"{sorted(self.keys)!r}, got {got!r}."
            )
        outputs: Any = None
        for i, (layer, key) in enumerate(self.layers):
            outputs = layer(params[key], *inputs, **side)  # side inputs reach every layer
            if i + 1 < len(self.layers):
                inputs = as_inputs(outputs)
        return outputs

    def map_consts(self, f: ConstFn) -> _Composed:
        return _Composed([(layer.map_consts(f), key) for layer, key in self.layers])

    def __repr__(self) -> str:
        return f"compose({', '.join(repr(key) for _, key in self.layers)})"


def from_module(module: nn.Module, *, name: str | None = None) -> tuple[Stage, dict[str, Tensor]]:
    """Turn ``module`` into a pure stage and its params.

    Returns ``(stage, params)`` where ``params = {name: p.detach()}`` over
    ``module.named_parameters()``: detached *aliases* of the module's parameters (no copy), so
    they share storage with the module. The module itself is never mutated by funcpipe: calling
    the stage swaps ``params`` in with ``torch.func.functional_call``. Buffers are captured as
    constants (detached aliases). Modules that update buffers in their forward (e.g. BatchNorm in
    training mode) are not pure functions and would write into those aliases: put such modules
    in eval mode, or keep that state in params.
    """
    if not isinstance(module, nn.Module):
        raise InvalidArgument(
            f"from_module needs a torch.nn.Module; got module={module!r} "
            f"(a {type(module).__name__}). For a plain function, use Stage(fn)."
        )
    buffers = {b_name: b.detach() for b_name, b in module.named_buffers()}
    params = {p_name: p.detach() for p_name, p in module.named_parameters()}
    stage = Stage(_ModuleFn(module, buffers), name if name is not None else type(module).__name__)
    return stage, params


def compose(layers: Sequence[tuple[Stage | Callable[..., Any], str]], *, name: str) -> Stage:
    """One stage that runs ``layers`` in order with the chaining convention.

    ``layers`` is a sequence of ``(stage_or_fn, key)`` pairs; the composed stage's params is a
    dict ``{key: params_of_that_layer}``. Each layer is called as ``layer(params[key], *inputs)``
    and its outputs become the next layer's inputs via :func:`as_inputs`.
    """
    layers = list(layers)
    if not layers:
        raise InvalidArgument("compose needs at least one (stage, key) layer; got layers=[].")
    staged: list[tuple[Stage, str]] = []
    for i, item in enumerate(layers):
        if not (isinstance(item, tuple) and len(item) == 2 and callable(item[0])):
            raise InvalidArgument(
                f"compose takes (stage_or_fn, key) pairs; got layers[{i}]={item!r}."
            )
        layer, key = item
        if not isinstance(key, str):
            raise InvalidArgument(f"layer keys must be str; got layers[{i}] key={key!r}.")
        staged.append((layer if isinstance(layer, Stage) else Stage(layer, key), key))
    keys = [key for _, key in staged]
    if len(set(keys)) != len(keys):
        dupes = sorted({key for key in keys if keys.count(key) > 1})
        raise InvalidArgument(f"layer keys must be unique; got keys={keys!r} (repeated: {dupes}).")
    return Stage(_Composed(staged), name)
