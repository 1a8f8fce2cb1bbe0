"""Shardings: shard-then-gather is the identity; errors name the shape and the axes (pure)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import ParallelConfig, Sharding
from funcpipe.parallel.ops import column_parallel_sharding
from funcpipe.parallel.sharding import OpSharding
from funcpipe.testing import assert_trees_close
from tests.parallel.strategies import configs

MODES = ["1d", "sequence", "2d", "2.5d", "3d"]


@st.composite
def shardings_and_tensors(draw: st.DrawFn) -> tuple[ParallelConfig, Sharding, torch.Tensor]:
    world = draw(st.sampled_from([1, 2, 4, 8]))
    mode = draw(st.sampled_from(MODES))
    cfg = ParallelConfig.from_dict(draw(configs(mode, world)), world_size=world)
    names = list(cfg.axis_sizes)
    ndim = draw(st.integers(1, 3))
    # each mesh axis goes to at most one dim (or is a partial axis, or is left replicated)
    dims: list[list[str]] = [[] for _ in range(ndim)]
    partial: list[str] = []
    used: set[str] = set()
    for name in draw(st.permutations(names)):
        bases = cfg.place(0).derived.get(name, (name,))
        if used & set(bases):
            continue  # a flattened axis and its own dims cannot both split the tensor
        where = draw(st.integers(-2, ndim - 1))
        if where == -2:
            continue
        if where == -1:
            partial.append(name)
        else:
            dims[where].append(name)
        used |= set(bases) | {name}
    sharding = Sharding(tuple(tuple(d) for d in dims), tuple(partial))
    shape = [draw(st.integers(1, 3)) * _prod(cfg.axis_sizes[a] for a in d) for d in dims]
    gen = torch.Generator().manual_seed(draw(st.integers(0, 99)))
    t = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return cfg, sharding, t


def _prod(xs: Any) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


@given(shardings_and_tensors())
def test_shard_then_gather_is_identity(case: tuple[ParallelConfig, Sharding, torch.Tensor]) -> None:
    cfg, sharding, full = case
    places = cfg.places()
    shards = [sharding.shard(full, p) for p in places]
    for s in shards:
        assert tuple(s.shape) == sharding.local_shape(full.shape, cfg.axis_sizes)
    assert_trees_close(sharding.gather(shards, places), full)


def test_partial_shards_sum_to_the_value() -> None:
    cfg = ParallelConfig.from_dict({"tensor": 4}, world_size=4)
    full = torch.arange(6.0, dtype=torch.float64).reshape(2, 3)
    lay = Sharding.of(None, None, partial=("tensor",))
    shards = [lay.shard(full, p) for p in cfg.places()]
    assert_trees_close(sum(shards), full)
    assert_trees_close(lay.gather(shards, cfg.places()), full)


def test_mixed_radix_blocks_outer_axis_first() -> None:
    cfg = ParallelConfig.from_dict(
        {"tensor": {"size": 8, "mode": "2.5d", "depth": 2}}, world_size=8
    )
    lay = Sharding.of(("tensor_dep", "tensor_row"), None)
    full = torch.arange(8.0).reshape(4, 2)
    for p in cfg.places():
        block = 2 * p.coords["tensor_dep"] + p.coords["tensor_row"]
        assert torch.equal(lay.shard(full, p), full[block : block + 1])


def test_op_sharding_round_trips_params() -> None:
    cfg = ParallelConfig.from_dict({"tensor": 2}, world_size=4)
    lay = column_parallel_sharding()
    full = {"weight": torch.randn(4, 3), "bias": torch.randn(4)}
    per_rank = [lay.shard_params(full, p) for p in cfg.places()]
    assert per_rank[1]["weight"].shape == (2, 3)
    assert_trees_close(lay.gather_params(per_rank, cfg.places()), full)


def test_sharding_errors_name_shape_and_axes() -> None:
    cfg = ParallelConfig.from_dict({"tensor": 4}, world_size=4)
    with pytest.raises(
        InvalidArgument,
        match=r"dim 0 of shape \(6, 2\) has size 6, not divisible by the 4 shards of mesh axes \('tensor',\)",
    ):
        Sharding.of("tensor", None).shard(torch.zeros(6, 2), cfg.place(0))
    with pytest.raises(
        InvalidArgument,
        match=r"shape \(6,\) \(1 dims\) but Sharding.of\('tensor', None\) describes 2 dims",
    ):
        Sharding.of("tensor", None).shard(torch.zeros(6), cfg.place(0))
    with pytest.raises(InvalidArgument, match="names mesh axis 'tensor_row'"):
        Sharding.of("tensor_row").shard(torch.zeros(4), cfg.place(0))
    assert repr(Sharding.of(("a", "b"), None, "c", partial=["d"])) == (
        "Sharding.of(('a', 'b'), None, 'c', partial=('d',))"
    )


def test_the_old_names_still_work() -> None:
    """``Layout`` / ``OpLayout``, the module path ``funcpipe.parallel.layout``, the ``*_layout``
    functions and ``gpt.layouts`` are the old names of the same objects."""
    import funcpipe.parallel as P
    from funcpipe.models import gpt
    from funcpipe.parallel import layout, ops, summa

    assert P.Layout is layout.Layout is Sharding and P.OpLayout is layout.OpLayout is OpSharding
    assert layout.shard_tree is P.shard_tree and layout.gather_tree is P.gather_tree
    for lib in (ops, summa):
        news = [n for n in lib.__all__ if n.endswith("_sharding")]
        assert news
        for name in news:
            assert getattr(lib, name.removesuffix("_sharding") + "_layout") is getattr(lib, name)
    assert gpt.layouts is gpt.shardings
