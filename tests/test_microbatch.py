from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from funcpipe import InvalidArgument, merge, microbatch_sizes, split
from funcpipe.tree import leaf_paths, tree_flatten, tree_leaves, tree_map, tree_structure

DTYPES = [torch.float32, torch.float64, torch.float16, torch.int64, torch.bool]


@dataclass(frozen=True)
class LeafSpec:
    """A leaf to build: its dtype, its non-batch shape and where the batch dim goes."""

    dtype: torch.dtype
    other: tuple[int, ...]
    dim: int  # may be negative


@st.composite
def leaf_specs(draw: Any) -> LeafSpec:
    other = tuple(draw(st.lists(st.integers(0, 3), max_size=2)))
    ndim = len(other) + 1
    return LeafSpec(draw(st.sampled_from(DTYPES)), other, draw(st.integers(-ndim, ndim - 1)))


def trees(leaves: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), children, max_size=3),
        ),
        max_leaves=6,
    )


def _build(spec: LeafSpec, batch: int) -> torch.Tensor:
    ndim = len(spec.other) + 1
    shape = list(spec.other)
    shape.insert(spec.dim % ndim, batch)
    if spec.dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if spec.dtype == torch.int64:
        return torch.randint(-100, 100, shape)
    return torch.randn(shape).to(spec.dtype)


@given(
    spec_tree=trees(leaf_specs()).filter(lambda t: len(tree_leaves(t)) > 0),
    batch=st.integers(1, 9),
    data=st.data(),
)
def test_split_merge_roundtrip(spec_tree: Any, batch: int, data: Any) -> None:
    m = data.draw(st.integers(1, batch), label="microbatches")
    tree = tree_map(lambda s: _build(s, batch), spec_tree)
    dims = tree_map(lambda s: s.dim, spec_tree)
    parts = split(tree, m, dim=dims)
    assert len(parts) == m
    sizes = microbatch_sizes(batch, m)
    for part, size in zip(parts, sizes, strict=True):
        assert tree_structure(part) == tree_structure(tree)
        for leaf, piece, s in zip(
            tree_leaves(tree), tree_leaves(part), tree_leaves(spec_tree), strict=True
        ):
            assert piece.shape[s.dim] == size
            assert piece.dtype == leaf.dtype
            if piece.numel() > 0:  # a view into the batch, not a copy
                assert piece.untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr()
    merged = merge(parts, dim=dims)
    assert tree_structure(merged) == tree_structure(tree)
    for a, b in zip(tree_leaves(merged), tree_leaves(tree), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@given(batch=st.integers(0, 50), m=st.integers(1, 50))
def test_microbatch_sizes(batch: int, m: int) -> None:
    if batch == 0:
        with pytest.raises(InvalidArgument, match="batch_size=0"):
            microbatch_sizes(batch, m)
        return
    if batch < m:
        with pytest.raises(InvalidArgument, match=f"microbatches={m}"):
            microbatch_sizes(batch, m)
        return
    sizes = microbatch_sizes(batch, m)
    assert sum(sizes) == batch and len(sizes) == m
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1
    assert sizes == [len(p) for p in torch.tensor_split(torch.arange(batch), m)]


def test_uneven_split_sizes() -> None:
    parts = split({"x": torch.arange(10), "y": torch.zeros(3, 10)}, 4, dim={"x": 0, "y": -1})
    assert [p["x"].shape[0] for p in parts] == [3, 3, 2, 2]
    assert [p["y"].shape for p in parts][-1] == (3, 2)


def test_batch_smaller_than_microbatches() -> None:
    with pytest.raises(
        InvalidArgument,
        match=r"batch has 3 samples along dim 0 but microbatches=4; use microbatches <= 3",
    ):
        split(torch.zeros(3, 2), 4)


def test_leaves_disagree_on_batch_size() -> None:
    batch = {"x": torch.zeros(4, 2), "y": (torch.zeros(5),)}
    with pytest.raises(
        InvalidArgument,
        match=r"leaves of batch disagree on the batch size: batch\['x'\]: 4 \(dim 0\), "
        r"batch\['y'\]\[0\]: 5 \(dim 0\)",
    ):
        split(batch, 2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_microbatch_count(bad: Any) -> None:
    with pytest.raises(
        InvalidArgument, match=r"microbatches must be an int >= 1; got microbatches="
    ):
        split(torch.zeros(4), bad)


def test_split_argument_errors() -> None:
    with pytest.raises(InvalidArgument, match=r"batch\['a'\]=1\.0 \(a float\)"):
        split({"a": 1.0}, 1)
    with pytest.raises(InvalidArgument, match="batch has no tensor leaves"):
        split({"a": None}, 1)
    with pytest.raises(InvalidArgument, match="batch has no tensor leaves"):
        split([], 1)
    with pytest.raises(
        InvalidArgument, match=r"dim=2 is out of range for batch\['a'\] with shape \(4, 2\)"
    ):
        split({"a": torch.zeros(4, 2)}, 2, dim=2)
    with pytest.raises(InvalidArgument, match=r"batch is empty \(0 samples"):
        split(torch.zeros(0, 3), 1)
    with pytest.raises(InvalidArgument, match=r"0-dim tensor has no batch dim"):
        split(torch.tensor(1.0), 1)
    with pytest.raises(InvalidArgument, match=r"same structure as the batch"):
        split({"a": torch.zeros(4)}, 2, dim={"b": 0})
    with pytest.raises(InvalidArgument, match=r"dim leaves must be ints"):
        split({"a": torch.zeros(4)}, 2, dim={"a": 0.5})


def test_merge_errors() -> None:
    with pytest.raises(InvalidArgument, match="at least one"):
        merge([])
    with pytest.raises(InvalidArgument, match=r"microbatches\[1\] is"):
        merge([{"a": torch.zeros(1)}, {"b": torch.zeros(1)}])
    with pytest.raises(InvalidArgument, match=r"microbatches\[0\]\['a'\]=1"):
        merge([{"a": 1}])
    with pytest.raises(InvalidArgument, match="sequence of microbatch"):
        merge(torch.zeros(3))  # type: ignore[arg-type]


def test_leaf_paths_are_reported_in_flatten_order() -> None:
    tree = {"b": torch.zeros(1), "a": torch.zeros(1)}
    leaves, _ = tree_flatten(tree)
    assert len(leaf_paths(tree, name="t")) == len(leaves)
