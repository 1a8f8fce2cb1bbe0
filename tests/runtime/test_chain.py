"""Chain stages (funcpipe.runtime.chain): a module stage of Linear and elementwise layers run as
one autograd node gives the module's outputs and gradients, hands its weight rows to the
runtime, is refused for anything it cannot reproduce, and a pipeline with it matches the
reference."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import funcpipe as fp
from funcpipe.runtime import chain, engine
from funcpipe.schedule import generate
from funcpipe.tree import tree_flatten

F64 = torch.float64

_ACTS = {
    "gelu": lambda: nn.GELU(),
    "gelu-tanh": lambda: nn.GELU(approximate="tanh"),
    "relu": lambda: nn.ReLU(),
    "tanh": lambda: nn.Tanh(),
    "sigmoid": lambda: nn.Sigmoid(),
    "silu": lambda: nn.SiLU(),
    "identity": lambda: nn.Identity(),
}


def _model(widths: list[int], acts: list[str], bias: list[bool], dtype: Any) -> nn.Sequential:
    mods: list[nn.Module] = []
    for k in range(len(widths) - 1):
        mods.append(nn.Linear(widths[k], widths[k + 1], bias=bias[k], dtype=dtype))
        if acts[k] != "none":
            mods.append(_ACTS[acts[k]]())
    return nn.Sequential(*mods)


def _chain_of(model: nn.Module) -> tuple[chain.Chain | None, list[torch.Tensor], Any, fp.Stage]:
    stage, params = fp.from_module(model)
    leaves, tree = tree_flatten(params)
    return chain.of(stage.fn, tree, len(leaves)), leaves, params, stage


@given(
    widths=st.lists(st.integers(1, 9), min_size=2, max_size=5),
    acts=st.lists(st.sampled_from([*_ACTS, "none"]), min_size=4, max_size=4),
    bias=st.lists(st.booleans(), min_size=4, max_size=4),
    lead=st.sampled_from([(3,), (2, 3), (1,)]),
    input_grad=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_chain_gives_the_modules_outputs_and_gradients(
    widths: list[int],
    acts: list[str],
    bias: list[bool],
    lead: tuple[int, ...],
    input_grad: bool,
    seed: int,
) -> None:
    torch.manual_seed(seed)
    model = _model(widths, acts, bias, F64)
    ch, leaves, params, stage = _chain_of(model)
    assert ch is not None
    x = torch.randn(*lead, widths[0], dtype=F64)
    assert ch.accepts(leaves, x)
    gy = torch.randn(*lead, widths[-1], dtype=F64)

    ps = [t.detach().requires_grad_() for t in leaves]
    xs = x.detach().requires_grad_(input_grad)
    y = ch(ps, xs)
    wrt = [xs, *ps] if input_grad else ps
    got = torch.autograd.grad(y, wrt, gy, allow_unused=True)

    ref_leaves = [t.detach().requires_grad_() for t in leaves]
    ref_params = dict(zip(sorted(params), ref_leaves, strict=True))  # dict leaves: sorted keys
    xr = x.detach().requires_grad_(input_grad)
    yr = stage(ref_params, xr)
    want = torch.autograd.grad(yr, [xr, *ref_leaves] if input_grad else ref_leaves, gy)

    assert torch.equal(y, yr)  # the same kernels: bit for bit
    if input_grad:
        assert torch.equal(got[0], want[0])
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_collected_rows_are_the_weight_gradients_and_nothing_else_is_returned() -> None:
    torch.manual_seed(0)
    model = _model([5, 7, 4], ["gelu", "tanh"], [True, False], F64)
    ch, leaves, params, stage = _chain_of(model)
    assert ch is not None
    ps = [t.detach().requires_grad_() for t in leaves]
    x = torch.randn(6, 5, dtype=F64, requires_grad=True)
    gy = torch.randn(6, 4, dtype=F64)
    y = ch(ps, x)
    with chain.collecting() as rows:
        (gx,) = engine.run([y], [gy], [x])
    want = torch.autograd.grad(stage(dict(zip(sorted(params), ps, strict=True)), x), [x, *ps], gy)
    torch.testing.assert_close(gx, want[0], rtol=0, atol=0)
    assert [lin.weight for lin, _, _ in rows] == [
        2,
        1,
    ]  # last layer first (0.bias, 0.weight, 2.weight)
    for lin, x2, g2 in rows:
        torch.testing.assert_close(g2.t() @ x2, want[1 + lin.weight], rtol=1e-12, atol=1e-12)
        if lin.bias is not None:
            torch.testing.assert_close(g2.sum(0), want[1 + lin.bias], rtol=1e-12, atol=1e-12)
    assert all(p.grad is None for p in ps)  # nothing went into .grad: the rows are the caller's


def test_small_float32_gelu_runs_without_onednn_and_the_switch_is_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(1)
    model = _model([16, 16, 16], ["gelu", "gelu"], [True, True], torch.float32)
    ch, leaves, params, stage = _chain_of(model)
    assert ch is not None
    x = torch.randn(8, 16)
    seen: list[bool] = []
    real = torch.nn.functional.gelu

    def spy(a: torch.Tensor, **kw: Any) -> torch.Tensor:
        seen.append(torch._C._get_mkldnn_enabled())
        return real(a, **kw)

    monkeypatch.setattr(torch.nn.functional, "gelu", spy)
    y = ch(leaves, x)
    assert seen == [False, False]  # ATen's kernel for 8 x 16
    assert torch._C._get_mkldnn_enabled()
    torch.testing.assert_close(y, stage(params, x), rtol=1e-5, atol=1e-6)
    big = torch.randn(chain.SMALL_GELU // 16 + 1, 16)
    seen.clear()
    ch(leaves, big)
    assert seen == [True, True]  # above the threshold: the default

    def boom(a: torch.Tensor, **kw: Any) -> torch.Tensor:
        raise RuntimeError("boom")

    monkeypatch.setattr(torch.nn.functional, "gelu", boom)
    with pytest.raises(RuntimeError, match="boom"):
        ch(leaves, x)
    assert torch._C._get_mkldnn_enabled()  # restored on the way out


class _Doubled(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return 2 * super().forward(x)


def _refused() -> list[tuple[str, nn.Module]]:
    lin = nn.Linear(4, 4)
    hooked = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    hooked[0].register_forward_hook(lambda m, i, o: o * 2)
    return [
        ("dropout", nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))),
        ("layernorm", nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))),
        ("a forward hook", hooked),
        ("a weight used twice", nn.Sequential(lin, nn.ReLU(), lin)),
        ("a subclass with its own forward", _Doubled(nn.Linear(4, 4))),
        ("a nested Sequential", nn.Sequential(nn.Sequential(nn.Linear(4, 4)))),
        ("a buffer", nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4).eval())),
        ("no Sequential", nn.Linear(4, 4)),
    ]


@pytest.mark.parametrize(("why", "model"), _refused(), ids=[w for w, _ in _refused()])
def test_what_a_chain_cannot_reproduce_stays_with_autograd(why: str, model: nn.Module) -> None:
    assert _chain_of(model)[0] is None, why


def test_calls_a_chain_cannot_take_are_declined() -> None:
    model = _model([4, 4], ["relu"], [True], F64)
    ch, leaves, _, _ = _chain_of(model)
    assert ch is not None
    assert ch.accepts(leaves, torch.zeros(2, 4, dtype=F64))
    assert not ch.accepts(leaves, torch.zeros(2, 4))  # another dtype: the module casts or fails
    assert not ch.accepts(leaves, torch.zeros(2, 3, dtype=F64))  # the module's error, not ours
    assert not ch.accepts(leaves, torch.zeros((), dtype=F64))
    assert not ch.accepts(leaves, (torch.zeros(2, 4, dtype=F64),))
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:  # a hook every module runs: the modules must run
        assert not ch.accepts(leaves, torch.zeros(2, 4, dtype=F64))
    finally:
        handle.remove()
    assert ch.accepts(leaves, torch.zeros(2, 4, dtype=F64))
    only_acts = nn.Sequential(nn.ReLU())
    ch2, leaves2, _, _ = _chain_of(only_acts)
    assert ch2 is not None and not ch2.accepts(leaves2, torch.zeros(2, 4))


def _mlp(layers: int = 8, width: int = 12) -> nn.Sequential:
    torch.manual_seed(2)
    return nn.Sequential(
        *[m for _ in range(layers) for m in (nn.Linear(width, width, dtype=F64), nn.GELU())]
    )


@pytest.mark.parametrize(
    ("schedule", "ranks", "options"),
    [
        ("gpipe", 2, {}),
        ("1f1b", 2, {}),
        ("1f1b", 4, {"recompute": True}),
        ("interleaved", 2, {}),
        ("zbv", 2, {}),
        ("zb-h1", 2, {"stage_weights": False}),
        ("1f1b", 2, {"batch_weights": False}),
        ("1f1b", 2, {"check_finite": True}),
    ],
)
def test_a_pipeline_of_chain_stages_matches_the_reference(
    schedule: str, ranks: int, options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    program = generate(schedule, ranks=ranks, microbatches=4)
    part = fp.partition(_mlp(), stages=program.n_stages, by="uniform")
    x, y = torch.randn(16, 12, dtype=F64), torch.randn(16, 12, dtype=F64)

    def mse(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((out - t) ** 2).mean()

    ref = fp.reference_step(part.stages, part.params, x, mse, targets=y, microbatches=4)
    calls = []
    # per chain backward: were its rows handed to the runtime (run by the engine while the
    # runtime collects, or called by the runtime directly), not returned as gradients?
    collected = []
    direct = []  # per chain backward: called by the runtime directly (no engine around it)?
    in_engine = _track_engine(monkeypatch)
    real, real_backward = chain.Chain.forward, chain.Chain.backward

    def counted(self: chain.Chain, *a: Any) -> Any:
        calls.append(1)
        return real(self, *a)

    def seen(self: chain.Chain, *a: Any) -> Any:
        collected.append(chain._items is not None or not in_engine[0])
        direct.append(not in_engine[0])
        return real_backward(self, *a)

    monkeypatch.setattr(chain.Chain, "forward", counted)
    monkeypatch.setattr(chain.Chain, "backward", seen)
    got = fp.Pipeline(part.stages, program, loss_fn=mse, **options).step(part.params, x, y)
    assert len(calls) >= 4 * program.n_stages  # every F ran as a chain (recompute: twice)
    assert len(collected) == 4 * program.n_stages
    # rows go to the runtime's in-place sums (batch_weights=False: autograd's gradients)
    assert all(collected) if options.get("batch_weights", True) else not any(collected)
    # the runtime calls a B's (or I's) chain directly, the last stage's after the engine ran
    # its loss back to the chain's output
    if options.get("batch_weights", True):
        assert all(direct)
    fp.testing.assert_trees_close((got.loss, got.grads), ref)
    calls.clear()
    off = fp.Pipeline(part.stages, program, loss_fn=mse, chains=False, **options)
    fp.testing.assert_trees_close(off.step(part.params, x, y).grads, got.grads)
    assert not calls


def test_the_option_is_checked() -> None:
    part = fp.partition(_mlp(2), stages=2)
    with pytest.raises(fp.InvalidArgument, match="chains"):
        fp.Pipeline(
            part.stages,
            generate("1f1b", ranks=2, microbatches=2),
            loss_fn=torch.nn.functional.mse_loss,
            chains=1,  # type: ignore[arg-type]
        )


def _track_engine(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A flag that is true while the autograd engine runs a chain node's backward."""
    in_engine = [False]
    real = chain._ChainFn.backward

    def engine_runs(ctx: Any, g: torch.Tensor) -> Any:
        in_engine[0] = True
        try:
            return real(ctx, g)
        finally:
            in_engine[0] = False

    monkeypatch.setattr(chain._ChainFn, "backward", staticmethod(engine_runs))
    return in_engine


