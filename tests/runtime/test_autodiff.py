"""The backward split: I then W gives exactly B's gradients; recompute replays the same forward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from funcpipe.runtime import autodiff
from funcpipe.testing import assert_trees_close

F64 = torch.float64


def _stage(  # type: ignore[no-untyped-def]
    depth: int, *, reuse: bool, param_output: bool, bias: bool, linear: str = "matmul"
):
    """``linear``: how a layer multiplies: "matmul" (``h @ w.T`` then ``+ b``), "linear"
    (``F.linear``: addmm with the bias) or "right"
    (``h @ w`` with ``w`` untransposed)."""

    def fn(params, inputs):  # type: ignore[no-untyped-def]
        (x,) = inputs
        h = x + params[-1]  # a parameter joining the input path right away
        for k in range(depth):
            w = params[0] if (reuse and k == depth - 1) else params[k]
            b = params[depth + k] if bias else None
            if linear == "linear":
                h = torch.nn.functional.linear(h, w, b)
            else:
                h = h @ (w if linear == "right" else w.T)
                if b is not None:
                    h = h + b
            h = torch.tanh(h)
        outs = [h]
        if param_output:
            outs.append(params[-1] * 3.0)  # depends on parameters only
        return outs

    return fn


@given(
    depth=st.integers(1, 4),
    reuse=st.booleans(),
    param_output=st.booleans(),
    bias=st.booleans(),
    input_grad=st.booleans(),
    linear=st.sampled_from(["matmul", "linear", "right"]),
    rows=st.sampled_from([(3,), (2, 3)]),
    seed=st.integers(0, 2**16),
)
def test_input_then_weight_equals_full_backward(
    depth: int,
    reuse: bool,
    param_output: bool,
    bias: bool,
    input_grad: bool,
    linear: str,
    rows: tuple[int, ...],
    seed: int,
) -> None:
    g = torch.Generator().manual_seed(seed)
    d = 5
    params = [torch.randn(d, d, generator=g, dtype=F64) for _ in range(depth)]
    params += [torch.randn(d, generator=g, dtype=F64) for _ in range(depth)]
    params += [torch.randn(d, generator=g, dtype=F64)]
    params = [p.requires_grad_() for p in params]
    x = torch.randn(*rows, d, generator=g, dtype=F64)
    fn = _stage(depth, reuse=reuse, param_output=param_output, bias=bias, linear=linear)
    n_out = 2 if param_output else 1
    grads_out = [
        torch.randn(*rows, d, generator=g, dtype=F64),
        torch.randn(d, generator=g, dtype=F64),
    ][:n_out]

    def zeros_for_none(got, like):  # type: ignore[no-untyped-def]
        return [torch.zeros_like(t) if g is None else g for g, t in zip(got, like, strict=True)]

    _, saved = autodiff.forward(fn, params, [x])
    if not input_grad:
        saved.inputs[0].requires_grad_(False)
    full_in, full_w = autodiff.backward(saved, params, grads_out)
    full_in, full_w = zeros_for_none(full_in, [x]), zeros_for_none(full_w, params)

    _, saved = autodiff.forward(fn, params, [x])
    if not input_grad:
        saved.inputs[0].requires_grad_(False)
    split_in = zeros_for_none(autodiff.backward_input(saved, params, grads_out), [x])
    split_w = zeros_for_none(autodiff.backward_weight(saved, params), params)
    assert_trees_close(split_in, full_in, rtol=1e-13, atol=1e-13)
    assert_trees_close(split_w, full_w, rtol=1e-13, atol=1e-13)

    # and both equal plain autograd
    leaves = [p.detach().requires_grad_() for p in params]
    xx = x.detach().requires_grad_()
    ref = torch.autograd.grad(fn(leaves, [xx]), [xx, *leaves], grads_out, allow_unused=True)
    ref = [torch.zeros_like(t) if r is None else r for t, r in zip([xx, *leaves], ref, strict=True)]
    assert_trees_close(full_w, ref[1:])
    if input_grad:
        assert_trees_close(full_in, ref[:1])

    # accumulate=True: two microbatches' parameter gradients summed by autograd into .grad of
    # the leaves (B for one, I then W for the other), input gradients still returned
    acc = [p.detach().requires_grad_() for p in params]
    for split in (False, True):
        _, saved = autodiff.forward(fn, acc, [x])
        if not input_grad:
            saved.inputs[0].requires_grad_(False)
        if split:
            got_in = autodiff.backward_input(saved, acc, grads_out)
            assert autodiff.backward_weight(saved, acc, accumulate=True) == [None] * len(acc)
        else:
            got_in, none = autodiff.backward(saved, acc, grads_out, accumulate=True)
            assert none == [None] * len(acc)
        assert_trees_close(zeros_for_none(got_in, [x]), full_in, rtol=1e-13, atol=1e-13)
        assert saved.inputs[0].grad is None  # handed over, not left on the leaf
    summed = [torch.zeros_like(p) if p.grad is None else p.grad for p in acc]
    assert_trees_close(summed, [2 * w for w in full_w], rtol=1e-13, atol=1e-13)


def test_recompute_replays_dropout_exactly() -> None:
    w = torch.randn(6, 6, dtype=F64).requires_grad_()

    def fn(params, inputs):  # type: ignore[no-untyped-def]
        return [torch.nn.functional.dropout(inputs[0] @ params[0], p=0.5, training=True)]

    x = torch.randn(4, 6, dtype=F64)
    gy = [torch.ones(4, 6, dtype=F64)]
    torch.manual_seed(7)
    kept_out, saved = autodiff.forward(fn, [w], [x])
    kept = autodiff.backward(saved, [w], gy)
    torch.manual_seed(7)
    lazy_out, saved = autodiff.forward(fn, [w], [x], keep=False)
    torch.rand(100)  # other work moves the global RNG on before the backward
    autodiff.recompute(fn, [w], saved)
    lazy = autodiff.backward(saved, [w], gy)
    assert_trees_close(lazy_out, kept_out, rtol=0, atol=0)
    assert_trees_close(lazy, kept, rtol=0, atol=0)


def test_backward_without_a_graph_is_an_error() -> None:
    w = torch.randn(2, 2, dtype=F64).requires_grad_()
    _, saved = autodiff.forward(
        lambda p, i: [i[0] @ p[0]], [w], [torch.randn(1, 2, dtype=F64)], keep=False
    )
    with pytest.raises(RuntimeError, match="recompute"):
        autodiff.backward(saved, [w], [None])


def test_weight_of_a_linear_with_mixed_dtypes() -> None:
    """A product whose operands' dtype differs from its parameter's (a cast between them): W's
    gradient has the parameter's dtype and equals B's."""
    w = torch.randn(4, 4, dtype=F64).requires_grad_()

    def fn(params, inputs):  # type: ignore[no-untyped-def]
        return [torch.nn.functional.linear(inputs[0], params[0].float())]

    x = torch.randn(3, 4)
    gy = [torch.randn(3, 4)]
    _, saved = autodiff.forward(fn, [w], [x])
    (want,) = autodiff.backward(saved, [w], gy)[1]
    _, saved = autodiff.forward(fn, [w], [x])
    autodiff.backward_input(saved, [w], gy)
    (got,) = autodiff.backward_weight(saved, [w])
    assert got is not None and got.dtype == F64
    assert_trees_close([got], [want])


def test_weight_gradients_record_no_graph() -> None:
    """W starts from nodes whose saved inputs require grad: its gradients must still be plain
    values (no graph attached, nothing kept alive)."""
    w = torch.randn(4, 4, dtype=F64).requires_grad_()
    b = torch.randn(4, dtype=F64).requires_grad_()

    def fn(params, inputs):  # type: ignore[no-untyped-def]
        h = torch.tanh(inputs[0])  # the product's input is an intermediate requiring grad
        return [torch.nn.functional.linear(h, params[0], params[1])]

    x = torch.randn(3, 4, dtype=F64)
    for accumulate in (False, True):
        _, saved = autodiff.forward(fn, [w, b], [x])
        autodiff.backward_input(saved, [w, b], [torch.ones(3, 4, dtype=F64)])
        got = autodiff.backward_weight(saved, [w, b], accumulate=accumulate)
        grads = [w.grad, b.grad] if accumulate else got
        assert all(t is not None and not t.requires_grad and t.grad_fn is None for t in grads)


class _Scaled(torch.autograd.Function):
    """``x @ w * 2`` whose backward computes both gradients whatever is asked (as a compiled
    region's does)."""

    @staticmethod
    def forward(ctx, x, w):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, w)
        return x @ w * 2

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def]
        x, w = ctx.saved_tensors
        return g @ w.T * 2, x.T @ g * 2


