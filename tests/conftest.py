"""Shared test set-up: hypothesis profiles, seeding, one thread."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Two cores run the suite; intra-op threads only add overhead on the tiny tensors used here.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> Iterator[None]:
    torch.manual_seed(0)
    yield


# ------------------------------------------------------------------------------ process pools
# Starting gloo processes costs seconds on two cores, so each pool size is started once per test
# session and reused. Jobs are module-level functions in tests/jobs_*.py (importable in the
# workers because the repository root is put on their path). A job that fails stops its pool;
# the next request for that size starts a fresh one.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

_POOLS: dict[int, Any] = {}
_USED: set[int] = set()  # the pool sizes handed to the running test


def get_pool(size: int) -> Any:
    from funcpipe.distributed.launcher import Pool

    pool = _POOLS.get(size)
    if pool is None or pool.closed:
        # short on purpose: a hung job fails the test within two minutes (the job's deadline),
        # and a wait in gloo or a socket gives up as soon (the process group's timeout)
        pool = _POOLS[size] = Pool(size, timeout=120, pg_timeout=120, paths=[ROOT])
    _USED.add(size)
    return pool


@pytest.fixture(scope="session")
def pool() -> Iterator[Callable[[int], Any]]:
    """``pool(n)``: a started group of ``n`` gloo processes (``.run(fn, *args)``)."""
    yield get_pool
    _close_pools()


def _close_pools() -> None:
    """Measure the pools while they idle (for the session summary), then stop them."""
    for size, p in sorted(_POOLS.items()):
        if not p.closed:
            _IDLE.extend(idle_usage(p, label=f"pool({size})"))
        p.close()


# ------------------------------------------------------------------ what idle pools cost
# Rank processes stay alive for the whole session, so whatever a test leaves in them (process
# groups: gloo starts threads per group, and their event loops wake up while idle) costs every
# later test CPU time, so they are destroyed after each test (_release_groups). The summary at
# the end of the session shows each pool process's threads and the CPU it used over one idle
# second, and the most threads a pool process held at the end of a test and between tests.
_IDLE: list[dict[str, Any]] = []
_HIGH_WATER: dict[str, tuple[int, str]] = {}  # pool process -> (most threads a test left, which)
_BETWEEN: dict[str, tuple[int, str]] = {}  # the same once the groups were destroyed
IDLE_WINDOW = 1.0  # seconds of idleness sampled per pool


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (its threads included)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_usage(p: Any, *, label: str, window: float = IDLE_WINDOW) -> list[dict[str, Any]]:
    """Threads and CPU seconds over ``window`` idle seconds of every process of pool ``p``."""
    import time

    pids = [proc.pid for proc in p.procs if proc.is_alive()]
    try:
        before = {pid: _cpu_seconds(pid) for pid in pids}
        time.sleep(window)
        after = {pid: _cpu_seconds(pid) for pid in pids}
    except OSError:  # /proc is not there (not Linux) or a process just went
        return []
    return [
        {
            "pool": label,
            "rank": r,
            "pid": pid,
            "threads": _threads(pid),
            "cpu": after[pid] - before[pid],
            "window": window,
        }
        for r, pid in enumerate(pids)
    ]


@pytest.fixture(autouse=True)
def _release_groups(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used a pool: note the most threads it left in a pool process, then
    destroy the process groups its jobs made (funcpipe.distributed.groups.destroy_all on every rank)."""
    yield
    used = sorted(_USED)
    _USED.clear()
    for size in used:
        p = _POOLS.get(size)
        if p is None or p.closed:
            continue
        _note(_HIGH_WATER, p, size, request.node.nodeid)
        from tests import jobs_resources

        p.run(jobs_resources.release, timeout=60)
        _note(_BETWEEN, p, size, request.node.nodeid)


def _note(seen: dict[str, tuple[int, str]], p: Any, size: int, test: str) -> None:
    for r, proc in enumerate(p.procs):
        n = _threads(proc.pid)
        key = f"pool({size}) rank {r}"
        if n > seen.get(key, (0, ""))[0]:
            seen[key] = (n, test)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for size, p in sorted(_POOLS.items()):  # pools no session fixture closed
        if not p.closed:
            _IDLE.extend(idle_usage(p, label=f"pool({size})"))
    if not _IDLE and not _HIGH_WATER:
        return
    tr = terminalreporter
    tr.section("rank pools while idle")
    for row in _IDLE:
        tr.write_line(
            f"{row['pool']} rank {row['rank']} (pid {row['pid']}): {row['threads']} threads, "
            f"{row['cpu']:.2f} CPU s over {row['window']:.1f} s idle"
        )
    if _IDLE:
        total = sum(row["cpu"] for row in _IDLE)
        tr.write_line(
            f"all {len(_IDLE)} pool processes: {sum(row['threads'] for row in _IDLE)} threads, "
            f"{total:.2f} CPU s over {IDLE_WINDOW:.1f} s idle ({100 * total / IDLE_WINDOW:.0f}% "
            "of a core)"
        )
    for key, (n, test) in sorted(_HIGH_WATER.items()):
        between = _BETWEEN.get(key, (0, ""))[0]
        tr.write_line(
            f"{key}: at most {n} threads at the end of a test (after {test}), at most "
            f"{between} between tests"
        )