def _direct_case(
    monkeypatch: pytest.MonkeyPatch, build: Any, extra: bool = False
) -> tuple[list[Any], int]:
    """Run ``linear.backward_deferred`` on ``build(chain_fn, x, ps, extra_param)`` (outputs) and
    compare its input gradient and rows with autograd's; returns (engine calls' targets, how
    many chain backwards the runtime called directly)."""
    from funcpipe.runtime import autodiff, linear

    torch.manual_seed(3)
    model = _model([5, 6, 4], ["gelu", "relu"], [True, True], F64)
    ch, leaves, params, stage = _chain_of(model)
    assert ch is not None
    ps = [t.detach().requires_grad_() for t in leaves]
    e = torch.randn(4, dtype=F64, requires_grad=True)
    x = torch.randn(3, 5, dtype=F64, requires_grad=True)
    targets: list[Any] = []
    real_run = engine.run

    def run(outputs: Any, grads: Any, tgts: Any, **k: Any) -> Any:
        targets.append(list(tgts))
        return real_run(outputs, grads, tgts, **k)

    monkeypatch.setattr(engine, "run", run)
    direct = [0]
    real_node = chain.run_node
    in_engine = _track_engine(monkeypatch)

    def node(n: Any, g: torch.Tensor) -> Any:
        direct[0] += not in_engine[0]
        return real_node(n, g)

    monkeypatch.setattr(chain, "run_node", node)
    allp = [*ps, e] if extra else ps
    outs = build(lambda h: ch(ps, h), x, e)
    gouts = [torch.ones_like(o) for o in outs]
    with chain.collecting():
        got = linear.backward_deferred(outs, gouts, [x], allp, autodiff.param_nodes(allp))
    assert got is not None
    gin, deferred = got
    assert gin[0] is not None and not gin[0].requires_grad  # nothing recorded on the way
    assert not any(g2.requires_grad for _, _, g2 in deferred.items)
    # the reference: the same graph through the modules, autograd's gradients
    xr = x.detach().requires_grad_()
    rps = [t.detach().requires_grad_() for t in leaves]
    er = e.detach().requires_grad_()

    def mod(h: torch.Tensor) -> torch.Tensor:
        return stage(dict(zip(sorted(params), rps, strict=True)), h)

    routs = build(mod, xr, er)
    want = torch.autograd.grad(routs, [xr, *rps], [torch.ones_like(o) for o in routs])
    torch.testing.assert_close(gin[0], want[0], rtol=1e-12, atol=1e-12)
    rows = {lin.weight: (lin, x2, g2) for lin, x2, g2 in deferred.items}
    assert len(rows) == 2
    for lin, x2, g2 in rows.values():
        torch.testing.assert_close(g2.t() @ x2, want[1 + lin.weight], rtol=1e-12, atol=1e-12)
    return targets, direct[0]


