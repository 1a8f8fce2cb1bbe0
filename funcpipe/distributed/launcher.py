"""Run a function on N local processes, or unchanged under ``torchrun``; fail fast and by name.

:func:`launch` starts one process per rank, joins them in a process group and calls
``fn(rank, *args)`` in each. The backend is NCCL when CUDA is available and gloo otherwise
(:func:`default_backend`); an explicit ``backend=`` is respected. Every rank's device follows one
rule, :func:`rank_device`: a gloo rank computes on the CPU, an NCCL rank gets the GPU of its local
rank (``cuda:<local rank>``), set with ``torch.cuda.set_device`` before the process group starts
(and passed as ``device_id=`` where torch takes it). More ranks on a host than GPUs is an
:class:`~funcpipe.errors.InvalidArgument` before any process starts, unless sharing is asked for
(``share_gpus=True`` or ``FUNCPIPE_SHARE_GPUS=1``). CPU ranks started here use one intra-op
thread each; GPU ranks keep torch's default.

The rendezvous store lives in the launching process, so it outlives any rank; it and the ranks'
gloo connections listen on 127.0.0.1 (loopback) only, unless ``host`` says otherwise (see
docs/security.md). When a rank raises, it records its error in the store and exits; the ranks
waiting on it see their connection drop, read the record and raise
:class:`~funcpipe.errors.RankFailed` naming it; the launcher stops every rank left after
``grace`` seconds and raises ``RankFailed`` with the first failure's traceback. A rank process
that dies without a word (SIGKILL, out of memory) is recorded by the launcher, which sees it
exit: the others then name it the same way. None of this waits on a collective: NCCL reports
errors asynchronously (a rank blocked in an NCCL operation on a dead peer may never return), so
the launcher names the failed rank from its pipes, the processes' exits and the store, and then
stops the ranks still blocked.

A rank whose function returns while others still run adds itself to the store's record of the
job's returns. A peer whose wait then breaks or runs out raises ``RankFailed`` saying "rank 1
returned while ranks [0] were still in step N" (the step of its Pipeline, counted from 1),
not that a process died or a timeout passed. Under :func:`launch` such a rank leaves (its process
exits) after ``grace`` seconds, so gloo and socket waits on it break at once; a :class:`Pool`
keeps it for the next job, so its peers are named only when their wait gives up
(``pg_timeout``) or at the deadline. A peer blocked in an NCCL operation does not notice a peer
that left: it is named when NCCL's watchdog or the deadline stops it. A failure that leaves
torch.distributed bare (a gloo timeout or dropped connection in a collective outside funcpipe's
transport, or in the user's own) is raised, where it leaves ``fn``, as the error the transport
would give (:func:`named`).

Two clocks, two options. ``timeout`` is the job's deadline, kept by the launcher: a job still
running after it is stopped, with a :class:`~funcpipe.errors.RankFailed` that names the option;
:func:`launch` has none by default (a GPU job may train for days; a rank that fails or dies is
named at once whatever the deadline). ``pg_timeout`` is the process group's own timeout
(``init_process_group(timeout=)``): how long one collective or message may wait before gloo
raises or NCCL's watchdog aborts the rank; by default torch's (:data:`PG_TIMEOUTS`: 10 minutes
for NCCL, 30 for gloo), long enough for a peer compiling its stages; it also bounds joining the
group, so it is at least a second (a join that runs out names it). Tests and benchmarks set
short ones explicitly, so that a hang fails fast.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set), ``launch`` runs ``fn`` in
this process only, with the process group torchrun describes, under the same rules: the backend
from :func:`default_backend`, the device from ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` checked
against the GPUs. A rank whose ``fn`` raises records its error in torchrun's store too, so that
peers blocked on it name it, and one whose ``fn`` returns records that; torchrun owns the
processes, so nothing makes a returned rank leave early: its peers' gloo waits break when its
process exits (usually at once, at the end of the script), NCCL waits at the watchdog.

The backend and device rule is :mod:`funcpipe.distributed.devices`, the failure and return
records' format :mod:`funcpipe.distributed.failures`, the process group's timeout
:mod:`funcpipe.distributed.timeouts`, where the store listens :mod:`funcpipe.distributed.network`,
and how the launcher waits for a job's results :mod:`funcpipe.distributed.collect`; what stays
here shares this process's store, rank and group timeout: starting the group (here or under
torchrun), a rank's side of a job (its worker), recording and naming failures and returns,
:class:`Pool` (it keeps a group of processes alive and runs one function after another on it:
starting processes costs seconds, so tests start one pool per session) and :func:`launch`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from funcpipe.distributed import records
from funcpipe.distributed.collect import LEAVE, collect
from funcpipe.distributed.devices import BACKENDS as BACKENDS  # (re-exported: its old home)
from funcpipe.distributed.devices import NCCL_ENV as NCCL_ENV
from funcpipe.distributed.devices import SHARE_ENV as SHARE_ENV
from funcpipe.distributed.devices import (
    choose_backend,
    claim_device,
    default_backend,
    device_id,
    rank_device,
    sharing,
)
from funcpipe.distributed.failures import FAIL_KEY as FAIL_KEY
from funcpipe.distributed.failures import (
    death,
    first_failure,
    timed_out,
)
from funcpipe.distributed.network import is_loopback as _is_loopback
from funcpipe.distributed.network import listen as _listen  # (tests patch it here)
from funcpipe.distributed.network import loopback_interface as _loopback_interface
from funcpipe.distributed.survive import (
    die_with_launcher,
    heartbeat,
    release_at_exit,
    same_threads,
    torchrun_store,
)
from funcpipe.distributed.timeouts import PG_TIMEOUTS as PG_TIMEOUTS
from funcpipe.distributed.timeouts import check_pg_timeout, join_expired, pg_seconds
from funcpipe.errors import (
    CommunicationError,
    InvalidArgument,
    check_int,
    check_seconds,
)

# the failure records' helpers under the names they had here (tests reach them so)
_death, _first_failure = death, first_failure
failure_handler, named = records.failure_handler, records.named
record_failure, record_return = records.record_failure, records.record_return

__all__ = [
    "PG_TIMEOUTS",
    "Pool",
    "default_backend",
    "failure_handler",
    "launch",
    "pg_seconds",
    "rank_device",
    "under_torchrun",
]


def under_torchrun() -> bool:
    """True when the environment describes this process as one rank of a larger job."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(
            f"{name}={raw!r} in the environment: an int (torchrun sets it)"
        ) from None


