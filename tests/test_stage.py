from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn

from funcpipe import InvalidArgument, Stage, as_inputs, compose, from_module, reference_step
from funcpipe.testing import assert_trees_close
from funcpipe.tree import tree_map


def _linear(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return x @ params["w"] + params["b"]


def test_stage_calls_fn_with_params_first() -> None:
    stage = Stage(_linear, name="linear")
    params = {"w": torch.eye(3), "b": torch.ones(3)}
    x = torch.randn(2, 3)
    assert_trees_close(stage(params, x), x + 1)
    assert repr(stage) == "Stage(name='linear', fn=_linear)"
    assert stage.map_consts(lambda t: t.to("meta")) is stage


def test_stage_rejects_non_callable() -> None:
    with pytest.raises(InvalidArgument, match="fn="):
        Stage(3)  # type: ignore[arg-type]


def test_as_inputs_convention() -> None:
    x = torch.zeros(1)
    assert as_inputs((x, x)) == (x, x)
    assert as_inputs(x) == (x,)
    d = {"a": x}
    assert as_inputs(d) == (d,)
    lst = [x, x]
    assert as_inputs(lst) == (lst,)
    Pair = namedtuple("Pair", "a b")
    pair = Pair(x, x)
    assert as_inputs(pair) == (pair,)


def test_from_module_params_are_aliases_with_module_names() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    stage, params = from_module(model)
    assert list(params) == [name for name, _ in model.named_parameters()]
    for name, p in model.named_parameters():
        assert params[name].data_ptr() == p.data_ptr()
        assert not params[name].requires_grad
    x = torch.randn(5, 3)
    with torch.no_grad():
        assert_trees_close(stage(params, x), model(x))
    assert stage.name == "Sequential"
    assert "functional_call(Sequential(0: Linear, 1: ReLU, 2: Linear), 4 params)" in repr(stage)


def test_from_module_uses_given_params() -> None:
    model = nn.Linear(3, 2)
    stage, params = from_module(model, name="head")
    zero = tree_map(torch.zeros_like, params)
    assert_trees_close(stage(zero, torch.randn(4, 3)), torch.zeros(4, 2))


def test_from_module_checks_param_names() -> None:
    stage, params = from_module(nn.Linear(3, 2))
    with pytest.raises(InvalidArgument, match=r"missing=\['bias'\], unexpected=\['extra'\]"):
        stage({"weight": params["weight"], "extra": params["bias"]}, torch.randn(1, 3))
    with pytest.raises(InvalidArgument, match="dict of parameter name"):
        stage([params["weight"]], torch.randn(1, 3))
    with pytest.raises(InvalidArgument, match="needs a torch.nn.Module"):
        from_module(_linear)  # type: ignore[arg-type]


def test_from_module_is_pure() -> None:
    """Calls and gradient steps never touch the module's parameters (values and identity)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    originals = list(model.parameters())
    saved = [p.detach().clone() for p in originals]
    stage, params = from_module(model)
    x = torch.randn(6, 3, dtype=torch.float64)
    y = torch.randn(6, 1, dtype=torch.float64)

    def mse(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((out - t) ** 2).mean()

    current = (params,)
    for _ in range(3):
        _, grads = reference_step([stage], current, x, mse, targets=y, microbatches=2)
        current = (tree_map(lambda p, g: p - 0.1 * g, current[0], grads[0]),)
    assert not torch.equal(current[0]["0.weight"], saved[0])
    for p, q, s in zip(model.parameters(), originals, saved, strict=True):
        assert p is q
        assert torch.equal(p.detach(), s)
        assert p.grad is None


def test_buffers_are_constants_and_map_consts_moves_them() -> None:
    model = nn.BatchNorm1d(3).eval()
    with torch.no_grad():
        model.running_mean.fill_(1.0)
    stage, params = from_module(model)
    assert set(params) == {"weight", "bias"}
    x = torch.randn(4, 3)
    with torch.no_grad():
        assert_trees_close(stage(params, x), model(x))
    meta = stage.map_consts(lambda t: torch.empty_like(t, device="meta"))
    assert meta is not stage and meta.name == stage.name
    out = meta(tree_map(lambda t: t.to("meta"), params), x.to("meta"))
    assert out.device.type == "meta" and out.shape == (4, 3)
    # The original stage keeps its real buffers.
    with torch.no_grad():
        assert_trees_close(stage(params, x), model(x))


def test_compose_chains_with_tuple_unpacking() -> None:
    def split_half(params: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x * params["s"], x.argmax(dim=-1)

    def use_both(
        params: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor
    ) -> torch.Tensor:
        return h.sum(-1) + idx + params["c"]

    lin_stage, lin_params = from_module(nn.Linear(3, 3))
    stage = compose(
        [(lin_stage, "lin"), (split_half, "split"), (Stage(use_both), "use")], name="block"
    )
    params = {"lin": lin_params, "split": {"s": torch.tensor(2.0)}, "use": {"c": torch.tensor(1.0)}}
    x = torch.randn(5, 3)
    with torch.no_grad():
        h = lin_stage(lin_params, x)
        expected = (h * 2).sum(-1) + h.argmax(-1) + 1
        assert_trees_close(stage(params, x), expected)
    assert repr(stage) == "Stage(name='block', fn=compose('lin', 'split', 'use'))"
    with pytest.raises(InvalidArgument, match="expected keys"):
        stage({"lin": lin_params}, x)
    meta = stage.map_consts(lambda t: t.to("meta"))
    assert meta is not stage


def test_compose_validates() -> None:
    with pytest.raises(InvalidArgument, match="at least one"):
        compose([], name="x")
    with pytest.raises(InvalidArgument, match="unique"):
        compose([(_linear, "a"), (_linear, "a")], name="x")
    with pytest.raises(InvalidArgument, match="keys must be str"):
        compose([(_linear, 0)], name="x")  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match=r"layers\[0\]"):
        compose([_linear], name="x")  # type: ignore[list-item]


def test_module_stage_swaps_tied_and_buffer_slots_like_functional_call() -> None:
    """The fast swap of from_module stages: aliases of one parameter (a tied weight) and buffers
    take the given values, and the module keeps its own tensors afterwards."""
    import torch
    from torch import nn

    from funcpipe import from_module

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3, bias=False)
            self.b = nn.Linear(3, 3, bias=False)
            self.b.weight = self.a.weight  # one parameter, two places
            self.register_buffer("shift", torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) + self.shift

    m = Tied()
    stage, params = from_module(m)
    assert list(params) == ["a.weight"]
    w = torch.randn(3, 3)
    x = torch.randn(2, 3)
    got = stage({"a.weight": w}, x)
    want = torch.func.functional_call(m, {"a.weight": w, "b.weight": w}, (x,))
    assert torch.allclose(got, want) and torch.allclose(got, x @ w.T @ w.T + 1)
    assert m.a.weight is m.b.weight and isinstance(m.a.weight, nn.Parameter)  # restored
    g = torch.autograd.grad(stage({"a.weight": w.requires_grad_()}, x).sum(), w)[0]
    assert torch.isfinite(g).all() and g.abs().sum() > 0
