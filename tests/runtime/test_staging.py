"""Linear weight gradients staged in their own memory and summed once per step
(funcpipe.runtime.staging): the in-place sum equals the products' sum, nothing is refused
silently, and a pipeline step stages where it may and gives the reference's gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import funcpipe as fp
from funcpipe.runtime import reuse, staging
from funcpipe.schedule import generate

F64 = torch.float64


@given(
    p=st.integers(2, 70),
    q=st.integers(2, 70),
    transposed=st.booleans(),
    rows=st.lists(st.integers(1, 12), min_size=0, max_size=8),
    seed=st.integers(0, 2**16),
)
def test_the_in_place_sum_equals_the_sum_of_the_products(
    p: int, q: int, transposed: bool, rows: list[int], seed: int
) -> None:
    """Any shape, any row counts: finish() gives the sum of the accepted products, in the
    gradient's own memory; a product that does not fit is refused whole and changes nothing."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.full((p, q), float("nan"), dtype=F64)  # stale memory: all of it is written
    staged = staging.Staged(buf, transposed)
    want = torch.zeros(p, q, dtype=F64)
    used = 0
    for n in rows:
        n_in, n_out = (q, p) if transposed else (p, q)
        x = torch.randn(n, n_in, generator=gen, dtype=F64)
        g = torch.randn(n, n_out, generator=gen, dtype=F64)
        fits = used + n <= staging.capacity(p, q)
        assert staged.add(x, g) is fits
        if fits:
            used += n
            want += g.t() @ x if transposed else x.t() @ g
    got = staged.finish()
    assert got.data_ptr() == buf.data_ptr()
    assert staged.rows == used
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_staging_area_is_half_the_gradient_at_most() -> None:
    for p, q in [(512, 512), (1024, 4096), (4096, 1024), (3, 1000), (2, 2)]:
        cap = staging.capacity(p, q)
        assert cap * (p + q) <= p * q / 2
        assert cap < p and cap <= q / 2


def _leaf(p: int, q: int) -> torch.Tensor:
    return torch.zeros(p, q, dtype=F64, requires_grad=True)


def test_a_leaf_stages_only_when_allowed_and_settles_into_its_grad() -> None:
    gen = torch.Generator().manual_seed(0)
    leaf = _leaf(16, 12)
    x, g = (
        torch.randn(2, 12, generator=gen, dtype=F64),
        torch.randn(2, 16, generator=gen, dtype=F64),
    )
    assert not staging.add(leaf, True, x, g)  # not allowed: the caller sums it
    staging.allow(leaf)
    assert staging.add(leaf, True, x, g)
    assert leaf.grad is None  # nothing to read until settled
    staging.settle(leaf)
    torch.testing.assert_close(leaf.grad, g.t() @ x)
    assert not staging.add(leaf, True, x, g)  # settled: staging is over for this step
    staging.settle(leaf)  # settling twice changes nothing
    torch.testing.assert_close(leaf.grad, g.t() @ x)


def test_settle_adds_to_what_the_engine_put_in_meanwhile() -> None:
    gen = torch.Generator().manual_seed(1)
    leaf = _leaf(16, 12)
    staging.allow(leaf)
    x, g = (
        torch.randn(2, 12, generator=gen, dtype=F64),
        torch.randn(2, 16, generator=gen, dtype=F64),
    )
    assert staging.add(leaf, True, x, g)
    other = torch.randn(16, 12, generator=gen, dtype=F64)
    leaf.grad = other.clone()  # as autograd's AccumulateGrad would for another use
    x2 = torch.randn(1, 12, generator=gen, dtype=F64)
    g2 = torch.randn(1, 16, generator=gen, dtype=F64)
    assert not staging.add(leaf, True, x2, g2)  # a gradient is there: settled, caller adds
    torch.testing.assert_close(leaf.grad, other + g.t() @ x)


def test_overflow_settles_and_the_caller_takes_over() -> None:
    gen = torch.Generator().manual_seed(2)
    leaf = _leaf(8, 8)  # room for 2 rows
    staging.allow(leaf)
    assert staging.capacity(8, 8) == 2
    x, g = torch.randn(2, 8, generator=gen, dtype=F64), torch.randn(2, 8, generator=gen, dtype=F64)
    assert staging.add(leaf, False, x, g)
    assert not staging.add(leaf, False, x[:1], g[:1])
    torch.testing.assert_close(leaf.grad, x.t() @ g)
    big = _leaf(8, 8)
    staging.allow(big)
    assert not staging.add(big, False, torch.zeros(3, 8, dtype=F64), torch.zeros(3, 8, dtype=F64))
    assert big.grad is None  # declined before anything: the default path sums it


