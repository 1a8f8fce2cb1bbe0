"""docs/training.md: its python blocks run, in order, as one script, in a temporary directory."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def test_python_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the doc writes a checkpoint
    blocks = _python_blocks(DOC.read_text())
    assert len(blocks) >= 7
    namespace: dict[str, object] = {"__name__": "__doc_test__"}
    for k, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/training.md[block {k}]", "exec"), namespace)
        except Exception as e:  # the message says which block failed
            raise AssertionError(
                f"docs/training.md, python block {k} failed: {e!r}\n{block}"
            ) from e
