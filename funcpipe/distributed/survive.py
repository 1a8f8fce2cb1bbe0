"""What keeps a job alive through what clusters do to it (issue 51): torchrun restarts that rejoin,
and ranks that stop with the launcher that started them."""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
from typing import Any

__all__ = ["die_with_launcher", "release_at_exit", "torchrun_store"]


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
