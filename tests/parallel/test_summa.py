"""2D (SUMMA), 2.5D and 3D ops against one device, on gloo (same checks as test_ops.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import Axis, summa
from tests import jobs_parallel as J
from tests.parallel.strategies import op_cases, ops_of, run_and_check, scaled

TWO_D, TWO_P5D, THREE_D = ops_of("2d"), ops_of("2.5d"), ops_of("3d")


@pytest.mark.timeout(120)
@settings(max_examples=scaled(5))
@given(st.lists(op_cases(TWO_D + TWO_P5D, 4, min_size=4), min_size=5, max_size=10))
def test_2d_and_2p5d_ops_on_4_ranks(pool: Any, cases: list[dict[str, Any]]) -> None:
    run_and_check(pool, 4, cases)


@pytest.mark.timeout(120)
@settings(max_examples=scaled(2))
@given(st.lists(op_cases(TWO_P5D, 2, min_size=2), min_size=4, max_size=6))
def test_2p5d_depth_only_on_2_ranks(pool: Any, cases: list[dict[str, Any]]) -> None:
    run_and_check(pool, 2, cases)


@pytest.mark.timeout(120)
@settings(max_examples=scaled(3))
@given(st.lists(op_cases(TWO_P5D + THREE_D, 8, min_size=8), min_size=4, max_size=6))
def test_2p5d_depth_2_and_3d_ops_on_8_ranks(pool: Any, cases: list[dict[str, Any]]) -> None:
    run_and_check(pool, 8, cases)


@pytest.mark.timeout(120)
def test_every_grid_op_once_on_8_ranks(pool: Any) -> None:
    """Each op once on the full cube / the d=2, q=2 tesseract, and 2D with a data axis."""
    dims = {
        "b": 8,
        "s": 3,
        "i": 8,
        "o": 4,
        "v": 4,
        "d": 4,
        "h": 4,
        "e": 2,
        "f": 8,
        "w": 4,
        "causal": 1,
    }
    config = {
        "2d": {"tensor": {"size": 4, "mode": "2d"}},
        "2.5d": {"tensor": {"size": 8, "mode": "2.5d", "depth": 2}},
        "3d": {"tensor": {"size": 8, "mode": "3d"}},
    }
    cases = [
        {"op": name, "config": config[J.OPS[name].mode], "dims": dims, "seed": k}
        for k, name in enumerate(sorted(TWO_D + TWO_P5D + THREE_D))
    ]
    run_and_check(pool, 8, cases)


# ------------------------------------------------------------------------------ errors (no processes)
ROW, COL = Axis("tensor_row", 2, 0, None), Axis("tensor_col", 2, 0, None)


def test_grid_shapes_are_checked() -> None:
    with pytest.raises(
        InvalidArgument, match=r"x\[\.\.\., 3\] \(in/q\) does not match weight of shape \(4, 2\)"
    ):
        summa.linear_2d(torch.zeros(1, 2, 3), {"weight": torch.zeros(4, 2)}, row=ROW, col=COL)
    with pytest.raises(InvalidArgument, match="the grid must be square"):
        summa.linear_2d(
            torch.zeros(1, 2, 3), {"weight": torch.zeros(3, 2)}, row=Axis("r", 3, 0, None), col=COL
        )
    with pytest.raises(InvalidArgument, match="num_heads=3 must be a positive multiple of 2"):
        summa.attention_block_2d(torch.zeros(1, 2, 4), {}, row=ROW, col=COL, num_heads=3)
    a, b = Axis("tensor_in", 2, 0, None), Axis("tensor_wt", 3, 0, None)
    with pytest.raises(InvalidArgument, match="must have one size \\(a cube\\)"):
        summa.linear_3d(
            torch.zeros(1, 1, 1), {"weight": torch.zeros(1, 1)}, in_axis=a, wt_axis=b, out_axis=a
        )
