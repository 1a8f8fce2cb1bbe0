"""Run a function on N local processes, or unchanged under ``torchrun``; fail fast and by name.

:func:`launch` starts one process per rank (gloo on CPU by default; NCCL when CUDA devices are
there and ``backend="nccl"``), joins them in a process group and calls ``fn(rank, *args)`` in
each. The rendezvous store lives in the launching process, so it outlives any rank. When a rank
raises, it records its error in the store and exits; the ranks waiting on it see their
connection drop, read the record and raise :class:`~funcpipe.errors.RankFailed` naming it; the
launcher stops every rank left after ``grace`` seconds and raises ``RankFailed`` with the first
failure's traceback. Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set), ``launch`` runs ``fn``
in this process only, with the process group torchrun describes.

:class:`Pool` keeps such a group of processes alive and runs one function after another on it:
starting processes costs seconds, so tests start one pool per session.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from funcpipe.errors import CommunicationError, InvalidArgument, RankFailed

__all__ = ["Pool", "failure_handler", "launch", "under_torchrun"]

FAIL_KEY = "funcpipe/failed"
_STORE: Any = None  # this process's rendezvous store (set in ranks started by funcpipe)
_RANK: int | None = None


def under_torchrun() -> bool:
    """True when the environment describes this process as one rank of a larger job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def record_failure(exc: BaseException) -> None:
    """Record in the shared store that this rank failed (first failure wins)."""
    if _STORE is None or _RANK is None:
        return
    text = f"{_RANK}\n{type(exc).__name__}: {exc}"
    with contextlib.suppress(Exception):  # the store may be gone; the launcher sees the exit
        _STORE.compare_set(FAIL_KEY, "", text)


def _read_failure() -> tuple[int, str] | None:
    if _STORE is None:
        return None
    try:
        if not _STORE.check([FAIL_KEY]):
            return None
        raw = _STORE.get(FAIL_KEY).decode()
    except Exception:
        return None
    rank, _, cause = raw.partition("\n")
    return int(rank), cause


def failure_handler() -> Callable[[BaseException, str], BaseException]:
    """What a transport raises when communication breaks: name the rank that failed first."""

    def handle(exc: BaseException, what: str) -> BaseException:
        for _ in range(20):  # the failed rank writes its record just before it exits
            found = _read_failure()
            if found is not None:
                rank, cause = found
                return RankFailed(
                    f"{what} stopped: rank {rank} failed with {cause}", rank=rank, cause=cause
                )
            time.sleep(0.05)
        return CommunicationError(
            f"{what} failed: {exc}. No rank recorded an error: a peer process died (killed, out "
            "of memory) or the network failed."
        )

    return handle


def _init_group(rank: int, world: int, host: str, port: int, backend: str, timeout: float) -> None:
    global _STORE, _RANK
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(
        host, port, world_size=None, is_master=False, timeout=datetime.timedelta(seconds=timeout)
    )
    _STORE, _RANK = store, rank
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())


