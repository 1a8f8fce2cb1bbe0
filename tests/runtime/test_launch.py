"""The example script on local processes and under torchrun; launcher arguments."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_launcher_arguments_are_checked() -> None:
    with pytest.raises(fp.InvalidArgument, match="size="):
        fp.Pool(0)
    with pytest.raises(fp.InvalidArgument, match="backend="):
        fp.Pool(2, backend="mpi")
    with pytest.raises(fp.InvalidArgument, match="timeout="):
        fp.Pool(2, timeout=0)
