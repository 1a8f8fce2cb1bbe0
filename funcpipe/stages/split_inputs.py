"""What a stage of :func:`funcpipe.split_module` takes: the traced specs of its inputs, checked.

``torch.export`` specialises the traced graph to the example's shapes and dtypes (every dim not
named in ``dynamic_shapes``): a size the forward reads (``h / h.shape[1]``, ``x.view(b, t, ...)``)
is a constant of the graph. On other shapes the graph fails deep inside, or worse computes a
wrong result. So each split stage checks its inputs (positional and side inputs) against the
specs they had in the trace before it runs, and refuses a mismatch naming both, the rule and the
fix; and its params against the module's shapes and dtypes (:func:`param_problem`). While the inputs match, the check is one comparison of shape and dtype per
input (with symbolic dims, a short loop over the dims); the pipeline's shape inference runs every stage once per microbatch signature, so a
mismatched batch is refused there, before any step runs.

A dim made symbolic by ``dynamic_shapes`` may take any size in the range the trace allows, the
same size wherever the trace found one symbol. Such a size that a later stage reads is not sent
across the cut (only tensors cross stages): the later stage reads it from the shape of one of its
own inputs (:func:`size_source`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from funcpipe.errors import InvalidArgument
from funcpipe.stages.shapes import _SHORT_DTYPES

__all__ = ["InputCheck", "InputSpec", "dim_names", "param_problem", "size_source"]

Dim = Any  # an int (static), a sympy Symbol (dynamic) or None (a dynamic expression: unchecked)


@dataclass(frozen=True)
class InputSpec:
    """One input of a split stage as traced: ``what`` names it in messages; ``dims`` and
    ``dtype`` for a tensor; ``value`` for a non-tensor input (a constant of the graph)."""

    what: str
    dims: tuple[Dim, ...] | None
    dtype: torch.dtype | None
    value: Any = None

    @classmethod
    def of(cls, what: str, val: Any) -> InputSpec:
        """From a traced placeholder's ``meta["val"]``."""
        if not isinstance(val, Tensor):
            return cls(what, None, None, val)
        return cls(what, tuple(_dim(d) for d in val.shape), val.dtype)

    def show(self, names: Mapping[Any, str]) -> str:
        if self.dims is None:
            return repr(self.value)
        dims = ", ".join("?" if d is None else str(names.get(d, d)) for d in self.dims)
        return f"{_short(self.dtype)}[{dims}]"


def _dim(d: Any) -> Dim:
    if isinstance(d, torch.SymInt):
        expr = d.node.expr
        return expr if expr.is_Symbol else None
    return int(d)


def _short(dtype: torch.dtype | None) -> str:
    return _SHORT_DTYPES.get(dtype, str(dtype).removeprefix("torch.")) if dtype else "?"


def _show(t: Any) -> str:
    if isinstance(t, Tensor):
        return f"{_short(t.dtype)}[{', '.join(str(s) for s in t.shape)}]"
    return f"{t!r} (a {type(t).__name__})"


def _bound(x: Any) -> int | None:
    """A range bound of ``ep.range_constraints`` as an int; None when unbounded."""
    if isinstance(x, int):
        return x
    return int(x) if getattr(x, "is_Integer", False) else None


