"""The launcher's side of a job: wait for every rank's result and name what stopped it.

:func:`collect` waits for a :class:`funcpipe.distributed.launcher.Pool`'s job: each rank's
answer on its pipe, each process's exit (a rank that dies without a word is recorded in the
store, so that its peers name it), the job's deadline. The first failure stops the pool after
``grace`` seconds and is raised as :class:`~funcpipe.errors.RankFailed` naming the rank, or the
option whose limit ran out. A rank that returns while others still run is noted: when a rank
waiting on it fails, the error names it; and with the pool's ``_let_go`` set
(:func:`funcpipe.launch`, one job) it is told to leave (:data:`LEAVE`: its process exits) that
many seconds later, so that a gloo wait on it breaks at once.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, NoReturn

from funcpipe.distributed.failures import FAIL_KEY, death, first_failure, read_record
from funcpipe.errors import RankFailed

__all__ = ["LEAVE", "collect"]

LEAVE = b"leave"  # the launcher's word to a rank that returned early: exit now


def collect(pool: Any, timeout: float | None) -> list[Any]:
    """Wait for every rank's result of ``pool``'s job, for ``timeout`` seconds at most
    (``None``: as long as the ranks live); with ``pool._let_go`` set, let a rank that returned
    while others still run go that many seconds later."""
    from multiprocessing.connection import wait

    let_go = pool._let_go
    results: dict[int, Any] = {}
    # ranks that returned while others still ran: when, and which were still running
    early: dict[int, tuple[float, list[int]]] = {}
    gone: set[int] = set()  # those let go
    deadline = float("inf") if timeout is None else time.monotonic() + timeout
    first: tuple[int, str] | None = None
    while len(results) < pool.size:
        left = deadline - time.monotonic()
        if left <= 0:
            _expired(pool, timeout, results, early)
        for r, (when, _) in early.items():
            if let_go is not None and r not in gone and time.monotonic() - when >= let_go:
                gone.add(r)  # its process exits: the connections its peers wait on drop
                with contextlib.suppress(OSError):
                    pool.conns[r].send(LEAVE)
        sentinels = {p.sentinel: r for r, p in enumerate(pool.procs) if r not in results}
        ready = wait(
            [pool.conns[r] for r in range(pool.size) if r not in results] + list(sentinels),
            timeout=min(left, 0.5),
        )
        for obj in ready:
            r = sentinels[obj] if obj in sentinels else pool.conns.index(obj)
            if r in results:
                continue
            try:
                message = pool.conns[r].recv() if pool.conns[r].poll() else None
            except (EOFError, OSError):  # the pipe closed: the process is gone
                message = None
            if message is None:
                if obj not in sentinels and pool.procs[r].is_alive():
                    pool.procs[r].join(timeout=1.0)
                if pool.procs[r].is_alive():
                    continue
                text = death(r, pool.procs[r].exitcode)
                results[r] = None
                # tell the ranks still waiting on it who failed (first failure wins)
                with contextlib.suppress(Exception):
                    pool.store.compare_set(FAIL_KEY, "", f"{r}\n{text}")
                if first is None:
                    first = (r, text)
                continue
            status, value = message
            results[r] = value
            if status == "error" and first is None:
                first = (r, str(value))
            elif status == "ok" and len(results) < pool.size:
                early[r] = (time.monotonic(), sorted(set(range(pool.size)) - set(results)))
        if first is not None:
            _failed(pool, first, early)
    return [results[r] for r in range(pool.size)]


def _expired(
    pool: Any, timeout: float | None, results: dict[int, Any], early: dict[int, Any]
) -> NoReturn:
    """The job's deadline passed: stop the pool and raise, naming a recorded failure if there
    is one, else the option."""
    pool.close(kill=True)
    waiting = sorted(set(range(pool.size)) - set(results))
    # a rank may have recorded its failure without its message arriving (NCCL errors surface in
    # the watchdog, not in the job): the store names it
    first = read_record(pool.store)
    if first is not None:
        raise RankFailed(f"rank {first[0]} failed:\n{first[1]}", rank=first[0], cause=first[1])
    returned = ""
    if early:
        returned = (
            f" Ranks {sorted(early)} had returned by then, while ranks {waiting} were still "
            "running: a rank that waits for a rank whose function has ended waits until a "
            "timeout (every process must take the same number of steps)."
        )
    raise RankFailed(
        f"ranks {waiting} did not finish within the job's deadline, timeout={timeout:g} "
        "s (of funcpipe.launch, funcpipe.Pool or Pool.run); the pool was stopped. A "
        "hang, or a job slower than that: if it is only slow, pass a longer timeout= "
        "(None: no deadline). It is separate from the process group's timeout, "
        f"pg_timeout={pool.pg_timeout:g} s, which bounds each collective and message." + returned,
        rank=waiting[0] if waiting else None,
    )


def _failed(
    pool: Any, first: tuple[int, str], early: dict[int, tuple[float, list[int]]]
) -> NoReturn:
    """A rank failed: give the others a moment to stop by themselves, stop them, and raise
    naming the cause (a rank that returned early, when the failed rank's wait broke on it)."""
    end = time.monotonic() + pool.grace
    while time.monotonic() < end and any(p.is_alive() for p in pool.procs):
        time.sleep(0.05)
    pool.close(kill=True)
    rank, text = first_failure(first, read_record(pool.store))
    named = [r for r in sorted(early) if f"rank {r} returned while" in text]
    if rank not in early and (named or (early and "returned while ranks" in text)):
        r = (named or sorted(early))[0]
        raise RankFailed(
            f"rank {r} returned while ranks {early[r][1]} were still running; rank {rank} "
            f"failed: {text}",
            rank=r,
            cause=text,
        )
    raise RankFailed(f"rank {rank} failed: {text}", rank=rank, cause=text)
