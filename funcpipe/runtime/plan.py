"""Shapes of everything that crosses a stage boundary, inferred without data.

For one microbatch shape (its *signature*), every stage of the program graph is run on fake
tensors (:func:`funcpipe.shapes.abstract`: shape, dtype and the stage's real device, no data;
autocast inside a stage applies as in a real run) in stage order: entry stages on the microbatch inputs, later stages on their producers'
outputs. The result sizes the receive buffers, so no shape ever travels over the wire. A change
of microbatch shape (a smaller last batch, a new sequence length) is just another signature.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from funcpipe.errors import InvalidArgument, ShapeInferenceError
from funcpipe.schedule.ir import Program
from funcpipe.shapes import TensorSpec, abstract, fake, stage_device
from funcpipe.stage import Stage, as_inputs
from funcpipe.tree import PyTreeSpec, tree_flatten, tree_map, tree_unflatten

__all__ = ["Layout", "OutputSpec", "infer_layout", "signature"]


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


Layout = dict[int, OutputSpec]  # stage -> its outputs


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


def infer_layout(
    program: Program,
    stages: Sequence[Stage],
    params: Sequence[Any],
    entry: tuple[Any, ...],
    side: Mapping[int, Mapping[str, Any]],
    *,
    device: torch.device | str | None = None,
) -> Layout:
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
) -> Layout:
    outputs: dict[int, Any] = {}
    layout: Layout = {}
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
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ShapeInferenceError(
                f"stage {s} ({stage.name!r}) cannot run on tensors without data "
                f"({type(e).__name__}: {first}); the pipeline infers the shapes of what crosses "
                "stages this way. If the output shapes depend on data (.item(), nonzero, "
                "masked_select), make them depend on input shapes only; otherwise the stage "
                "fails on these inputs: call it once on a real microbatch to see the error."
            ) from e
        leaves, tree = tree_flatten(out)
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


def _diff(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _needs_grad(t: torch.Tensor) -> torch.Tensor:
    """A fake leaf that requires grad when it can (floating point or complex)."""
    return t.detach().requires_grad_(_diff(t.dtype))


def rebuild(spec: OutputSpec, leaves: Sequence[torch.Tensor]) -> Any:
    return tree_unflatten(spec.tree, list(leaves))
