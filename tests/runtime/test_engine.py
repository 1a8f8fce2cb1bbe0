"""funcpipe.runtime.engine.run: the autograd engine without torch.autograd.grad's preamble."""

from __future__ import annotations

import pytest
import torch
from torch.autograd.graph import get_gradient_edge

from funcpipe.runtime import autodiff, engine, linear

F64 = torch.float64


def _graph() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 5, generator=g, dtype=F64, requires_grad=True)
    x = torch.randn(3, 5, generator=g, dtype=F64, requires_grad=True)
    h = torch.nn.functional.linear(x, w)
    y = torch.tanh(h) * 2
    return w, x, h, y


@pytest.mark.parametrize("private", [True, False])
def test_run_matches_autograd_grad(monkeypatch: pytest.MonkeyPatch, private: bool) -> None:
    if not private:  # the fallback through the public functions
        monkeypatch.setattr(engine, "_run_backward", None)
    w, x, h, y = _graph()
    gy = torch.randn(y.shape, dtype=F64)
    want = torch.autograd.grad([y], [x, w, h], [gy], retain_graph=True)
    got = engine.run([y], [gy], [x, get_gradient_edge(w), get_gradient_edge(h)], retain=True)
    assert len(got) == 3
    for a, b in zip(got, want, strict=True):
        assert a is not None
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    unused = torch.zeros(2, dtype=F64, requires_grad=True)
    assert engine.run([y], [gy], [unused], retain=True) == (None,)
    engine.run([y], [gy], [w, x], accumulate=True)  # into .grad, frees the graph
    assert w.grad is not None and x.grad is not None
    torch.testing.assert_close(w.grad, want[1], rtol=0, atol=0)
    torch.testing.assert_close(x.grad, want[0], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        engine.run([y], [gy], [x])


def test_run_rejects_a_gradient_of_the_wrong_shape() -> None:
    _, x, _, y = _graph()
    with pytest.raises(RuntimeError, match="shape"):
        engine.run([y], [torch.ones(7, dtype=F64)], [x])


def test_the_runtime_calls_the_engine_only_through_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """B, the deferred B, I and W (direct and through the graph) never take the public path:
    a future engine call added elsewhere would miss ``run``'s savings (and its tests)."""

    def refuse(*a: object, **k: object) -> None:
        raise AssertionError("torch.autograd.grad / backward called directly")

    monkeypatch.setattr(torch.autograd, "grad", refuse)
    monkeypatch.setattr(torch.autograd, "backward", refuse)
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(4, 4, generator=g, dtype=F64), torch.randn(4, generator=g, dtype=F64)]
    params += [torch.randn(4, generator=g, dtype=F64)]

    def stage(ps, inputs):  # type: ignore[no-untyped-def]
        (h,) = inputs  # a Linear (direct) and a scale (through the engine)
        return [torch.tanh(torch.nn.functional.linear(h, ps[0], ps[1])) * ps[2]]

    x = torch.randn(3, 4, generator=g, dtype=F64)
    gy = [torch.randn(3, 4, generator=g, dtype=F64)]
    leaves = [p.clone().requires_grad_() for p in params]
    _, saved = autodiff.forward(stage, leaves, [x])
    autodiff.backward(saved, leaves, gy)
    _, saved = autodiff.forward(stage, leaves, [x])
    autodiff.backward(saved, leaves, gy, accumulate=True)
    _, saved = autodiff.forward(stage, leaves, [x])
    _, later = autodiff.backward_deferred(saved, leaves, gy)
    assert later is not None
    linear.weight_batch([later], leaves)
    _, saved = autodiff.forward(stage, leaves, [x])
    autodiff.backward_input(saved, leaves, gy)
    assert saved.roots  # the scale's W goes through the graph
    autodiff.backward_weight(saved, leaves, accumulate=True)
