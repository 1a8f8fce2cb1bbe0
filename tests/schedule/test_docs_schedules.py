"""docs/schedules.md: its python blocks run, in order, in a temporary directory."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from funcpipe.cli.app import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "schedules.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_python_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    blocks = _python_blocks(DOC.read_text())
    assert len(blocks) >= 8
    namespace: dict[str, object] = {"__name__": "__doc_test__"}
    for k, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/schedules.md[block {k}]", "exec"), namespace)
        except Exception as e:  # the message says which block failed
            raise AssertionError(
                f"docs/schedules.md, python block {k} failed: {e!r}\n{block}"
            ) from e
    assert (tmp_path / "my-1f1b.png").stat().st_size > 0
    assert (tmp_path / "zbv.png").stat().st_size > 0


def test_cli_example_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schedule", "1f1b", "--ranks", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    text = DOC.read_text()
    for line in (
        "makespan          33",
        "bubble            27.3%",
        "peak activations  4 3 2 1  (per rank)",
    ):
        assert line in out and line in text
