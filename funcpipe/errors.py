"""The funcpipe error hierarchy.

Every error funcpipe raises on purpose is a :class:`FuncpipeError`. Messages follow one rule: say
what was given (``name=value!r``), the rule it broke, and how to fix it.
"""

from __future__ import annotations

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