def _worker(
    rank: int,
    world: int,
    host: str,
    port: int,
    backend: str,
    timeout: float,
    conn: Any,
    paths: Sequence[str],
) -> None:
    for p in paths:
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        _init_group(rank, world, host, port, backend, timeout)
    except BaseException as e:
        conn.send(("error", f"rank {rank} could not join the process group: {e!r}"))
        return
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        if job is None:
            break
        try:
            fn, args, kwargs = pickle.loads(job)
            out = fn(rank, *args, **kwargs)
            conn.send(("ok", out))
        except BaseException as e:
            record_failure(e)
            conn.send(
                ("error", f"rank {rank} raised {type(e).__name__}: {e}\n{traceback.format_exc()}")
            )
            os._exit(1)  # drop the connections now, so peers stop waiting on this rank
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class Pool:
    """``size`` local processes in one process group, running jobs one after another.

    ``pool.run(fn, *args)`` calls ``fn(rank, *args)`` on every rank and returns the results by
    rank; ``fn`` must be importable (a module-level function). A job that fails or exceeds
    ``timeout`` seconds stops the whole pool and raises :class:`RankFailed` naming the rank.
    """

    def __init__(
        self,
        size: int,
        *,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        timeout: float = 60.0,
        grace: float = 5.0,
        paths: Sequence[str] = (),
    ) -> None:
        if not isinstance(size, int) or size < 1:
            raise InvalidArgument(f"size={size!r}: the number of processes, an int >= 1")
        if backend not in ("gloo", "nccl"):
            raise InvalidArgument(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidArgument(f"timeout={timeout!r}: seconds, > 0")
        import multiprocessing as mp

        import torch.distributed as dist

        self.size, self.timeout, self.grace = size, float(timeout), float(grace)
        port = _free_port(host)
        # the store lives here, in the launcher: it survives any rank
        self.store = dist.TCPStore(
            host, port, world_size=None, is_master=True, timeout=datetime.timedelta(seconds=timeout)
        )
        self.store.set(FAIL_KEY, "")
        ctx = mp.get_context("spawn")
        self.conns = []
        self.procs = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, size, host, port, backend, timeout, child, [*paths, *sys.path[:1]]),
                daemon=True,
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.closed = False

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        if self.closed:
            raise InvalidArgument(
                "this Pool was closed (a job failed or close() was called); start a new one"
            )
        job = pickle.dumps((fn, args, kwargs))
        for c in self.conns:
            c.send(job)
        return self._collect(self.timeout if timeout is None else timeout)

    def _collect(self, timeout: float) -> list[Any]:
        from multiprocessing.connection import wait

        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        first: tuple[int, str] | None = None
        while len(results) < self.size:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(kill=True)
                waiting = sorted(set(range(self.size)) - set(results))
                if first is not None:
                    raise RankFailed(
                        f"rank {first[0]} failed:\n{first[1]}", rank=first[0], cause=first[1]
                    )
                raise RankFailed(
                    f"ranks {waiting} did not finish within {timeout:.0f} s (a hang or a slow job); "
                    "the pool was stopped",
                    rank=waiting[0] if waiting else None,
                )
            sentinels = {p.sentinel: r for r, p in enumerate(self.procs) if r not in results}
            ready = wait(
                [self.conns[r] for r in range(self.size) if r not in results] + list(sentinels),
                timeout=min(left, 0.5),
            )
            for obj in ready:
                if obj in sentinels:
                    r = sentinels[obj]
                    if r not in results and not self.conns[r].poll():
                        code = self.procs[r].exitcode
                        results[r] = None
                        if first is None:
                            first = (r, f"rank {r} died (exit code {code})")
                    continue
                r = self.conns.index(obj)  # type: ignore[arg-type]
                try:
                    status, value = self.conns[r].recv()
                except EOFError:
                    continue
                results[r] = value
                if status == "error" and first is None:
                    first = (r, str(value))
            if first is not None:
                # give the others a moment to stop by themselves, then stop them
                end = time.monotonic() + self.grace
                while time.monotonic() < end and any(p.is_alive() for p in self.procs):
                    time.sleep(0.05)
                self.close(kill=True)
                rank, text = first
                recorded = _read_store(self.store)
                if recorded is not None and recorded[0] != rank and "died" not in text:
                    rank, text = recorded[0], recorded[1]
                raise RankFailed(f"rank {rank} failed: {text}", rank=rank, cause=text)
        return [results[r] for r in range(self.size)]

    def close(self, *, kill: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        for c in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                c.send(None)
        end = time.monotonic() + (0.0 if kill else 5.0)
        for p in self.procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_store(store: Any) -> tuple[int, str] | None:
    try:
        raw = store.get(FAIL_KEY).decode()
    except Exception:
        return None
    if not raw:
        return None
    rank, _, cause = raw.partition("\n")
    return int(rank), cause


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str = "gloo",
    timeout: float = 60.0,
    grace: float = 5.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, *args, **kwargs)`` on ``nprocs`` local processes; return the results.

    Under ``torchrun`` this process is already one rank: the process group is initialised from
    the environment and ``[fn(rank, ...)]`` (this rank's result only) is returned. The local
    processes bind to 127.0.0.1 (loopback) only.
    """
    if under_torchrun():
        import torch.distributed as dist

        global _RANK
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        rank = dist.get_rank()
        _RANK = rank
        return [fn(rank, *args, **kwargs)]
    with Pool(nprocs, backend=backend, timeout=timeout, grace=grace) as pool:
        return pool.run(fn, *args, **kwargs)
