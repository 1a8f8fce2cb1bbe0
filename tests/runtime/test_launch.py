"""The example script on local processes and under torchrun; launcher arguments."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import funcpipe as fp

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "pipeline_training.py"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    # the example trains on CPU tensors: hide any GPU, so that launch's default backend is gloo
    # (with CUDA it would be NCCL, one GPU per rank)
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


@pytest.mark.timeout(120)
def test_example_runs_with_funcpipe_launch() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "12"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    first = float(out.stdout.split("step   0  loss ")[1].split()[0])
    final = float(out.stdout.split("final loss ")[1].split()[0])
    assert final < first


@pytest.mark.timeout(150)
def test_example_runs_unchanged_under_torchrun() -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    out = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(SCRIPT),
            "--steps",
            "12",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    assert "final loss" in out.stdout


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("when", "step"), [("after-one-step", 2), ("without-stepping", 1)])
def test_under_torchrun_a_rank_that_returned_is_named(when: str, step: int) -> None:
    """Rank 1 returns early (after one step, or without stepping) under torchrun: it records
    its return in torchrun's store and its process exits, so rank 0's wait (a message, or a
    collective outside the transport) breaks and names it (it used to blame a dead process, or
    to surface gloo's bare "Connection closed by peer")."""
    torchrun = Path(sys.executable).with_name("torchrun")
    start = time.monotonic()
    command = ["--standalone", "--nproc-per-node", "2", "-m", "tests.jobs_faults"]
    command += ["return-early", when, "--pg-timeout", "100"]
    out = subprocess.run(
        [str(torchrun), *command],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=140,
    )
    err = out.stderr[-3000:]
    assert out.returncode != 0, err
    assert "RankFailed: rank 0: " in err, err
    assert f"rank 1 returned while ranks [0] were still in step {step}" in err, err
    assert time.monotonic() - start < 60  # the group's timeout is 100 s


def test_launcher_arguments_are_checked() -> None:
    with pytest.raises(fp.InvalidArgument, match="size="):
        fp.Pool(0)
    with pytest.raises(fp.InvalidArgument, match="backend="):
        fp.Pool(2, backend="mpi")
    with pytest.raises(fp.InvalidArgument, match="timeout="):
        fp.Pool(2, timeout=0)