@pytest.mark.parametrize("kind", ["function", "compiled"])
def test_a_join_that_computes_every_gradient_runs_once(kind: str) -> None:
    """I keeps the parameter gradients such a join passed on; W starts below it and never runs
    it again, and the gradients are B's."""
    if kind == "function":

        def inner(x, w):  # type: ignore[no-untyped-def]
            return _Scaled.apply(x, w)

    else:
        inner = torch.compile(lambda x, w: x @ w * 2, backend="aot_eager")

    def fn(params, inputs):  # type: ignore[no-untyped-def]
        return [torch.tanh(inner(inputs[0], params[0])) + params[1]]

    g = torch.Generator().manual_seed(0)
    params = [
        torch.randn(*shape, generator=g, dtype=F64).requires_grad_() for shape in ((4, 4), (4,))
    ]
    x = torch.randn(3, 4, generator=g, dtype=F64)
    seed = [torch.randn(3, 4, generator=g, dtype=F64)]
    _, saved = autodiff.forward(fn, params, [x])
    want_in, want_p = autodiff.backward(saved, params, seed)
    _, saved = autodiff.forward(fn, params, [x])
    runs: list[int] = []
    node = saved.outputs[0].grad_fn.next_functions[0][0].next_functions[0][0]  # inner's node
    node.register_prehook(lambda grads: runs.append(1))
    got_in = autodiff.backward_input(saved, params, seed)
    got_p = autodiff.backward_weight(saved, params)
    assert len(runs) == 1  # in I only
    assert_trees_close((got_in, got_p), (want_in, want_p))
