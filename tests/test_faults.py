"""Injected faults: a rank raises (forward, backward, REDUCE), a rank is SIGKILLed mid-step, a NaN
appears, the process is killed while saving a checkpoint. Each test has a timeout; the pool jobs
are in tests/jobs_faults.py.

Every failing step runs on a pool of its own with a short ``timeout`` (the configured timeout
the failure must be reported within), so the session pool stays healthy for other tests.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from funcpipe.distributed.launcher import Pool
from funcpipe.errors import RankFailed
from funcpipe.train import checkpoint, optim
from tests import jobs_faults
from tests.jobs_runtime import toy

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 40.0  # the pools' configured timeout: failures must be reported well within it


def _children(pid: int) -> dict[int, str]:
    """Live child processes of ``pid`` (from /proc): pid -> command line."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out[int(entry)] = cmd
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextmanager
def _own_pool(size: int) -> Iterator[Pool]:
    """A pool for one failing job; afterwards no process it started is left."""
    before = set(_children(os.getpid()))
    pool = Pool(size, timeout=TIMEOUT, pg_timeout=TIMEOUT, grace=5.0, paths=[str(ROOT)])
    pids = [p.pid for p in pool.procs]
    try:
        yield pool
    finally:
        pool.close(kill=True)
    assert not [p for p in pids if _alive(p)], "a rank process outlived the pool"
    left = {
        pid: cmd
        for pid, cmd in _children(os.getpid()).items()
        if pid not in before and "resource_tracker" not in cmd
    }
    assert not left, f"processes left behind: {left}"


def _reports(directory: Path, size: int) -> dict[int, dict[str, Any]]:
    return {
        r: json.loads((directory / f"rank{r}.json").read_text())
        for r in range(size)
        if (directory / f"rank{r}.json").exists()
    }


# ------------------------------------------------------------------------------ a rank raises
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["forward", "backward", "tie-reduce", "data-reduce"])
def test_a_rank_that_raises_is_named_by_every_other_rank(tmp_path: Path, where: str) -> None:
    start = time.monotonic()
    with _own_pool(2) as pool, pytest.raises(RankFailed) as info:
        pool.run(jobs_faults.raise_in, 1, where, str(tmp_path))
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    assert f"injected failure in the {where} of rank 1" in str(info.value)
    assert "Traceback" in str(info.value)  # the failed rank's traceback reaches the launcher
    seen = _reports(tmp_path, 2)
    assert seen[1]["type"] == "ValueError"
    assert seen[0]["type"] == "RankFailed" and seen[0]["rank"] == 1, seen[0]
    assert "rank 1 failed with ValueError: injected failure" in seen[0]["message"]
    assert elapsed < TIMEOUT, elapsed


@pytest.mark.timeout(120)
def test_a_rank_that_raises_in_an_overlapped_pair_is_named_in_bounded_time(tmp_path: Path) -> None:
    """A process raising in a paired forward while its expert peer's halves take turns at their
    all-to-alls: every other process names it, well within the configured timeout (no half left
    waiting for its turn)."""
    start = time.monotonic()
    with _own_pool(4) as pool, pytest.raises(RankFailed) as info:
        pool.run(jobs_faults.raise_in_a_pair, 1, str(tmp_path))
    elapsed = time.monotonic() - start
    assert info.value.rank == 1, str(info.value)
    assert "injected failure in a paired forward of rank 1" in str(info.value)
    seen = _reports(tmp_path, 4)
    assert seen[1]["type"] == "ValueError"
    for r in (0, 2, 3):
        assert seen[r]["type"] == "RankFailed" and seen[r]["rank"] == 1, (r, seen[r])
    assert elapsed < TIMEOUT, elapsed


# ------------------------------------------------------------------ ranks build different programs
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["schedule", "option"])
def test_ranks_that_build_different_programs_fail_at_construction(
    tmp_path: Path, what: str
) -> None:
    start = time.monotonic()
    with _own_pool(2) as pool, pytest.raises(RankFailed):
        pool.run(jobs_faults.different_programs, what, str(tmp_path))
    elapsed = time.monotonic() - start
    seen = _reports(tmp_path, 2)
    assert seen.keys() == {0, 1}, seen
    for r in (0, 1):  # every rank names the difference, none waits for the other
        assert seen[r]["type"] == "InvalidArgument", seen[r]
        message = seen[r]["message"]
        assert "the processes built different pipelines" in message
        assert f"process {r} and process(es) [{1 - r}] differ" in message
        assert ("recompute" if what == "option" else "1f1b") in message
    assert elapsed < TIMEOUT, elapsed


