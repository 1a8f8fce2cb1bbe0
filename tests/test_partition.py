from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from funcpipe import InvalidArgument, Partition, partition
from funcpipe.testing import assert_trees_close
from funcpipe.tree import tree_leaves


def _mlp(depth: int = 4, width: int = 5) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers)


def _scale(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x * params["w"].sum()


def _fn_layers(sizes: list[int]) -> list[tuple[Any, Any]]:
    return [(_scale, {"w": torch.ones(n)}) for n in sizes]


def _counts(part: Partition) -> list[int]:
    return [sum(t.numel() for t in tree_leaves(p)) for p in part.params]


def test_uniform_module_partition_keeps_names() -> None:
    model = _mlp()
    part = partition(model, 3)
    assert part.bounds == ((0, 3), (3, 6), (6, 8))
    assert [s.name for s in part.stages] == ["layers 0-2", "layers 3-5", "layers 6-7"]
    union = {k: v for p in part.params for k, v in p.items()}
    assert list(union) == [name for name, _ in model.named_parameters()]
    assert "2.weight" in part.params[0] and "4.weight" in part.params[1]
    x = torch.randn(2, 5)
    with torch.no_grad():
        h = x
        for stage, params in zip(part.stages, part.params, strict=True):
            h = stage(params, h)
        assert_trees_close(h, model(x))


def test_list_of_modules_and_ranks_chunks() -> None:
    layers = [nn.Linear(2, 2) for _ in range(6)]
    part = partition(layers, ranks=2, chunks=3)
    assert len(part.stages) == 6
    assert part.stages[4].name == "layer 4"
    assert set(part.params[4]) == {"4.weight", "4.bias"}


def test_shared_activation_instance_is_kept() -> None:
    act = nn.ReLU()
    model = nn.Sequential(nn.Linear(2, 2), act, nn.Linear(2, 2), act)
    part = partition(model, 2)
    assert part.bounds == ((0, 2), (2, 4))


def test_function_layers_are_composed() -> None:
    layers = _fn_layers([1, 2, 3, 4])
    part = partition(layers, 2, by=[1])
    assert part.bounds == ((0, 1), (1, 4))
    assert set(part.params[1]) == {"1", "2", "3"}
    x = torch.ones(2)
    assert_trees_close(part.stages[1](part.params[1], x), x * 2 * 3 * 4)


def test_parameters_split_prefers_spread_activations() -> None:
    # Weightless activations do not pile up at one end among equally good splits.
    part = partition(_mlp(depth=4), 4, by="parameters")
    assert part.bounds == ((0, 2), (2, 4), (4, 6), (6, 8))


def test_tuple_outputs_chain_inside_module_stage() -> None:
    class Fork(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, 2 * x

    class Join(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    part = partition([nn.Linear(2, 2), Fork(), Join()], 1)
    x = torch.randn(3, 2)
    with torch.no_grad():
        lin = part.params[0]
        expected = 3 * (x @ lin["0.weight"].T + lin["0.bias"])
        assert_trees_close(part.stages[0](part.params[0], x), expected)


def _brute_force(sizes: list[int], n: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(sizes)), n - 1):
        points = [0, *cuts, len(sizes)]
        worst = max(sum(sizes[a:b]) for a, b in itertools.pairwise(points))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@given(sizes=st.lists(st.integers(0, 50), min_size=1, max_size=8), data=st.data())
def test_parameters_partition_is_balanced_and_optimal(sizes: list[int], data: Any) -> None:
    n = data.draw(st.integers(1, len(sizes)), label="stages")
    part = partition(_fn_layers(sizes), n, by="parameters")
    assert len(part.stages) == n
    assert all(a < b for a, b in part.bounds)
    assert part.bounds[0][0] == 0 and part.bounds[-1][1] == len(sizes)
    counts = _counts(part)
    assert sum(counts) == sum(sizes)
    assert max(counts) <= sum(sizes) / n + max(sizes)
    assert max(counts) == _brute_force(sizes, n)


@given(n_layers=st.integers(1, 30), data=st.data())
def test_uniform_counts_differ_by_at_most_one(n_layers: int, data: Any) -> None:
    n = data.draw(st.integers(1, n_layers), label="stages")
    part = partition(_fn_layers([1] * n_layers), n)
    lengths = [b - a for a, b in part.bounds]
    assert max(lengths) - min(lengths) <= 1 and sum(lengths) == n_layers


def test_profile_balances_time() -> None:
    slow = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    layers = [nn.Identity(), slow, nn.Identity(), nn.Identity(), nn.Identity(), nn.Identity()]
    # uniform would give ((0, 3), (3, 6)); by time the slow layer's stage takes nothing more.
    # The identities take ~0 s, so the first one may go either side of the cut (timing noise).
    part = partition(layers, 2, by="profile", example=torch.randn(64, 64))
    assert part.bounds in (((0, 2), (2, 6)), ((0, 1), (1, 6)))


def test_profile_does_not_touch_module_buffers() -> None:
    bn = nn.BatchNorm1d(4)  # training mode: its forward writes running stats
    before = bn.running_mean.clone()
    partition([nn.Linear(4, 4), bn], 2, by="profile", example=torch.randn(8, 4))
    assert torch.equal(bn.running_mean, before)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stages": 5}, r"stages=5 asks for 5 stages but layers has only 4 layers"),
        ({"ranks": 2, "chunks": 3}, r"ranks=2 \* chunks=3 asks for 6 stages"),
        ({"stages": 0}, r"stages must be an int >= 1; got stages=0"),
        ({}, r"exactly one of the two; got stages=None, ranks=None"),
        ({"stages": 2, "ranks": 2}, r"exactly one of the two"),
        ({"stages": 2, "chunks": 2}, r"chunks only applies together with ranks"),
        ({"ranks": 1, "chunks": 0}, r"chunks must be an int >= 1; got chunks=0"),
        ({"stages": 2, "by": "magic"}, r"by must be one of .*got by='magic'"),
        ({"stages": 2, "by": 3}, r"by must be one of .*got by=3"),
        ({"stages": 3, "by": [2]}, r"needs N-1 = 2 cut indices"),
        ({"stages": 3, "by": [2, 2]}, r"strictly increasing .*got by=\[2, 2\]"),
        ({"stages": 2, "by": [4]}, r"within 1\.\.3"),
        ({"stages": 2, "by": [0]}, r"within 1\.\.3"),
        ({"stages": 2, "by": "profile"}, r"got example=None"),
    ],
)
def test_partition_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        partition(_mlp(depth=2), **kwargs)


def test_layer_list_errors() -> None:
    with pytest.raises(InvalidArgument, match="layers is empty"):
        partition([], 1)
    with pytest.raises(InvalidArgument, match="empty nn.Sequential"):
        partition(nn.Sequential(), 1)
    with pytest.raises(InvalidArgument, match="layers mixes kinds"):
        partition([nn.Linear(2, 2), (_scale, {"w": torch.ones(1)})], 1)
    with pytest.raises(InvalidArgument, match=r"layers\[1\]=3 is neither"):
        partition([nn.Linear(2, 2), 3], 1)  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match=r"layers\[0\] params\['w'\]=1"):
        partition([(_scale, {"w": 1})], 1)
    with pytest.raises(InvalidArgument, match="got layers of type Linear"):
        partition(nn.Linear(2, 2), 1)  # type: ignore[arg-type]


def test_partition_repr_is_short() -> None:
    text = repr(partition(_mlp(depth=2), 2))
    assert "params=(2 tensors, 2 tensors)" in text and "tensor(" not in text
