"""One qkv projection instead of three: the same attention, and a row split that keeps heads."""

from __future__ import annotations

import pytest
import torch

from funcpipe.errors import InvalidArgument
from funcpipe.models import gpt
from funcpipe.parallel import ops
from funcpipe.parallel.spec import _is_linear
from funcpipe.testing import assert_trees_close

F64 = torch.float64


def _linear(g: torch.Generator, out: int, inp: int) -> dict[str, torch.Tensor]:
    return {
        "weight": torch.randn(out, inp, generator=g, dtype=F64),
        "bias": torch.randn(out, generator=g, dtype=F64),
    }


@pytest.mark.parametrize("causal", [False, True])
def test_fused_attention_equals_three_projections(causal: bool) -> None:
    g = torch.Generator().manual_seed(0)
    d, heads = 12, 3
    sep = {n: _linear(g, d, d) for n in ("q", "k", "v", "o")}
    fused = {
        "qkv": {
            n: ops.fuse_qkv(sep["q"][n], sep["k"][n], sep["v"][n], num_heads=heads)
            for n in ("weight", "bias")
        },
        "o": sep["o"],
    }
    x = torch.randn(2, 5, d, generator=g, dtype=F64)
    axis = gpt.single_axis()

    def run(params: dict) -> tuple[torch.Tensor, dict]:
        leaves = {
            k: {n: t.clone().requires_grad_() for n, t in v.items()} for k, v in params.items()
        }
        y = ops.parallel_attention(x, leaves, axis=axis, num_heads=heads, causal=causal)
        y.backward(torch.ones_like(y))
        return y, {k: {n: t.grad for n, t in v.items()} for k, v in leaves.items()}

    y_sep, g_sep = run(sep)
    y_fused, g_fused = run(fused)
    assert_trees_close(y_fused, y_sep)
    want = {
        n: ops.fuse_qkv(g_sep["q"][n], g_sep["k"][n], g_sep["v"][n], num_heads=heads)
        for n in ("weight", "bias")
    }
    assert_trees_close(g_fused["qkv"], want)
    assert_trees_close(g_fused["o"], g_sep["o"])


@pytest.mark.parametrize("t", [1, 2, 4])
def test_a_row_split_of_the_fused_weight_keeps_whole_heads(t: int) -> None:
    """Rank r's block of rows is the fused weight of rank r's heads: what column-parallel q, k
    and v shards give that rank."""
    g = torch.Generator().manual_seed(1)
    d, heads = 16, 4
    q, k, v = (torch.randn(d, d, generator=g, dtype=F64) for _ in range(3))
    fused = ops.fuse_qkv(q, k, v, num_heads=heads)
    for r, block in enumerate(fused.chunk(t)):
        mine = [w.chunk(t)[r] for w in (q, k, v)]
        assert torch.equal(block, ops.fuse_qkv(*mine, num_heads=heads // t))


def test_fuse_qkv_refuses_mismatched_shapes() -> None:
    with pytest.raises(InvalidArgument, match="num_heads=3"):
        ops.fuse_qkv(torch.zeros(4, 4), torch.zeros(4, 4), torch.zeros(4, 4), num_heads=3)
    with pytest.raises(InvalidArgument, match="one shape"):
        ops.fuse_qkv(torch.zeros(4, 4), torch.zeros(2, 4), torch.zeros(4, 4), num_heads=2)


@pytest.mark.parametrize(
    ("equation", "linear"),
    [
        ("...a,ba->...b", True),
        ("adb,cb->adc", True),
        ("ab,bc->ac", False),  # weight not [out, in]
        ("...a,ab->...b", False),
        ("ab,ba->a", False),
        ("abc,dc,e->abd", False),  # three operands
    ],
)
def test_which_local_products_lower_to_f_linear(equation: str, linear: bool) -> None:
    assert _is_linear(equation) is linear


def test_a_spec_adds_its_bias_once_and_refuses_a_non_tensor() -> None:
    from funcpipe.parallel import shard_spec

    g = torch.Generator().manual_seed(2)
    x, w, b = (torch.randn(*s, generator=g, dtype=F64) for s in ((3, 4), (5, 4), (5,)))
    axis = gpt.single_axis()
    spec = shard_spec("b i, o i -> b o", {"o": axis.name})
    assert_trees_close(spec(x, w, bias=b, mesh={axis.name: axis}), x @ w.T + b)
    outer = shard_spec("i, o -> o i", {})
    assert_trees_close(outer(x[0], b, bias=x[0][:1], mesh={}), torch.outer(b, x[0]) + x[0][:1])
    with pytest.raises(InvalidArgument, match="bias of pattern"):
        spec(x, w, bias=1.0, mesh={axis.name: axis})  # type: ignore[arg-type]


def test_a_bias_on_partial_sums_is_refused_before_any_collective() -> None:
    """reduce='partial' leaves each rank a partial sum: a bias fused there would be counted once
    per rank after the later reduction (a silently wrong result), so it is refused; at size 1
    there is no partial sum and the bias is added."""
    from funcpipe.parallel import shard_spec
    from funcpipe.parallel.mesh import Axis

    x, w, b = torch.ones(3, 2, dtype=F64), torch.ones(5, 2, dtype=F64), torch.ones(5, dtype=F64)
    spec = shard_spec("b i, o i -> b o", {"i": "tensor"}, reduce="partial")
    two = Axis("tensor", 2, 0, None)  # refused before any collective: no group needed
    with pytest.raises(InvalidArgument, match="partial sums over mesh axes \\['tensor'\\]"):
        spec(x, w, bias=b, mesh={"tensor": two})
    one = gpt.single_axis()
    assert_trees_close(spec(x, w, bias=b, mesh={"tensor": one}), x @ w.T + b)
