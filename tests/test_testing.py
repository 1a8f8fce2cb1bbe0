from __future__ import annotations

import pytest
import torch

from funcpipe.testing import assert_trees_close


def test_close_trees_pass() -> None:
    a = {"w": torch.ones(3, dtype=torch.float64), "i": torch.arange(4), "n": None}
    b = {"w": torch.ones(3, dtype=torch.float64) + 1e-12, "i": torch.arange(4), "n": None}
    assert_trees_close(a, b)


def test_structure_mismatch_shows_both() -> None:
    with pytest.raises(AssertionError, match=r"structure(.|\n)*actual(.|\n)*expected"):
        assert_trees_close({"a": torch.zeros(1)}, [torch.zeros(1)])


def test_value_mismatch_names_path_diff_and_tolerances() -> None:
    a = {"w": (torch.zeros(3, dtype=torch.float32), torch.zeros(2, dtype=torch.float32))}
    b = {"w": (torch.zeros(3, dtype=torch.float32), torch.tensor([0.0, 0.5]))}
    with pytest.raises(AssertionError, match=r"tree\['w'\]\[1\].*max abs diff 0\.5.*rtol=1e-05"):
        assert_trees_close(a, b, msg="grads")


def test_default_tolerances_per_dtype() -> None:
    x = torch.ones(4, dtype=torch.float64)
    with pytest.raises(AssertionError):
        assert_trees_close(x, x + 1e-8)
    assert_trees_close(x.float(), (x + 1e-8).float())
    assert_trees_close(x.half(), (x + 1e-4).half())
    assert_trees_close(x, x + 1e-8, atol=1e-7)


def test_integer_and_bool_exact() -> None:
    with pytest.raises(AssertionError, match="must be equal"):
        assert_trees_close(torch.tensor([1, 2]), torch.tensor([1, 3]))
    with pytest.raises(AssertionError, match="must be equal"):
        assert_trees_close(torch.tensor([True]), torch.tensor([False]))


def test_shape_and_dtype_mismatch() -> None:
    with pytest.raises(AssertionError, match="shape"):
        assert_trees_close(torch.zeros(2), torch.zeros(3))
    with pytest.raises(AssertionError, match="dtype"):
        assert_trees_close(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


def test_nan_is_reported() -> None:
    with pytest.raises(AssertionError, match="max abs diff inf"):
        assert_trees_close(torch.tensor([float("nan")]), torch.tensor([0.0]))