# ------------------------------------------------------------------------------ a rank is killed
@pytest.mark.timeout(120)
def test_a_rank_killed_mid_step_is_named_and_nothing_is_left_behind(tmp_path: Path) -> None:
    start = time.monotonic()
    with _own_pool(2) as pool, pytest.raises(RankFailed) as info:
        pool.run(jobs_faults.die_mid_step, 1, str(tmp_path))
    elapsed = time.monotonic() - start
    assert info.value.rank == 1
    assert "rank 1 died: its process was killed by SIGKILL (exit code -9)" in str(info.value)
    seen = _reports(tmp_path, 2)
    assert 1 not in seen  # it had no chance to say anything
    assert seen[0]["type"] == "RankFailed" and seen[0]["rank"] == 1, seen[0]
    assert "killed by SIGKILL" in seen[0]["message"]
    assert elapsed < TIMEOUT, elapsed


# ------------------------------------------------------------------ a rank returns early
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("when", "where"),
    [
        ("before-pipeline", "running"),
        ("without-stepping", "in step 1"),
        ("after-one-step", "in step 2"),
    ],
)
def test_a_rank_that_returns_early_is_named_promptly(tmp_path: Path, when: str, where: str) -> None:
    """Under launch a rank whose function returned leaves after ``grace`` seconds, so a peer
    still waiting on it fails at once, naming it (it used to wait for the deadline, or to blame
    a dead process)."""
    import funcpipe as fp

    before = set(_children(os.getpid()))
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        fp.launch(jobs_faults.return_early, 2, when, str(tmp_path), timeout=100, pg_timeout=100)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert info.value.rank == 1, text
    assert f"rank 1 returned while ranks [0] were still {where}" in text, text
    assert "the same number of steps" in text, text
    if when == "after-one-step":  # a wait of the transport: rank 0's own error names it too
        seen = _reports(tmp_path, 2)
        assert seen[0]["type"] == "RankFailed" and seen[0]["rank"] == 1, seen[0]
    assert elapsed < TIMEOUT, elapsed  # the deadline and the group's timeout are 100 s
    left = {p: c for p, c in _children(os.getpid()).items() if p not in before}
    assert not {p: c for p, c in left.items() if "resource_tracker" not in c}, left


@pytest.mark.timeout(150)
def test_in_a_pool_a_rank_that_returned_is_named_when_the_wait_gives_up(tmp_path: Path) -> None:
    """A Pool keeps a returned rank's process for the next job: its peer is not stopped at
    once, but when its wait runs out (pg_timeout) its error says why it waited."""
    start = time.monotonic()
    with (
        Pool(2, timeout=100, pg_timeout=3, grace=5.0, paths=[str(ROOT)]) as pool,
        pytest.raises(RankFailed) as info,
    ):
        pool.run(jobs_faults.return_early, "without-stepping", str(tmp_path))
    text = str(info.value)
    assert info.value.rank == 1, text
    assert "rank 1 returned while ranks [0] were still in step 1" in text, text
    assert time.monotonic() - start < TIMEOUT


# ------------------------------------------------------------------------------ NaN and inf
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("where", "bad", "stage", "microbatch", "what", "via_env"),
    [("loss", 1, 1, 2, "loss", True), ("grad", 0, 0, 1, "parameter gradient", False)],
    ids=["inf-loss-FUNCPIPE_DEBUG", "nan-gradient-check_finite"],
)
def test_a_non_finite_value_is_reported_by_stage_and_microbatch(
    tmp_path: Path, where: str, bad: int, stage: int, microbatch: int, what: str, via_env: bool
) -> None:
    with _own_pool(2) as pool, pytest.raises(RankFailed) as info:
        pool.run(jobs_faults.non_finite, where, str(tmp_path), via_env)
    assert info.value.rank == bad
    assert "NonFiniteError" in str(info.value)
    seen = _reports(tmp_path, 2)
    assert seen[bad]["type"] == "NonFiniteError"
    assert f"of stage {stage} ('faulty'), microbatch {microbatch}" in seen[bad]["message"]
    assert what in seen[bad]["message"]
    other = 1 - bad
    assert seen[other]["type"] == "RankFailed" and seen[other]["rank"] == bad, seen[other]
    assert "NonFiniteError" in seen[other]["message"]


