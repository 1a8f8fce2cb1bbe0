"""ParallelConfig validation (pure) and the DeviceMesh built from it (gloo)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.parallel import Axis, ParallelConfig, build_mesh
from tests import jobs_parallel as J
from tests.parallel.strategies import configs


# ------------------------------------------------------------------------------ valid configs
def test_colossal_style_config() -> None:
    cfg = ParallelConfig.from_dict(
        {"pipeline": 2, "tensor": {"size": 4, "mode": "2d"}}, world_size=16
    )
    assert (cfg.pipeline, cfg.data, cfg.tensor, cfg.mode) == (2, 2, 4, "2d")
    assert cfg.mesh_dim_names == ("pipe", "data", "tensor_row", "tensor_col")
    assert cfg.mesh_shape == (2, 2, 2, 2)
    assert cfg.axis_sizes["tensor"] == 4


def test_the_expert_axis_spans_data_parallel_copies() -> None:
    cfg = ParallelConfig.from_dict({"pipeline": 2, "expert": 2, "tensor": 2}, world_size=16)
    assert (cfg.data, cfg.expert) == (4, 2)
    assert cfg.mesh_dim_names == ("pipe", "expert_data", "expert", "tensor")
    assert cfg.mesh_shape == (2, 2, 2, 2)
    assert cfg.axis_sizes["data"] == 4
    for place in cfg.places():  # data: all copies, expert_data * expert + expert
        c = place.coords
        assert c["data"] == c["expert_data"] * 2 + c["expert"] == (place.rank // 2) % 4
        assert place.derived["data"] == ("expert_data", "expert")
    plain = ParallelConfig.from_dict({"pipeline": 2}, world_size=4)
    assert plain.expert == 1 and plain.mesh_dim_names == ("pipe", "data", "tensor")


def test_an_expert_axis_that_does_not_divide_the_copies_is_refused() -> None:
    with pytest.raises(
        InvalidArgument, match=r"expert=3 does not divide .* use expert in \[1, 2, 4\]"
    ):
        ParallelConfig.from_dict({"pipeline": 2, "expert": 3}, world_size=8)
    with pytest.raises(InvalidArgument, match="expert"):
        ParallelConfig.from_dict({"expert": 0}, world_size=8)


@pytest.mark.parametrize(
    ("tensor", "names", "shape"),
    [
        (3, ("tensor",), (3,)),
        ({"size": 3, "mode": "sequence"}, ("sequence",), (3,)),
        ({"size": 9, "mode": "2d"}, ("tensor_row", "tensor_col"), (3, 3)),
        (
            {"size": 8, "mode": "2.5d", "depth": 2},
            ("tensor_dep", "tensor_row", "tensor_col"),
            (2, 2, 2),
        ),
        ({"size": 27, "mode": "3d"}, ("tensor_in", "tensor_wt", "tensor_out"), (3, 3, 3)),
    ],
)
def test_tensor_axes_per_mode(tensor: Any, names: tuple[str, ...], shape: tuple[int, ...]) -> None:
    size = math.prod(shape)
    cfg = ParallelConfig.from_dict({"tensor": tensor}, world_size=2 * size)
    assert cfg.mesh_dim_names[2:] == names
    assert cfg.mesh_shape == (1, 2, *shape)


@given(
    st.sampled_from([1, 2, 4, 8, 12, 16])
    .flatmap(
        lambda w: st.tuples(st.just(w), st.sampled_from(["1d", "sequence", "2d", "2.5d", "3d"]))
    )
    .flatmap(lambda wm: st.tuples(st.just(wm[0]), configs(wm[1], wm[0])))
)
def test_places_cover_the_mesh(world_config: tuple[int, dict[str, Any]]) -> None:
    world, config = world_config
    cfg = ParallelConfig.from_dict(config, world_size=world)
    assert math.prod(cfg.mesh_shape) == world == cfg.pipeline * cfg.data * cfg.tensor
    seen = set()
    for place in cfg.places():
        coords = tuple(place.coords[n] for n in cfg.mesh_dim_names)
        assert all(0 <= c < s for c, s in zip(coords, cfg.mesh_shape, strict=True))
        # row-major: the rank is the mixed-radix number of its coordinates
        rank = 0
        for c, s in zip(coords, cfg.mesh_shape, strict=True):
            rank = rank * s + c
        assert rank == place.rank
        # the flattened tensor coordinate is row-major over the tensor axes
        flat = 0
        for name, size in cfg.tensor_axes:
            flat = flat * size + place.coords[name]
        assert flat == place.coords["tensor"]
        seen.add(coords)
    assert len(seen) == world


# ------------------------------------------------------------------------------ impossible configs
@pytest.mark.parametrize(
    ("config", "world", "needles"),
    [
        (
            {"pipeline": 2, "tensor": 4},
            12,
            ["world_size=12", "pipeline (2) x tensor (4) = 8", "multiple of 8"],
        ),
        (
            {"tensor": {"size": 6, "mode": "2d"}},
            12,
            ["tensor size 6 with mode '2d' must be a square q*q", "size=4", "size=9", "mode='1d'"],
        ),
        (
            {"tensor": {"size": 4, "mode": "3d"}},
            8,
            ["tensor size 4 with mode '3d' must be a cube", "size=8", "mode='1d'"],
        ),
        (
            {"tensor": {"size": 8, "mode": "2.5d", "depth": 3}},
            8,
            [
                "size 8 with mode '2.5d' and depth 3 must be depth*q*q",
                "depths that work are [2, 8]",
            ],
        ),
        ({"tensor": {"size": 8, "mode": "2.5d"}}, 8, ["needs a depth", "[2, 8]"]),
        ({"tensor": {"size": 4, "mode": "4d"}}, 8, ["mode='4d' is unknown", "'2.5d'"]),
        (
            {"tensor": {"size": 4, "mode": "2d", "depth": 2}},
            8,
            ["depth=2 is only meaningful with mode='2.5d'"],
        ),
        ({"tensor": 0}, 8, ["tensor=0", "positive int"]),
        ({"pipeline": -2}, 8, ["pipeline=-2", "positive int"]),
        ({"tensor": {"size": 2.0}}, 8, ["tensor size=2.0"]),
        ({"tensor": {"mode": "1d"}}, 8, ["has no 'size'"]),
        ({"pipline": 2}, 8, ["unknown key(s) ['pipline']", "'pipeline'"]),
        ({"tensor": {"size": 2, "kind": "1d"}}, 8, ["unknown key(s) ['kind']", "'mode'"]),
        ({"tensor": 2, "data": 3}, 8, ["data=3 does not fit", "leave 'data' out to infer it (4)"]),
        ({"tensor": "2d"}, 8, ["tensor='2d'", "dict(size=4, mode='2d')"]),
        ([("tensor", 2)], 8, ["must be a dict"]),
    ],
)
def test_impossible_configs_say_what_would_work(
    config: Any, world: int, needles: list[str]
) -> None:
    with pytest.raises(InvalidArgument) as info:
        ParallelConfig.from_dict(config, world_size=world)
    for needle in needles:
        assert needle in str(info.value)


def test_world_size_is_validated() -> None:
    with pytest.raises(InvalidArgument, match="world_size=0"):
        ParallelConfig.from_dict({}, world_size=0)
    cfg = ParallelConfig.from_dict({}, world_size=4)
    with pytest.raises(InvalidArgument, match=r"rank=4: must be an int in range\(4\)"):
        cfg.place(4)


def test_build_mesh_needs_a_process_group() -> None:
    with pytest.raises(InvalidArgument, match="launch"):
        build_mesh({"tensor": 2})


# ------------------------------------------------------------------------------ on gloo
def _check_mesh_info(
    world: int, configs_: list[dict[str, Any]], infos: list[list[dict[str, Any]]]
) -> None:
    for k, config in enumerate(configs_):
        cfg = ParallelConfig.from_dict(config, world_size=world)
        places = cfg.places()
        for rank, place in enumerate(places):
            info = infos[rank][k]
            assert set(info) == set(cfg.axis_sizes)
            for name, (size, coord, ranks) in info.items():
                assert size == cfg.axis_sizes[name]
                assert coord == place.coords[name], (config, rank, name)
                # the group holds the ranks that differ from this one only along the axis
                bases = place.derived.get(name, (name,))
                expected = [
                    p.rank
                    for p in places
                    if all(
                        p.coords[a] == place.coords[a] for a in cfg.mesh_dim_names if a not in bases
                    )
                ]
                assert ranks == expected, (config, rank, name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [4, 8])
def test_device_mesh_matches_the_config(pool: Any, world: int) -> None:
    configs_ = [
        {"tensor": world},
        {"pipeline": 2, "tensor": {"size": world // 2, "mode": "sequence"}},
        {"tensor": {"size": 4, "mode": "2d"}},
        {"tensor": {"size": 4, "mode": "2.5d", "depth": 4}},
        {"pipeline": 2, "expert": 2},
    ]
    if world == 8:
        configs_ += [
            {"tensor": {"size": 8, "mode": "3d"}},
            {"tensor": {"size": 8, "mode": "2.5d", "depth": 2}},
            {"pipeline": 2, "tensor": {"size": 4, "mode": "2d"}},
            {"expert": 2, "tensor": 2},
            {"pipeline": 2, "expert": 2},
        ]
    infos = pool(world).run(J.mesh_info, configs_)
    _check_mesh_info(world, configs_, infos)


def test_axis_repr_hides_the_group() -> None:
    ax = Axis("tensor", 4, 1, object())
    assert repr(ax) == "Axis(name='tensor', size=4, coord=1)"


@pytest.mark.timeout(120)
def test_mesh_is_a_mapping_of_axes(pool: Any) -> None:
    out = pool(2).run(J.mesh_api, {"tensor": 2})
    assert out[1]["axes"] == ["pipe", "data", "tensor"] and out[1]["len"] == 3
    assert out[1]["repr"] == "Mesh(rank=1, pipe=0/1, data=0/1, tensor=1/2)"
    assert (
        "mesh has no axis 'tensor_row'; its axes are ['pipe', 'data', 'tensor']" in out[0]["error"]
    )
    assert "config.world_size=4 but the process group has 2 ranks" in out[0]["mismatch"]
