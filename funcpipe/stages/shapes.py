"""Shape inference: run every stage on tensors without data to learn its input and output specs.

The stages run on *fake* tensors (``torch._subclasses.FakeTensorMode``): they carry shape,
dtype and a device but no data, so inference costs no compute and no memory. Unlike the meta
device, a fake tensor keeps the device the stage really runs on, so everything that depends on
the device applies as in a real run: ``torch.autocast("cuda" | "cpu", ...)`` inside a stage
function (its outputs come out in bf16 / float16 exactly as they will for real), device-specific
kernels' output dtypes, and constants the stage captured on its device. ``torch.compile``d
functions run eagerly during inference (``torch.compiler.set_stance("force_eager")``), so
inference never compiles a graph nor fills dynamo's cache. A stage that cannot run without data
(data-dependent shapes such as ``torch.nonzero``, or ``.item()``) is rerun on one real
microbatch, with a :class:`ShapeInferenceWarning`.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from funcpipe.errors import InvalidArgument, ShapeInferenceError, ShapeInferenceWarning
from funcpipe.stages.stage import Stage, as_inputs
from funcpipe.tree import check_tensor_tree, leaf_paths, tree_leaves, tree_map

__all__ = ["StageSpec", "TensorSpec", "abstract", "infer_specs", "stage_device"]

_SHORT_DTYPES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.complex128: "c128",
    torch.complex64: "c64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
}


@dataclass(frozen=True, repr=False)
class TensorSpec:
    """Shape and dtype of a tensor; prints as ``f32[4, 16]``."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        shape = tuple(self.shape)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
            raise InvalidArgument(
                f"TensorSpec shape must be a tuple of ints >= 0; got shape={self.shape!r}."
            )
        if not isinstance(self.dtype, torch.dtype):
            raise InvalidArgument(
                f"TensorSpec dtype must be a torch.dtype; got dtype={self.dtype!r}."
            )
        object.__setattr__(self, "shape", shape)

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tensor.dtype)

    def empty(self, device: torch.device | str = "meta") -> torch.Tensor:
        """An uninitialised tensor of this spec (on the meta device by default)."""
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    def zeros(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=device)

    def __repr__(self) -> str:
        dtype = _SHORT_DTYPES.get(self.dtype, str(self.dtype).removeprefix("torch."))
        return f"{dtype}[{', '.join(str(s) for s in self.shape)}]"


@dataclass(frozen=True)
class StageSpec:
    """What one stage takes and returns for one microbatch.

    ``inputs`` has one pytree of :class:`TensorSpec` per positional input; ``outputs`` is the
    pytree of :class:`TensorSpec` the stage returns; ``method`` is ``"fake"`` (run without data) or ``"real"``
    (the stage had to run on a real microbatch).
    """

    inputs: tuple[Any, ...]
    outputs: Any
    method: str


@contextlib.contextmanager
def abstract() -> Iterator[None]:
    """Run the body on tensors without data: fake tensors, no autograd graph, no compiling.

    Inside, :func:`fake` makes a fake tensor of a given spec and device; real tensors a stage
    captured (module buffers, constants) are turned into fake ones on their own device when
    they meet a fake tensor.
    """
    eager = (
        torch.compiler.set_stance("force_eager")
        if hasattr(torch.compiler, "set_stance")
        else contextlib.nullcontext()
    )
    # a stage that fails here is reported once, by the caller; torch's fake-tensor logger would
    # also print the failing kernel's traceback
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad(), eager:
            yield
    finally:
        log.setLevel(level)


