"""The job's deadline and the process group's timeout are two options (issue 32).

``timeout=`` is the deadline the launcher keeps (none by default for :func:`funcpipe.launch`);
``pg_timeout=`` is ``init_process_group(timeout=)``, the NCCL watchdog's and gloo's limit on one
collective or message (torch's default by default). Each reaches its own place, and each one's
expiry names the option to change. The tests themselves keep short limits, explicitly.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

import funcpipe as fp
from funcpipe.cli import demo
from funcpipe.distributed import launcher, records
from funcpipe.errors import CommunicationError, InvalidArgument, RankFailed

ROOT = str(Path(__file__).resolve().parents[1])


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Restore the environment (the launcher sets NCCL variables) and the launcher's globals."""
    saved = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv(launcher.SHARE_ENV, raising=False)
    for name in ("_STORE", "_RANK", "_PG_TIMEOUT"):
        monkeypatch.setattr(records, name, None)
    monkeypatch.setattr(launcher, "heartbeat", lambda store, rank: None)  # (no thread in pytest)
    monkeypatch.setattr(launcher, "same_threads", lambda: None)  # (a collective: no group here)
    monkeypatch.setattr(launcher, "release_at_exit", lambda: None)  # (nor an exit hook)
    yield
    os.environ.clear()
    os.environ.update(saved)


class RecordingPool:
    """Stands in for Pool: records the options launch() asked for."""

    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, size: int, **options: Any) -> None:
        RecordingPool.made.append(options)

    def __enter__(self) -> RecordingPool:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        return []


# ---------------------------------------------------------------------- defaults, and where each goes
def test_launch_has_no_deadline_and_torchs_group_timeout_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    RecordingPool.made = []
    monkeypatch.setattr(launcher, "Pool", RecordingPool)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fp.launch(abs, 2)
    fp.launch(abs, 2, timeout=5, pg_timeout=7)
    assert [(p["timeout"], p["pg_timeout"]) for p in RecordingPool.made] == [(None, None), (5, 7)]
    # None is torch's default for the backend
    assert launcher.pg_seconds(None, "gloo") == default_pg_timeout.total_seconds() == 1800.0
    assert launcher.pg_seconds(None, "nccl") == 600.0  # torch's default_pg_nccl_timeout
    assert launcher.pg_seconds(42, "nccl") == 42.0


def test_both_options_are_checked_before_any_process_starts() -> None:
    for call, words in (
        (lambda: fp.launch(abs, 1, timeout=0), "timeout=0: the job's deadline"),
        (lambda: fp.launch(abs, 1, pg_timeout=-1), "pg_timeout=-1: the process group's timeout"),
        (lambda: fp.Pool(1, pg_timeout="60"), "pg_timeout='60'"),
        (lambda: demo.run(demo.parse(["--device", "cpu", "--pg-timeout", "0"])), "--pg-timeout=0"),
    ):
        with pytest.raises(InvalidArgument, match=words):
            call()


def recording_init(events: list[dict[str, Any]]) -> Any:
    def init(backend: str | None = None, timeout: Any = None, **rest: Any) -> None:
        events.append({"backend": backend, "timeout": timeout})

    return init


@pytest.mark.parametrize(
    ("gpus", "given", "seconds"), [(0, None, 1800.0), (1, None, 600.0), (1, 90.0, 90.0)]
)
def test_under_torchrun_pg_timeout_is_the_groups_timeout(
    monkeypatch: pytest.MonkeyPatch, gpus: int, given: float | None, seconds: float
) -> None:
    events: list[dict[str, Any]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: None)
    monkeypatch.setattr(dist, "init_process_group", recording_init(events))
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(events))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: dist.HashStore())
    for name, value in {"RANK": 0, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 1}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert fp.launch(lambda r: r, 2, timeout=1, pg_timeout=given) == [0]
    assert events == [
        {"backend": "nccl" if gpus else "gloo", "timeout": datetime.timedelta(seconds=seconds)}
    ]
    assert seconds == records._PG_TIMEOUT


def group_timeout(rank: int) -> tuple[float, float | None]:
    """The process group's timeout as this rank's group has it, and as the launcher noted it."""
    from funcpipe.distributed.world import _pg_timeout

    return _pg_timeout(), records._PG_TIMEOUT


@pytest.mark.timeout(150)
def test_a_pools_pg_timeout_is_the_timeout_of_its_ranks_group(pool: Any) -> None:
    # the session pool (tests/conftest.py) asks for pg_timeout=120
    assert pool(2).run(group_timeout, timeout=60) == [(120.0, 120.0)] * 2


# ----------------------------------------------------------------------------- expiry names the option
def sleeper(rank: int, seconds: float) -> None:
    time.sleep(seconds)


@pytest.mark.timeout(90)
def test_the_deadline_expiring_names_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailed) as e:
        fp.launch(sleeper, 1, 60.0, timeout=3, pg_timeout=30)
    text = str(e.value)
    assert "did not finish within the job's deadline, timeout=3 s" in text, text
    assert "pass a longer timeout=" in text and "pg_timeout=30 s" in text, text
    assert time.monotonic() - start < 50


def wait_for_silent_peer(rank: int) -> None:
    """Rank 0 waits for a message rank 1 never sends (rank 1 sleeps past the group's timeout)."""
    t = torch.zeros(1)
    if rank == 1:
        time.sleep(20)
        return
    work = dist.irecv(t, src=1)
    try:
        work.wait()
    except RuntimeError as exc:  # as a transport reports it
        raise launcher.failure_handler()(exc, "rank 0: receive from rank 1") from exc


