"""The python code blocks of the docs run, in order, as one script per document."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["docs/concepts.md", "README.md", "docs/pipeline.md", "docs/precision.md", "docs/moe.md"]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("doc", DOCS)
def test_doc_code_blocks_run(doc: str) -> None:
    blocks = _python_blocks((ROOT / doc).read_text())
    if doc == "docs/concepts.md":
        assert len(blocks) >= 5
    # a real module, as a script's __main__ is: torch.compile looks up a function's module
    module = types.ModuleType("__doc_test__")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"{doc}[block {i}]", "exec"), namespace)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"{doc}, python block {i} failed: {e!r}\n{block}") from e
