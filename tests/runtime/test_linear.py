"""Direct weight gradients of Linear-shaped products: deferred from B, summed over microbatches
in one product, equal to autograd's; and the interpreter's plan of when to sum them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import funcpipe as fp
from funcpipe.errors import InvalidArgument
from funcpipe.runtime import autodiff, linear
from funcpipe.runtime.interpreter import _deferral_plan
from funcpipe.schedule import GENERATORS, generate
from funcpipe.schedule.ir import Op
from funcpipe.testing import assert_trees_close
from tests.runtime.test_autodiff import _stage

F64 = torch.float64


@given(
    depth=st.integers(1, 3),
    reuse=st.booleans(),
    param_output=st.booleans(),
    bias=st.booleans(),
    input_grad=st.booleans(),
    kind=st.sampled_from(["matmul", "linear", "right"]),
    rows=st.sampled_from([(3,), (2, 3)]),
    microbatches=st.integers(1, 4),
    extra_use=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_deferred_then_batched_equals_whole_backwards(
    depth: int,
    reuse: bool,
    param_output: bool,
    bias: bool,
    input_grad: bool,
    kind: str,
    rows: tuple[int, ...],
    microbatches: int,
    extra_use: bool,
    seed: int,
) -> None:
    """k microbatches' B with their direct products deferred, then one weight_batch: the same
    input gradients per microbatch and the same parameter gradient sums as k ordinary Bs. A
    weight used twice (reuse), a parameter joining the input path by an add, a parameter-only
    output, a product weight also used outside any product (``extra_use``) and a stage whose
    input needs no gradient (the entry stage) go through the engine."""
    g = torch.Generator().manual_seed(seed)
    d = 4
    base = [torch.randn(d, d, generator=g, dtype=F64) for _ in range(depth)]
    base += [torch.randn(d, generator=g, dtype=F64) for _ in range(depth)]
    base += [torch.randn(d, generator=g, dtype=F64)]
    inner = _stage(depth, reuse=reuse, param_output=param_output, bias=bias, linear=kind)

    def fn(params, inputs):  # type: ignore[no-untyped-def]
        outs = list(inner(params, inputs))
        if extra_use:  # the first layer's weight, also outside its product
            outs[0] = outs[0] + (params[0] * params[0]).sum()
        return outs

    xs = [torch.randn(*rows, d, generator=g, dtype=F64) for _ in range(microbatches)]
    gys = [
        [torch.randn(*rows, d, generator=g, dtype=F64), torch.randn(d, generator=g, dtype=F64)][
            : 2 if param_output else 1
        ]
        for _ in range(microbatches)
    ]
    whole = [p.clone().requires_grad_() for p in base]
    later = [p.clone().requires_grad_() for p in base]
    nodes = None
    waiting = []
    for x, gy in zip(xs, gys, strict=True):
        _, saved = autodiff.forward(fn, whole, [x])
        if not input_grad:
            saved.inputs[0].requires_grad_(False)
        want_in, _ = autodiff.backward(saved, whole, gy, accumulate=True)
        _, saved = autodiff.forward(fn, later, [x])
        if not input_grad:
            saved.inputs[0].requires_grad_(False)
        nodes = nodes or autodiff.param_nodes(later)
        got_in, deferred = autodiff.backward_deferred(saved, later, gy, nodes=nodes)
        assert saved.outputs is None  # the graph is freed either way
        assert_trees_close(
            [torch.zeros(1) if t is None else t for t in got_in],
            [torch.zeros(1) if t is None else t for t in want_in],
            rtol=1e-13,
            atol=1e-13,
        )
        if deferred is not None:
            waiting.append(deferred)
    linear.weight_batch(waiting, later)
    zeros = [torch.zeros_like(p) if p.grad is None else p.grad for p in whole]
    got = [torch.zeros_like(p) if p.grad is None else p.grad for p in later]
    assert_trees_close(got, zeros, rtol=1e-12, atol=1e-12)
    assert all(not d.items for d in waiting)  # handed over


def test_a_linear_stage_defers_every_weight_and_its_engine_call_computes_none() -> None:
    g = torch.Generator().manual_seed(0)
    layers = [torch.nn.Linear(5, 5, dtype=F64) for _ in range(3)]
    params = [t.detach().clone().requires_grad_() for m in layers for t in (m.weight, m.bias)]

    def fn(ps, inputs):  # type: ignore[no-untyped-def]
        h = inputs[0]
        for k in range(3):
            h = torch.nn.functional.gelu(torch.nn.functional.linear(h, ps[2 * k], ps[2 * k + 1]))
        return [h]

    _, saved = autodiff.forward(fn, params, [torch.randn(4, 5, generator=g, dtype=F64)])
    _, deferred = autodiff.backward_deferred(saved, params, [torch.ones(4, 5, dtype=F64)])
    assert deferred is not None and len(deferred.items) == 3
    assert all(p.grad is None for p in params)  # nothing computed for them yet
    linear.weight_batch([deferred], params)
    assert all(p.grad is not None and p.grad.grad_fn is None for p in params)


def test_a_stage_without_direct_products_is_an_ordinary_backward() -> None:
    w = torch.randn(3, dtype=F64).requires_grad_()
    _, saved = autodiff.forward(lambda p, i: [torch.tanh(i[0] * p[0])], [w], [torch.ones(3)])
    got_in, deferred = autodiff.backward_deferred(saved, [w], [torch.ones(3, dtype=F64)])
    assert deferred is None and w.grad is not None and got_in[0] is not None


def _live(instrs, defer, flush_at):  # type: ignore[no-untyped-def]
    """The activation count along a rank's instructions under a deferral plan (as the
    interpreter keeps it): a deferred B stays alive until the next flush."""
    live = peak = waiting = 0
    for t, i in enumerate(instrs):
        if t in flush_at:
            live -= waiting
            waiting = 0
        if i.op in (Op.F, Op.R):
            live += 1
        elif i.op is Op.B and t in defer:
            waiting += 1
        elif i.op in (Op.B, Op.W):
            live -= 1
        peak = max(peak, live)
    return peak, waiting


@given(
    name=st.sampled_from(sorted(n for n in GENERATORS if n != "chimera")),
    ranks=st.integers(1, 4),
    microbatches=st.integers(1, 10),
    extra=st.sampled_from([0, 0, 1, 3]),
)
def test_the_deferral_plan_keeps_the_programs_peak(
    name: str, ranks: int, microbatches: int, extra: int
) -> None:
    """For every generator: with the plan, no rank keeps more activations than the program's
    own peak (plus ``extra``, Pipeline's batch_weights_extra), every deferred B is summed with
    at least one other, and REDUCE never sees a waiting product; without ``extra`` nothing is
    summed before an F (only before a REDUCE or at the end)."""
    try:
        program = fp.schedule.add_reduce(generate(name, ranks=ranks, microbatches=microbatches))
    except InvalidArgument:
        return  # sizes the generator does not support
    peaks = fp.schedule.peak_activations(program)
    for r, instrs in enumerate(program.ranks):
        defer, flush_at = _deferral_plan(instrs, frozenset(), extra=extra)
        assert all(instrs[t].op is Op.B for t in defer)
        peak, _ = _live(instrs, defer, flush_at)
        assert peak <= peaks[r] + extra
        for t in flush_at:
            assert instrs[t].op in ((Op.F, Op.R, Op.REDUCE) if extra else (Op.REDUCE,))
        if name == "gpipe" and microbatches > 1:
            assert len(defer) == microbatches  # all of a rank's backwards summed at once
        if defer:
            assert len(defer) >= 2


@pytest.mark.parametrize("extra", [0, 1, 2])
def test_extra_memory_lets_1f1b_sum_its_steady_state_weights_in_groups(extra: int) -> None:
    """The last rank of 1F1B keeps one activation at a time: with no extra it sums every B's
    weights alone; with ``extra`` = k it sums them in groups of up to k + 1, keeping at most
    1 + k activations."""
    instrs = generate("1f1b", ranks=2, microbatches=8).ranks[1]
    defer, flush_at = _deferral_plan(instrs, frozenset(), extra=extra)
    bs = [t for t, i in enumerate(instrs) if i.op is Op.B]
    peak, _ = _live(instrs, defer, flush_at)
    assert peak == 1 + extra
    if extra == 0:
        assert defer == set()
    else:
        assert defer == set(bs)
        # a group: the B's between two flushes (the last one: summed at the end)
        group_of = [sum(f <= t for f in flush_at) for t in bs]
        sizes = [group_of.count(g) for g in sorted(set(group_of))]
        assert max(sizes) == extra + 1 and sum(sizes) == 8, sizes


def test_without_extra_memory_dualpipev_sums_no_batch_before_an_f() -> None:
    """DualPipeV's first rank reaches its peak with two backwards waiting before its last
    stage's last forward: without extra memory those sum their weights at once (after their
    sends); the backwards after that F still wait for the end of the step."""
    instrs = generate("dualpipev", ranks=2, microbatches=8).ranks[0]
    defer, flush_at = _deferral_plan(instrs, frozenset())
    assert flush_at == set()
    last_f = max(t for t, i in enumerate(instrs) if i.op is Op.F)
    assert defer and all(t > last_f for t in defer)
    with_extra, flushes = _deferral_plan(instrs, frozenset(), extra=1)
    assert any(t < last_f for t in with_extra) and flushes


def _mse(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((out - t) ** 2).mean()


def _four_linears(name: str, microbatches: int):  # type: ignore[no-untyped-def]
    """4 x Linear(6) in float64 cut for a 2-rank ``name`` program, and a batch of 2 rows per
    microbatch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(6, 6, dtype=F64) for _ in range(4)])
    program = generate(name, ranks=2, microbatches=microbatches)
    part = fp.partition(model, stages=program.n_stages)
    rows = 2 * microbatches
    return program, part, torch.randn(rows, 6, dtype=F64), torch.randn(rows, 6, dtype=F64)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "dualpipev"])
