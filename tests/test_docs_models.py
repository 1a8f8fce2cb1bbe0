"""docs/models.md's code blocks run, in order, as one script (needs the [models] extra)."""

from __future__ import annotations

import sys
import types

import pytest

from tests import models_zoo
from tests.test_docs import ROOT, _python_blocks

# tracing a model with torch.export takes seconds each; minutes on a loaded 2-core machine
pytestmark = pytest.mark.timeout(600)


def test_models_doc_runs() -> None:
    models_zoo.load("transformers")
    models_zoo.load("timm")
    blocks = _python_blocks((ROOT / "docs/models.md").read_text())
    assert len(blocks) == 5
    for block in blocks:  # "bring your model" in at most 15 lines each
        assert len([line for line in block.splitlines() if line.strip()]) <= 15
    module = types.ModuleType("__doc_models__")
    sys.modules[module.__name__] = module
    for i, block in enumerate(blocks):
        try:
            exec(compile(block, f"docs/models.md[block {i}]", "exec"), module.__dict__)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"docs/models.md, python block {i} failed: {e!r}\n{block}") from e
    assert module.__dict__["loss"].isfinite()