class InputCheck:
    """``check(given)``: refuse inputs that differ from the traced ``specs`` (see the module).

    ``given`` are the stage's positional inputs then its side inputs, in the order of ``specs``.
    ``ranges`` (``ep.range_constraints``) bound the symbolic dims; ``names`` are the names of
    their ``Dim``s in ``dynamic_shapes``, for messages; ``entry`` is the first stage's first
    input name, for the ``dynamic_shapes=`` example in messages.
    """

    def __init__(
        self,
        label: str,
        specs: Sequence[InputSpec],
        ranges: Mapping[Any, Any],
        names: Mapping[Any, str],
        entry: str,
    ) -> None:
        self.label = label
        self.specs = tuple(specs)
        self.names = dict(names)
        self.entry = entry
        self.ranges = {
            s: (_bound(vr.lower), _bound(vr.upper))
            for s in {d for sp in self.specs for d in sp.dims or () if not isinstance(d, int)}
            if s is not None and (vr := ranges.get(s)) is not None
        }
        static = all(
            sp.dims is not None and all(isinstance(d, int) for d in sp.dims) for sp in self.specs
        )
        # the fast path: every input a tensor of one fixed shape and dtype
        self.fast = (
            tuple((torch.Size(sp.dims or ()), sp.dtype) for sp in self.specs) if static else None
        )

    def __call__(self, given: Sequence[Any]) -> None:
        if self.fast is not None:
            for t, (shape, dtype) in zip(given, self.fast, strict=True):
                if not isinstance(t, Tensor) or t.shape != shape or t.dtype != dtype:
                    break
            else:
                return
        problem = self.problem(given)
        if problem is not None:
            raise InvalidArgument(problem)

    def problem(self, given: Sequence[Any]) -> str | None:
        """The message for the first input that differs from its traced spec, else None."""
        bound: dict[Any, tuple[int, str, int]] = {}  # symbol -> (size, input, dim) first seen
        for t, spec in zip(given, self.specs, strict=True):
            if spec.dims is None:
                if not isinstance(t, Tensor) and _same_value(t, spec.value):
                    continue
                return self._message(
                    spec,
                    t,
                    "a non-tensor input is a constant of the traced graph",
                    "Give the example's value, or split the model again with an example that has "
                    "this one.",
                )
            if not isinstance(t, Tensor):
                return self._message(spec, t, "the stage takes a tensor here", "Give a tensor.")
            if t.dim() != len(spec.dims):
                return self._shape(spec, t, f"it has {t.dim()} dims, the example {len(spec.dims)}")
            for d, (want, got) in enumerate(zip(spec.dims, t.shape, strict=True)):
                if want is None:
                    continue
                if isinstance(want, int):
                    if want != got:
                        return self._shape(spec, t, _dim_text(d, got, want), d)
                    continue
                lo, hi = self.ranges.get(want, (None, None))
                if (lo is not None and got < lo) or (hi is not None and got > hi):
                    return self._range(spec, t, d, want, lo, hi)
                first = bound.setdefault(want, (int(got), spec.what, d))
                if first[0] != got:
                    return self._message(
                        spec,
                        t,
                        f"dim {d} is {got} where {first[1]} dim {first[2]} is {first[0]}, and the "
                        f"trace found them one size ({self.names.get(want, want)})",
                        "Give inputs whose sizes agree as the example's did.",
                    )
            if t.dtype != spec.dtype and not _autocast(t, spec.dtype):
                return self._message(
                    spec,
                    t,
                    f"its dtype is {str(t.dtype).removeprefix('torch.')}, the example's "
                    f"{str(spec.dtype).removeprefix('torch.')}; torch.export specialised the "
                    "traced graph to the example's dtypes (a cast to a dtype the forward reads "
                    "stays the traced one)",
                    "Give inputs (and params) in the dtypes the example (and the module) had "
                    "when split, or split the model again in the dtype you train in.",
                )
        return None

    def _message(self, spec: InputSpec, t: Any, rule: str, fix: str) -> str:
        return (
            f"stage {self.label} (made by split_module) was traced on {spec.what} = "
            f"{spec.show(self.names)} and is given {_show(t)}: {rule}. {fix}"
        )

    def _shape(self, spec: InputSpec, t: Tensor, detail: str, d: int | None = None) -> str:
        name = "batch" if d == 0 else "n"
        at = d if d is not None else 1
        traced = spec.dims[0] if d == 0 and spec.dims else None
        if isinstance(traced, int) and traced > t.shape[0] > 0 and traced % t.shape[0] == 0:
            return self._whole_batch(spec, t, traced)
        rule = (
            f"{detail}. torch.export specialised the traced graph to the example's shapes: a "
            "size the forward reads (a sequence length, a batch size) is a constant in it, so on "
            "other shapes it would compute a wrong result or fail deep inside"
        )
        if d == 0:
            fix = (
                "The example is one microbatch: give it the batch's rows / microbatches rows "
                "(per data-parallel copy; every microbatch has that size, so the batch's rows "
                "must be a multiple of the microbatch count), or choose the microbatch count "
                f"that gives the example's size; or pass dynamic_shapes= to split_module for the dims that vary (e.g. "
                f"dynamic_shapes={{{self.entry!r}: {{0: torch.export.Dim({name!r})}}}})."
            )
            if isinstance(traced, int) and 0 < traced < t.shape[0] and t.shape[0] % traced == 0:
                fix += (
                    " Over processes each data-parallel process passes its own slice of the "
                    "batch (its rows / the data size), not the whole batch: only a Pipeline "
                    "with data=k in one process splits the batch among copies itself."
                )
        else:
            fix = (
                "Give microbatches shaped like the example, split the model again with an "
                "example of this shape, or pass dynamic_shapes= to split_module for the dims "
                f"that vary (e.g. dynamic_shapes={{{self.entry!r}: "
                f"{{{at}: torch.export.Dim({name!r})}}}})."
            )
        return self._message(spec, t, rule, fix)

    def _whole_batch(self, spec: InputSpec, t: Tensor, traced: int) -> str:
        rows = int(t.shape[0])
        return self._message(
            spec,
            t,
            f"dim 0 (the microbatch size) is {rows}, the example's {traced} ({traced // rows} x "
            f"{rows}): it looks like the whole batch was given as example=, but split_module "
            "traces one microbatch and its size is a constant of the traced graph",
            "Split again with example= one microbatch: batch[:batch_size // microbatches] "
            f"(here [:{rows}]), or pass dynamic_shapes={{{self.entry!r}: "
            "{0: torch.export.Dim('batch')}} to split_module.",
        )

    def _range(
        self, spec: InputSpec, t: Tensor, d: int, sym: Any, lo: int | None, hi: int | None
    ) -> str:
        span = f"{'' if lo is None else lo}..{'' if hi is None else hi}"
        return self._message(
            spec,
            t,
            f"dim {d} is {t.shape[d]}, outside {span}, the sizes the trace holds for it "
            f"({self.names.get(sym, sym)}: "
            "the Dim's min and max in dynamic_shapes=, narrowed by what the forward requires)",
            "Give sizes in that range, or split the model again with a Dim whose min and max "
            "hold them.",
        )


