"""The MoE layer with expert parallelism over 2 and 4 gloo processes equals the layer on one
device over every process's tokens in float64: outputs, the tokens' gradients, each expert's
gradient on the process holding it, and the router's and shared experts' gradients summed
over the processes; routings hypothesis draws (top-k, scores, shared experts, processes with
no tokens)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument
from funcpipe.models import moe
from funcpipe.parallel import Axis
from tests import jobs_moe as J
from tests.parallel.strategies import scaled


@st.composite
def cases(draw: st.DrawFn, world: int) -> dict[str, Any]:
    per = draw(st.integers(1, 2))
    return {
        "world": world,
        "per": per,
        "k": draw(st.integers(1, min(3, world * per))),
        "shared": draw(st.integers(0, 1)),
        "score": draw(st.sampled_from(["softmax", "sigmoid"])),
        "tokens": [draw(st.integers(0, 5)) for _ in range(world)],
        # a capacity counted over every process's tokens (None: dropless)
        "capacity": draw(st.sampled_from([None, None, 0.5, 1.0, 1.5])),
        "seed": draw(st.integers(0, 10**6)),
    }


def _check(case: dict[str, Any], got: list[dict[str, Any]]) -> None:
    world, config = case["world"], J.config_of(case)
    full = {
        k: v.requires_grad_(True)
        for k, v in moe.init(config, seed=case["seed"], dtype=J.F64).items()
    }
    xs, gys = zip(*(J.tokens_of(case, r) for r in range(world)), strict=True)
    x = torch.cat(xs).requires_grad_(True)
    y, stats = moe.moe(full, x, config)
    y.backward(torch.cat(gys))
    local = config.experts // world
    tol = {"atol": 1e-12, "rtol": 1e-10}
    start = 0
    for r, mine in enumerate(got):
        rows = slice(start, start + case["tokens"][r])
        start += case["tokens"][r]
        torch.testing.assert_close(mine["y"], y.detach()[rows], **tol, msg=f"{case} rank {r}")
        torch.testing.assert_close(mine["x_grad"], x.grad[rows], **tol)
        for name in ("w_in", "w_out"):
            held = full[name].grad[r * local : (r + 1) * local]
            torch.testing.assert_close(mine["grads"][name], held, **tol)
    for name in [k for k in full if k not in ("w_in", "w_out")]:
        summed = sum(m["grads"][name] for m in got)
        torch.testing.assert_close(summed, full[name].grad, **tol, msg=f"{case} {name}")
    assert sum(m["counts"] for m in got).tolist() == stats["counts"].tolist()


@pytest.mark.timeout(180)
@settings(max_examples=scaled(6), deadline=None)
@given(st.lists(cases(2), min_size=3, max_size=6))
def test_expert_parallel_over_two_processes_equals_one_device(
    pool: Any, drawn: list[dict[str, Any]]
) -> None:
    results = pool(2).run(J.run_moe_cases, drawn)
    for c, case in enumerate(drawn):
        _check(case, [results[r][c] for r in range(2)])


@pytest.mark.timeout(240)
@settings(max_examples=scaled(4), deadline=None)
@given(st.lists(cases(4), min_size=3, max_size=6))
def test_expert_parallel_over_four_processes_equals_one_device(
    pool: Any, drawn: list[dict[str, Any]]
) -> None:
    results = pool(4).run(J.run_moe_cases, drawn)
    for c, case in enumerate(drawn):
        _check(case, [results[r][c] for r in range(4)])


def test_experts_that_do_not_divide_are_refused() -> None:
    two = Axis("expert", 2, 0, None)
    config = moe.MoEConfig(d_model=4, experts=3, ffn=3)
    params = moe.init(config)
    with pytest.raises(InvalidArgument, match="experts=3 do not divide over axis 'expert' of 2"):
        moe.moe(params, torch.randn(2, 4), config, axis=two)
    even = moe.MoEConfig(d_model=4, experts=4, ffn=3)
    with pytest.raises(InvalidArgument, match="holds 4 experts.*each holds 2"):
        moe.moe(moe.init(even), torch.randn(2, 4), even, axis=two)


@st.composite
def split_cases(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "k": draw(st.integers(1, 4)),
        "shared": draw(st.integers(0, 1)),
        "score": draw(st.sampled_from(["softmax", "sigmoid"])),
        "tokens": 2 * draw(st.integers(1, 4)),
        "capacity": draw(st.sampled_from([None, None, 0.5, 1.0])),
        "seed": draw(st.integers(0, 10**6)),
    }


@pytest.mark.timeout(300)
@settings(max_examples=scaled(2), deadline=None)
@given(st.lists(split_cases(), min_size=3, max_size=5))
def test_tokens_split_over_tensor_ranks_equals_one_device(
    pool: Any, drawn: list[dict[str, Any]]
) -> None:
    """``moe(split="tokens")`` over 2 tensor ranks (each routing half the tokens, 2 of the 4
    experts each, the router's gradient summed over them in backward): the output, the counts,
    the auxiliary and z losses and every gradient equal the layer on one device, for routings
    hypothesis draws, a capacity (counted over both ranks' tokens, in token order) included."""
    for rank, worst in enumerate(pool(2).run(J.tokens_split_vs_one_device, drawn)):
        assert max(worst) < 1e-10, (rank, worst)
