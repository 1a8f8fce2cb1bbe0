"""Installing the models extra keeps the venv's torch: the torchvision pin that belongs to it
(tools/torch_pins.py, used by ``make setup``), the table docs/models.md prints, and this venv."""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys

import pytest
import torch

from tests.test_docs import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from torch_pins import torchvision_for


@pytest.mark.parametrize(
    ("torch_version", "vision"),
    [("2.13.0", "0.28.0"), ("2.13.0+cpu", "0.28.0"), ("2.9.1", "0.24.1"), ("2.14.0", "0.29.0"),
     ("2.1.2+cu121", "0.16.2")],
)  # fmt: skip
def test_the_matching_torchvision(torch_version: str, vision: str) -> None:
    assert torchvision_for(torch_version) == vision


def test_an_unknown_torch_says_so() -> None:
    with pytest.raises(ValueError, match="install torchvision by hand"):
        torchvision_for("1.13.1")


def test_the_docs_table_is_the_rule() -> None:
    text = (ROOT / "docs/models.md").read_text()
    rows = re.findall(r"^\| (2\.\d+\.\d+) \| (0\.\d+\.\d+) \|$", text, flags=re.M)
    assert len(rows) >= 5
    assert all(torchvision_for(t) == v for t, v in rows), rows
    assert f"torch=={torch.__version__.split('+')[0]} torchvision=={rows[1][1]}" in text


def test_setup_pins_torch_and_checks_it() -> None:
    recipe = (ROOT / "Makefile").read_text()
    assert 'pip install -e \'.[test,models]\' "$$TORCH" "$$VISION"' in recipe
    assert 'torch_pins.py check "$$TORCH"' in recipe


def test_this_venv_holds_the_matching_pair() -> None:
    """What make setup installed: torchvision built for this very torch."""
    try:
        requires = md.requires("torchvision") or []
    except md.PackageNotFoundError:
        pytest.skip("torchvision is not installed (the [models] extra)")
    pins = [r for r in requires if re.match(r"torch\b", r) and "==" in r]
    assert md.version("torchvision") == torchvision_for(torch.__version__)
    if pins:  # e.g. "torch==2.13.0": the torch it was built for
        assert pins[0].split("==")[1].strip(" )") == torch.__version__.split("+")[0]


def test_check_refuses_another_torch() -> None:
    tool = str(ROOT / "tools" / "torch_pins.py")
    ok = subprocess.run([sys.executable, tool, "check", f"torch=={torch.__version__}"])
    bad = subprocess.run(
        [sys.executable, tool, "check", "torch==0.0.1"], capture_output=True, text=True
    )
    assert ok.returncode == 0
    assert bad.returncode == 1 and "replaced it" in bad.stderr
