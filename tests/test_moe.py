"""The MoE layer (funcpipe.models.moe) on one device: against a token-by-token reference
written independently, the grouped matmul against the per-expert loop, capacity, sigmoid
scores with a balancing bias, the statistics and the bad configurations."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.models import moe as M

F64 = torch.float64


def _token_by_token(p: dict[str, torch.Tensor], x: torch.Tensor, c: M.MoEConfig) -> torch.Tensor:
    """Each token alone: its scores, its top-k, the weighted sum of its experts' SwiGLUs."""
    out = []
    for tok in x.reshape(-1, c.d_model):
        logits = p["router"] @ tok
        scores = torch.softmax(logits, -1) if c.score == "softmax" else torch.sigmoid(logits)
        top = sorted(range(c.experts), key=lambda e: -float(scores[e].detach()))[: c.top_k]
        w = scores[top]
        if c.normalize and (c.top_k > 1 or c.score == "sigmoid"):
            w = w / w.sum()
        y = torch.zeros(c.d_model, dtype=x.dtype)
        for weight, e in zip(w, top, strict=True):
            h = tok @ p["w_in"][e]  # gate and up interleaved: gate j at 2j, up j at 2j + 1
            gate, up = h[0::2], h[1::2]
            y = y + weight * ((torch.nn.functional.silu(gate) * up) @ p["w_out"][e])
        if c.shared:
            h = tok @ p["shared_in"]
            gate, up = h[0::2], h[1::2]
            y = y + (torch.nn.functional.silu(gate) * up) @ p["shared_out"]
        out.append(y)
    if not out:
        return x.clone() * 0
    return torch.stack(out).reshape(x.shape)


def _grads(fn: Any, params: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[Any, ...]:
    p = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    xx = x.clone().requires_grad_(True)
    y = fn(p, xx)
    y.backward(torch.linspace(-1, 1, y.numel(), dtype=y.dtype).reshape(y.shape))
    zero = {k: torch.zeros_like(v) for k, v in p.items()}  # (no token: no gradient reaches)
    grads = {k: zero[k] if v.grad is None else v.grad for k, v in p.items()}
    return y.detach(), xx.grad, grads


@settings(max_examples=10, deadline=None)
@given(
    experts=st.integers(1, 6),
    k=st.integers(1, 6),
    shared=st.integers(0, 2),
    score=st.sampled_from(["softmax", "sigmoid"]),
    tokens=st.integers(1, 7),
    seed=st.integers(0, 1000),
)
def test_equals_a_token_by_token_reference_in_float64(
    experts: int, k: int, shared: int, score: str, tokens: int, seed: int
) -> None:
    c = M.MoEConfig(
        d_model=4, experts=experts, ffn=3, top_k=min(k, experts), shared=shared, score=score
    )
    params = M.init(c, seed=seed, dtype=F64)
    x = torch.randn(tokens, 4, dtype=F64, generator=torch.Generator().manual_seed(seed))
    got = _grads(lambda p, t: M.moe(p, t, c)[0], params, x)
    want = _grads(lambda p, t: _token_by_token(p, t, c), params, x)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)


