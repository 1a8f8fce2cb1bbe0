"""Module paths from before the regrouping (2026-11-28) still import, as the very same modules.

docs/design.md "The tree" lists where each went. Old code (``from funcpipe.optim import adamw``,
``from funcpipe.plan import Layout``, ``import funcpipe.launcher``) keeps running unchanged, and
``funcpipe.plan`` stays the planner's function, ``funcpipe.partition`` the partition function.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

import funcpipe

ROOT = Path(__file__).resolve().parents[1]
MOVED = dict(funcpipe._MOVED)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_module_at_its_new_place(old: str) -> None:
    new = importlib.import_module(MOVED[old])
    assert importlib.import_module(old) is new
    assert new.__name__ == MOVED[old] and new.__spec__.name == MOVED[old]


def test_the_public_names_keep_their_meaning_whatever_is_imported_first() -> None:
    """In a fresh interpreter: old paths imported in every style leave the package's functions
    alone, and the planner is a plain function beside a plain package."""
    script = """
import types
import funcpipe
import funcpipe.partition, funcpipe.launcher, funcpipe.checkpoint, funcpipe.demo
from funcpipe.plan import Layout, estimate
from funcpipe.plan.published import MEGATRON_2021
from funcpipe.optim import adamw
from funcpipe.cut import split_module
from funcpipe.pipeline import Pipeline, StepResult
from funcpipe.cli import main
assert isinstance(funcpipe.plan, types.FunctionType), funcpipe.plan
assert type(funcpipe.planner) is types.ModuleType, type(funcpipe.planner)
assert Layout is funcpipe.planner.ClusterLayout and estimate is funcpipe.planner.estimate
assert isinstance(funcpipe.partition, types.FunctionType), funcpipe.partition
assert split_module is funcpipe.split_module and Pipeline is funcpipe.Pipeline
assert funcpipe.optim is funcpipe.train.optim and adamw is funcpipe.train.optim.adamw
assert funcpipe.launcher is funcpipe.distributed.launcher
assert MEGATRON_2021 is funcpipe.planner.published.MEGATRON_2021
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_funcpipe_plan_is_a_function_and_the_planner_a_plain_module() -> None:
    assert isinstance(funcpipe.plan, types.FunctionType)
    assert type(funcpipe.planner) is types.ModuleType
    assert sys.modules["funcpipe.plan"] is funcpipe.planner