def _init_group(
    rank: int, world: int, host: str, port: int, backend: str, pg_timeout: float, share: bool
) -> None:
    """Join the launcher's process group as ``rank`` (every rank of the launcher is on its host,
    so the rank is also the local rank that picks the device); ``pg_timeout`` seconds is the
    group's timeout (and its store's)."""
    import torch
    import torch.distributed as dist

    # the device first: NCCL binds this process's communicators to the current device
    device = claim_device(rank, backend, share=share)
    if device.type == "cpu":
        torch.set_num_threads(1)  # ranks share the host's cores; GPU ranks keep torch's default
    if backend == "gloo" and _is_loopback(host) and "GLOO_SOCKET_IFNAME" not in os.environ:
        # gloo otherwise listens on the address the machine's hostname resolves to
        iface = _loopback_interface()
        if iface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
    limit = datetime.timedelta(seconds=pg_timeout)
    store = dist.TCPStore(host, port, world_size=None, is_master=False, timeout=limit)
    records.joined(store, rank, float(pg_timeout))
    heartbeat(store, rank)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("pg", store),
        rank=rank,
        world_size=world,
        timeout=limit,
        **device_id(device),
    )


def _worker(
    rank: int,
    world: int,
    host: str,
    port: int,
    backend: str,
    pg_timeout: float,
    share: bool,
    conn: Any,
    paths: Sequence[str],
) -> None:
    for p in paths:
        if p not in sys.path:
            sys.path.insert(0, p)
    die_with_launcher(rank)
    try:
        _init_group(rank, world, host, port, backend, pg_timeout, share)
    except BaseException as e:
        why = f". {join_expired(pg_timeout)}" if timed_out(e) else ""
        conn.send(("error", f"rank {rank} could not join the process group: {e!r}{why}"))
        return
    while True:
        try:
            job = conn.recv()
        except EOFError:
            break
        if job is None:
            break
        if job == LEAVE:  # returned while peers still ran: drop the connections they wait on
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        records.next_job()
        try:
            fn, args, kwargs = pickle.loads(job)
            out = fn(rank, *args, **kwargs)
            record_return()
            conn.send(("ok", out))
        except BaseException as e:
            e = named(e, rank)
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
    rank; ``fn`` must be importable (a module-level function). A job that fails, or runs past
    its deadline, stops the whole pool and raises :class:`RankFailed` naming the rank (and, for
    a deadline, the option). ``timeout`` is each job's deadline in seconds (``None``: none),
    unless ``run(..., timeout=)`` gives its own; ``pg_timeout`` is the process group's timeout
    (``None``: torch's default, :data:`PG_TIMEOUTS`). The two are separate: see the module's
    docstring.

    ``backend`` is ``"gloo"`` by default (a pool serves CPU jobs, as the tests' pools do);
    ``backend=None`` picks as :func:`launch` does (:func:`default_backend`). Rank ``r`` runs on
    :func:`rank_device` ``(r, backend, share=share_gpus)``; ``share_gpus=None`` reads
    ``FUNCPIPE_SHARE_GPUS``. An NCCL pool larger than the host's GPU count, or one on a host
    without CUDA, is an :class:`InvalidArgument` before any process starts.

    A rank whose function returned stays for the next job even while others still run; if they
    wait for it, they are stopped by ``pg_timeout`` or the deadline, and the error says that it
    returned (:func:`launch`, with one job, lets it go after ``grace`` seconds).
    """

    def __init__(
        self,
        size: int,
        *,
        backend: str | None = "gloo",
        share_gpus: bool | None = None,
        host: str = "127.0.0.1",
        timeout: float | None = None,
        pg_timeout: float | None = None,
        grace: float = 5.0,
        paths: Sequence[str] = (),
    ) -> None:
        check_int("size", size, 1, "the number of processes, an int >= 1")
        share = sharing(share_gpus)
        check_seconds("timeout", timeout, "the deadline of each job")
        check_pg_timeout(pg_timeout)
        if not isinstance(grace, (int, float)) or grace < 0:
            raise InvalidArgument(
                f"grace={grace!r}: seconds the other ranks get to stop by themselves after a "
                "failure, >= 0"
            )
        if not isinstance(host, str) or not host:
            raise InvalidArgument(f"host={host!r}: an address to bind, e.g. '127.0.0.1'")
        backend = choose_backend(backend, size, share=share)
        import multiprocessing as mp

        import torch.distributed as dist

        self.size, self.grace = size, float(grace)
        self.timeout = None if timeout is None else float(timeout)
        self.pg_timeout = pg_seconds(pg_timeout, backend)
        self.backend = backend
        self.host = host
        fd, port = _listen(host)
        # the store lives here, in the launcher: it survives any rank. It serves on a socket
        # bound to `host` only (loopback by default), never on every interface.
        self.store = dist.TCPStore(
            host,
            port,
            world_size=None,
            is_master=True,
            timeout=datetime.timedelta(seconds=self.pg_timeout),
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
                args=(
                    rank,
                    size,
                    host,
                    port,
                    backend,
                    self.pg_timeout,
                    share,
                    child,
                    [*paths, *sys.path[:1]],
                ),
                daemon=True,
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.closed = False
        # seconds after which a rank that returned while others still run leaves (its process
        # exits, so the peers waiting on it fail at once; the pool is then spent): launch sets
        # it, for its one job; None keeps every rank for the next job
        self._let_go: float | None = None

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """``fn(rank, *args, **kwargs)`` on every rank; the results by rank. ``timeout``: this
        job's deadline in seconds (``None``: the pool's ``timeout``)."""
        if self.closed:
            raise InvalidArgument(
                "this Pool was closed (a job failed or close() was called); start a new one"
            )
        check_seconds("timeout", timeout, "this job's deadline")
        job = _pickle_job(fn, args, kwargs)
        for c in self.conns:
            c.send(job)
        try:
            return collect(self, self.timeout if timeout is None else float(timeout))
        except BaseException:
            # interrupted (a test's timeout, Ctrl-C) with the job still running: its answers
            # would be read as the next job's, so the pool stops (a no-op when closed already)
            self.close(kill=True)
            raise

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


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    share_gpus: bool | None = None,
    timeout: float | None = None,
    pg_timeout: float | None = None,
    grace: float = 5.0,
    **kwargs: Any,
) -> list[Any]:
    """Call ``fn(rank, *args, **kwargs)`` on ``nprocs`` local processes; return the results.

    ``backend``: ``"gloo"`` (CPU ranks), ``"nccl"`` (one GPU per rank) or ``None``, NCCL when
    CUDA is available, else gloo (:func:`default_backend`). Rank ``r`` runs on
    :func:`rank_device` ``(r, backend)``: the CPU under gloo (one intra-op thread per rank),
    ``cuda:r`` under NCCL, made current before the process group starts. More NCCL ranks than
    GPUs, or NCCL without CUDA, is an :class:`InvalidArgument` before any process starts;
    ``share_gpus=True`` (or ``FUNCPIPE_SHARE_GPUS=1`` in the environment, read when
    ``share_gpus`` is ``None``) lets local rank ``r`` use ``cuda:r % device_count`` instead.

    ``timeout``: the job's deadline in seconds, ``None`` (the default) for none; a job still
    running after it is stopped with a :class:`RankFailed` that names ``timeout=``.
    ``pg_timeout``: the process group's timeout (``init_process_group(timeout=)``), how long one
    collective or message may wait before gloo raises or NCCL's watchdog aborts the rank;
    ``None`` (the default) is torch's, :data:`PG_TIMEOUTS` (10 minutes for NCCL, 30 for gloo).
    A rank that raises or dies is named at once, whatever either says; a rank that returns
    while others still run leaves ``grace`` seconds later, so that one still waiting on it fails
    then, naming it (``RankFailed``: "rank 1 returned while ranks [0] were still in step N").

    Under ``torchrun`` this process is already one rank: the process group is initialised from
    the environment (unless it already is) under the same rules, the device taken from
    ``LOCAL_RANK`` (``RANK`` when it is unset) and the host's rank count from
    ``LOCAL_WORLD_SIZE``; ``nprocs`` is not used, and ``[fn(rank, ...)]`` (this rank's result
    only) is returned. There ``pg_timeout`` is the group's timeout when ``launch`` starts the
    group, and ``timeout`` does not apply (torchrun owns the processes). The local processes
    bind to 127.0.0.1 (loopback) only.
    """
    check_int("nprocs", nprocs, 1, "the number of local processes to start, an int >= 1")
    share = sharing(share_gpus)
    check_seconds("timeout", timeout, "the job's deadline")
    check_pg_timeout(pg_timeout)
    if under_torchrun():
        return [_run_torchrun(fn, args, kwargs, backend, share=share, pg_timeout=pg_timeout)]
    _pickle_job(fn, args, kwargs)  # before starting any process
    with Pool(
        nprocs,
        backend=choose_backend(backend, nprocs, share=share),
        share_gpus=share,
        timeout=timeout,
        pg_timeout=pg_timeout,
        grace=grace,
    ) as pool:
        # a rank that returned has nothing left to do: after grace it leaves, so a peer still
        # waiting on it (a rank that took fewer steps) fails at once, naming it
        pool._let_go = grace
        return pool.run(fn, *args, **kwargs)


def _run_torchrun(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    backend: str | None,
    *,
    share: bool,
    pg_timeout: float | None,
) -> Any:
    """``fn(rank, ...)`` in this process, one rank of torchrun's job: its failure, or its
    return, is recorded in torchrun's store for the peers that wait on it."""
    rank = _join_torchrun(backend, share=share, pg_timeout=pg_timeout)
    records.next_job()
    try:
        out = fn(rank, *args, **kwargs)
    except BaseException as e:
        err = named(e, rank)
        record_failure(err)  # peers blocked on this rank read it from torchrun's store
        if err is e:
            raise
        raise err from e
    record_return()
    if records.pg_timeout() is not None:  # funcpipe started this process's group: it ends it
        release_at_exit()
    return out


def _join_torchrun(backend: str | None, *, share: bool, pg_timeout: float | None) -> int:
    """Join the process group torchrun describes (unless this process already has); its rank.

    The device is made current from ``LOCAL_RANK`` before the group starts, as for the local
    launcher's ranks; thread counts are left to torchrun (it sets ``OMP_NUM_THREADS``). The
    group's timeout is ``pg_timeout`` seconds (``None``: :data:`PG_TIMEOUTS`)."""
    import torch.distributed as dist

    started: float | None = None
    if not dist.is_initialized():
        local = _env_int("LOCAL_RANK")
        if local is None:
            local = _env_int("RANK")
        chosen = choose_backend(backend, _env_int("LOCAL_WORLD_SIZE"), share=share)
        device = claim_device(0 if local is None else local, chosen, share=share)
        seconds = pg_seconds(pg_timeout, chosen)
        limit = datetime.timedelta(seconds=seconds)
        try:
            if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # torchrun's agent: restarts
                store, rank, world = torchrun_store(limit)
                joined = {"store": store, "rank": rank, "world_size": world}
            else:  # RANK, WORLD_SIZE and MASTER_* set by hand: torch's env:// as it is
                joined = {}
            dist.init_process_group(chosen, timeout=limit, **joined, **device_id(device))
        except RuntimeError as e:
            if not timed_out(e):
                raise
            raise CommunicationError(
                f"rank {os.environ.get('RANK')} could not join the process group torchrun "
                f"describes: {e!r}. {join_expired(seconds)}"
            ) from e
        started = seconds
        die_with_launcher(dist.get_rank())
        same_threads()
    rank = dist.get_rank()
    store = None
    with contextlib.suppress(Exception):  # a group started elsewhere may have no store to share
        store = dist.distributed_c10d._get_default_store()
    records.joined(store, rank, started if started is not None else records.pg_timeout())
    heartbeat(store, rank)
    return rank