def test_a_mismatched_form_or_dtype_is_declined() -> None:
    leaf = _leaf(6, 6)
    staging.allow(leaf)
    x = torch.ones(1, 6, dtype=F64)
    assert not staging.add(leaf, True, x.float(), x)  # a cast between: the engine's case
    vec = torch.zeros(6, dtype=F64, requires_grad=True)
    staging.allow(vec)
    assert not staging.add(vec, True, x, x)
    leaf = _leaf(6, 6)
    staging.allow(leaf)
    assert staging.add(leaf, True, x, 2 * x)
    assert not staging.add(leaf, False, x, x)  # the other form of product: settled first
    torch.testing.assert_close(leaf.grad, (2 * x).t() @ x)


def test_staging_writes_into_the_memory_offered_for_the_gradient() -> None:
    leaf = _leaf(8, 6)
    spare = torch.empty(8, 6, dtype=F64)
    reuse.offer_to(leaf, spare)
    staging.allow(leaf)
    assert staging.add(leaf, True, torch.ones(1, 6, dtype=F64), torch.ones(1, 8, dtype=F64))
    staging.settle(leaf)
    assert leaf.grad is not None and leaf.grad.data_ptr() == spare.data_ptr()


def test_a_bias_waits_with_its_weights_rows_and_settles_with_it() -> None:
    gen = torch.Generator().manual_seed(5)
    weight, bias = _leaf(16, 12), torch.zeros(16, dtype=F64, requires_grad=True)
    staging.allow(weight)
    xs = [torch.randn(n, 12, generator=gen, dtype=F64) for n in (2, 1)]  # 3 rows fit
    gs = [torch.randn(n, 16, generator=gen, dtype=F64) for n in (2, 1)]
    for x, g in zip(xs, gs, strict=True):
        assert staging.add(weight, True, x, g, bias) == staging.BOTH
    assert bias.grad is None and weight.grad is None  # both wait
    assert not staging.staged(bias)  # the weight is what idle waits settle
    staging.settle(bias)  # reading the bias settles its weight
    x, g = torch.cat(xs), torch.cat(gs)
    torch.testing.assert_close(bias.grad, g.sum(0))
    torch.testing.assert_close(weight.grad, g.t() @ x)
    staging.settle(weight)  # nothing left: unchanged
    staging.settle(bias)
    torch.testing.assert_close(bias.grad, g.sum(0))
    torch.testing.assert_close(weight.grad, g.t() @ x)


def test_a_bias_follows_in_the_untransposed_form_and_into_offered_memory() -> None:
    gen = torch.Generator().manual_seed(6)
    weight, bias = _leaf(12, 16), torch.zeros(16, dtype=F64, requires_grad=True)
    spare = torch.empty(16, dtype=F64)
    reuse.offer_to(bias, spare)
    staging.allow(weight)
    x, g = (
        torch.randn(3, 12, generator=gen, dtype=F64),
        torch.randn(3, 16, generator=gen, dtype=F64),
    )
    assert staging.add(weight, False, x, g, bias) == staging.BOTH
    staging.settle(weight)
    torch.testing.assert_close(weight.grad, x.t() @ g)
    torch.testing.assert_close(bias.grad, g.sum(0))
    assert bias.grad is not None and bias.grad.data_ptr() == spare.data_ptr()


def test_a_bias_that_cannot_follow_is_left_to_the_caller() -> None:
    gen = torch.Generator().manual_seed(7)
    x, g = (
        torch.randn(2, 12, generator=gen, dtype=F64),
        torch.randn(2, 16, generator=gen, dtype=F64),
    )
    for bias in (
        torch.zeros(1, 16, dtype=F64, requires_grad=True),  # broadcast: not a column sum
        torch.zeros(16, dtype=torch.float32, requires_grad=True),  # another dtype
    ):
        weight = _leaf(16, 12)
        staging.allow(weight)
        assert staging.add(weight, True, x, g, bias) == staging.WEIGHT
        staging.settle(weight)
        assert bias.grad is None
    weight, bias = _leaf(16, 12), torch.zeros(16, dtype=F64, requires_grad=True)
    bias.grad = torch.ones(16, dtype=F64)  # a gradient there already
    staging.allow(weight)
    assert staging.add(weight, True, x, g, bias) == staging.WEIGHT
    staging.settle(bias)
    torch.testing.assert_close(bias.grad, torch.ones(16, dtype=F64))


