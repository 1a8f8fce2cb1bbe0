from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from funcpipe import (
    InvalidArgument,
    ShapeInferenceError,
    ShapeInferenceWarning,
    Stage,
    StageSpec,
    TensorSpec,
    as_inputs,
    infer_specs,
    partition,
)
from funcpipe.tree import tree_map

# A small menu of function layers: (fn, params) pairs.


def _linear(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ params["w"])


def _fork(params: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A tuple output with an integer side tensor."""
    return x * params["s"], x.argmax(dim=-1)


def _join(params: dict[str, torch.Tensor], h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return h + idx[:, None].to(h.dtype) * params["s"]


def _to_dict(params: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, Any]:
    return {"h": x, "sq": (x * x).sum(-1, keepdim=True), "none": None}


def _from_dict(params: dict[str, torch.Tensor], d: dict[str, torch.Tensor]) -> torch.Tensor:
    return d["h"] * d["sq"]


@st.composite
def models(draw: Any) -> tuple[list[tuple[Any, Any]], int, torch.dtype]:
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    width = draw(st.integers(1, 6))
    d_in = width
    layers: list[tuple[Any, Any]] = []
    for block in draw(
        st.lists(st.sampled_from(["linear", "forkjoin", "dict"]), min_size=1, max_size=4)
    ):
        if block == "linear":
            d_out = draw(st.integers(1, 6))
            layers.append((_linear, {"w": torch.randn(width, d_out, dtype=dtype)}))
            width = d_out
        elif block == "forkjoin":
            s = torch.ones((), dtype=dtype)
            layers += [(_fork, {"s": s}), (_join, {"s": s})]
        else:
            layers += [(_to_dict, {}), (_from_dict, {})]
    return layers, d_in, dtype


def _real_specs(stages: Any, params: Any, example: Any) -> list[tuple[Any, Any]]:
    inputs = as_inputs(example)
    out = []
    with torch.no_grad():
        for stage, p in zip(stages, params, strict=True):
            outputs = stage(p, *inputs)
            out.append(
                (
                    tree_map(TensorSpec.from_tensor, inputs),
                    tree_map(TensorSpec.from_tensor, outputs),
                )
            )
            inputs = as_inputs(outputs)
    return out


@given(model=models(), batch=st.integers(1, 5), data=st.data())
def test_inferred_specs_match_real_run(model: Any, batch: int, data: Any) -> None:
    layers, d_in, dtype = model
    n = data.draw(st.integers(1, len(layers)), label="stages")
    part = partition(layers, n)
    x = torch.randn(batch, d_in, dtype=dtype)
    specs = infer_specs(part.stages, part.params, x)
    assert len(specs) == n
    for spec, (inputs, outputs) in zip(
        specs, _real_specs(part.stages, part.params, x), strict=True
    ):
        assert spec.method == "fake"
        assert spec.inputs == inputs
        assert spec.outputs == outputs


def test_module_stages_with_buffers_and_tuple_example() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4).eval(), nn.Linear(4, 2)).double()
    part = partition(model, 2)
    specs = infer_specs(part.stages, part.params, (torch.zeros(5, 3, dtype=torch.float64),))
    assert [repr(s.inputs) for s in specs] == ["(f64[5, 3],)", "(f64[5, 4],)"]
    assert repr(specs[-1].outputs) == "f64[5, 2]"
    assert repr(specs[0]) == "StageSpec(inputs=(f64[5, 3],), outputs=f64[5, 4], method='fake')"


def _filter_positive(params: Any, x: torch.Tensor) -> torch.Tensor:
    return x[torch.nonzero(x[:, 0] > 0).squeeze(1)]


def _scale_by_item(params: Any, x: torch.Tensor) -> torch.Tensor:
    return x * float(x.abs().sum().item())


def _double(params: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x], dim=-1)


def test_meta_fallback_runs_real_microbatch() -> None:
    x = torch.tensor([[1.0, 2.0], [-1.0, 0.0], [3.0, 1.0]])
    stages = [Stage(_double, "double"), Stage(_filter_positive, "filter"), Stage(_double, "again")]
    with pytest.warns(
        ShapeInferenceWarning, match=r"stage 1 \('filter'\) cannot run on tensors without data"
    ):
        specs = infer_specs(stages, [{}, {}, {}], x)
    assert [s.method for s in specs] == ["fake", "real", "fake"]
    assert specs[1].inputs == (TensorSpec((3, 4), torch.float32),)
    assert specs[1].outputs == TensorSpec((2, 4), torch.float32)  # two rows have x[:, 0] > 0
    assert specs[2].outputs == TensorSpec((2, 8), torch.float32)


def test_item_falls_back_too() -> None:
    with pytest.warns(ShapeInferenceWarning, match="item"):
        specs = infer_specs([Stage(_scale_by_item, "item")], [{}], torch.ones(2, 3))
    assert specs[0].outputs == TensorSpec((2, 3), torch.float32)


def test_fallback_error() -> None:
    with pytest.raises(
        ShapeInferenceError, match=r"stage 0 \('filter'\) cannot run on tensors without data"
    ):
        infer_specs([Stage(_filter_positive, "filter")], [{}], torch.ones(2, 2), fallback="error")


def test_non_tensor_output_leaf() -> None:
    def bad(params: Any, x: torch.Tensor) -> tuple[torch.Tensor, float]:
        return x, 1.5

    with pytest.raises(
        InvalidArgument, match=r"stage 1 \('bad'\) returned a non-tensor leaf: outputs\[1\]=1\.5"
    ):
        infer_specs([Stage(_double, "ok"), Stage(bad, "bad")], [{}, {}], torch.ones(2, 2))


def test_none_inside_outputs_is_fine() -> None:
    def with_none(params: Any, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return x, None

    def takes_none(params: Any, x: torch.Tensor, nothing: None) -> torch.Tensor:
        assert nothing is None
        return x

    specs = infer_specs([Stage(with_none), Stage(takes_none)], [{}, {}], torch.ones(2, 2))
    assert specs[1].inputs == (TensorSpec((2, 2), torch.float32), None)


def test_real_errors_surface_after_warning() -> None:
    def broken(params: Any, x: torch.Tensor) -> torch.Tensor:
        return x @ torch.ones(5, 5)

    with pytest.warns(ShapeInferenceWarning), pytest.raises(RuntimeError):
        infer_specs([Stage(broken)], [{}], torch.ones(2, 2))


def test_infer_specs_argument_errors() -> None:
    with pytest.raises(InvalidArgument, match="got 1 stages and 2 params"):
        infer_specs([Stage(_double)], [{}, {}], torch.ones(1))
    with pytest.raises(
        InvalidArgument, match="fallback must be 'real' or 'error'; got fallback='x'"
    ):
        infer_specs([Stage(_double)], [{}], torch.ones(1), fallback="x")
    with pytest.raises(InvalidArgument, match=r"example\[0\]\['a'\]=1"):
        infer_specs([Stage(_double)], [{}], {"a": 1})
    with pytest.raises(InvalidArgument, match=r"stages\[0\] must be a Stage"):
        infer_specs([_double], [{}], torch.ones(1))  # type: ignore[list-item]
    with pytest.raises(InvalidArgument, match="stages is empty"):
        infer_specs([], [], torch.ones(1))


def test_tensor_spec() -> None:
    spec = TensorSpec(torch.Size([4, 16]), torch.float32)
    assert spec.shape == (4, 16) and isinstance(spec.shape, tuple)
    assert repr(spec) == "f32[4, 16]"
    assert repr(TensorSpec((), torch.int64)) == "i64[]"
    assert repr(TensorSpec((2,), torch.bfloat16)) == "bf16[2]"
    assert repr(TensorSpec((2,), torch.uint16)) == "uint16[2]"
    assert spec.empty().device.type == "meta" and spec.empty().shape == (4, 16)
    assert torch.equal(spec.zeros(), torch.zeros(4, 16))
    assert TensorSpec.from_tensor(torch.zeros(2, 3, dtype=torch.bool)) == TensorSpec(
        (2, 3), torch.bool
    )
    with pytest.raises(InvalidArgument, match=r"shape=\(2, -1\)"):
        TensorSpec((2, -1), torch.float32)
    with pytest.raises(InvalidArgument, match="dtype="):
        TensorSpec((2,), "float32")  # type: ignore[arg-type]
    assert StageSpec((spec,), spec, "meta").method == "meta"
