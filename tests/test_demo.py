"""`funcpipe demo` end to end at a tiny size, and an interrupted run resumed exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--d-model",
    "16",
    "--layers",
    "2",
    "--heads",
    "2",
    "--context",
    "16",
    "--batch",
    "4",
    "--microbatches",
    "2",
    "--eval-every",
    "2",
    "--eval-batches",
    "1",
    "--corpus-bytes",
    "200000",
]


def _demo(*args: str, timeout: float = 170) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "funcpipe", "demo", *TINY, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(180)
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    out = _demo("--pipeline", "2", "--tensor", "2", "--steps", "4", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_val_loss"] < summary["first_val_loss"]
    for key in ("trace", "loss_curve", "timeline"):
        assert Path(summary["files"][key]).stat().st_size > 0
    assert (tmp_path / "checkpoint").is_dir()
    assert "bubble" in out.stdout and "tokens/s" in out.stdout


@pytest.mark.timeout(300)
def test_interrupted_demo_resumes_with_the_same_losses(tmp_path: Path) -> None:
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    common = [
        "--pipeline",
        "2",
        "--tensor",
        "1",
        "--data",
        "2",
        "--steps",
        "6",
        "--eval-every",
        "0",
    ]
    a = _demo(*common, "--out", str(straight))
    assert a.returncode == 0, a.stderr[-3000:]
    b = _demo(*common, "--out", str(interrupted), "--stop-after", "3")
    assert b.returncode == 0, b.stderr[-3000:]
    assert not (interrupted / "summary.json").exists()
    c = _demo(*common, "--out", str(interrupted), "--resume")
    assert c.returncode == 0, c.stderr[-3000:]
    first = json.loads((straight / "history.json").read_text())["train"]
    second = json.loads((interrupted / "history.json").read_text())["train"]
    assert second == first  # exactly the same losses, step by step


def test_demo_rejects_bad_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    from funcpipe.cli import main

    assert main(["demo", "--tensor", "3"]) == 2
    assert "divisible" in capsys.readouterr().err
    assert main(["demo", "--stop-after", "99", "--steps", "5"]) == 2
