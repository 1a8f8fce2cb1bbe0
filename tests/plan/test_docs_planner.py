"""docs/planner.md's python blocks run, in order, as one script."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_planner_doc_code_blocks_run() -> None:
    text = (ROOT / "docs" / "planner.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)
    assert blocks
    namespace: dict[str, object] = {"__name__": "__planner_doc__"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"docs/planner.md[block {i}]", "exec"), namespace)