def fake(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor shaped like ``t`` on ``device`` (call inside :func:`abstract`)."""
    return torch.empty(tuple(t.shape), dtype=t.dtype, device=device)


def stage_device(params: Any, default: torch.device | str | None = None) -> torch.device:
    """Where a stage runs: its parameters' device (the first leaf not on meta), else
    ``default``, else the CPU."""
    for leaf in tree_leaves(params):
        if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
            return leaf.device
    return torch.device(default) if default is not None else torch.device("cpu")


def _specs(tree: Any) -> Any:
    return tree_map(TensorSpec.from_tensor, tree)


def _check_outputs(outputs: Any, index: int, stage: Stage) -> None:
    leaves = tree_leaves(outputs)
    if all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        return
    for path, leaf in zip(leaf_paths(outputs, name="outputs"), leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            raise InvalidArgument(
                f"stage {index} ({stage.name!r}) returned a non-tensor leaf: {path}={leaf!r} "
                f"(a {type(leaf).__name__}). Stage outputs must be pytrees of tensors (None "
                "entries are allowed); return torch.tensor(...) instead."
            )


def infer_specs(
    stages: Sequence[Stage],
    params: Sequence[Any],
    example: Any,
    *,
    fallback: str = "real",
    device: torch.device | str | None = None,
) -> tuple[StageSpec, ...]:
    """Infer every stage's input and output specs for one microbatch.

    Args:
        stages: the stages, run in order with the chaining convention (a tuple output is
            unpacked into the next stage's positional inputs).
        params: one params pytree per stage.
        example: the first stage's inputs for one microbatch: a tuple of positional inputs, or
            a single pytree (one input). Only shapes and dtypes are used on the meta path.
        fallback: what to do when a stage fails on the meta device. ``"real"`` warns
            (:class:`ShapeInferenceWarning`) and runs that stage on real tensors: the real chain
            is computed from ``example`` up to that stage, i.e. one real microbatch goes
            through the stages before it. ``"error"`` raises :class:`ShapeInferenceError`.
        device: where a stage without parameters runs (default: the CPU); a stage with
            parameters runs where they are. Inference sees what a run on that device sees
            (autocast for its device type, for one).

    Returns:
        One :class:`StageSpec` per stage.
    """
    stages, params = list(stages), list(params)
    if fallback not in ("real", "error"):
        raise InvalidArgument(f"fallback must be 'real' or 'error'; got fallback={fallback!r}.")
    if not stages:
        raise InvalidArgument("stages is empty; infer_specs needs at least one stage.")
    if len(stages) != len(params):
        raise InvalidArgument(
            f"stages and params must have one entry per stage; got {len(stages)} stages and "
            f"{len(params)} params."
        )
    for i, stage in enumerate(stages):
        if not isinstance(stage, Stage):
            raise InvalidArgument(f"stages[{i}] must be a Stage; got {stage!r}.")
        check_tensor_tree(params[i], name=f"params[{i}]")
    inputs = as_inputs(example)
    check_tensor_tree(inputs, name="example")

    # Real activations, computed lazily only if some stage needs the fallback:
    # real[i] are the real inputs of stage i.
    real: list[tuple[Any, ...]] = [inputs]

    def real_inputs(upto: int) -> tuple[Any, ...]:
        with torch.no_grad():
            while len(real) <= upto:
                j = len(real) - 1
                real.append(as_inputs(stages[j](params[j], *real[j])))
        return real[upto]

    specs = []
    given: Any = inputs  # stage i's inputs: fake, or real after a fallback
    for i, stage in enumerate(stages):
        method = "fake"
        dev = stage_device(params[i], device)
        try:
            with abstract():
                outputs = stage(
                    tree_map(lambda t, d=dev: fake(t, d), params[i]),
                    *tree_map(lambda t, d=dev: fake(t, d), given),
                )
                _check_outputs(outputs, i, stage)
                out_specs = _specs(outputs)
        except InvalidArgument:
            raise
        except Exception as e:
            reason = (
                f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            )
            if fallback == "error":
                raise ShapeInferenceError(
                    f"stage {i} ({stage.name!r}) cannot run on tensors without data ({reason}). "
                    "Its output shape probably depends on data (nonzero, masked_select, "
                    ".item()); use fallback='real' to run it on one real microbatch."
                ) from e
            warnings.warn(
                f"stage {i} ({stage.name!r}) cannot run on tensors without data ({reason}); "
                "running it on one real microbatch instead to infer its shapes.",
                ShapeInferenceWarning,
                stacklevel=2,
            )
            method = "real"
            stage_inputs = real_inputs(i)
            with torch.no_grad():
                outputs = stage(params[i], *stage_inputs)
            if len(real) == i + 1:
                real.append(as_inputs(outputs))
            _check_outputs(outputs, i, stage)
            out_specs = _specs(outputs)
        specs.append(StageSpec(_specs(given), out_specs, method))
        given = tree_map(TensorSpec.empty, as_inputs(out_specs))
    return tuple(specs)
