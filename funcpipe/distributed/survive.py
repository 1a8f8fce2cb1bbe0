"""What keeps a job alive through what clusters do to it (issue 51): torchrun restarts that rejoin,
ranks that stop with the launcher that started them, and a heartbeat that names a rank that
stopped answering (:func:`heartbeat`, :func:`stalled`)."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from typing import Any

__all__ = [
    "die_with_launcher",
    "heartbeat",
    "release_at_exit",
    "same_threads",
    "stalled",
    "torchrun_store",
]


def die_with_launcher(rank: int) -> None:
    """Stop this rank when the process that started it is gone (a launcher killed by SIGKILL
    or SIGTERM would otherwise leave its ranks training on, orphans): a daemon thread waits on
    the launcher's sentinel (a rank of :class:`Pool`), or checks once a second that the parent
    is still the one that started it (torchrun's), and ends this process."""
    import multiprocessing as mp
    import threading

    parent = mp.parent_process()
    first = os.getppid()

    def gone() -> None:
        if parent is not None:
            from multiprocessing.connection import wait

            wait([parent.sentinel])
        else:
            while os.getppid() == first:
                time.sleep(1.0)
        with contextlib.suppress(Exception):  # (its stderr may have gone with it)
            sys.stderr.write(
                f"funcpipe: rank {rank}: the launcher that started it (pid {first}) is gone; "
                "this rank stops\n"
            )
            sys.stderr.flush()
        os._exit(1)

    threading.Thread(target=gone, name="funcpipe-launcher-watch", daemon=True).start()


def torchrun_store(limit: datetime.timedelta) -> tuple[Any, int, int]:
    """The store torchrun's environment names (as ``init_method="env://"`` makes it), its keys
    scoped to this run and restart: ``(store, rank, world size)``.

    torchrun (torch 2.13) keeps one rendezvous TCP store for every restart of the workers and
    hands it to them (``TORCHELASTIC_USE_AGENT_STORE``); the keys a process group writes while
    it connects (gloo's listening address of each rank, NCCL's unique id) are the same in
    every incarnation, so after a restart the new ranks read the dead ones' addresses and their
    connect is refused. Prefixed by ``TORCHELASTIC_RESTART_COUNT``, each incarnation has keys of
    its own (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` is then not needed)."""
    import torch.distributed as dist

    store, rank, world = next(dist.rendezvous("env://", timeout=limit))
    store.set_timeout(limit)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"funcpipe/{run}/attempt_{attempt}/default_pg", store), rank, world


_RELEASING = False


def release_at_exit() -> None:
    """Destroy the process group funcpipe started in this process when the interpreter exits
    (once, however many jobs ran). Left to the interpreter's end, gloo's threads were torn down
    while still running, and a rank that had finished its work aborted (SIGABRT, "terminate
    called without an active exception"; about one torchrun restart in five): torchrun then
    called the whole job failed. Registered only after a job returned, so a rank that fails
    never waits at exit on a group whose peers are gone."""
    global _RELEASING
    if _RELEASING:
        return
    _RELEASING = True
    import atexit

    import torch.distributed as dist

    def release() -> None:
        with contextlib.suppress(Exception):  # (a group destroyed by the user already)
            if dist.is_initialized():
                dist.destroy_process_group()

    atexit.register(release)


BEAT = 1.0  # seconds between two heartbeats of a rank
_BEATING: list[int] = []  # the rank this process beats for (once per process)


def _beat_key(rank: int) -> str:
    return f"funcpipe/beat/{rank}"


def heartbeat(store: Any, rank: int) -> None:
    """Beat for ``rank`` in ``store`` (the job's rendezvous store) every :data:`BEAT` seconds,
    from a daemon thread: a counter and the step this process is in. A rank whose process is
    stopped (SIGSTOP, a debugger), frozen (swapping, native code that holds the GIL) or whose
    host is cut off stops beating, while a rank that only waits in a collective goes on (the
    wait releases the GIL), so :func:`stalled` can tell the one that holds a job up from those
    waiting for it. One store write a second per rank.

    The thread is stopped and joined when the interpreter exits (``atexit``): a daemon thread
    still inside the store's write then (native code that let go of the GIL) is ended by the
    interpreter as it takes the GIL back, through C++ code that may not be unwound, and the
    process aborted ("terminate called without an active exception"), turning a rank that had
    finished its work into a failed job."""
    if _BEATING or store is None:
        return
    _BEATING.append(rank)
    import atexit
    import threading

    from funcpipe.distributed.failures import current_step

    stop = threading.Event()

    def beat() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            with contextlib.suppress(Exception):  # (a store gone with the job: the end)
                step = current_step()
                store.set(_beat_key(rank), f"{n} {'' if step is None else step}")
            stop.wait(BEAT)

    thread = threading.Thread(target=beat, name="funcpipe-heartbeat", daemon=True)
    thread.start()

    def end() -> None:  # (bounded: a write to a store that is gone ends at its timeout)
        stop.set()
        thread.join(timeout=_END_WAIT)

    atexit.register(end)


_END_WAIT = 5.0  # seconds the exit waits for the heartbeat's last write (one takes ms)


def _beats(store: Any, world: int) -> dict[int, str]:
    got: dict[int, str] = {}
    for r in range(world):
        with contextlib.suppress(Exception):
            if store.check([_beat_key(r)]):
                got[r] = store.get(_beat_key(r)).decode()
    return got


def stalled(store: Any, world: int, me: int | None) -> str | None:
    """Which ranks stopped answering, said as the cause of a wait that timed out (``None``
    when every rank that ever beat still beats): their heartbeats read twice, 2.5 beats apart.
    Costs that long, once, on the way to the error."""
    if store is None:
        return None
    before = _beats(store, world)
    time.sleep(2.5 * BEAT)
    after = _beats(store, world)
    quiet = [r for r in sorted(before) if r != me and after.get(r) == before[r]]
    if not quiet:
        return None
    steps = {r: before[r].partition(" ")[2] for r in quiet}
    said = ", ".join(f"rank {r}" + (f" (at step {steps[r]})" if steps[r] else "") for r in quiet)
    return (
        f"{said} stopped answering: its heartbeat (every {BEAT:g} s over the job's store) has "
        f"not moved for {2.5 * BEAT:g} s while this rank waited on it. The process is stopped "
        "(SIGSTOP, a debugger, a suspended job), frozen (swapping, native code holding the GIL) "
        "or its host is unreachable; the other ranks only wait"
    )


def same_threads() -> None:
    """Give every rank of the default group the smallest intra-op thread count any has (a
    collective, once, as the job starts). torchrun sets ``OMP_NUM_THREADS=1`` only on a node
    that runs several processes, so with ``--nproc-per-node 3`` on one node and 1 on the other
    the ranks summed in different orders: the tensor-parallel copies of one parameter drifted
    apart over the steps, and the final save refused them. With one count on every rank, the
    same computation on the same kind of CPU gives the same bits (GPU kernels do not depend on
    it). Said on stderr by the first rank when it changed anything."""
    import torch
    import torch.distributed as dist

    mine = torch.get_num_threads()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    least = min(int(n) for n in every)
    if least != mine:
        torch.set_num_threads(least)
    if len(set(every)) > 1 and dist.get_rank() == 0:
        sys.stderr.write(
            f"funcpipe: the ranks had different intra-op thread counts ({sorted(set(every))}); "
            f"every rank now uses {least}, so that copies of one computation agree bit for bit "
            "(set OMP_NUM_THREADS alike on every node to choose the count)\n"
        )