def test_an_overflow_settles_the_bias_too_and_the_caller_takes_over() -> None:
    gen = torch.Generator().manual_seed(8)
    weight, bias = _leaf(8, 8), torch.zeros(8, dtype=F64, requires_grad=True)  # room for 2 rows
    staging.allow(weight)
    x, g = torch.randn(2, 8, generator=gen, dtype=F64), torch.randn(2, 8, generator=gen, dtype=F64)
    assert staging.add(weight, True, x, g, bias) == staging.BOTH
    assert staging.add(weight, True, x[:1], g[:1], bias) == staging.NONE
    torch.testing.assert_close(weight.grad, g.t() @ x)
    torch.testing.assert_close(
        bias.grad, g.sum(0)
    )  # the staged rows' part, for the caller to add to


def _mlp(width: int = 64, layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[m for _ in range(layers) for m in (nn.Linear(width, width), nn.GELU())]
    ).double()


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _count_finishes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    count = [0]
    finish = staging.Staged.finish

    def counted(self: staging.Staged) -> torch.Tensor:
        count[0] += 1
        return finish(self)

    monkeypatch.setattr(staging.Staged, "finish", counted)
    return count


@pytest.mark.parametrize("width", [64, 32], ids=["fits", "overflows"])
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"])
def test_a_step_sums_each_linear_weight_once_and_matches_the_reference(
    name: str, width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Width 64: a 64 x 64 gradient stages 16 rows, the whole batch; each Linear weight is
    summed once per step, whatever the schedule (GPipe's deferral plan hands all 4 microbatches
    over at once: that one product is not staged). Width 32: room for 8 of the 16 rows; the rest
    is summed microbatch by microbatch (or, batched by the deferral plan, not staged at all)."""
    model = _mlp(width)
    prog = generate(name, ranks=2, microbatches=4)
    part = fp.partition(model, stages=prog.n_stages)
    x, y = torch.randn(16, width, dtype=F64), torch.randn(16, width, dtype=F64)
    count = _count_finishes(monkeypatch)
    _, grads = fp.Pipeline(part.stages, prog, loss_fn=_mse).step(part.params, x, y)
    if width == 64:  # GPipe sums each weight's 4 microbatches as one batch, not staged
        assert count[0] == (0 if name == "gpipe" else 4)
    ref = torch.func.grad(lambda p: _mse(torch.func.functional_call(model, p, (x,)), y))(
        dict(model.named_parameters())
    )
    got = torch.cat([g.flatten() for d in grads for g in d.values()])
    want = torch.cat([g.flatten() for g in ref.values()])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "options",
    [{"stage_weights": False}, {"batch_weights": False}, {"check_finite": True}],
    ids=["off", "unbatched", "checked"],
)
def test_steps_that_need_per_microbatch_sums_do_not_stage(
    options: dict[str, bool], monkeypatch: pytest.MonkeyPatch
) -> None:
    part = fp.partition(_mlp(), stages=2)
    x, y = torch.randn(16, 64, dtype=F64), torch.randn(16, 64, dtype=F64)
    count = _count_finishes(monkeypatch)
    pipe = fp.Pipeline(
        part.stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=_mse, **options
    )
    _, grads = pipe.step(part.params, x, y)
    assert count[0] == 0
    pipe = fp.Pipeline(part.stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=_mse)
    traced = pipe.step(part.params, x, y, trace=True)  # shows the B the simulator models
    assert count[0] == 0
    _, staged = pipe.step(part.params, x, y)
    assert count[0] == 4
    for want in (traced.grads, staged):  # the same sums, up to their order
        for a, b in zip(grads, want, strict=True):
            for k in a:
                torch.testing.assert_close(a[k], b[k], rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------ sums while a rank waits
def _count_idle_finishes(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Finishes in all, and those run inside _Rank.idle (a receive's wait)."""
    from funcpipe.runtime import interpreter

    counts = {"all": 0, "idle": 0}
    inside = [False]
    finish, idle = staging.Staged.finish, interpreter._Rank.idle

    def counted(self: staging.Staged) -> torch.Tensor:
        counts["all"] += 1
        counts["idle"] += inside[0]
        return finish(self)

    def watched(self: object, *args: object) -> None:
        inside[0] = True
        try:
            idle(self, *args)  # type: ignore[arg-type]
        finally:
            inside[0] = False

    monkeypatch.setattr(staging.Staged, "finish", counted)
    monkeypatch.setattr(interpreter._Rank, "idle", watched)
    return counts


@pytest.mark.parametrize(("name", "early"), [("interleaved", 4), ("zbv", 1), ("dualpipev", 1)])
def test_a_waiting_rank_sums_early_and_the_gradients_are_the_same(
    name: str, early: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In one process a rank's receive is not ready until the driver runs its peer, so every
    sum the idle plan allows is computed in the wait (deterministically); the stage's last B or
    W then adds its rows in place. idle_weights=False computes them all at the end. Both give
    the reference's gradients, each Linear finished once."""
    model = _mlp()
    prog = generate(name, ranks=2, microbatches=4)
    part = fp.partition(model, stages=prog.n_stages)
    x, y = torch.randn(16, 64, dtype=F64), torch.randn(16, 64, dtype=F64)
    ref = torch.func.grad(lambda p: _mse(torch.func.functional_call(model, p, (x,)), y))(
        dict(model.named_parameters())
    )
    want = torch.cat([g.flatten() for g in ref.values()])
    for idle, in_wait in ((True, early), (False, 0)):
        counts = _count_idle_finishes(monkeypatch)
        pipe = fp.Pipeline(part.stages, prog, loss_fn=_mse, idle_weights=idle)
        _, grads = pipe.step(part.params, x, y)
        assert counts == {"all": 4, "idle": in_wait}, idle
        got = torch.cat([g.flatten() for d in grads for g in d.values()])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_the_idle_plan_names_the_waits_before_a_stages_last_backward() -> None:
    """A receive may fill its wait with an owner's sums once at most one B or W of that owner
    follows it on the rank; 1F1B: only each rank's last receive."""
    from funcpipe.runtime.interpreter import _idle_plan
    from funcpipe.schedule.ir import Op

    for name in ["1f1b", "interleaved", "zb-h1", "zbv", "dualpipev", "gpipe"]:
        prog = fp.Pipeline(
            fp.partition(
                _mlp(), stages=4 if name in ("interleaved", "zbv", "dualpipev") else 2
            ).stages,
            generate(name, ranks=2, microbatches=4),
            loss_fn=_mse,
        ).program
        for r, instrs in enumerate(prog.ranks):
            owners = sorted({i.stage for i in instrs if i.stage is not None})
            plan = _idle_plan(instrs, range(prog.n_stages), owners)
            for t, i in enumerate(instrs):
                later = [j.stage for j in instrs[t + 1 :] if j.op in (Op.B, Op.W)]
                allowed = [o for o in owners if later.count(o) <= 1]
                if i.op is Op.RECV and allowed:
                    assert plan[t] == allowed, (name, r, t)
                else:
                    assert t not in plan, (name, r, t)
            if name == "1f1b":
                recvs = [t for t, i in enumerate(instrs) if i.op is Op.RECV]
                assert list(plan) == [recvs[-1]]


class _Ready:
    """A receive that is not in for the first ``n`` checks."""

    def __init__(self, n: int) -> None:
        self.n = n

    def ready(self) -> bool:
        self.n -= 1
        return self.n < 0


def test_idle_stops_when_the_data_is_in_and_skips_gradients_being_reduced() -> None:
    from types import SimpleNamespace

    from funcpipe.runtime.interpreter import _Rank

    gen = torch.Generator().manual_seed(0)

    def staged_leaf() -> torch.Tensor:
        leaf = _leaf(16, 12)
        staging.allow(leaf)
        x = torch.randn(2, 12, generator=gen, dtype=F64)
        assert staging.add(leaf, True, x, torch.randn(2, 16, generator=gen, dtype=F64))
        return leaf

    leaves = {0: [staged_leaf(), staged_leaf()], 1: [staged_leaf()], 2: [staged_leaf()]}
    rank = SimpleNamespace(inflight={1: ["a reduction"]}, leaves=leaves)
    _Rank.idle(rank, _Ready(1), [0, 1, 2])  # type: ignore[arg-type]
    assert [staging.staged(t) for t in leaves[0]] == [False, True]  # one sum, then the data
    _Rank.idle(rank, _Ready(5), [0, 1, 2])  # type: ignore[arg-type]
    assert not staging.staged(leaves[0][1]) and not staging.staged(leaves[2][0])
    assert staging.staged(leaves[1][0])  # its owner's gradients are being reduced: untouched
    assert leaves[2][0].grad is not None and leaves[1][0].grad is None
