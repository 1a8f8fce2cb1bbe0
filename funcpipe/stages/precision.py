"""Mixed precision as a stage transform: :func:`autocast_stage`.

A stage is the whole computation of its slice of the model, so the precision it computes in is
part of the function, not a setting of the runner: ``autocast_stage(stage, torch.bfloat16)`` is
a stage whose body runs under ``torch.autocast`` for the device its tensors are on. The same
stage then computes the same thing in :class:`funcpipe.Pipeline`, in
:func:`funcpipe.reference_step`, in stage profiling and in shape inference (which runs on fake
tensors that keep the device, so autocast applies there too and receive buffers get the dtypes
the stage really produces). Writing ``with torch.autocast(...)`` inside your own stage function
is equally supported; this transform only saves the boilerplate and picks the device type.

Parameters keep their own dtype: float32 parameters under bf16 autocast are the usual mixed
precision (float32 weights, bf16 matmuls); bf16 parameters need no autocast at all. For the
optimizer side (float32 master weights and state) see :mod:`funcpipe.train.optim`; to sum gradients
of bf16 parameters in float32 across microbatches, ``Pipeline(grad_dtype=torch.float32)``.
"""

from __future__ import annotations

from typing import Any

import torch

from funcpipe.errors import InvalidArgument
from funcpipe.stages.stage import ConstFn, Stage, _describe_fn, _HasConsts
from funcpipe.tree import tree_leaves

__all__ = ["autocast_stage"]

_LOW = (torch.bfloat16, torch.float16)


class _Autocast:
    """``fn`` run under ``torch.autocast(<device type of its tensors>, dtype)``."""

    _funcpipe_repr = True  # a Stage's repr shows this object's

    def __init__(self, fn: Any, dtype: torch.dtype, device_type: str | None) -> None:
        self.fn, self.dtype, self.device_type = fn, dtype, device_type

    def _device_type(self, params: Any, inputs: tuple[Any, ...]) -> str:
        if self.device_type is not None:
            return self.device_type
        for tree in (inputs, params):  # the inputs first: a few leaves, not every parameter
            for leaf in tree_leaves(tree):
                if isinstance(leaf, torch.Tensor):
                    return leaf.device.type
        return "cpu"

    def __call__(self, params: Any, *inputs: Any, **side: Any) -> Any:
        with torch.autocast(self._device_type(params, inputs), dtype=self.dtype):
            return self.fn(params, *inputs, **side)

    def map_consts(self, f: ConstFn) -> _Autocast:
        fn = self.fn.map_consts(f) if isinstance(self.fn, _HasConsts) else self.fn
        return _Autocast(fn, self.dtype, self.device_type)

    def __repr__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"autocast({_describe_fn(self.fn)}, {dtype})"


def autocast_stage(
    stage: Stage, dtype: torch.dtype = torch.bfloat16, *, device_type: str | None = None
) -> Stage:
    """``stage`` with its body under ``torch.autocast(device_type, dtype=dtype)``.

    Args:
        stage: a :class:`funcpipe.Stage`.
        dtype: ``torch.bfloat16`` (the default) or ``torch.float16``. float16 gradients can
            underflow: use loss scaling (:mod:`funcpipe.train.loss_scale`).
        device_type: ``"cuda"``, ``"cpu"``, ...; default: the device of the stage's first
            tensor (parameter or input) at each call, so one stage serves CPU tests and GPU runs.

    Example::

        stage = fp.autocast_stage(fp.Stage(block_fn, name="block"), torch.bfloat16)
    """
    if not isinstance(stage, Stage):
        raise InvalidArgument(
            f"autocast_stage(stage=...) needs a funcpipe.Stage; got {type(stage).__name__}. "
            "Wrap a function first: Stage(fn, name=...)."
        )
    if dtype not in _LOW:
        raise InvalidArgument(
            f"autocast_stage(dtype={dtype!r}): autocast computes in torch.bfloat16 or "
            "torch.float16; for float32 or float64 use the stage as it is."
        )
    if device_type is not None and not isinstance(device_type, str):
        raise InvalidArgument(
            f"autocast_stage(device_type={device_type!r}): a device type string such as "
            "'cuda' or 'cpu', or None to follow the stage's tensors."
        )
    return Stage(_Autocast(stage.fn, dtype, device_type), stage.name)
