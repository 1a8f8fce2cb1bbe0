"""The process group's timeout (``pg_timeout=``): its default, its bounds, what its expiry says.

``pg_timeout`` is ``init_process_group(timeout=)``: how long one collective or message may wait
before gloo raises or NCCL's watchdog aborts the rank, and also how long joining the group may
take. ``None`` is torch's default for the backend (:data:`PG_TIMEOUTS`); anything shorter than
:data:`MIN_PG_TIMEOUT` cannot even join (:func:`check_pg_timeout`). When a wait runs past it,
:func:`pg_expired` (or, while joining, :func:`join_expired`) names the option and the fix. The
job's deadline, ``timeout=``, is the launcher's own (:mod:`funcpipe.distributed.collect`).
"""

from __future__ import annotations

import datetime
from typing import Any

from funcpipe.errors import InvalidArgument, check_seconds

__all__ = [
    "MIN_PG_TIMEOUT",
    "PG_TIMEOUTS",
    "check_pg_timeout",
    "job_timeout",
    "join_expired",
    "pg_expired",
    "pg_seconds",
]

# The process group's timeout when pg_timeout is None: torch's defaults (torch.distributed's
# default_pg_nccl_timeout and default_pg_timeout), in seconds.
PG_TIMEOUTS = {"nccl": 600.0, "gloo": 1800.0}
MIN_PG_TIMEOUT = 1.0  # shorter, the ranks cannot even connect to each other


def check_pg_timeout(pg_timeout: Any) -> None:
    """``pg_timeout`` is ``None`` or seconds, at least :data:`MIN_PG_TIMEOUT`."""
    check_seconds("pg_timeout", pg_timeout, "the process group's timeout")
    if pg_timeout is not None and pg_timeout < MIN_PG_TIMEOUT:
        raise InvalidArgument(
            f"pg_timeout={pg_timeout!r}: the process group's timeout, at least "
            f"{MIN_PG_TIMEOUT:g} s: it bounds joining the group (every rank connecting to the "
            "others) as well as each collective and message, and that is too short to join. "
            "Give seconds (e.g. 60; it is not milliseconds), or None for torch's default"
        )


def pg_seconds(pg_timeout: float | None, backend: str) -> float:
    """The process group timeout in seconds for ``pg_timeout`` (``None``: :data:`PG_TIMEOUTS`)."""
    return PG_TIMEOUTS[backend] if pg_timeout is None else float(pg_timeout)


def pg_expired(seconds: float | None) -> str:
    """What to say when a wait ran past the process group's timeout (``seconds``, if known):
    the option to change."""
    limit = "" if seconds is None else f" ({seconds:g} s)"
    return (
        f"It waited longer than the process group's timeout{limit} and no rank recorded an "
        "error: a hang, or a peer slower than that (compiling, loading data). If the peer is "
        "only slow, raise pg_timeout= of funcpipe.launch or funcpipe.Pool (under torchrun, of "
        "funcpipe.launch, or init_process_group(timeout=) where you start the group)."
    )


def join_expired(seconds: float) -> str:
    """What to say when joining the process group ran past its timeout."""
    return (
        f"Joining timed out: the process group's timeout, pg_timeout={seconds:g} s, also bounds "
        "how long each rank waits for the others to connect. If the ranks start slowly "
        "(importing, loading data), raise pg_timeout= of funcpipe.launch or funcpipe.Pool "
        "(None: torch's default)"
    )


def job_timeout() -> datetime.timedelta | None:
    """The default process group's timeout: the job's, which every group funcpipe creates takes
    (``dist.new_group`` without ``timeout=`` gets the backend's default, 30 minutes on gloo,
    whatever the world's is). ``None`` where it cannot be read."""
    import torch
    import torch.distributed as dist

    world = dist.group.WORLD
    for kind in ("cuda", "cpu"):
        try:
            limit = world._get_backend(torch.device(kind)).options._timeout  # type: ignore[union-attr]
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(limit, datetime.timedelta):
            return limit
    return None


def group_options(backend: str, limit: datetime.timedelta) -> Any:
    """Backend options that carry ``limit`` as a new group's timeout (for ``init_device_mesh``'s
    ``backend_override``), or ``None`` for a backend without them."""
    import torch.distributed as dist

    kind, name = {
        "gloo": ("ProcessGroupGloo", "_Options"),
        "nccl": ("ProcessGroupNCCL", "Options"),
    }.get(backend, ("", ""))
    make = getattr(getattr(dist, kind, None), name, None) if kind else None
    if make is None:  # another backend, or a torch built without this one
        return None
    options = make()
    options._timeout = limit
    return options
