"""Shapes of everything that crosses a stage boundary, inferred without data.

For one microbatch shape (its *signature*), every stage of the program graph is run on fake
tensors (:func:`funcpipe.stages.shapes.abstract`: shape, dtype and the stage's real device, no data;
autocast inside a stage applies as in a real run) in stage order: entry stages on the microbatch inputs, later stages on their producers'
outputs. The result sizes the receive buffers, so no shape ever travels over the wire. A change
of microbatch shape (a smaller last batch, a new sequence length) is just another signature.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from funcpipe.errors import InvalidArgument, ShapeInferenceError, ShapeInferenceWarning
from funcpipe.schedule.ir import Program
from funcpipe.stages.shapes import _SHORT_DTYPES, TensorSpec, abstract, fake, stage_device
from funcpipe.stages.stage import Stage, as_inputs
from funcpipe.tree import PyTreeSpec, tree_flatten, tree_leaves, tree_map, tree_unflatten

__all__ = ["BoundarySpecs", "OutputSpec", "infer_boundaries", "signature"]


@dataclass(frozen=True)
class OutputSpec:
    """A stage's outputs for one microbatch: flat leaf specs and the tree they rebuild."""

    leaves: tuple[TensorSpec, ...]
    tree: PyTreeSpec
    nograd: frozenset[int] = frozenset()  # floating leaves that depend on no param nor input

    @property
    def differentiable(self) -> tuple[int, ...]:
        """Indices of the leaves that carry gradients: floating point or complex, and depending
        on a parameter or a differentiable input (a mask or rotary table computed from
        buffers and the batch alone carries none, and no gradient is sent back for it)."""
        return tuple(
            i
            for i, s in enumerate(self.leaves)
            if (s.dtype.is_floating_point or s.dtype.is_complex) and i not in self.nograd
        )


BoundarySpecs = dict[int, OutputSpec]
"""What crosses every stage boundary for one microbatch signature: stage -> its outputs' specs."""


def signature(tree: Any) -> tuple[Any, ...]:
    """A hashable key of a pytree's structure, shapes and dtypes."""
    leaves, spec = tree_flatten(tree)
    return (spec, tuple((tuple(t.shape), t.dtype) for t in leaves))


def stage_args(
    program: Program, stage: int, entry: tuple[Any, ...], outputs: Callable[[int], Any]
) -> tuple[Any, ...]:
    """The positional inputs of ``stage``: the microbatch inputs for an entry stage, else the
    outputs of its producers in stage order, each unpacked with the chaining convention."""
    producers = program.producers(stage)
    if not producers:
        return entry
    args: list[Any] = []
    for p in producers:
        args.extend(as_inputs(outputs(p)))
    return tuple(args)


def infer_boundaries(
    program: Program,
    stages: Sequence[Stage],
    params: Sequence[Any],
    entry: tuple[Any, ...],
    side: Mapping[int, Mapping[str, Any]],
    *,
    device: torch.device | str | None = None,
) -> BoundarySpecs:
    """Output specs of every stage of ``program`` for one microbatch.

    ``stages[k]`` / ``params[k]`` are indexed by the program's stages (replicas already resolved);
    params may be real or meta tensors (only shapes are read). ``entry`` is the entry stages'
    positional inputs and ``side[s]`` the keyword side inputs of stage ``s`` for one microbatch.
    A stage runs where its params are; one whose params are all on meta (another rank holds
    them) or that has none runs on ``device`` (default: the CPU).
    """
    with abstract():
        return _infer(program, stages, params, entry, side, device)