def param_problem(
    label: str,
    names: Sequence[str],
    specs: Sequence[tuple[torch.Size, torch.dtype]],
    given: Sequence[Any],
) -> str | None:
    """The message for the first of a split stage's params whose shape or dtype differs from
    the traced one (a floating param in the autocast dtype, under autocast, passes), else None.
    torch.export traced the module's parameters at their shapes and dtypes: on others a matrix
    product fails deep inside torch, or an elementwise op silently computes in another dtype."""
    for name, (shape, dtype), t in zip(names, specs, given, strict=True):
        traced = f"{_short(dtype)}[{', '.join(str(s) for s in shape)}]"
        where = f"stage {label} (made by split_module) was traced with param {name!r} = {traced}"
        if not isinstance(t, Tensor):
            return f"{where} and is given {_show(t)}. Give the tensor split_module returned."
        if t.shape != shape:
            return (
                f"{where} and is given {_show(t)}: the traced graph holds the module's parameter "
                "shapes. Give each stage the params split_module returned (parts.params), whole: "
                "a split stage runs on one device, without tensor parallelism."
            )
        if t.dtype != dtype and not _autocast(t, dtype):
            return (
                f"{where} and is given {_show(t)}: torch.export specialised the traced graph to "
                "the module's dtypes. Give params (and inputs) in the dtypes the module had when "
                "split, or split the model again in the dtype you train in "
                "(model.to(torch.bfloat16) before split_module)."
            )
    return None


def _dim_text(d: int, got: int, want: int) -> str:
    if d == 0:
        return (
            f"dim 0 (the microbatch size, where the batch dim is 0) is {got}, the example's {want}"
        )
    return f"dim {d} is {got}, the example's {want}"


def _same_value(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _autocast(t: Tensor, traced: torch.dtype | None) -> bool:
    """Under autocast a floating input may come in the autocast dtype (a stage wrapped by
    ``autocast_stage`` passes such activations on); the traced ops follow it as in the model."""
    if traced is None or not traced.is_floating_point:
        return False
    kind = t.device.type
    try:
        return torch.is_autocast_enabled(kind) and t.dtype == torch.get_autocast_dtype(kind)
    except RuntimeError:  # a device type autocast does not know
        return False


def size_source(size: Any, inputs: Sequence[tuple[Any, Any]]) -> tuple[Any, int] | None:
    """For a symbolic size (a ``torch.SymInt``), an input and dim whose traced size is that same
    size, from ``inputs`` (``(node, meta val)`` pairs), so a stage can read it from its own
    input instead of receiving it; None if none has it."""
    expr = size.node.expr
    for node, val in inputs:
        if not isinstance(val, Tensor):
            continue
        for d, s in enumerate(val.shape):
            if isinstance(s, torch.SymInt) and s.node.expr == expr:
                return node, d
    return None


def dim_names(dynamic_shapes: Any, inputs: Mapping[str, Any]) -> dict[Any, str]:
    """The name of the ``Dim`` behind each symbol of the trace, for messages: ``dynamic_shapes``
    as ``torch.export`` takes it (a dict by input name, or a tuple in input order; per input a
    dict ``{dim: Dim}`` or a sequence of ``Dim``/``None``), ``inputs`` the traced user inputs'
    ``meta["val"]`` by name, in order."""
    if isinstance(dynamic_shapes, Mapping):
        per_input = [(inputs.get(str(k)), v) for k, v in dynamic_shapes.items()]
    elif isinstance(dynamic_shapes, list | tuple):
        per_input = list(zip(inputs.values(), dynamic_shapes, strict=False))
    else:
        return {}
    names: dict[Any, str] = {}
    for val, dims in per_input:
        if not isinstance(val, Tensor):
            continue
        pairs = dims.items() if isinstance(dims, Mapping) else enumerate(dims or ())
        for d, dim in pairs:
            name = getattr(dim, "__name__", None)
            if isinstance(d, int) and 0 <= d < val.dim() and isinstance(name, str):
                size = val.shape[d]
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    names[size.node.expr] = name
    return names
