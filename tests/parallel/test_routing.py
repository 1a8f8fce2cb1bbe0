"""dispatch / combine (funcpipe.parallel.routing) and the uneven all-to-all under them, over 2
and 4 gloo processes, against one device: every output row, the tokens' gradients and the
experts' gradients, for routings hypothesis draws (experts left empty or overfull, ranks that
send nothing), and the bytes each rank records."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import Axis
from funcpipe.parallel.collectives import all_to_all
from funcpipe.parallel.routing import Routed, combine, dispatch
from funcpipe.testing import assert_trees_close
from tests import jobs_routing as J
from tests.parallel.strategies import scaled


@st.composite
def routings(draw: st.DrawFn, world: int) -> dict[str, Any]:
    per = draw(st.integers(1, 3))
    experts = world * per
    # skewed draws: often every token of a rank to one expert, some ranks with none
    hot = draw(st.integers(0, experts - 1))
    pick = st.one_of(st.just(hot), st.integers(0, experts - 1))
    rows = [draw(st.lists(pick, min_size=0, max_size=7)) for _ in range(world)]
    return {"world": world, "per": per, "d": draw(st.integers(1, 4)), "experts": rows,
            "seed": draw(st.integers(0, 10**6))}  # fmt: skip


def _reference(case: dict[str, Any]) -> list[dict[str, Any]]:
    """One device: every rank's tokens through their experts' weights, and the gradients."""
    world, per = case["world"], case["per"]
    weights = J.case_tensors(case, 0)[3].clone().requires_grad_(True)
    out = []
    xs = []
    for r in range(world):
        x, experts, gout, _ = J.case_tensors(case, r)
        x.requires_grad_(True)
        y = torch.bmm(x.unsqueeze(1), weights[experts]).squeeze(1)
        y.backward(gout)
        xs.append(x)
        out.append({"out": y.detach()})
    for r in range(world):
        out[r]["x_grad"] = xs[r].grad
        out[r]["w_grad"] = weights.grad[r * per : (r + 1) * per]
        out[r]["received"] = sum(e // per == r for rank in case["experts"] for e in rank)
        out[r]["sent"] = sum(e // per != r for e in case["experts"][r]) * case["d"] * 8
        others = [rows for k, rows in enumerate(case["experts"]) if k != r]
        out[r]["returned"] = sum(e // per == r for rows in others for e in rows) * case["d"] * 8
    return out


def _check(case: dict[str, Any], got: list[dict[str, Any]]) -> None:
    for r, (mine, want) in enumerate(zip(got, _reference(case), strict=True)):
        where = f"{case} rank {r}"
        assert mine["received"] == want["received"], where
        assert_trees_close(mine["out"], want["out"], atol=1e-12, rtol=1e-12, msg=f"{where} out")
        assert_trees_close(mine["x_grad"], want["x_grad"], atol=1e-12, rtol=1e-12, msg=where)
        assert_trees_close(mine["w_grad"], want["w_grad"], atol=1e-12, rtol=1e-12, msg=where)
        forward = [v for k, ph, _, v in mine["records"] if k == "all_to_all" and ph == "forward"]
        # forward: the rows (d float64 each) and their expert ids (one int64 each) dispatched to
        # other ranks, then the rows computed for other ranks combined back to them
        total = want["sent"] * (1 + 1 / case["d"]) + want["returned"]
        assert math.isclose(sum(forward), total), (where, forward)


@pytest.mark.timeout(180)
@settings(max_examples=scaled(8), deadline=None)
@given(st.lists(routings(2), min_size=4, max_size=8))
def test_routing_over_two_processes(pool: Any, cases: list[dict[str, Any]]) -> None:
    results = pool(2).run(J.run_routing_cases, cases)
    for c, case in enumerate(cases):
        _check(case, [results[r][c] for r in range(2)])


@pytest.mark.timeout(240)
@settings(max_examples=scaled(6), deadline=None)
@given(st.lists(routings(4), min_size=4, max_size=8))
def test_routing_over_four_processes(pool: Any, cases: list[dict[str, Any]]) -> None:
    results = pool(4).run(J.run_routing_cases, cases)
    for c, case in enumerate(cases):
        _check(case, [results[r][c] for r in range(4)])


def test_one_coordinate_and_bad_input() -> None:
    """A size-1 axis moves nothing and needs no process group; wrong sizes and destinations are
    clear errors before anything is sent."""
    axis = Axis("expert", 1, 0, None)
    x = torch.randn(5, 3, requires_grad=True)
    y, routed = dispatch(x, torch.zeros(5, dtype=torch.int64), axis)
    assert isinstance(routed, Routed) and routed.send == routed.recv == [5]
    back = combine(y * 2, routed)
    back.sum().backward()
    assert torch.equal(back, x.detach() * 2) and torch.equal(x.grad, torch.full((5, 3), 2.0))
    with pytest.raises(InvalidArgument, match="sum to 4, but x has 5 rows"):
        all_to_all(x, axis, [4])
    with pytest.raises(InvalidArgument, match="one row count per coordinate"):
        all_to_all(x, axis, [2, 3])
    with pytest.raises(InvalidArgument, match="ints >= 0"):
        all_to_all(x, axis, [-1])
    with pytest.raises(InvalidArgument, match="one destination per row"):
        dispatch(x, torch.zeros(4, dtype=torch.int64), axis)
    with pytest.raises(InvalidArgument, match="2 destination\\(s\\) outside"):
        dispatch(x, torch.tensor([0, 1, -1, 0, 0]), axis)
    with pytest.raises(InvalidArgument, match="one row per row dispatch delivered"):
        combine(y[:2], routed)
