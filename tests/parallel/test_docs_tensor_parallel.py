"""docs/tensor-parallel.md: every python block runs, and prints exactly the text block after it.

Blocks with ``if __name__ == "__main__":`` start processes: they run as scripts (``python
script.py``, concurrently); the others run in order in one namespace. The derived-collectives
tables in the doc are such printed outputs, so they always match the code.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "tensor-parallel.md"


def _blocks() -> list[tuple[str, str]]:
    return re.findall(r"^```(\w+)\n(.*?)^```", DOC.read_text(), flags=re.MULTILINE | re.DOTALL)


def _expected(blocks: list[tuple[str, str]], k: int) -> str | None:
    if k + 1 < len(blocks) and blocks[k + 1][0] == "text":
        return blocks[k + 1][1]
    return None


@pytest.mark.timeout(170)
def test_doc_blocks_run_and_print_what_the_doc_shows(tmp_path: Path) -> None:
    blocks = _blocks()
    scripts = []
    for k, (lang, code) in enumerate(blocks):  # start the slow ones first, all at once
        if lang == "python" and 'if __name__ == "__main__":' in code:
            path = tmp_path / f"block_{k}.py"
            path.write_text(code)
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            proc = subprocess.Popen(
                [sys.executable, str(path)],
                cwd=tmp_path,
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            scripts.append((k, proc))
    namespace: dict[str, object] = {"__name__": "__doc_test__"}
    for k, (lang, code) in enumerate(blocks):
        if lang != "python" or 'if __name__ == "__main__":' in code:
            continue
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, f"{DOC.name}[block {k}]", "exec"), namespace)
        except Exception as e:  # the message says which block failed
            for _, proc in scripts:
                proc.kill()
            raise AssertionError(f"{DOC.name}, python block {k} failed: {e!r}\n{code}") from e
        expected = _expected(blocks, k)
        if expected is not None and out.getvalue() != expected:
            for _, proc in scripts:
                proc.kill()
            raise AssertionError(
                f"block {k} printed:\n{out.getvalue()}\nthe doc shows:\n{expected}"
            )
    assert len(scripts) >= 2
    for k, proc in scripts:
        stdout, stderr = proc.communicate(timeout=160)
        assert proc.returncode == 0, f"script block {k} failed:\n{stderr}"
        expected = _expected(blocks, k)
        assert expected is not None and stdout == expected, f"script block {k} printed:\n{stdout}"


def test_doc_has_the_plan_tables() -> None:
    text = DOC.read_text()
    assert text.count("| operand | pattern") >= 6