def test_pipeline_with_and_without_batched_weights(name: str) -> None:
    program, part, x, y = _four_linears(name, 4)
    mse = _mse
    on = fp.Pipeline(list(part.stages), program, loss_fn=mse).step(list(part.params), x, y)
    off = fp.Pipeline(list(part.stages), program, loss_fn=mse, batch_weights=False).step(
        list(part.params), x, y
    )
    ref = fp.reference_step(list(part.stages), list(part.params), x, mse, targets=y, microbatches=4)
    assert_trees_close((on.loss, on.grads), ref)
    assert_trees_close((off.loss, off.grads), ref)
    assert on.peak_activations == off.peak_activations


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "dualpipev", "zbv"])
@pytest.mark.parametrize("extra", [1, 3])
def test_pipeline_with_extra_memory_for_batched_weights(name: str, extra: int) -> None:
    """``batch_weights_extra``: the same gradients as one process, each rank within the
    program's peak plus ``extra``, and 1F1B's last rank actually using it."""
    program, part, x, y = _four_linears(name, 6)
    mse = _mse
    pipe = fp.Pipeline(list(part.stages), program, loss_fn=mse, batch_weights_extra=extra)
    res = pipe.step(list(part.params), x, y)
    ref = fp.reference_step(list(part.stages), list(part.params), x, mse, targets=y, microbatches=6)
    assert_trees_close((res.loss, res.grads), ref)
    peaks = fp.schedule.peak_activations(pipe.program)
    assert all(res.peak_activations[r] <= peaks[r] + extra for r in range(2))
    if name == "1f1b":
        assert res.peak_activations[1] == peaks[1] + extra == 1 + extra


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_weights": 1}, "batch_weights"),  # the switches take True/False
        ({"reuse_grads": "yes"}, "reuse_grads"),  # (funcpipe.runtime.reuse)
        ({"stage_weights": None}, "stage_weights"),  # (funcpipe.runtime.staging)
        ({"idle_weights": 1}, "idle_weights"),  # (True, False or None)
        ({"batch_weights_extra": -1}, "whole number >= 0"),
        ({"batch_weights_extra": 1.5}, "whole number >= 0"),
        ({"batch_weights_extra": True}, "whole number >= 0"),
        ({"batch_weights_extra": 2, "batch_weights": False}, "needs batch_weights=True"),
    ],
)
def test_pipeline_weight_and_memory_options_are_checked(
    kwargs: dict[str, object], match: str
) -> None:
    part = fp.partition(torch.nn.Sequential(torch.nn.Linear(2, 2)), stages=1)
    with pytest.raises(InvalidArgument, match=match):
        fp.Pipeline(
            list(part.stages),
            generate("gpipe", ranks=1, microbatches=1),
            loss_fn=torch.sum,
            **kwargs,  # type: ignore[arg-type]
        )


