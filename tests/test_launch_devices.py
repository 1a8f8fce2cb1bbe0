"""Which backend and device each rank gets, under funcpipe.launch and under torchrun.

No GPU runs these tests: CUDA and ``torch.distributed``'s start-up are replaced by recorders,
so the rules (NCCL by default with CUDA, ``cuda:<local rank>`` made current before the process
group starts, ``device_id=`` where torch takes it, no silent GPU sharing, no thread pinning on
GPU ranks) are checked as calls in order. Two tests start real gloo processes; one, skipped
without CUDA, starts a real NCCL rank.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist

import funcpipe as fp
from funcpipe.distributed import launcher, records
from funcpipe.distributed.launcher import default_backend, rank_device
from funcpipe.errors import InvalidArgument, RankFailed

HERE = str(Path(__file__).resolve().parent)
ASYNC = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")

Events = list[tuple[str, Any]]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Restore the environment (the launcher sets NCCL and gloo variables) and its globals."""
    saved = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv(launcher.SHARE_ENV, raising=False)
    monkeypatch.setattr(records, "_STORE", None)
    monkeypatch.setattr(records, "_RANK", None)
    monkeypatch.setattr(launcher, "heartbeat", lambda store, rank: None)  # (no thread in pytest)
    monkeypatch.setattr(launcher, "same_threads", lambda: None)  # (a collective: no group here)
    yield
    os.environ.clear()
    os.environ.update(saved)


def fake_cuda(monkeypatch: pytest.MonkeyPatch, gpus: int) -> Events:
    """Pretend this host has ``gpus`` CUDA devices; record set_device and set_num_threads."""
    events: Events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: events.append(("set_device", torch.device(d)))
    )
    monkeypatch.setattr(torch, "set_num_threads", lambda n: events.append(("threads", n)))
    return events


def fake_dist(
    monkeypatch: pytest.MonkeyPatch, events: Events, *, device_id: bool = True, rank: int = 0
) -> dist.HashStore:
    """Replace the process group's start-up by a recorder (with or without torch 2.3's
    ``device_id`` parameter); stores are in-memory. Returns the default group's store."""
    store = dist.HashStore()

    def record(**seen: Any) -> None:
        seen["async_error_handling"] = os.environ.get(ASYNC)  # as the new group would read it
        events.append(("init", seen))

    if device_id:

        def init(
            backend: str | None = None,
            init_method: str | None = None,
            timeout: Any = None,
            world_size: int = -1,
            rank: int = -1,
            store: Any = None,
            group_name: str = "",
            pg_options: Any = None,
            device_id: Any = None,
        ) -> None:
            record(backend=backend, rank=rank, world_size=world_size, device_id=device_id)

    else:

        def init(  # type: ignore[misc]  # torch before 2.3: no device_id
            backend: str | None = None,
            init_method: str | None = None,
            timeout: Any = None,
            world_size: int = -1,
            rank: int = -1,
            store: Any = None,
            group_name: str = "",
            pg_options: Any = None,
        ) -> None:
            record(backend=backend, rank=rank, world_size=world_size)

    monkeypatch.setattr(dist, "init_process_group", init)
    monkeypatch.setattr(dist, "TCPStore", lambda *a, **k: dist.HashStore())
    monkeypatch.setattr(dist, "is_initialized", lambda: any(e[0] == "init" for e in events))
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    return store


