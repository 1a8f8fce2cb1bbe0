"""How a failure is written down and told, between the ranks and the launcher.

A rank that raises leaves a record in the job's store under :data:`FAIL_KEY`: its rank, a
newline, then :func:`describe` of the error (first failure wins; an empty value means none yet).
:func:`parse_record` and :func:`read_record` read it back; :func:`death` says what happened to a
rank process that exited without a word (killed by a signal, or an exit code);
:func:`first_failure` chooses which of two failures to report as the cause; :func:`timed_out`
tells a wait that ran past its timeout from other communication errors.
:mod:`funcpipe.distributed.launcher` keeps this process's store and writes and reads with these.
"""

from __future__ import annotations

import signal
from typing import Any

__all__ = [
    "FAIL_KEY",
    "death",
    "describe",
    "first_failure",
    "parse_record",
    "read_record",
    "timed_out",
]

FAIL_KEY = "funcpipe/failed"


def describe(exc: BaseException) -> str:
    """``Type: message``, then any notes added to the exception (where it was raised)."""
    notes = getattr(exc, "__notes__", None) or []
    return "\n".join([f"{type(exc).__name__}: {exc}", *(str(n) for n in notes)])


def parse_record(raw: str) -> tuple[int, str] | None:
    """``(rank, cause)`` from a failure record; ``None`` while nothing is recorded (``""``)."""
    rank, _, cause = raw.partition("\n")
    try:
        return int(rank), cause
    except ValueError:
        return None


def death(rank: int, code: int | None) -> str:
    """What to say about a rank process that exited without reporting back."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        text = f"rank {rank} died: its process was killed by {name} (exit code {code})"
        if name == "SIGABRT":
            text += (
                " (NCCL's watchdog aborts a rank whose collective or message waited longer than "
                "the process group's timeout, pg_timeout= of funcpipe.launch / funcpipe.Pool, or "
                "whose peer failed)"
            )
        return text
    return f"rank {rank} died: its process exited with code {code} without reporting an error"


def timed_out(exc: BaseException) -> bool:
    """Whether a communication error is a wait that ran past its timeout (gloo: "Timed out
    waiting 2000ms for recv operation", "Application timeout caused pair closure"; funcpipe's
    sockets: a ``TimeoutError``)."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


def first_failure(seen: tuple[int, str], recorded: tuple[int, str] | None) -> tuple[int, str]:
    """Which failure to report: the first the launcher saw (a rank's error message or its
    process's exit), or the store's record (first failure wins there) when that names another
    rank and the launcher saw no death, or saw only a ``SIGABRT`` -- NCCL's watchdog tearing a
    rank down after a peer's failure -- while the record is an error of its own (not a
    ``RankFailed`` or ``CommunicationError`` that itself names a peer)."""
    rank, text = seen
    if recorded is None or recorded[0] == rank:
        return seen
    if "died" not in text:
        return recorded
    secondary = recorded[1].startswith(("RankFailed", "CommunicationError"))
    if "by SIGABRT" in text and not secondary:
        return recorded
    return seen


def read_record(store: Any) -> tuple[int, str] | None:
    """The failure recorded in ``store`` as ``(rank, cause)``; ``None`` when there is none or
    the store cannot be read (it may be gone)."""
    try:
        raw = store.get(FAIL_KEY).decode()
    except Exception:
        return None
    if not raw:
        return None
    return parse_record(raw)