@given(
    depth=st.integers(1, 3),
    kind=st.sampled_from(["linear", "linear-bias", "matmul", "right", "mT", "transpose", "t"]),
    rows=st.sampled_from([(3,), (2, 3)]),
    input_grad=st.booleans(),
    accumulate=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_split_of_a_products_only_stage_keeps_no_graph_for_w(
    depth: int, kind: str, rows: tuple[int, ...], input_grad: bool, accumulate: bool, seed: int
) -> None:
    """Every parameter in a direct product: I is one engine call that keeps each product's
    (x, g), W sums them without the graph and without the engine; same gradients as B."""
    g = torch.Generator().manual_seed(seed)
    d = 4
    bias = kind == "linear-bias"
    base = [torch.randn(d, d, generator=g, dtype=F64) for _ in range(depth)]
    base += [torch.randn(d, generator=g, dtype=F64) for _ in range(depth if bias else 0)]

    def fn(ps, inputs):  # type: ignore[no-untyped-def]
        h = inputs[0]
        for k in range(depth):
            if kind.startswith("linear"):
                h = torch.nn.functional.linear(h, ps[k], ps[depth + k] if bias else None)
            else:
                w = ps[k]
                h = h @ {"right": w, "matmul": w.T, "mT": w.mT, "t": w.t()}.get(
                    kind, w.transpose(0, 1)
                )
            h = torch.tanh(h)
        return [h]

    x = torch.randn(*rows, d, generator=g, dtype=F64)
    gy = [torch.randn(*rows, d, generator=g, dtype=F64)]
    whole = [p.clone().requires_grad_() for p in base]
    split = [p.clone().requires_grad_() for p in base]
    _, saved = autodiff.forward(fn, whole, [x])
    if not input_grad:
        saved.inputs[0].requires_grad_(False)
    want_in, want_w = autodiff.backward(saved, whole, gy)
    _, saved = autodiff.forward(fn, split, [x])
    if not input_grad:
        saved.inputs[0].requires_grad_(False)
    got_in = autodiff.backward_input(saved, split, gy)
    assert saved.products is not None and len(saved.products.items) == depth
    assert saved.outputs is None and not saved.roots  # nothing of the graph is kept
    calls: list[object] = []
    real = torch.autograd.grad
    torch.autograd.grad = lambda *a, **k: calls.append(a) or real(*a, **k)  # type: ignore[assignment]
    try:
        got_w = autodiff.backward_weight(saved, split, accumulate=accumulate)
    finally:
        torch.autograd.grad = real  # type: ignore[assignment]
    assert not calls
    if accumulate:
        got_w = [p.grad for p in split]
    if input_grad:
        assert_trees_close(got_in, want_in, rtol=1e-13, atol=1e-13)
    assert_trees_close(got_w, want_w, rtol=1e-13, atol=1e-13)


def test_gradients_autograd_hands_back_as_the_same_tensor_are_not_shared() -> None:
    """``out = h + a + b`` with ``a``, ``b`` shaped as ``h``: autograd may return the incoming
    gradient itself for both. Summing microbatches in place must not let one parameter's sum
    write into the other's (or into the incoming gradient)."""
    lin = torch.nn.Linear(3, 3, dtype=F64)
    base = [lin.weight.detach(), lin.bias.detach(), torch.zeros(2, 3, dtype=F64)]
    base.append(torch.zeros(2, 3, dtype=F64))

    def fn(ps, inputs):  # type: ignore[no-untyped-def]
        h = torch.nn.functional.linear(inputs[0], ps[0], ps[1])
        return [h + ps[2] + ps[3]]

    whole = [p.clone().requires_grad_() for p in base]
    later = [p.clone().requires_grad_() for p in base]
    gys = [torch.randn(2, 3, dtype=F64) for _ in range(2)]
    kept = [g.clone() for g in gys]
    waiting = []
    for gy in gys:
        x = torch.randn(2, 3, dtype=F64)
        _, saved = autodiff.forward(fn, whole, [x])
        autodiff.backward(saved, whole, [gy], accumulate=True)
        _, saved = autodiff.forward(fn, later, [x])
        _, deferred = autodiff.backward_deferred(saved, later, [gy])
        assert deferred is not None
        waiting.append(deferred)
    linear.weight_batch(waiting, later)
    assert_trees_close([p.grad for p in later], [p.grad for p in whole], rtol=1e-13, atol=1e-13)
    assert_trees_close(gys, kept, rtol=0, atol=0)  # the incoming gradients are untouched


def test_check_finite_names_the_microbatch_of_a_nan_weight_gradient() -> None:
    """With check_finite nothing waits to be batched, so a NaN that only reaches a Linear's
    weight gradient (the entry stage: no input gradient to check) is reported with its
    microbatch, in GPipe too."""
    from funcpipe.errors import NonFiniteError

    def first(p, x):  # type: ignore[no-untyped-def]
        out = torch.nn.functional.linear(x, p["w"], p["b"])
        if x.device.type != "meta" and bool(x[0, 0] == 99.0):  # microbatch 1's rows
            out.register_hook(lambda g: g * float("nan"))
        return torch.tanh(out)

    def last(p, h):  # type: ignore[no-untyped-def]
        return torch.nn.functional.linear(h, p["w"], p["b"])

    params = [{"w": torch.randn(3, 3, dtype=F64), "b": torch.zeros(3, dtype=F64)} for _ in range(2)]
    pipe = fp.Pipeline(
        [fp.Stage(first), fp.Stage(last)],
        generate("gpipe", ranks=2, microbatches=4),
        loss_fn=lambda out, y: ((out - y) ** 2).mean(),
        check_finite=True,
    )
    x, y = torch.randn(8, 3, dtype=F64), torch.randn(8, 3, dtype=F64)
    x[2, 0] = 99.0  # rows 2-3 are microbatch 1
    with pytest.raises(NonFiniteError) as info:
        pipe.step(params, x, y)
    assert info.value.stage == 0 and info.value.microbatch == 1
    assert "parameter gradient" in info.value.what


@pytest.mark.parametrize("name", ["gpipe", "zb-h1"])
def test_a_stage_without_products_is_searched_once_per_step(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The search for Linear-shaped products walks a whole graph: once a stage's graph had none
    (B) or had parameters outside them (I), the other microbatches of the step skip it."""
    calls: list[int] = []
    real = linear._find

    def counted(*a, **k):  # type: ignore[no-untyped-def]
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(linear, "_find", counted)

    def scale(p, h):  # type: ignore[no-untyped-def]
        return torch.tanh(h * p["a"] + p["b"])  # no matrix product at all

    params = [{"a": torch.ones(3, dtype=F64), "b": torch.zeros(3, dtype=F64)} for _ in range(2)]
    pipe = fp.Pipeline(
        [fp.Stage(scale), fp.Stage(scale)],
        generate(name, ranks=2, microbatches=4),
        loss_fn=lambda out, y: ((out - y) ** 2).mean(),
    )
    x, y = torch.randn(8, 3, dtype=F64), torch.randn(8, 3, dtype=F64)
    got = pipe.step(params, x, y)
    assert len(calls) == 2  # one per stage, not one per (stage, microbatch)
    ref = fp.reference_step(pipe.stages, params, x, pipe.loss_fn, targets=y, microbatches=4)
    assert_trees_close((got.loss, got.grads), ref)