# ------------------------------------------------------------------------------ killed while saving
def _train(out: Path, *args: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env.pop("FUNCPIPE_TEST_CHECKPOINT_PAUSE", None)
    return subprocess.Popen(
        [sys.executable, "-m", "tests.jobs_faults", "train", str(out), "--steps", "8", *args],
        cwd=ROOT,
        env=env,
    )


def _kill_when(
    proc: subprocess.Popen[bytes], pattern: str, deadline: float, *, step: int | None = None
) -> None:
    """SIGKILL ``proc`` once a file matches ``pattern`` (with ``step``: a funcpipe.json that
    records that step, so an earlier save passing through the same names does not count)."""

    def reached() -> bool:
        for found in glob.glob(pattern):
            if step is None:
                return True
            try:
                if json.loads(Path(found).read_text())["step"] == step:
                    return True
            except (OSError, ValueError, KeyError):
                continue  # being written, or already renamed away
        return False

    try:
        while not reached():
            assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before pausing"
            assert time.monotonic() < deadline, "the trainer never reached the pause"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _steps_of(path: str | None) -> int:
    assert path is not None
    return int(json.loads(Path(path, "funcpipe.json").read_text())["step"])


@pytest.mark.timeout(180)
def test_killed_while_saving_then_resumed_gives_the_uninterrupted_losses(tmp_path: Path) -> None:
    """SIGKILL (a) after the new checkpoint is written, before it replaces the old one, and (b)
    after the old one is moved aside, before the new one is renamed in. Both times the previous
    checkpoint (step 2) still loads, and the resumed run's losses equal the uninterrupted ones."""
    straight = dict(jobs_faults.train(None, steps=8))  # the same code, in this process
    out = tmp_path / "run"
    out.mkdir()
    deadline = time.monotonic() + 150

    # (a) a fresh run saves at step 2, then is killed inside the save of step 4
    _kill_when(
        _train(out, "--pause-at", "4", "--pause", "written"),
        str(out / "ck.tmp-*" / "funcpipe.json"),
        deadline,
        step=4,  # step 2's save passes through a ck.tmp-* too, for an instant
    )
    found = checkpoint.latest(out)
    assert found == str(out / "ck") and _steps_of(found) == 2
    assert glob.glob(str(out / "ck.tmp-*"))  # the half-committed save is there, and ignored
    _check_loads(found)

    # (b) resumed from step 2, killed inside the save of step 4 again, one rename further on
    _kill_when(_train(out, "--pause-at", "4", "--pause", "aside"), str(out / "ck.old-*"), deadline)
    assert not (out / "ck").exists()
    found = checkpoint.latest(out)
    assert found is not None and ".old-" in found and _steps_of(found) == 2
    _check_loads(found)

    # resumed once more from step 2, it runs to the end
    final = _train(out)
    assert final.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    assert _steps_of(checkpoint.latest(out)) == 8
    assert sorted(os.listdir(out)) == ["ck", "losses.jsonl"]  # the next save cleaned up

    rows = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    runs = sorted({r["pid"] for r in rows}, key=[r["pid"] for r in rows].index)
    assert len(runs) == 3
    last = [(r["step"], r["loss"]) for r in rows if r["pid"] == runs[-1]]
    assert [s for s, _ in last] == list(range(2, 8))  # it resumed at the checkpoint's step
    for r in rows:
        assert r["loss"] == straight[r["step"]], r  # exactly the uninterrupted loss


def _check_loads(path: str) -> None:
    params = tuple(toy(3)[1])
    like = {"params": params, "opt": optim.adamw(1e-3).init(params), "step": 0}
    loaded = checkpoint.load(path, like)
    assert loaded["step"] == 2 and loaded["opt"].step == 2
    assert all(torch.isfinite(t).all() for p in loaded["params"] for t in p.values())
