from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn

from funcpipe import InvalidArgument, Stage, merge, partition, reference_step, split
from funcpipe.testing import assert_trees_close


def _mse(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return ((outputs - targets) ** 2).mean()


def _mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 3)
    ).double()


def _plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, m: int) -> tuple[Any, Any]:
    """Plain autograd on the unpartitioned module: mean over microbatches of the loss."""
    losses = [_mse(model(xb), yb) for xb, yb in zip(split(x, m), split(y, m), strict=True)]
    loss = torch.stack(losses).mean()
    names = [name for name, _ in model.named_parameters()]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), dict(zip(names, grads, strict=True))


@pytest.mark.parametrize(("n_stages", "by"), [(1, "uniform"), (2, "parameters"), (3, [1, 3])])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7])
def test_matches_plain_autograd_on_module(n_stages: int, by: Any, m: int) -> None:
    model = _mlp()
    x = torch.randn(10, 4, dtype=torch.float64)
    y = torch.randn(10, 3, dtype=torch.float64)
    part = partition(model, n_stages, by=by)
    loss, grads, outputs = reference_step(
        part.stages, part.params, x, _mse, targets=y, microbatches=m, return_outputs=True
    )
    expected_loss, expected_grads = _plain_step(model, x, y, m)
    assert_trees_close(loss, expected_loss)
    assert_trees_close({k: v for g in grads for k, v in g.items()}, expected_grads)
    for g, p in zip(grads, part.params, strict=True):
        assert list(g) == list(p)
    with torch.no_grad():
        assert_trees_close(outputs, model(x))


def test_even_microbatches_equal_full_batch_loss() -> None:
    model = _mlp()
    x, y = torch.randn(12, 4, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64)
    part = partition(model, 2)
    loss, _ = reference_step(part.stages, part.params, x, _mse, targets=y, microbatches=4)
    with torch.no_grad():
        assert_trees_close(loss, _mse(model(x), y))


def _affine(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ params["w"] + params["b"])


def test_function_layers_match_plain_autograd() -> None:
    widths = [3, 5, 4, 2]
    layer_params = [
        {"w": torch.randn(a, b, dtype=torch.float64), "b": torch.randn(b, dtype=torch.float64)}
        for a, b in itertools.pairwise(widths)
    ]
    part = partition([(_affine, p) for p in layer_params], 2, by="parameters")
    x, y = torch.randn(7, 3, dtype=torch.float64), torch.randn(7, 2, dtype=torch.float64)
    loss, grads = reference_step(part.stages, part.params, x, _mse, targets=y, microbatches=3)

    leaves = [{k: v.clone().requires_grad_(True) for k, v in p.items()} for p in layer_params]
    losses = []
    for xb, yb in zip(split(x, 3), split(y, 3), strict=True):
        h = xb
        for p in leaves:
            h = _affine(p, h)
        losses.append(_mse(h, yb))
    expected = torch.stack(losses).mean()
    flat = [t for p in leaves for t in p.values()]
    expected_grads = torch.autograd.grad(expected, flat)
    assert_trees_close(loss, expected.detach())
    ours = [t for g in grads for layer in g.values() for t in layer.values()]
    assert_trees_close(ours, list(expected_grads))


def test_tuple_batch_is_unpacked_and_targets_optional() -> None:
    def masked(
        params: dict[str, torch.Tensor], x: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        return (x @ params["w"]) * mask[:, None]

    w = torch.randn(3, 2, dtype=torch.float64)
    x = torch.randn(6, 3, dtype=torch.float64)
    mask = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.float64)
    loss, grads = reference_step(
        [Stage(masked)], [{"w": w}], (x, mask), lambda out: out.sum(), microbatches=3
    )
    wg = w.clone().requires_grad_(True)
    expected = ((x @ wg) * mask[:, None]).sum() / 3
    assert_trees_close(loss, expected.detach())
    assert_trees_close(grads[0]["w"], torch.autograd.grad(expected, wg)[0])


