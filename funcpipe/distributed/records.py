"""This process's part in the job's failure records: what a rank records when it fails or
returns, and what it reads when a wait breaks, to name the rank that caused it.

The launcher (:mod:`funcpipe.distributed.launcher`) says which store, rank and group timeout
this process joined with (:func:`joined`) and counts its jobs (:func:`next_job`); a transport
or a collective whose wait broke calls :func:`failure_handler`'s function, which looks for the
first failure any rank recorded, then for ranks whose function returned, then (a wait that ran
past the group's timeout) for a rank whose heartbeat stopped (:func:`funcpipe.distributed.
survive.stalled`), and says the process group's timeout only when none of those explains it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from funcpipe.distributed.failures import (
    FAIL_KEY,
    call_site,
    communication_failure,
    current_step,
    describe,
    parse_record,
    parse_returns,
    return_key,
    returned_text,
    timed_out,
)
from funcpipe.distributed.survive import stalled
from funcpipe.distributed.timeouts import pg_expired
from funcpipe.errors import CommunicationError, FuncpipeError, RankFailed

__all__ = ["failure_handler", "joined", "named", "next_job", "record_failure", "record_return"]

_STORE: Any = None  # this process's rendezvous store (set in ranks started by funcpipe)
_RANK: int | None = None
_PG_TIMEOUT: float | None = None  # this process's group timeout, where funcpipe started the group
_JOB = 0  # the jobs this process ran (a Pool's, or launch's under torchrun): every rank alike
_POLLS = 60  # how many times (every 0.05 s) a broken wait looks for a peer's record


def joined(store: Any, rank: int, pg_timeout: float | None) -> None:
    """This process is ``rank`` of a job whose records are in ``store``; ``pg_timeout``: the
    group timeout funcpipe started its group with (None: the group was started elsewhere)."""
    global _STORE, _RANK, _PG_TIMEOUT
    _STORE, _RANK, _PG_TIMEOUT = store, rank, pg_timeout


def pg_timeout() -> float | None:
    return _PG_TIMEOUT


def next_job() -> None:
    """One more job starts in this process (a Pool's, or launch's under torchrun)."""
    global _JOB
    _JOB += 1


def record_failure(exc: BaseException) -> None:
    """Record in the shared store that this rank failed (first failure wins)."""
    if _STORE is None or _RANK is None:
        return
    text = f"{_RANK}\n{describe(exc)}"
    with contextlib.suppress(Exception):  # the store may be gone; the launcher sees the exit
        _STORE.compare_set(FAIL_KEY, "", text)


def record_return() -> None:
    """Record in the shared store that this rank's function returned (in this job)."""
    if _STORE is None or _RANK is None:
        return
    with contextlib.suppress(Exception):  # (a store without append: not recorded)
        _STORE.append(return_key(_JOB), f"{_RANK} ")


def _read(key: str) -> str | None:
    if _STORE is None:
        return None
    try:
        if not _STORE.check([key]):
            return None
        return str(_STORE.get(key).decode())
    except Exception:
        return None


def _read_failure() -> tuple[int, str] | None:
    raw = _read(FAIL_KEY)
    return None if raw is None else parse_record(raw)


def _returned(step: int | None) -> RankFailed | None:
    """Which ranks' functions returned in this job, told as the reason a wait broke."""
    raw = _read(return_key(_JOB))
    returned = [] if raw is None else [r for r in parse_returns(raw) if r != _RANK]
    if not returned:
        return None

    world = _world() or max(returned) + 1
    running = sorted(set(range(world)) - set(returned))
    text = returned_text(returned, running, step)
    return RankFailed(text, rank=returned[0], cause=text)


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 0


def failure_handler(
    step: Callable[[], int | None] | None = None,
) -> Callable[[BaseException, str], BaseException]:
    """What a transport raises when communication breaks: name the rank that failed first, or
    the ranks whose function returned; ``step()``: the step this process is in, if known."""

    def handle(exc: BaseException, what: str) -> BaseException:
        for k in range(_POLLS):  # the failed rank (or, for a dead one, the launcher) records it
            found = _read_failure()
            if found is not None:
                rank, cause = found
                return RankFailed(
                    f"{what} stopped: rank {rank} failed with {cause}", rank=rank, cause=cause
                )
            # a failure, if there is one, is the cause; the launcher takes a second to see a death
            gone = _returned(step() if step is not None else None) if 2 * k >= _POLLS else None
            if gone is not None:
                return RankFailed(f"{what} stopped: {gone}", rank=gone.rank, cause=gone.cause)
            time.sleep(0.05)
        if timed_out(exc):
            quiet = stalled(_STORE, _world(), _RANK)
            if quiet is not None:  # named: the rank that holds the job up, not this one
                who = int(quiet.split()[1])
                return RankFailed(f"{what} timed out: {quiet}", rank=who, cause=quiet)
            return CommunicationError(f"{what} failed: {exc}. {pg_expired(_PG_TIMEOUT)}")
        return CommunicationError(
            f"{what} failed: {exc}. No rank recorded an error: a peer process died (killed, out "
            "of memory) or the network failed."
        )

    return handle


def named(exc: BaseException, rank: int | None) -> BaseException:
    """``exc``, or for torch.distributed's own report of a wait that ran out or a connection
    that dropped (a collective outside funcpipe's transport, or the user's), the error the
    transport would have raised: naming the rank that failed, the rank that returned, or the
    process group's timeout."""
    if isinstance(exc, FuncpipeError) or not communication_failure(exc):
        return exc
    where = call_site(exc) or "a torch.distributed call"
    return failure_handler(current_step)(exc, f"rank {rank}: {where}")