def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a launcher store or rank process is started."""

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("the launcher started its store and processes")

    monkeypatch.setattr(launcher, "_listen", refuse)


def calls(events: Events) -> list[str]:
    return [name for name, _ in events]


def init_args(events: Events) -> dict[str, Any]:
    (seen,) = [value for name, value in events if name == "init"]
    return seen


# ---------------------------------------------------------------------- the decision functions
def test_default_backend_is_nccl_with_cuda_and_gloo_without(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda(monkeypatch, 2)
    assert default_backend() == "nccl"
    fake_cuda(monkeypatch, 0)
    assert default_backend() == "gloo"


def test_rank_device_gives_each_nccl_rank_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, 2)
    assert rank_device(0, "nccl") == torch.device("cuda", 0)
    assert rank_device(1, "nccl") == torch.device("cuda", 1)
    assert rank_device(1, "gloo") == torch.device("cpu")  # gloo ranks compute on the CPU
    with pytest.raises(InvalidArgument) as e:
        rank_device(2, "nccl")
    text = str(e.value)
    for words in ("local rank 2", "2 CUDA devices (cuda:0, cuda:1)", "share_gpus=True"):
        assert words in text
    assert f"{launcher.SHARE_ENV}=1" in text
    assert rank_device(2, "nccl", share=True) == torch.device("cuda", 0)
    assert rank_device(3, "nccl", share=True) == torch.device("cuda", 1)


def test_rank_device_arguments_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cuda(monkeypatch, 0)
    with pytest.raises(InvalidArgument, match=r"backend='nccl' needs CUDA.*backend='gloo'"):
        rank_device(0, "nccl")
    with pytest.raises(InvalidArgument, match="backend='mpi'"):
        rank_device(0, "mpi")
    with pytest.raises(InvalidArgument, match="local_rank=-1"):
        rank_device(-1, "gloo")


# ------------------------------------------------------------------ ranks of the local launcher
@pytest.mark.parametrize("device_id", [True, False], ids=["torch>=2.3", "older torch"])
def test_a_gpu_rank_sets_its_device_before_the_group_starts(
    monkeypatch: pytest.MonkeyPatch, device_id: bool
) -> None:
    events = fake_cuda(monkeypatch, 2)
    fake_dist(monkeypatch, events, device_id=device_id)
    monkeypatch.delenv(ASYNC, raising=False)
    launcher._init_group(1, 2, "127.0.0.1", 1, "nccl", 30.0, False)
    assert calls(events) == ["set_device", "init"]  # and no set_num_threads on a GPU rank
    assert events[0][1] == torch.device("cuda", 1)
    seen = init_args(events)
    assert (seen["backend"], seen["rank"], seen["world_size"]) == ("nccl", 1, 2)
    if device_id:
        assert seen["device_id"] == torch.device("cuda", 1)
    else:
        assert "device_id" not in seen
    assert seen["async_error_handling"] == "3"  # set before the group reads it


def test_nccl_settings_already_in_the_environment_are_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = fake_cuda(monkeypatch, 1)
    fake_dist(monkeypatch, events)
    monkeypatch.setenv(ASYNC, "1")
    launcher._init_group(0, 1, "127.0.0.1", 1, "nccl", 30.0, False)
    assert init_args(events)["async_error_handling"] == "1"


def test_a_cpu_rank_pins_one_thread_and_sets_no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    events = fake_cuda(monkeypatch, 2)  # gloo chosen explicitly on a host with GPUs
    fake_dist(monkeypatch, events)
    launcher._init_group(0, 2, "127.0.0.1", 1, "gloo", 30.0, False)
    assert events[0] == ("threads", 1)
    assert calls(events) == ["threads", "init"]
    assert init_args(events).get("device_id") is None


def test_ranks_sharing_gpus_wrap_around_when_opted_in(monkeypatch: pytest.MonkeyPatch) -> None:
    events = fake_cuda(monkeypatch, 2)
    fake_dist(monkeypatch, events)
    launcher._init_group(3, 4, "127.0.0.1", 1, "nccl", 30.0, True)
    assert events[0] == ("set_device", torch.device("cuda", 1))


# ------------------------------------------------------------------------ launch() and Pool()
class RecordingPool:
    """Stands in for Pool: records how launch() asked for the processes."""

    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, size: int, **options: Any) -> None:
        RecordingPool.made.append({"size": size, **options})

    def __enter__(self) -> RecordingPool:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        return []


@pytest.fixture
def pools(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    RecordingPool.made = []
    monkeypatch.setattr(launcher, "Pool", RecordingPool)
    return RecordingPool.made


def test_launch_defaults_to_nccl_with_cuda_and_gloo_without(
    monkeypatch: pytest.MonkeyPatch, pools: list[dict[str, Any]]
) -> None:
    fake_cuda(monkeypatch, 2)
    fp.launch(abs, 2)
    fp.launch(abs, 2, backend="gloo")  # an explicit backend is respected
    fake_cuda(monkeypatch, 0)
    fp.launch(abs, 2)
    assert [p["backend"] for p in pools] == ["nccl", "gloo", "gloo"]


def test_more_ranks_than_gpus_is_refused_before_any_process_starts(
    monkeypatch: pytest.MonkeyPatch, pools: list[dict[str, Any]]
) -> None:
    fake_cuda(monkeypatch, 1)
    with pytest.raises(InvalidArgument) as e:
        fp.launch(abs, 3)
    text = str(e.value)
    for words in (
        "3 ranks on this host (local ranks 0..2)",
        "1 CUDA device (cuda:0)",
        "at most 1 rank per host",
        "backend='gloo'",
        "share_gpus=True",
        f"{launcher.SHARE_ENV}=1",
    ):
        assert words in text, (words, text)
    assert pools == []
    fp.launch(abs, 3, share_gpus=True)  # the opt-in, as an argument
    monkeypatch.setenv(launcher.SHARE_ENV, "1")
    fp.launch(abs, 3)  # or from the environment
    assert [(p["backend"], p["share_gpus"]) for p in pools] == [("nccl", True), ("nccl", True)]
    with pytest.raises(InvalidArgument, match="3 ranks on this host"):
        fp.launch(abs, 3, share_gpus=False)  # an explicit False wins over the environment


def test_pool_checks_backend_and_gpus_before_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    no_processes(monkeypatch)
    fake_cuda(monkeypatch, 0)
    with pytest.raises(InvalidArgument, match="backend='nccl' needs CUDA"):
        fp.Pool(1, backend="nccl")
    with pytest.raises(InvalidArgument, match="backend='nccl' needs CUDA"):
        fp.launch(abs, 1, backend="nccl")
    fake_cuda(monkeypatch, 2)
    with pytest.raises(InvalidArgument, match=r"4 ranks on this host .* 2 CUDA devices"):
        fp.Pool(4, backend="nccl")
    with pytest.raises(InvalidArgument, match=r"4 ranks on this host .* 2 CUDA devices"):
        fp.Pool(4, backend=None)
    with pytest.raises(InvalidArgument, match="share_gpus='yes'"):
        fp.launch(abs, 1, share_gpus="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="backend='mpi'"):
        fp.launch(abs, 1, backend="mpi")


# ------------------------------------------------------------------------------------ torchrun
def torchrun_env(
    monkeypatch: pytest.MonkeyPatch, rank: int, local: int, world: int, local_world: int
) -> None:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(local))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")


def test_under_torchrun_the_device_comes_from_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    events = fake_cuda(monkeypatch, 2)
    fake_dist(monkeypatch, events, rank=3)
    torchrun_env(monkeypatch, rank=3, local=1, world=4, local_world=2)
    assert fp.launch(lambda r, x: (r, x), 99, "x") == [(3, "x")]
    assert calls(events) == ["set_device", "init"]  # no set_num_threads under torchrun
    assert events[0][1] == torch.device("cuda", 1)
    seen = init_args(events)
    assert (seen["backend"], seen["device_id"]) == ("nccl", torch.device("cuda", 1))
    assert seen["async_error_handling"] == "3"


def test_under_torchrun_without_cuda_the_backend_is_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    events = fake_cuda(monkeypatch, 0)
    fake_dist(monkeypatch, events, rank=1)
    torchrun_env(monkeypatch, rank=1, local=1, world=2, local_world=2)
    assert fp.launch(lambda r: r, 2) == [1]
    assert calls(events) == ["init"]
    assert init_args(events)["backend"] == "gloo"
    assert init_args(events).get("device_id") is None


def test_under_torchrun_more_local_ranks_than_gpus_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = fake_cuda(monkeypatch, 2)
    fake_dist(monkeypatch, events)
    torchrun_env(monkeypatch, rank=0, local=0, world=8, local_world=4)
    with pytest.raises(InvalidArgument) as e:
        fp.launch(abs, 1)
    assert "4 ranks on this host" in str(e.value)
    assert "torchrun --nproc-per-node 2" in str(e.value)
    assert events == []  # neither a device nor a group
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(InvalidArgument, match="LOCAL_WORLD_SIZE='x'"):
        fp.launch(abs, 1)


def test_under_torchrun_a_group_started_by_the_user_is_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = fake_cuda(monkeypatch, 2)
    fake_dist(monkeypatch, events, rank=1)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    torchrun_env(monkeypatch, rank=1, local=1, world=2, local_world=2)
    assert fp.launch(lambda r: r, 2) == [1]
    assert events == []


def boom(rank: int) -> None:
    raise ValueError("boom")


def test_under_torchrun_a_failed_rank_is_named_through_the_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = fake_cuda(monkeypatch, 0)
    store = fake_dist(monkeypatch, events, rank=3)
    torchrun_env(monkeypatch, rank=3, local=1, world=4, local_world=2)
    with pytest.raises(ValueError, match="boom"):
        fp.launch(boom, 4)
    assert store.check([launcher.FAIL_KEY]), "the failure was not recorded"
    assert store.get(launcher.FAIL_KEY).decode() == "3\nValueError: boom"
    named = launcher.failure_handler()(RuntimeError("connection closed"), "receive")
    assert isinstance(named, RankFailed) and named.rank == 3


# ------------------------------------------------------------------------- naming the failure
def test_a_watchdog_abort_does_not_hide_the_rank_that_failed_first() -> None:
    abort = (0, launcher._death(0, -6))  # NCCL's watchdog tore rank 0 down (SIGABRT)
    killed = (0, launcher._death(0, -9))
    raised = (1, "ValueError: boom")
    assert launcher._first_failure(abort, raised) == raised
    assert launcher._first_failure(killed, raised) == killed  # a kill is a cause of its own
    secondary = (1, "RankFailed: receive stopped: rank 0 failed with ...")
    assert launcher._first_failure(abort, secondary) == abort
    assert launcher._first_failure((2, "RuntimeError: x"), raised) == raised
    assert launcher._first_failure(raised, None) == raised


def record_then_hang(rank: int) -> None:
    """A failure that reaches the store but never the launcher's pipe (as when NCCL's watchdog,
    not the job, sees it), then a rank that stays blocked."""
    launcher.record_failure(RuntimeError("NCCL watchdog: collective timed out"))
    time.sleep(60)


@pytest.mark.timeout(90)
def test_a_timeout_names_the_rank_recorded_in_the_store() -> None:
    with fp.Pool(1, timeout=60, paths=[HERE]) as pool, pytest.raises(RankFailed) as e:
        pool.run(record_then_hang, timeout=4)
    assert e.value.rank == 0
    assert "NCCL watchdog: collective timed out" in str(e.value)


# ----------------------------------------------------------------------------- real processes
def probe(rank: int) -> tuple[str, str, int]:
    import torch.distributed as dist

    device = "cpu" if dist.get_backend() == "gloo" else f"cuda:{torch.cuda.current_device()}"
    return dist.get_backend(), device, torch.get_num_threads()


@pytest.mark.skipif(torch.cuda.is_available(), reason="launch's default is NCCL with CUDA")
@pytest.mark.timeout(90)
def test_launch_on_a_host_without_cuda_starts_gloo_ranks_on_one_thread() -> None:
    assert fp.launch(probe, 2, timeout=60) == [("gloo", "cpu", 1)] * 2


def nccl_probe(rank: int) -> tuple[str, int, str, float, str | None]:
    import torch.distributed as dist

    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    return (
        dist.get_backend(),
        torch.cuda.current_device(),
        t.device.type,
        float(t.sum()),
        os.environ.get(ASYNC),
    )


@CUDA
@pytest.mark.timeout(120)
def test_one_nccl_rank_on_its_gpu() -> None:
    backend, current, kind, total, handling = fp.launch(nccl_probe, 1, backend="nccl")[0]
    assert (backend, current, kind, total) == ("nccl", 0, "cuda", 4.0)
    assert handling == os.environ.get(ASYNC, "3")
