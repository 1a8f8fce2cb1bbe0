"""Run a function on N local processes, or unchanged under ``torchrun``; fail fast and by name.

:func:`launch` starts one process per rank (gloo on CPU by default; NCCL when CUDA devices are
there and ``backend="nccl"``), joins them in a process group and calls ``fn(rank, *args)`` in
each. The rendezvous store lives in the launching process, so it outlives any rank; it and the
ranks' gloo connections listen on 127.0.0.1 (loopback) only, unless ``host`` says otherwise
(see docs/security.md). When a rank raises, it records its error in the store and exits; the
ranks waiting on it see their connection drop, read the record and raise
:class:`~funcpipe.errors.RankFailed` naming it; the launcher stops every rank left after
``grace`` seconds and raises ``RankFailed`` with the first failure's traceback. A rank process
that dies without a word (SIGKILL, out of memory) is recorded by the launcher, which sees it
exit: the others then name it the same way. Under ``torchrun`` (``RANK`` and ``WORLD_SIZE``
set), ``launch`` runs ``fn`` in this process only, with the process group torchrun describes.

:class:`Pool` keeps such a group of processes alive and runs one function after another on it:
starting processes costs seconds, so tests start one pool per session.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import pickle
import signal
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


def _listen(host: str) -> tuple[int, int]:
    """A listening socket bound to ``host`` only (port chosen by the OS): ``(fd, port)``.

    The launcher's store serves on this socket. Given a host alone, torch's ``TCPStore`` listens
    on every interface; handing it a socket bound to ``host`` keeps it there (loopback by
    default), and there is no window between choosing a port and binding it.
    """
    family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    s = socket.socket(family, kind, proto)
    try:
        s.bind(addr[:2] if family == socket.AF_INET else addr)
        s.listen(1024)
        port = int(s.getsockname()[1])
    except BaseException:
        s.close()
        raise
    return s.detach(), port  # the store owns (and closes) the descriptor from now on


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    with contextlib.suppress(OSError):
        names = [name for _, name in socket.if_nameindex()]
        for name in ("lo", "lo0"):
            if name in names:
                return name
    return None


def _describe(exc: BaseException) -> str:
    """``Type: message``, then any notes added to the exception (where it was raised)."""
    notes = getattr(exc, "__notes__", None) or []
    return "\n".join([f"{type(exc).__name__}: {exc}", *(str(n) for n in notes)])


def record_failure(exc: BaseException) -> None:
    """Record in the shared store that this rank failed (first failure wins)."""
    if _STORE is None or _RANK is None:
        return
    text = f"{_RANK}\n{_describe(exc)}"
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
    return _parse_record(raw)


def _parse_record(raw: str) -> tuple[int, str] | None:
    """``(rank, cause)`` from a failure record; ``None`` while nothing is recorded (``""``)."""
    rank, _, cause = raw.partition("\n")
    try:
        return int(rank), cause
    except ValueError:
        return None


def _death(rank: int, code: int | None) -> str:
    """What to say about a rank process that exited without reporting back."""
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"rank {rank} died: its process was killed by {name} (exit code {code})"
    return f"rank {rank} died: its process exited with code {code} without reporting an error"


def failure_handler() -> Callable[[BaseException, str], BaseException]:
    """What a transport raises when communication breaks: name the rank that failed first."""

    def handle(exc: BaseException, what: str) -> BaseException:
        for _ in range(60):  # the failed rank (or, for a dead one, the launcher) records it soon
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
    if backend == "gloo" and _is_loopback(host) and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo otherwise listens on the address the machine's hostname resolves to
        iface = _loopback_interface()
        if iface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
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
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise InvalidArgument(f"size={size!r}: the number of processes, an int >= 1")
        if backend not in ("gloo", "nccl"):
            raise InvalidArgument(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
        if not isinstance(timeout, (int, float)) or timeout <= 0:
            raise InvalidArgument(f"timeout={timeout!r}: seconds, > 0")
        if not isinstance(grace, (int, float)) or grace < 0:
            raise InvalidArgument(
                f"grace={grace!r}: seconds the other ranks get to stop by themselves after a "
                "failure, >= 0"
            )
        if not isinstance(host, str) or not host:
            raise InvalidArgument(f"host={host!r}: an address to bind, e.g. '127.0.0.1'")
        import multiprocessing as mp

        import torch.distributed as dist

        self.size, self.timeout, self.grace = size, float(timeout), float(grace)
        self.host = host
        fd, port = _listen(host)
        # the store lives here, in the launcher: it survives any rank. It serves on a socket
        # bound to `host` only (loopback by default), never on every interface.
        self.store = dist.TCPStore(
            host,
            port,
            world_size=None,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout),
            master_listen_fd=fd,
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
        job = _pickle_job(fn, args, kwargs)
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
                r = sentinels[obj] if obj in sentinels else self.conns.index(obj)  # type: ignore[arg-type]
                if r in results:
                    continue
                try:
                    message = self.conns[r].recv() if self.conns[r].poll() else None
                except (EOFError, OSError):  # the pipe closed: the process is gone
                    message = None
                if message is None:
                    if obj not in sentinels and self.procs[r].is_alive():
                        self.procs[r].join(timeout=1.0)
                    if self.procs[r].is_alive():
                        continue
                    text = _death(r, self.procs[r].exitcode)
                    results[r] = None
                    # tell the ranks still waiting on it who failed (first failure wins)
                    with contextlib.suppress(Exception):
                        self.store.compare_set(FAIL_KEY, "", f"{r}\n{text}")
                    if first is None:
                        first = (r, text)
                    continue
                status, value = message
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


def _pickle_job(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> bytes:
    try:
        return pickle.dumps((fn, tuple(args), kwargs))
    except Exception as e:
        raise InvalidArgument(
            f"fn={fn!r}: the job cannot be sent to the rank processes ({type(e).__name__}: {e}); "
            "fn must be a module-level function of an importable module (not a lambda or a "
            "nested function), and its arguments picklable data and tensors"
        ) from None


def _read_store(store: Any) -> tuple[int, str] | None:
    try:
        raw = store.get(FAIL_KEY).decode()
    except Exception:
        return None
    if not raw:
        return None
    return _parse_record(raw)


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
    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise InvalidArgument(
            f"nprocs={nprocs!r}: the number of local processes to start, an int >= 1"
        )
    if under_torchrun():
        import torch.distributed as dist

        global _RANK
        if not dist.is_initialized():
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        rank = dist.get_rank()
        _RANK = rank
        return [fn(rank, *args, **kwargs)]
    _pickle_job(fn, args, kwargs)  # before starting any process
    with Pool(nprocs, backend=backend, timeout=timeout, grace=grace) as pool:
        return pool.run(fn, *args, **kwargs)
