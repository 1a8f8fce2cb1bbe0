"""``torch.compile`` for stages: :func:`compile_stage`.

``Stage(torch.compile(fn))`` works with every schedule. :func:`compile_stage` does the same with
one difference that matters for pipelines: each stage gets a dynamo cache of its own.

Dynamo keeps compiled graphs per Python code object and stops compiling a code object after
``torch._dynamo.config.recompile_limit`` (8) variants, falling back to eager from then on.
Pipeline stages are usually closures of *one* function (one code object) that differ in which
blocks they run, and each stage needs a graph per grad mode (recompute runs the forward once
without a graph): an 8-stage model with recompute compiled as ``torch.compile(fn)`` per stage
reaches the limit in its first step and silently runs half its variants eagerly. :func:`compile_stage` wraps each
stage's function in a small function with its own code object, so every stage has its own
cache and its own limit.

What compiles when: nothing during shape inference (it runs compiled functions eagerly); the
first step compiles each stage once per grad mode it runs in (and once more for a microbatch
shape it has not seen, e.g. a smaller last batch); later steps reuse those graphs.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import torch

from funcpipe.errors import InvalidArgument
from funcpipe.stages.stage import ConstFn, Stage, _describe_fn, _HasConsts, evaluating, module_of

__all__ = ["compile_stage"]

_SERIAL = itertools.count()


def _own_code(fn: Any) -> Any:
    """A function calling ``fn`` whose code object is new (a dynamo cache of its own)."""

    def stage_fn(params: Any, *inputs: Any, **side: Any) -> Any:
        return fn(params, *inputs, **side)

    code = stage_fn.__code__.replace(co_name=f"funcpipe_stage_{next(_SERIAL)}")
    return types.FunctionType(
        code, stage_fn.__globals__, code.co_name, stage_fn.__defaults__, stage_fn.__closure__
    )


class _Compiled:
    """``torch.compile(fn, **options)`` over a code object of its own."""

    _funcpipe_repr = True  # a Stage's repr shows this object's

    def __init__(self, fn: Any, options: dict[str, Any]) -> None:
        self.fn, self.options = fn, options
        self.compiled = torch.compile(_own_code(fn), **options)

    def __call__(self, params: Any, *inputs: Any, **side: Any) -> Any:
        with evaluating(module_of(self.fn)):  # (outside a keyed call: in eval mode)
            return self.compiled(params, *inputs, **side)

    def map_consts(self, f: ConstFn) -> _Compiled:
        fn = self.fn.map_consts(f) if isinstance(self.fn, _HasConsts) else self.fn
        return _Compiled(fn, self.options)

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"compile({_describe_fn(self.fn)}{extra})"


def compile_stage(stage: Stage, **options: Any) -> Stage:
    """``stage`` with its function compiled by ``torch.compile(fn, **options)``, with a dynamo
    cache of its own (see the module docstring).

    Args:
        stage: a :class:`funcpipe.Stage`.
        options: passed to ``torch.compile`` (``backend="aot_eager"``, ``mode=...``, ...).

    Example::

        stages = [fp.compile_stage(s) for s in stages]
    """
    if not isinstance(stage, Stage):
        raise InvalidArgument(
            f"compile_stage(stage=...) needs a funcpipe.Stage; got {type(stage).__name__}. "
            "Wrap a function first: Stage(fn, name=...)."
        )
    if "fullgraph" in options and not isinstance(options["fullgraph"], bool):
        raise InvalidArgument(f"compile_stage(fullgraph={options['fullgraph']!r}): a bool")
    return Stage(_Compiled(stage.fn, dict(options)), stage.name)
