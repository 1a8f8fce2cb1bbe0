"""Learning-rate schedules: pure functions ``step -> lr`` of the number of updates made.

:func:`constant`, :func:`linear_warmup` and :func:`warmup_cosine`; an optimizer calls its
schedule with the count of updates already made (0 for the first). Users reach these through
:mod:`funcpipe.train.optim` (``funcpipe.optim``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch

from funcpipe.errors import InvalidArgument, check_int, check_number

__all__ = ["Schedule", "constant", "linear_warmup", "warmup_cosine"]

Tensor = torch.Tensor
Schedule = Callable[[int], float]
"""A learning-rate schedule: ``step -> lr``, where ``step`` counts the updates already made."""


# ------------------------------------------------------------------------------ schedules
def _check_step(step: Any) -> int:
    if isinstance(step, Tensor) and step.numel() == 1:
        step = int(step.item())
    return check_int("step", step, 0, "the number of updates made so far, an int >= 0")


_STEPS = "a number of steps, an int >= 0"
_RATE = "a learning rate, a finite number >= 0"


@dataclasses.dataclass(frozen=True)
class _Constant:
    lr: float

    def __call__(self, step: int) -> float:
        _check_step(step)
        return self.lr

    def __repr__(self) -> str:
        return f"constant({self.lr!r})"


@dataclasses.dataclass(frozen=True)
class _LinearWarmup:
    peak: float
    warmup: int

    def __call__(self, step: int) -> float:
        step = _check_step(step)
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        return self.peak

    def __repr__(self) -> str:
        return f"linear_warmup({self.peak!r}, warmup={self.warmup!r})"


@dataclasses.dataclass(frozen=True)
class _WarmupCosine:
    peak: float
    warmup: int
    total: int
    final: float

    def __call__(self, step: int) -> float:
        step = _check_step(step)
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        if step >= self.total:
            return self.final
        progress = (step - self.warmup) / (self.total - self.warmup)
        return self.final + (self.peak - self.final) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def __repr__(self) -> str:
        return (
            f"warmup_cosine({self.peak!r}, warmup={self.warmup!r}, total={self.total!r}, "
            f"final={self.final!r})"
        )


def constant(lr: float) -> Schedule:
    """The schedule ``step -> lr``."""
    return _Constant(check_number("lr", lr, _RATE, ge=0))


def linear_warmup(peak: float, *, warmup: int) -> Schedule:
    """``peak * (step + 1) / warmup`` for ``step < warmup``, then ``peak``.

    The first update (step 0) uses ``peak / warmup`` and step ``warmup - 1`` reaches ``peak``;
    ``warmup=0`` is the constant ``peak``.
    """
    return _LinearWarmup(
        check_number("peak", peak, _RATE, ge=0), check_int("warmup", warmup, 0, _STEPS)
    )


def warmup_cosine(peak: float, *, warmup: int, total: int, final: float = 0.0) -> Schedule:
    """Linear warmup to ``peak``, then a cosine decay to ``final`` at step ``total``.

    * ``step < warmup``: ``peak * (step + 1) / warmup`` (as :func:`linear_warmup`);
    * ``warmup <= step < total``: ``final + (peak - final) * (1 + cos(pi * p)) / 2`` with
      ``p = (step - warmup) / (total - warmup)``, so ``peak`` at ``step == warmup``;
    * ``step >= total``: ``final``.
    """
    peak = check_number("peak", peak, _RATE, ge=0)
    warmup = check_int("warmup", warmup, 0, _STEPS)
    total = check_int("total", total, 0, _STEPS)
    if total < warmup:
        raise InvalidArgument(
            f"total={total!r} < warmup={warmup!r}: total counts all steps, warmup included; "
            "pass total >= warmup"
        )
    return _WarmupCosine(peak, warmup, total, check_number("final", final, _RATE, ge=0))
