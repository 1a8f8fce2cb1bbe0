"""How a failure is written down and told, between the ranks and the launcher.

A rank that raises leaves a record in the job's store under :data:`FAIL_KEY`: its rank, a
newline, then :func:`describe` of the error (first failure wins; an empty value means none yet).
:func:`parse_record` and :func:`read_record` read it back; :func:`death` says what happened to a
rank process that exited without a word (killed by a signal, or an exit code);
:func:`first_failure` chooses which of two failures to report as the cause; :func:`timed_out`
tells a wait that ran past its timeout from other communication errors.

A rank whose function returns adds itself to the record under :func:`return_key` of that job
(:func:`parse_returns` reads it back): a peer whose wait then breaks, or runs out, says
:func:`returned_text` rather than blaming a dead process or the network. A failure that leaves
torch.distributed bare (a collective outside funcpipe's transport, or the user's own) is
recognised by :func:`communication_failure` and located by :func:`call_site`. A world's
:class:`Steps` counts the steps its transport finished, so that such a message can say which
step the waiting rank is in (:func:`current_step`).
:mod:`funcpipe.distributed.launcher` keeps this process's store and writes and reads with these.
"""

from __future__ import annotations

import os
import signal
import traceback
import weakref
from collections.abc import Sequence
from typing import Any

__all__ = [
    "FAIL_KEY",
    "RETURN_KEY",
    "Steps",
    "call_site",
    "communication_failure",
    "current_step",
    "death",
    "describe",
    "first_failure",
    "forget_steps",
    "parse_record",
    "parse_returns",
    "read_record",
    "return_key",
    "returned_text",
    "timed_out",
]

FAIL_KEY = "funcpipe/failed"
RETURN_KEY = "funcpipe/returned"


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
    waiting 2000ms for recv operation", "Application timeout caused pair closure"; or a ``TimeoutError``)."""
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


# ------------------------------------------------------------------ ranks whose function returned
def return_key(job: int) -> str:
    """The store key where the ranks whose function returned in job ``job`` add themselves
    (``"<rank> "`` each; every process counts its jobs alike, so the keys agree)."""
    return f"{RETURN_KEY}/{job}"


def parse_returns(raw: str) -> list[int]:
    """The ranks in a returns record, sorted."""
    return sorted({int(word) for word in raw.split() if word.lstrip("-").isdigit()})


def returned_text(returned: Sequence[int], running: Sequence[int], step: int | None) -> str:
    """Why a rank waited in vain: ``returned`` ranks' functions ended while ``running`` were
    still in ``step`` (counted from 1; ``None``: not known)."""
    who = f"rank {returned[0]}" if len(returned) == 1 else f"ranks {list(returned)}"
    where = "running" if step is None else f"in step {step}"
    return (
        f"{who} returned while ranks {list(running)} were still {where}: a rank whose function "
        "has ended will never send what they wait for. Every process must build the same "
        "Pipelines and take the same number of steps of each (step 1 is a Pipeline's first), "
        "e.g. the same number of batches on every rank"
    )


# ------------------------------------------------------------------ torch.distributed left bare
# what gloo says when the peer's end of a connection went away
_GONE = ("connection closed", "connection reset", "closed by peer", "broken pipe")


def communication_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.distributed's own report of a wait that ran out or a peer's
    connection that dropped (gloo and the store raise ``RuntimeError`` subclasses), raised from
    within torch.distributed: not an argument torch refused, nor an error of the user's."""
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    if not (timed_out(exc) or any(words in text for words in _GONE)):
        return False
    import torch.distributed as dist

    if isinstance(exc, getattr(dist, "DistError", ())) or "/gloo/" in text:
        return True
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and _in_torch_distributed(frames[-1].filename)


def _in_torch_distributed(filename: str) -> bool:
    return f"{os.sep}torch{os.sep}distributed{os.sep}" in filename


def call_site(exc: BaseException) -> str | None:
    """Where a torch.distributed failure was called from: the call's source line and the
    calling function (``dist.all_gather(every, mine) in funcpipe.pipeline.checks._hashes``; for
    a file outside the package, with its name and line); ``None`` when the traceback does not
    show it."""
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [k for k, f in enumerate(frames) if _in_torch_distributed(f.filename)]
    if inside and inside[0] > 0:
        caller = frames[inside[0] - 1]
    elif frames and not inside:
        caller = frames[-1]
    else:
        return None
    call = (caller.line or "").strip() or "a torch.distributed call"
    parts = os.path.normpath(caller.filename).split(os.sep)
    if "funcpipe" in parts and parts[-1].endswith(".py"):
        module = parts[len(parts) - 1 - parts[::-1].index("funcpipe") :]
        return f"{call} in {'.'.join(module)[: -len('.py')]}.{caller.name}"
    return f"{call} in {caller.name} ({parts[-1]}:{caller.lineno})"


# ------------------------------------------------------------------ which step a rank is in
class Steps:
    """The steps a world's transport finished (its ``finish()`` ends each step), for failure
    messages: a rank waiting in vain says which step it is in. It holds the transport weakly
    (the transport holds it: no reference cycle, so a dropped Pipeline still goes at once)."""

    def __init__(self) -> None:
        self.done = 0
        self._transport: Any = None

    def attach(self, transport: Any) -> None:
        self._transport = weakref.ref(transport)
        transport.finish = self._finish
        _OPEN.add(self)

    def _finish(self) -> None:
        transport = self._transport()
        if transport is not None:
            type(transport).finish(transport)
        self.done += 1

    def current(self) -> int:
        """The step in progress (or the next one), counted from 1."""
        return self.done + 1


_OPEN: weakref.WeakSet[Steps] = weakref.WeakSet()  # the step counts of this process's worlds


def forget_steps(steps: Steps) -> None:
    """``steps``' world was closed: it is no longer one of this process's."""
    _OPEN.discard(steps)


def current_step() -> int | None:
    """The step this process's Pipeline is in (counted from 1) when it has exactly one open
    ``"dist"`` Pipeline; ``None`` otherwise (which one is waiting is not known)."""
    live = list(_OPEN)
    return live[0].current() if len(live) == 1 else None
