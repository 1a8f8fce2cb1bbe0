"""Tallies: values a stage counts as it runs, which a step sums and returns beside its loss.

A mixture-of-experts layer's per-expert token counts are the example: DeepSeek-V3's balancing
moves each layer's routing bias from the counts of the whole step, summed over microbatches and
data-parallel copies, and they are made deep inside a stage, not at the loss. A stage function
calls ``tally(name, value)``; a :class:`funcpipe.Pipeline` step collects each forward's values
(never a recomputation's, nor shape inference's: those run outside a collecting call), sums
them per name over microbatches and copies, and returns them as ``result.tallies``
(``{name: tensor}``, on the processes holding the stages that made them). Outside a step
(a stage called by hand, an evaluation with nothing collecting) ``tally`` does nothing, so the
stage stays a function of its inputs; the values are detached: a tally is not differentiated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

from funcpipe.errors import InvalidArgument

__all__ = ["collecting", "tally"]

_SINK: ContextVar[dict[str, torch.Tensor] | None] = ContextVar("funcpipe_tally", default=None)


def tally(name: str, value: torch.Tensor) -> None:
    """Add ``value`` (a tensor, detached) to the running step's tally ``name``; a no-op outside
    a collecting call."""
    sink = _SINK.get()
    if sink is None:
        return
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"tally(name={name!r}): a non-empty str naming the value")
    if not isinstance(value, torch.Tensor):
        raise InvalidArgument(f"tally({name!r}, {type(value).__name__}): the value is a tensor")
    value = value.detach()
    got = sink.get(name)
    if got is not None and (got.shape != value.shape or got.dtype != value.dtype):
        raise InvalidArgument(
            f"tally({name!r}): a value of shape {tuple(value.shape)} {value.dtype} after one of "
            f"{tuple(got.shape)} {got.dtype}; a tally keeps one shape and dtype"
        )
    sink[name] = value.clone() if got is None else got + value


@contextlib.contextmanager
def collecting(sink: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """Collect the block's tallies into ``sink`` (summed per name)."""
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)