def _infer(
    program: Program,
    stages: Sequence[Stage],
    params: Sequence[Any],
    entry: tuple[Any, ...],
    side: Mapping[int, Mapping[str, Any]],
    device: torch.device | str | None,
) -> BoundarySpecs:
    outputs: dict[int, Any] = {}
    real: dict[int, Any] = {}  # stages run on real tensors (the fallback): their real outputs
    layout: BoundarySpecs = {}
    for s in range(program.n_stages):
        dev = stage_device(params[s], device)

        def to(t: torch.Tensor, dev: torch.device = dev) -> torch.Tensor:
            return fake(t, dev)

        # autograd on the fake tensors tells which outputs depend on a parameter or on a
        # differentiable input: the others need no gradient
        def carry(
            t: torch.Tensor, dev: torch.device = dev, entry: bool = not program.producers(s)
        ) -> torch.Tensor:
            # the batch needs no gradient; a producer's output needs one if it carries one
            return fake(t, dev).requires_grad_(not entry and t.requires_grad)

        args = tree_map(carry, stage_args(program, s, entry, outputs.__getitem__))
        kwargs = tree_map(to, dict(side.get(s, {})))
        stage = stages[s]
        try:
            with torch.enable_grad():
                out = stage(tree_map(_needs_grad, tree_map(to, params[s])), *args, **kwargs)
        except InvalidArgument:
            raise
        except Exception as e:
            given = _shapes(args, kwargs)
            out = _real_fallback(
                program, stages, params, entry, side, device, s, layout, real, e, given
            )
            # run under no_grad, it says nothing of which outputs need a gradient: all may
            out = tree_map(_needs_grad, out) if _all_tensors(out) else out
        leaves, tree = tree_flatten(out)
        if not leaves:
            raise InvalidArgument(
                f"stage {s} ({stage.name!r}) returned {out!r}, which holds no tensor: a stage "
                "must return its outputs (a tensor or a pytree of tensors); did its function "
                "forget to return?"
            )
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                raise InvalidArgument(
                    f"stage {s} ({stage.name!r}) returned a non-tensor leaf #{i}: {leaf!r}; "
                    "stage outputs must be pytrees of tensors"
                )
        nograd = frozenset(
            i for i, t in enumerate(leaves) if _diff(t.dtype) and not t.requires_grad
        )
        layout[s] = OutputSpec(tuple(TensorSpec.from_tensor(t) for t in leaves), tree, nograd)
        outputs[s] = tree_map(lambda t: t.detach().requires_grad_(t.requires_grad), out)
    return layout


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _real_fallback(
    program: Program,
    stages: Sequence[Stage],
    params: Sequence[Any],
    entry: tuple[Any, ...],
    side: Mapping[int, Mapping[str, Any]],
    device: torch.device | str | None,
    s: int,
    layout: BoundarySpecs,
    real: dict[int, Any],
    error: BaseException,
    given: str = "",
) -> Any:
    """Stage ``s`` failed on tensors without data (control flow on values, ``.item()``): run it
    on real tensors of one microbatch, under ``no_grad``, to learn its output shapes.

    Its inputs are the microbatch itself for an entry stage, else its producers' real outputs,
    computed the same way; a producer whose parameters this process does not hold (meta) gives
    zeros of its inferred output specs instead, and a stage whose own parameters are on meta
    runs on zeros of their shapes. Output shapes must not depend on the values (the
    interpreter checks every microbatch against them)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def held(k: int) -> bool:
        return not any(t.is_meta for t in tree_leaves(params[k]))

    def materialise(tree: Any, dev: torch.device) -> Any:
        def one(t: torch.Tensor) -> torch.Tensor:
            if t.is_meta:
                return torch.zeros(tuple(t.shape), dtype=t.dtype, device=dev)
            return t.to(dev)

        return tree_map(one, tree)

    def run(k: int) -> Any:
        if k not in real:
            dev = stage_device(params[k], device)

            def produced(q: int) -> Any:
                if q in real or held(q):
                    return run(q)
                return rebuild(layout[q], [spec.zeros(dev) for spec in layout[q].leaves])

            args = materialise(stage_args(program, k, entry, produced), dev)
            kwargs = materialise(dict(side.get(k, {})), dev)
            real[k] = stages[k](materialise(params[k], dev), *args, **kwargs)
        return real[k]

    stage = stages[s]
    try:
        with unset_fake_temporarily(), torch.no_grad():
            out = run(s)
    except InvalidArgument:
        raise
    except Exception as e:
        fake, real_error = _first_line(error), _first_line(e)
        what = (
            f"fails on its inputs {given}, without data and on one real microbatch ({fake})"
            if fake == real_error
            else f"cannot run on tensors without data ({fake}), nor on one real microbatch "
            f"({real_error})"
        )
        raise ShapeInferenceError(
            f"stage {s} ({stage.name!r}) {what}. Call the stage on one microbatch of the batch "
            "to see the error, and fix the stage or the batch"
        ) from e
    warnings.warn(
        f"stage {s} ({stage.name!r}) cannot run on tensors without data ({_first_line(error)}); "
        "its shapes were inferred by running it on one real microbatch instead. Its output "
        "shapes must not depend on the values (funcpipe checks every microbatch against them)",
        ShapeInferenceWarning,
        stacklevel=5,
    )
    return out


def _shapes(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """The shapes of a stage's inputs, for messages: ``(f32[2, 4], mask=f64[2, 5])``."""

    def one(t: torch.Tensor) -> str:
        dtype = _SHORT_DTYPES.get(t.dtype, str(t.dtype).removeprefix("torch."))
        return f"{dtype}[{', '.join(str(d) for d in t.shape)}]"

    def show(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return one(x)
        leaves = tree_leaves(x)
        if len(leaves) > 1 and all(isinstance(t, torch.Tensor) for t in leaves):
            return "(" + ", ".join(one(t) for t in leaves) + ")"
        return type(x).__name__

    parts = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _diff(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _all_tensors(tree: Any) -> bool:
    return all(isinstance(t, torch.Tensor) for t in tree_leaves(tree))


def _needs_grad(t: torch.Tensor) -> torch.Tensor:
    """A fake leaf that requires grad when it can (floating point or complex)."""
    return t.detach().requires_grad_(_diff(t.dtype))


def rebuild(spec: OutputSpec, leaves: Sequence[torch.Tensor]) -> Any:
    return tree_unflatten(spec.tree, list(leaves))
