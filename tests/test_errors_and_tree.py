from __future__ import annotations

import pytest
import torch

from funcpipe import FuncpipeError, InvalidArgument, ScheduleError, ShapeInferenceError
from funcpipe.errors import ShapeInferenceWarning
from funcpipe.tree import (
    check_tensor_tree,
    leaf_paths,
    tree_add,
    tree_flatten,
    tree_leaves,
    tree_map,
    tree_structure,
    tree_to,
    tree_unflatten,
    tree_zeros_like,
)


def test_error_hierarchy() -> None:
    assert issubclass(InvalidArgument, FuncpipeError)
    assert issubclass(InvalidArgument, ValueError)
    assert issubclass(ScheduleError, FuncpipeError)
    assert issubclass(ShapeInferenceError, FuncpipeError)
    assert issubclass(ShapeInferenceWarning, UserWarning)


def test_schedule_error_attributes() -> None:
    e = ScheduleError(
        "rank 1 waits forever", rank=1, step=3, instruction="F s0 m1", rule="deadlock"
    )
    assert str(e) == "rank 1 waits forever"
    assert (e.rank, e.step, e.instruction, e.rule) == (1, 3, "F s0 m1", "deadlock")
    plain = ScheduleError("bad")
    assert (plain.rank, plain.step, plain.instruction, plain.rule) == (None, None, None, None)


def test_none_is_not_a_leaf() -> None:
    tree = {"a": (torch.zeros(1), None), "b": [torch.ones(2)]}
    leaves, spec = tree_flatten(tree)
    assert len(leaves) == 2
    assert tree_leaves(tree) == leaves
    assert tree_structure(tree) == spec
    rebuilt = tree_unflatten(spec, leaves)
    assert rebuilt["a"][1] is None
    assert tree_map(lambda t: t + 1, tree)["a"][1] is None


def test_leaf_paths_use_python_syntax() -> None:
    tree = {"x": (torch.zeros(1), [torch.zeros(1)])}
    assert leaf_paths(tree, name="batch") == ["batch['x'][0]", "batch['x'][1][0]"]
    assert leaf_paths(torch.zeros(1), name="batch") == ["batch"]


def test_check_tensor_tree_names_argument_and_path() -> None:
    check_tensor_tree({"a": torch.zeros(1), "b": None}, name="batch")
    with pytest.raises(InvalidArgument, match=r"batch\['b'\]\[1\]=3\.0 \(a float\)"):
        check_tensor_tree({"a": torch.zeros(1), "b": (torch.zeros(1), 3.0)}, name="batch")


def test_tree_to_zeros_like_add() -> None:
    tree = {"a": torch.ones(2, dtype=torch.float64), "b": (torch.arange(3),)}
    moved = tree_to(tree, "meta")
    assert moved["a"].device.type == "meta" and moved["b"][0].dtype == torch.int64
    zeros = tree_zeros_like(tree)
    assert torch.equal(zeros["a"], torch.zeros(2, dtype=torch.float64))
    total = tree_add(tree, tree)
    assert torch.equal(total["b"][0], torch.arange(3) * 2)
    with pytest.raises(InvalidArgument, match="same structure"):
        tree_add(tree, {"a": torch.ones(2)})