def test_a_chain_stage_backward_runs_without_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    targets, direct = _direct_case(monkeypatch, lambda f, x, e: [f(x)])
    assert targets == [] and direct == 1


def test_a_loss_after_the_chain_runs_the_engine_only_up_to_the_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    targets, direct = _direct_case(monkeypatch, lambda f, x, e: [(f(x) ** 2).mean()])
    assert direct == 1 and len(targets) == 1
    assert [type(t).__name__ for t in targets[0]] == ["GradientEdge"]


@pytest.mark.parametrize(
    "case",
    [
        "input used twice",  # another path to the chain's input: the engine sums both
        "input computed",  # the chain's input is not the stage's input
        "another parameter",  # a parameter outside the chain needs a gradient
    ],
)
def test_anything_else_in_the_graph_leaves_the_chain_to_the_engine(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = {
        "input used twice": lambda f, x, e: [(f(x) ** 2).mean() + (x**3).sum()],
        "input computed": lambda f, x, e: [(f(torch.sin(x)) ** 2).mean()],
        "another parameter": lambda f, x, e: [(f(x) * e).sum()],
    }
    targets, direct = _direct_case(monkeypatch, builds[case], extra=case == "another parameter")
    assert direct == 0  # (the engine ran the chain, collecting its rows)
    assert len(targets) == 1