@pytest.mark.timeout(90)
def test_the_process_groups_timeout_expiring_names_pg_timeout() -> None:
    with (
        fp.Pool(2, timeout=60, pg_timeout=2, grace=0, paths=[ROOT]) as p,
        pytest.raises(RankFailed) as e,
    ):
        p.run(wait_for_silent_peer)
    text = str(e.value)
    assert e.value.rank == 0, text
    assert CommunicationError.__name__ in text, text
    assert "longer than the process group's timeout (2 s)" in text, text
    assert "raise pg_timeout= of funcpipe.launch or funcpipe.Pool" in text, text


@pytest.mark.timeout(120)
def test_a_group_timeout_in_the_second_step_names_pg_timeout() -> None:
    """Rank 1 sleeps past the group's timeout before its second step: rank 0 waits in a message
    (this always named pg_timeout=). The same sleep before the first step, where rank 0 waits in
    a collective outside the transport (it used to surface gloo's bare "Timed out waiting
    2000ms"), says the same: the errors catalogue's case
    ``launch-pg-timeout-shorter-than-the-first-step`` runs it (the same job, once a suite)."""
    from tests import jobs_faults

    start = time.monotonic()
    with pytest.raises(RankFailed) as e:  # (a timeout of seconds: the ranks must join in it)
        fp.launch(jobs_faults.slow_first_step, 2, 16.0, 1, timeout=60, pg_timeout=8, grace=1)
    text = str(e.value)
    assert e.value.rank == 0, text
    assert "rank 0 raised CommunicationError" in text, text
    assert "longer than the process group's timeout (8 s)" in text, text
    assert "raise pg_timeout= of funcpipe.launch or funcpipe.Pool" in text, text
    assert time.monotonic() - start < 50


def test_a_pg_timeout_too_short_to_join_is_refused_naming_it() -> None:
    """pg_timeout=0.001 used to start the processes and fail in a socket connect timeout."""
    for call in (lambda: fp.launch(abs, 2, pg_timeout=0.001), lambda: fp.Pool(2, pg_timeout=0.5)):
        with pytest.raises(InvalidArgument, match="the process group's timeout, at least 1 s") as e:
            call()
        assert "bounds joining the group" in str(e.value)


def test_joining_that_times_out_names_pg_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun, a group that cannot be joined within pg_timeout says so (it used to be
    torch's bare store or socket timeout)."""

    def init(*args: Any, **kwargs: Any) -> None:
        raise dist.DistStoreError("wait timeout after 3000ms, keys: /default_pg/0//cpu//0/1")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for name, value in {"RANK": 0, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 2}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(CommunicationError) as e:
        fp.launch(abs, 2, pg_timeout=3)
    text = str(e.value)
    assert "wait timeout after 3000ms" in text and "pg_timeout=3 s" in text, text
    assert "raise pg_timeout= of funcpipe.launch" in text, text


def store_timeout(rank: int) -> None:
    """A torch.distributed wait that runs out, in this rank's function."""
    dist.HashStore().wait(["never"], datetime.timedelta(milliseconds=10))


def test_under_torchrun_a_raw_timeout_names_pg_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch.distributed wait that ran out inside the function launch runs under torchrun is
    raised as a CommunicationError naming pg_timeout= (the original is its cause)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: dist.HashStore())
    for name, value in {"RANK": 0, "WORLD_SIZE": 2, "LOCAL_RANK": 0, "LOCAL_WORLD_SIZE": 2}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setattr(records, "_POLLS", 1)
    with pytest.raises(CommunicationError) as e:
        fp.launch(store_timeout, 2, pg_timeout=5)
    text = str(e.value)
    assert text.startswith("rank 0: ") and "Wait timeout" in text, text
    assert "longer than the process group's timeout (5 s)" in text, text
    assert isinstance(e.value.__cause__, dist.DistStoreError)


def test_only_torch_distributeds_own_failures_are_renamed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's error that merely says "timeout", or an argument torch.distributed refuses, is
    raised as it was; a store wait that ran out is told as the transport would, with its call."""
    monkeypatch.setattr(records, "_POLLS", 1)  # (no store here: nothing to wait for)

    def mine() -> None:
        raise RuntimeError("my data loader timed out")

    def refused() -> None:
        dist.HashStore().wait(["never"], "soon")  # type: ignore[arg-type]

    def ran_out() -> None:
        dist.HashStore().wait(["never"], datetime.timedelta(milliseconds=1))

    for fn in (mine, refused, ran_out):
        try:
            fn()
        except Exception as e:
            out = launcher.named(e, 3)
            if fn is ran_out:
                assert isinstance(out, CommunicationError), out
                assert str(out).startswith("rank 3: dist.HashStore().wait(") and " in " in str(out)
            else:
                assert out is e, out


def test_an_nccl_abort_names_pg_timeout() -> None:
    text = launcher._death(1, -6)
    assert "killed by SIGABRT" in text and "pg_timeout=" in text


def test_the_demo_passes_both_and_names_its_own_option(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    def fake_launch(fn: Any, n: int, *args: Any, **options: Any) -> list[Any]:
        seen.append(options)
        raise RankFailed("ranks [0] did not finish within the job's deadline, timeout=9 s", rank=0)

    monkeypatch.setattr(launcher, "launch", fake_launch)
    o = demo.parse(["--device", "cpu", "--timeout", "9", "--pg-timeout", "33"])
    with pytest.raises(RankFailed, match="funcpipe demo: that deadline is --timeout 9"):
        demo.run(o)
    assert (seen[0]["timeout"], seen[0]["pg_timeout"]) == (9.0, 33.0)
    d = demo.parse(["--device", "cpu"])
    assert (d.timeout, d.pg_timeout) == (None, None)
