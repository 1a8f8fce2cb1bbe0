"""The funcpipe error hierarchy, and the small validators that raise it.

Every error funcpipe raises on purpose is a :class:`FuncpipeError`. Messages follow one rule: say
what was given (``name=value!r``), the rule it broke, and how to fix it. The validators at the
end (:func:`check_int`, :func:`check_number`, :func:`check_seconds`) check one argument and
raise :class:`InvalidArgument` as ``"{name}={value!r}: {rule}"``, with the rule text each
caller gives; they sit here, in the bottom layer, so that every package can use them.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = [
    "CommunicationError",
    "FuncpipeError",
    "InvalidArgument",
    "NonFiniteError",
    "RankFailed",
    "ScheduleError",
    "ShapeInferenceError",
    "ShapeInferenceWarning",
    "check_int",
    "check_number",
    "check_seconds",
    "is_real",
]


class FuncpipeError(Exception):
    """Base class of every error raised by funcpipe."""


class InvalidArgument(FuncpipeError, ValueError):
    """An argument given to a public function breaks that function's contract.

    Also a :class:`ValueError`, so code that catches ``ValueError`` keeps working.
    """


class ScheduleError(FuncpipeError):
    """A schedule (program) is unsound or failed while running.

    The optional attributes locate the problem: ``rank`` and ``step`` index the program table,
    ``instruction`` is the offending instruction (or its text form) and ``rule`` names the rule
    that was broken. Each defaults to ``None``; the message is passed through unchanged.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        step: int | None = None,
        instruction: Any = None,
        rule: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.instruction = instruction
        self.rule = rule


class ShapeInferenceError(FuncpipeError):
    """A stage's output shapes could not be inferred (and no fallback was allowed)."""


class ShapeInferenceWarning(UserWarning):
    """Shape inference had to leave the meta device (it ran a stage on real tensors)."""


class CommunicationError(FuncpipeError):
    """A message or collective between ranks failed (a peer died, or shapes disagreed)."""


class RankFailed(FuncpipeError):
    """Another rank failed; ``rank`` names it and ``cause`` is its error, as text.

    Raised on the ranks that were waiting for the failed one, and by the launcher.
    """

    def __init__(self, message: str, *, rank: int | None = None, cause: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.cause = cause


class NonFiniteError(FuncpipeError, FloatingPointError):
    """A NaN or an infinity appeared in a loss, an activation or a gradient.

    ``stage`` and ``microbatch`` say where it was first seen; ``what`` names the tensor.
    """

    def __init__(self, message: str, *, stage: int, microbatch: int, what: str) -> None:
        super().__init__(message)
        self.stage, self.microbatch, self.what = stage, microbatch, what


# ------------------------------------------------------------------------------ validators
def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (an ``int``, a ``float``, any :class:`numbers.Real`)
    and not a ``bool``."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value: Any, low: int | None = 0, rule: str | None = None) -> int:
    """``value`` as an int, if it is an ``int`` (not a ``bool``) >= ``low`` (``None``: any int);
    else :class:`InvalidArgument` ``"{name}={value!r}: {rule}"``, the rule by default
    ``"an int >= {low}"`` (``"an int"`` without a bound)."""
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        if rule is None:
            rule = "an int" if low is None else f"an int >= {low}"
        raise InvalidArgument(f"{name}={value!r}: {rule}")
    return int(value)


def check_number(
    name: str,
    value: Any,
    rule: str,
    *,
    gt: float | None = None,
    ge: float | None = None,
    lt: float | None = None,
    finite: bool = True,
) -> float:
    """``value`` as a float, if it is a real number (:func:`is_real`), finite unless
    ``finite=False``, and within the bounds given (``> gt``, ``>= ge``, ``< lt``); else
    :class:`InvalidArgument` ``"{name}={value!r}: {rule}"``. NaN is never within a bound."""
    if (
        not is_real(value)
        or (finite and not math.isfinite(float(value)))
        or (gt is not None and not float(value) > gt)
        or (ge is not None and not float(value) >= ge)
        or (lt is not None and not float(value) < lt)
    ):
        raise InvalidArgument(f"{name}={value!r}: {rule}")
    return float(value)


def check_seconds(name: str, value: Any, what: str) -> None:
    """``value`` is ``None`` or a number of seconds > 0 (an ``int`` or a ``float``, not a
    ``bool``); else :class:`InvalidArgument` ``"{name}={value!r}: {what}, seconds > 0 or None"``."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise InvalidArgument(f"{name}={value!r}: {what}, seconds > 0 or None")
