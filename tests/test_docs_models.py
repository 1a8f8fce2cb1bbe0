"""docs/models.md's code blocks run, in order, as one script (needs the [models] extra); the
training recipe (examples/transformers_recipe.py, which starts processes) is run by
tests/test_export.py under torchrun instead."""

from __future__ import annotations

import sys
import types

import pytest

from tests import models_zoo
from tests.test_docs import ROOT, _python_blocks

# tracing a model with torch.export takes seconds each; minutes on a loaded 2-core machine
pytestmark = pytest.mark.timeout(600)

RECIPE = (ROOT / "examples" / "transformers_recipe.py").read_text()


def test_models_doc_runs() -> None:
    models_zoo.load("transformers")
    models_zoo.load("timm")
    every = _python_blocks((ROOT / "docs/models.md").read_text())
    assert every[0] == RECIPE  # the doc opens with the recipe, as the file holds it
    blocks = every[1:]
    assert len(blocks) == 6
    for block in blocks:  # "bring your model" in at most 15 lines each
        assert len([line for line in block.splitlines() if line.strip()]) <= 15
    module = types.ModuleType("__doc_models__")
    sys.modules[module.__name__] = module
    for i, block in enumerate(blocks, start=1):
        try:
            exec(compile(block, f"docs/models.md[block {i}]", "exec"), module.__dict__)
        except Exception as e:  # pragma: no cover - the message is the point
            raise AssertionError(f"docs/models.md, python block {i} failed: {e!r}\n{block}") from e
    assert module.__dict__["loss"].isfinite()