def test_unused_params_get_zero_grads_and_params_untouched() -> None:
    def uses_a(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x * params["a"]

    params = {"a": torch.tensor(2.0), "unused": torch.ones(3), "nested": (torch.zeros(2),)}
    _, grads = reference_step(
        [Stage(uses_a)], [params], torch.ones(4), lambda o: o.sum(), microbatches=2
    )
    assert_trees_close(
        grads[0], {"a": torch.tensor(2.0), "unused": torch.zeros(3), "nested": (torch.zeros(2),)}
    )
    assert not params["a"].requires_grad and params["a"].grad is None


def test_works_under_no_grad_and_with_dims() -> None:
    def proj(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x @ params["w"]

    w = torch.randn(3, 2, dtype=torch.float64)
    x = torch.randn(5, 3, dtype=torch.float64).T.contiguous()  # batch along dim 1

    def proj_t(params: dict[str, torch.Tensor], xt: torch.Tensor) -> torch.Tensor:
        return proj(params, xt.T).T  # (2, batch)

    y = torch.randn(2, 5, dtype=torch.float64)
    with torch.no_grad():
        _, grads, out = reference_step(
            [Stage(proj_t)],
            [{"w": w}],
            x,
            _mse,
            targets=y,
            microbatches=2,
            dim=1,
            return_outputs=True,
        )
    assert out.shape == (2, 5)
    assert_trees_close(out, (x.T @ w).T)
    assert grads[0]["w"].shape == (3, 2)
    parts = split(x, 2, dim=1)
    assert_trees_close(merge(parts, dim=1), x)


def test_reference_errors() -> None:
    stage, params = Stage(_affine), {"w": torch.ones(2, 2), "b": torch.ones(2)}
    x, y = torch.ones(4, 2), torch.ones(4, 2)
    with pytest.raises(
        InvalidArgument,
        match=r"loss_fn must return a scalar tensor; for microbatch 0 it returned a tensor of shape \(2, 2\)",
    ):
        reference_step([stage], [params], x, lambda o: o, microbatches=2)
    with pytest.raises(InvalidArgument, match="loss_fn must return a scalar tensor.*returned 3.0"):
        reference_step([stage], [params], x, lambda o: 3.0)
    with pytest.raises(InvalidArgument, match="loss_fn must be callable"):
        reference_step([stage], [params], x, None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="got 1 stages and 2 params"):
        reference_step([stage], [params, params], x, _mse, targets=y)
    with pytest.raises(
        InvalidArgument,
        match=r"stage 0 \('stage'\) must be floating point.*params\[0\]\['i'\] with dtype torch.int64",
    ):
        reference_step(
            [stage], [{**params, "i": torch.ones(2, dtype=torch.int64)}], x, _mse, targets=y
        )
    with pytest.raises(InvalidArgument, match=r"params\[0\]\['w'\]=1"):
        reference_step([stage], [{"w": 1}], x, _mse, targets=y)
    with pytest.raises(InvalidArgument, match="batch has 4 and targets has 3"):
        reference_step([stage], [params], x, _mse, targets=torch.ones(3, 2))
    with pytest.raises(InvalidArgument, match="batch has 4 samples along dim 0 but microbatches=5"):
        reference_step([stage], [params], x, _mse, targets=y, microbatches=5)
    with pytest.raises(InvalidArgument, match="stages is empty"):
        reference_step([], [], x, _mse)


def _masked_first(p: dict[str, torch.Tensor], x: torch.Tensor, *, mask: torch.Tensor) -> Any:
    return torch.tanh(x @ p["W"]) * mask[:, None]


def _masked_last(p: dict[str, torch.Tensor], h: torch.Tensor, *, mask: torch.Tensor) -> Any:
    return (h @ p["U"]) * mask[:, None]


def test_side_inputs_reach_each_stage_as_in_a_pipeline() -> None:
    """``side_inputs``: a mask field of the batch, split like it, passed to both stages as a
    keyword; the reference equals plain autograd over the whole batch and the pipeline step."""
    from funcpipe import Pipeline
    from funcpipe.schedule import generate

    g = torch.Generator().manual_seed(0)
    params = (
        {"W": torch.randn(4, 4, generator=g, dtype=torch.float64)},
        {"U": torch.randn(4, 3, generator=g, dtype=torch.float64)},
    )
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randn(8, 3, generator=g, dtype=torch.float64)
    mask = (torch.rand(8, generator=g) > 0.3).double()
    stages = [Stage(_masked_first), Stage(_masked_last)]
    side = {0: ["mask"], 1: ["mask"]}
    batch = {"inputs": x, "mask": mask}

    def mse(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((out - t) ** 2).mean()

    loss, grads = reference_step(
        stages, params, batch, mse, targets=y, microbatches=4, side_inputs=side
    )
    leaves = [params[0]["W"].clone().requires_grad_(), params[1]["U"].clone().requires_grad_()]
    want = mse(_masked_last({"U": leaves[1]}, _masked_first({"W": leaves[0]}, x, mask=mask),
                            mask=mask), y)  # fmt: skip
    dw, du = torch.autograd.grad(want, leaves)
    assert_trees_close((loss, grads), (want.detach(), ({"W": dw}, {"U": du})), atol=1e-12, rtol=0)
    pipe = Pipeline(
        stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=mse, side_inputs=side
    )
    step = pipe.step(params, batch, y)
    assert_trees_close((step.loss, step.grads), (loss, grads), atol=1e-12, rtol=0)
    with pytest.raises(InvalidArgument, match="side_inputs need batch keys \\['mask'\\]"):
        reference_step(stages, params, {"inputs": x}, mse, targets=y, side_inputs=side)
