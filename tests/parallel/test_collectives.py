"""Collective pairs on gloo: forward values, adjoint identities, byte counts, no mutation."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import Axis, ByteCounter, ParallelConfig, Record, ring_volume
from funcpipe.parallel import collectives as C
from funcpipe.testing import assert_trees_close
from tests import jobs_parallel as J
from tests.parallel.strategies import scaled

PAIRS = sorted(J.PAIR_KINDS)
# (config, axis): a whole-world axis, and sub-axes of a grid
AXES = {
    2: [({"tensor": 2}, "tensor")],
    4: [
        ({"tensor": 4}, "tensor"),
        ({"tensor": {"size": 4, "mode": "2d"}}, "tensor_col"),
        ({"tensor": {"size": 4, "mode": "2d"}}, "tensor_row"),
    ],
    8: [
        ({"tensor": 8}, "tensor"),
        ({"tensor": {"size": 8, "mode": "3d"}}, "tensor_wt"),
        ({"pipeline": 2, "tensor": 4}, "tensor"),
    ],
}


@st.composite
def pair_cases(draw: st.DrawFn, world: int) -> dict[str, Any]:
    pair = draw(st.sampled_from(PAIRS))
    config, axis = draw(st.sampled_from(AXES[world]))
    n = ParallelConfig.from_dict(config, world_size=world).axis_sizes[axis]
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    if pair in ("reduce_scatter", "split_to_group", "split_then_gather"):
        shape[dim] *= n
    return {
        "pair": pair,
        "config": config,
        "axis": axis,
        "shape": shape,
        "dim": dim,
        "arg": draw(st.integers(-3, 3)),
        "seed": draw(st.integers(0, 10**6)),
        "fallback": pair in ("reduce_scatter", "all_gather") and draw(st.booleans()),
    }


def _groups(world: int, config: dict[str, Any], axis: str) -> list[list[int]]:
    """The ranks of each group of ``axis``, ordered by coordinate."""
    cfg = ParallelConfig.from_dict(config, world_size=world)
    places = cfg.places()
    bases = places[0].derived.get(axis, (axis,))
    groups: dict[tuple[int, ...], list[int]] = {}
    for p in places:
        key = tuple(p.coords[a] for a in cfg.mesh_dim_names if a not in bases)
        groups.setdefault(key, []).append(p.rank)
    return [sorted(g, key=lambda r: places[r].coords[axis]) for g in groups.values()]


def _expected(case: dict[str, Any], members: list[int], k: int) -> torch.Tensor:
    """What member ``k`` of a group must hold after the forward pass."""
    name, dim, n = case["pair"], case["dim"], len(members)
    xs = [J.pair_tensor(case["seed"], 0, J.PAIR_KINDS[name][0], r, case["shape"]) for r in members]
    if name == "copy_to_group" or name == "split_then_gather":
        return xs[k]
    if name in ("reduce_from_group", "all_reduce"):
        return sum(xs)
    if name in ("all_gather", "gather_from_group"):
        return torch.cat(xs, dim)
    if name == "reduce_scatter":
        return sum(xs).chunk(n, dim)[k]
    if name == "split_to_group":
        return xs[k].chunk(n, dim)[k]
    if name == "broadcast":
        return xs[case["arg"] % n]
    if name == "reduce_to":
        return sum(xs) if k == case["arg"] % n else torch.zeros_like(xs[k])
    if name == "ring_shift":
        return xs[(k - case["arg"]) % n]
    raise KeyError(name)


def _traffic(case: dict[str, Any], n: int) -> dict[tuple[str, str, str], float]:
    """Closed forms: bytes one rank sends, ring model (see funcpipe.parallel.collectives)."""
    x = math.prod(case["shape"]) * 8
    a, name = case["axis"], case["pair"]
    f = {
        "copy_to_group": [J.AR("backward", a, x / 8, n)],
        "reduce_from_group": [J.AR("forward", a, x / 8, n)],
        "all_reduce": [J.AR("forward", a, x / 8, n), J.AR("backward", a, x / 8, n)],
        "all_gather": [J.AG("forward", a, x / 8, n), J.RS("backward", a, n * x / 8, n)],
        "reduce_scatter": [J.RS("forward", a, x / 8, n), J.AG("backward", a, x / 8 / n, n)],
        "split_to_group": [J.AG("backward", a, x / 8 / n, n)],
        "gather_from_group": [J.AG("forward", a, x / 8, n)],
        "broadcast": [J.BC("forward", a, x / 8, n), J.RED("backward", a, x / 8, n)],
        "reduce_to": [J.RED("forward", a, x / 8, n), J.BC("backward", a, x / 8, n)],
        "ring_shift": [
            J.SEND(ph, a, x / 8, n, 1 if case["arg"] % n else 0) for ph in ("forward", "backward")
        ],
        "split_then_gather": [J.AG("forward", a, x / 8 / n, n), J.AG("backward", a, x / 8 / n, n)],
    }[name]
    out = dict(J.total(*f))
    if case["fallback"]:  # reduce-scatter as all-reduce + slice: an all-reduce's volume
        for key in list(out):
            if key[0] == "reduce_scatter":
                full = out.pop(key) * n / (n - 1)
                out[key] = 2 * (n - 1) / n * full
    return {k: v for k, v in out.items() if v}


def _check(world: int, cases: list[dict[str, Any]], results: list[list[dict[str, Any]]]) -> None:
    for c, case in enumerate(cases):
        kin, kout = J.PAIR_KINDS[case["pair"]]
        fwd = bwd = 0.0
        for members in _groups(world, case["config"], case["axis"]):
            n = len(members)
            for k, r in enumerate(members):
                res = results[r][c]
                where = f"{case} rank {r}"
                assert not res["mutated"], f"{where}: an input or incoming gradient was written"
                assert_trees_close(res["y"], _expected(case, members, k), msg=f"{where} forward")
                fwd += res["fwd"] / (n if kout == "R" else 1)
                bwd += res["bwd"] / (n if kin == "R" else 1)
                got = {k2: v for k2, v in res["traffic"].items() if v}
                want = _traffic(case, n)
                assert got.keys() == want.keys(), f"{where}: traffic {got} != {want}"
                for key in want:
                    assert math.isclose(got[key], want[key], rel_tol=1e-12), (where, key)
                assert math.isclose(res["total"], sum(want.values()), rel_tol=1e-12)
                if case["fallback"] and case["pair"] == "reduce_scatter" and n > 1:
                    assert "all_reduce+slice" in res["algorithms"]
        # <A x, y> = <x, A* y>, inner products over the logical (replicated-once) spaces
        assert math.isclose(fwd, bwd, rel_tol=1e-10, abs_tol=1e-10), (case, fwd, bwd)


@pytest.mark.timeout(120)
@settings(max_examples=scaled(6))
@given(st.lists(pair_cases(2), min_size=6, max_size=12))
def test_pairs_on_2_ranks(pool: Any, cases: list[dict[str, Any]]) -> None:
    _check(2, cases, pool(2).run(J.run_pair_cases, cases))


@pytest.mark.timeout(120)
@settings(max_examples=scaled(5))
@given(st.lists(pair_cases(4), min_size=6, max_size=12))
def test_pairs_on_4_ranks(pool: Any, cases: list[dict[str, Any]]) -> None:
    _check(4, cases, pool(4).run(J.run_pair_cases, cases))


@pytest.mark.timeout(120)
@settings(max_examples=scaled(2))
@given(st.lists(pair_cases(8), min_size=8, max_size=12))
def test_pairs_on_8_ranks(pool: Any, cases: list[dict[str, Any]]) -> None:
    _check(8, cases, pool(8).run(J.run_pair_cases, cases))


@pytest.mark.timeout(120)
def test_every_pair_and_the_fallback_on_4_ranks(pool: Any) -> None:
    """Every pair at least once, on a sub-axis of a grid, with and without the fallback."""
    cases = []
    for k, pair in enumerate(PAIRS):
        for fallback in (False, True) if pair in ("reduce_scatter", "all_gather") else (False,):
            cases.append(
                {
                    "pair": pair,
                    "config": {"tensor": {"size": 4, "mode": "2d"}},
                    "axis": "tensor_col",
                    "shape": [2, 4, 3],
                    "dim": 1,
                    "arg": 1,
                    "seed": k,
                    "fallback": fallback,
                }
            )
    _check(4, cases, pool(4).run(J.run_pair_cases, cases))


# ------------------------------------------------------------------------------ pure
def test_ring_volume_convention() -> None:
    assert ring_volume("all_reduce", 800, 4) == 1200
    assert ring_volume("all_gather", 100, 4) == 300
    assert ring_volume("reduce_scatter", 400, 4) == 300
    assert ring_volume("broadcast", 400, 4) == 300
    assert ring_volume("send", 64, 2) == 64
    assert ring_volume("all_reduce", 800, 1) == 0
    with pytest.raises(InvalidArgument, match="kind='gather'"):
        ring_volume("gather", 8, 2)


def test_byte_counter_aggregates() -> None:
    c = ByteCounter()
    c.records += [
        Record("all_reduce", "forward", "tensor", 2, 80, 80.0),
        Record("all_gather", "backward", "tensor", 2, 16, 16.0),
        Record("all_reduce", "backward", "data", 2, 8, 8.0),
    ]
    assert c.total == 104 and c.payload == 104
    assert c.by_kind == {"all_reduce": 88.0, "all_gather": 16.0}
    assert c.by_phase == {"forward": 80.0, "backward": 24.0}
    assert [r.axis for r in c.select(kind="all_reduce", phase="backward")] == ["data"]
    assert "all_reduce=88" in repr(c)
    c.reset()
    assert c.total == 0 and repr(c) == "ByteCounter(total=0, no traffic)"


def test_size_one_axis_is_identity_and_free() -> None:
    ax = Axis("tensor", 1, 0, None)
    x = torch.randn(3, 2)
    with C.count_bytes() as c:
        for y in (
            C.copy_to_group(x, ax),
            C.all_gather(x, ax, dim=0),
            C.reduce_scatter(x, ax, dim=1),
            C.broadcast(x, ax, src=0),
            C.ring_shift(x, ax, offset=3),
        ):
            assert torch.equal(y, x)
    assert c.records == []


def test_collective_arguments_are_checked() -> None:
    ax = Axis("tensor", 2, 0, None)
    x = torch.randn(3, 2)
    with pytest.raises(
        InvalidArgument, match=r"dim=2 is out of range for a tensor of shape \(3, 2\)"
    ):
        C.all_gather(x, ax, dim=2)
    with pytest.raises(InvalidArgument, match=r"src=2 must be a coordinate of axis 'tensor'"):
        C.broadcast(x, ax, src=2)
    with pytest.raises(InvalidArgument, match="axis='tensor' must be a funcpipe.parallel.Axis"):
        C.copy_to_group(x, "tensor")  # type: ignore[arg-type]
    with pytest.raises(
        InvalidArgument, match=r"along dim 0 needs that dim divisible by 2; got shape \(3, 2\)"
    ):
        C.split_to_group(x, ax, dim=0)