def test_the_grouped_matmul_equals_the_loop_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    c = M.MoEConfig(d_model=8, experts=4, ffn=8, top_k=2, shared=1)
    params = M.init(c, seed=1)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(2))
    grouped = _grads(lambda p, t: M.moe(p, t, c)[0], params, x)
    monkeypatch.setattr(M, "_GROUPED", ())
    loop = _grads(lambda p, t: M.moe(p, t, c)[0], params, x)
    for a, b in zip(grouped, loop, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_capacity_drops_the_late_assignments_and_counts_the_load() -> None:
    c = M.MoEConfig(d_model=4, experts=4, ffn=3, top_k=1, capacity=1.0)
    params = M.init(c, seed=0, dtype=F64)
    params["router"] = torch.zeros(4, 4, dtype=F64)
    params["router"][2] = 10.0  # every token of positive inputs prefers expert 2
    x = torch.rand(8, 4, dtype=F64, generator=torch.Generator().manual_seed(0)) + 0.1
    y, stats = M.moe(params, x, c)
    assert stats["counts"].tolist() == [0, 0, 2, 0]  # ceil(1.0 * 8 * 1 / 4) = 2 kept
    assert int(torch.count_nonzero(y.abs().sum(-1))) == 2
    assert torch.equal(y[2:], torch.zeros(6, 4, dtype=F64))  # the late ones: nothing added
    dropless = M.moe(params, x, M.MoEConfig(d_model=4, experts=4, ffn=3, top_k=1))[1]
    assert dropless["counts"].tolist() == [0, 0, 8, 0]


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=24), st.sampled_from([0.5, 1.0, 1.5]))
def test_a_capacity_keeps_the_first_assignments_of_each_expert_in_token_order(
    picks: list[int], capacity: float
) -> None:
    c = M.MoEConfig(d_model=4, experts=4, ffn=3, top_k=2, capacity=capacity)
    experts = torch.tensor(picks + picks[:1] * (len(picks) % 2)).reshape(-1, 2)
    cap = -(-capacity * experts.shape[0] * 2 // 4)
    seen = [0, 0, 0, 0]
    want = []
    for e in experts.reshape(-1).tolist():
        want.append(seen[e] < cap)
        seen[e] += 1
    got = M._keep(experts, c)
    assert got is not None and got.reshape(-1).tolist() == want


def test_sigmoid_scores_with_a_bias_choose_by_the_bias_and_weigh_by_the_scores() -> None:
    c = M.MoEConfig(d_model=4, experts=4, ffn=3, top_k=2, score="sigmoid")
    params = M.init(c, seed=3, dtype=F64)
    x = torch.randn(6, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    bias = torch.tensor([0.0, 0.0, 5.0, 5.0], dtype=F64)  # experts 2 and 3 for every token
    weights, experts, scores, _ = M.route(params["router"], x, c, bias)
    assert experts.sort(-1).values.tolist() == [[2, 3]] * 6
    chosen = scores.gather(-1, experts)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
    _, stats = M.moe(params, x, c, bias)
    assert stats["counts"].tolist() == [0, 0, 6, 6]
    moved = M.update_bias(bias, stats["counts"], rate=0.125)
    assert moved.tolist() == [0.125, 0.125, 4.875, 4.875]


def test_the_auxiliary_loss_and_the_z_loss() -> None:
    c = M.MoEConfig(d_model=4, experts=4, ffn=3, top_k=1)
    params = M.init(c, seed=0, dtype=F64)
    params["router"] = torch.zeros(4, 4, dtype=F64)  # uniform scores: aux is exactly 1
    _, stats = M.moe(params, torch.randn(5, 4, dtype=F64), c)
    torch.testing.assert_close(stats["aux"], torch.tensor(1.0, dtype=F64))
    torch.testing.assert_close(stats["z"], torch.log(torch.tensor(4.0, dtype=F64)) ** 2)


@pytest.mark.parametrize(
    ("kw", "said"),
    [
        ({"top_k": 5}, "top_k=5.*from 1 to min\\(8, experts=4\\)"),
        ({"capacity": 0.0}, "capacity=0.0.*> 0"),
        ({"score": "relu"}, "'softmax' or 'sigmoid'"),
        ({"shared": -1}, "shared=-1"),
    ],
)
def test_bad_configurations_are_refused(kw: dict[str, Any], said: str) -> None:
    with pytest.raises(InvalidArgument, match=said):
        M.MoEConfig(**{"d_model": 4, "experts": 4, "ffn": 3, **kw})


def test_a_bias_of_the_wrong_length_and_counts_of_another_layer_are_refused() -> None:
    c = M.MoEConfig(d_model=4, experts=4, ffn=3)
    params = M.init(c)
    with pytest.raises(InvalidArgument, match="one value per expert \\(4,\\); got \\(3,\\)"):
        M.moe(params, torch.randn(2, 4), c, torch.zeros(3))
    with pytest.raises(InvalidArgument, match="counts \\(8,\\) and bias \\(4,\\)"):
        M.update_bias(torch.zeros(4), torch.zeros(8))


@pytest.mark.parametrize(
    ("schedule", "recompute"), [("gpipe", False), ("1f1b", True), ("zbv", False)]
)
def test_moe_stages_in_a_pipeline_equal_the_reference_step(schedule: str, recompute: bool) -> None:
    """Residual MoE blocks as pipeline stages (the grouped matmul, float32): the step equals
    reference_step, and shape inference runs without data (no fallback to a real microbatch,
    which warns: warnings fail the tests)."""
    import funcpipe as fp
    from funcpipe.schedule import generate

    c = M.MoEConfig(d_model=8, experts=4, ffn=8, top_k=2, shared=1)

    def block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return h + 0.5 * M.moe(p, h, c)[0]

    program = generate(schedule, ranks=2, microbatches=4)
    stages = [fp.Stage(block) for _ in range(program.n_stages)]
    params = tuple(M.init(c, seed=s) for s in range(program.n_stages))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, 8, generator=g), torch.randn(8, 5, 8, generator=g)

    def mse(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((o - t) ** 2).mean()

    pipe = fp.Pipeline(stages, program, loss_fn=mse, recompute=recompute)
    got = pipe.step(params, x, y)
    ref = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    fp.testing.assert_trees_close((got.loss, got.grads), ref, atol=1e-5, rtol=1e-4)


def test_experts_named_without_an_expert_axis_reduce_like_dense_leaves() -> None:
    """Pipeline(experts=...) with no expert axis (one expert rank, 2 in-process copies): every
    copy holds every expert, so the expert leaves are averaged over both copies like the others
    (they were left unreduced before: 0.88 off)."""
    import funcpipe as fp
    from funcpipe.schedule import generate

    c = M.MoEConfig(d_model=4, experts=4, ffn=3, top_k=2)

    def block(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return h + M.moe(p, h, c)[0]

    def mse(o: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return ((o - t) ** 2).mean()

    stages = [fp.Stage(block), fp.Stage(block)]
    params = tuple(M.init(c, seed=s, dtype=F64) for s in range(2))
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randn(8, 3, 4, dtype=F64, generator=g) for _ in range(2))
    experts = [(s, leaf) for s in range(2) for leaf in ("w_in", "w_out")]
    pipe = fp.Pipeline(
        stages, generate("1f1b", ranks=2, microbatches=2), loss_fn=mse, data=2, experts=experts
    )
    got = pipe.step(params, x, y)
    ref = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    fp.testing.assert_trees_close((got.loss, got.grads), ref, atol=1e-12, rtol=1e-10)


def test_params_of_another_tensor_split_are_refused_not_summed() -> None:
    """Over a tensor axis each rank holds 1/t of every split width: a leaf left whole (which the
    sum over tensor would count t times over) or cut for the other split is named before any
    collective, and so is an unknown split."""
    from funcpipe.parallel import Axis
    from funcpipe.parallel.mesh import ParallelConfig
    from funcpipe.parallel.sharding import shard_tree

    c = M.MoEConfig(d_model=8, experts=4, ffn=8, top_k=2, shared=1)
    full = M.init(c, seed=0)
    place = ParallelConfig.from_dict({"tensor": 2}, world_size=2).place(0)
    tensor, spread = Axis("tensor", 2, 0, None), Axis("expert_tensor", 2, 0, None)
    x = torch.randn(4, 8)
    width = shard_tree(full, M.shardings(c, expert=None), place)
    tokens = shard_tree(full, M.shardings(c, expert=None, split="tokens"), place)
    cases = [
        ({**width, "shared_in": full["shared_in"], "shared_out": full["shared_out"]}, "width",
         None, "params['shared_out'] holds 8 rows"),
        ({**width, "w_in": full["w_in"]}, "width", None, "params['w_in'] holds 16 columns"),
        ({**tokens, "shared_out": full["shared_out"]}, "tokens", spread,
         "params['shared_out'] holds 8 rows"),
        (width, "tokens", spread, "params['w_out'] holds 4 rows"),  # width-cut, tokens split
    ]  # fmt: skip
    for params, split, axis, said in cases:
        if axis is not None:  # (the tokens split holds E / 2 experts over the spread axis)
            params = {**params, "w_in": params["w_in"][:2], "w_out": params["w_out"][:2]}
        with pytest.raises(InvalidArgument, match=re.escape(said)):
            M.moe(params, x, c, axis=axis, tensor=tensor, split=split)
    with pytest.raises(InvalidArgument, match=r"split='rows'; one of \('width', 'tokens'\)"):
        M.moe(full, x, c, split="rows")
    with pytest.raises(InvalidArgument, match="split='rows'"):
        M.shardings(c, split="rows")
