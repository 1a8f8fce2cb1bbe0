from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from funcpipe.cli.app import _build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_demo_prints_comparison_and_falling_loss(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tour", "--microbatches", "3", "--stages", "3", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "3 microbatches" in out
    assert "stage 2" in out and "(fake)" in out
    match = re.search(r"loss (\S+) vs (\S+)\s+max \|grad diff\| (\S+)", out)
    assert match is not None
    assert match[1] == match[2] and float(match[3]) < 1e-10
    losses = [float(v) for v in re.findall(r"step\s+\d+\s+loss (\S+)", out)]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    assert "unchanged (values, identity, no .grad): True" in out


def test_demo_reports_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tour", "--stages", "99", "--steps", "1"]) == 2
    assert "stages=99" in capsys.readouterr().err


def test_parser_requires_a_command() -> None:
    with pytest.raises(SystemExit):
        _build_parser().parse_args([])


def test_quickstart_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "max grad diff" in out and "step 9" in out
