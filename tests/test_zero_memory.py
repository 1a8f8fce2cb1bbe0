"""The planner's memory model of ZeRO-1 (``ClusterLayout(zero1=True)``) against what the runtime
holds (``Pipeline(zero=1)``): optimizer state, gradients and parameters per rank, at data 2 and
4, within 5%. ZeRO-2 (``ClusterLayout(zero=2)``): what ``Pipeline(zero=2)`` holds between steps
is measured to equal ``zero=1``'s; its in-step gradient bytes are planned from the pieces they
are made of, measured at ``zero=0`` and ``zero=1`` (the planner leaves out the packed copy a
SCATTER has in flight, which ``benchmarks/zero_peak.py`` measures; the arithmetic is pinned in
tests/plan/test_zero2.py).

Measured in one process (``Pipeline(data=d)``: the copies side by side, the same shards the
processes of ``benchmarks/zero.py`` hold) on the benchmark GPT in float32, cut into 2 stages,
after one AdamW step: the bytes of every tensor a (stage, copy) holds. Planned for the same
shape (``Transformer(dtype="fp32", tied=False)``: the same blocks; the GPT's position embedding
and head bias, which the planner leaves out, are under 3% of a stage). No timing, no processes.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

from benchmarks import _common as C
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.planner import ClusterLayout, Transformer, cluster, estimate
from funcpipe.planner.estimate import GRADIENT_BYTES, optimizer_bytes_per_param
from funcpipe.schedule import generate
from funcpipe.train.optimizers import adamw

SIZE = C.SIZES["gpt-tiny"]  # d_model 16, 4 blocks, 2 heads, 8 tokens, vocab 256
MICROBATCHES = 2
PLANNED = Transformer(
    layers=SIZE.layers,
    hidden=SIZE.width,
    heads=SIZE.heads,
    vocab=SIZE.vocab,
    seq=SIZE.seq,
    tied=False,
    dtype="fp32",
)


def _bytes(tree: Any) -> int:
    leaves = torch.utils._pytree.tree_leaves(tree)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


@cache
def measured(data: int, zero: int) -> dict[str, int]:
    """The largest bytes any (stage, copy) holds after one AdamW step, by kind: ``optimizer``
    (mu, nu, master), ``gradients`` (what the step returns), ``held`` (params between steps)."""
    stages, params = C.funcpipe_stages(C.build(SIZE), SIZE, 2)
    program = generate("1f1b", ranks=2, microbatches=MICROBATCHES)
    pipe = Pipeline(stages, program, loss_fn=C.loss_fn(SIZE), data=data, zero=zero)
    x, y = C.data(SIZE)
    opt = adamw(1e-3)
    copies = pipe.shard(tuple(params)) if zero else [tuple(params)] * data
    if zero:
        states = [opt.init(c) for c in copies]
        _, grads = pipe.step(copies, x, y)
        new = [opt.update(g, s, c) for g, s, c in zip(grads, states, copies, strict=True)]
    else:  # one set of full params and state, the same on every copy
        state = opt.init(copies[0])
        _, g = pipe.step(copies[0], x, y)
        grads = [g] * data
        new = [opt.update(g, state, copies[0])] * data
    pipe.close()
    out = {"optimizer": 0, "gradients": 0, "held": 0}
    for c in range(data):
        values, st = new[c]
        for o in range(2):  # stage o of copy c: one rank
            mine = {
                "optimizer": _bytes(st.mu[o]) + _bytes(st.nu[o]) + _bytes(st.master),
                "gradients": _bytes(grads[c][o]),
                "held": _bytes(values[o]),
            }
            out = {k: max(v, mine[k]) for k, v in out.items()}
    return out


def planned(data: int, zero1: bool, zero: int = 0) -> dict[str, float]:
    layout = ClusterLayout(pipeline=2, data=data, zero=zero or int(zero1))
    e = estimate(
        PLANNED, cluster("h100-sxm"), layout, global_batch=data * MICROBATCHES
    )  # microbatch 1: MICROBATCHES per copy
    return e.memory


def _close(a: float, b: float, rel: float = 0.05) -> bool:
    return abs(a - b) <= rel * b


@pytest.mark.parametrize("data", [2, 4])
def test_planner_zero1_memory_matches_the_runtime(data: int) -> None:
    full, sharded = measured(data, 0), measured(data, 1)
    plan0, plan1 = planned(data, False), planned(data, True)
    # optimizer state: AdamW's two float32 moments (8 bytes a parameter, no master for float32
    # parameters), whole unsharded and 1/d sharded: the runtime's and the planner's
    assert _close(sharded["optimizer"] * data, full["optimizer"])
    assert _close(plan0["optimizer"], full["optimizer"]), (plan0, full)
    assert _close(plan1["optimizer"], sharded["optimizer"]), (plan1, sharded)
    # gradients: the planner counts the float32 sum a step accumulates, whole on every copy
    # with or without zero1 (ZeRO-1 reduce-scatters it at the end of the step); the runtime
    # returns it whole (zero=0) or this copy's 1/d piece of it (zero=1)
    for plan in (plan0, plan1):
        assert _close(plan["gradients"], full["gradients"]), (plan, full)
    assert _close(sharded["gradients"] * data, full["gradients"])
    # parameters: the planner counts the full float32 weights a step computes with (sharded:
    # what the GATHERs rebuild, measured in benchmarks/zero_peak.py); the runtime keeps them
    # whole between steps unsharded, 1/d of them sharded
    for plan in (plan0, plan1):
        assert _close(plan["parameters"], full["held"]), (plan, full)
    assert _close(sharded["held"] * data, full["held"])


@pytest.mark.parametrize("data", [2, 4])
def test_planner_zero2_memory_from_the_runtime_pieces(data: int) -> None:
    """ZeRO-2 keeps what ZeRO-1 keeps between steps (optimizer state and parameter shards, the
    gradient shard it returns); in the step it holds a float32 shard of the gradient sums (the
    1/d piece ``zero=1`` returns) plus one chunk's whole gradient until its reduce-scatter (one
    stage's gradient, what ``zero=0`` returns: one chunk per rank here). Between steps the
    runtime's zero=2 holds exactly zero=1's bytes."""
    full, sharded = measured(data, 0), measured(data, 1)
    assert measured(data, 2) == sharded
    plan1, plan2 = planned(data, True), planned(data, False, zero=2)
    for key in ("optimizer", "parameters", "activations", "buffers"):
        assert plan2[key] == plan1[key]
    assert _close(plan2["gradients"], sharded["gradients"] + full["gradients"]), (plan2, full)
    # one chunk per rank: the transient whole gradient is the rank's, so ZeRO-2 holds 1/d more
    assert plan2["gradients"] == pytest.approx(plan1["gradients"] * (1 + 1 / data))


def test_optimizer_bytes_follow_the_dtype() -> None:
    """float32 parameters: AdamW's m and v (8 bytes); narrower ones add a float32 master (12)."""
    assert optimizer_bytes_per_param("fp32") == 8
    assert optimizer_bytes_per_param("bf16") == optimizer_bytes_per_param("fp16") == 12
    assert GRADIENT_BYTES == 4
    n = PLANNED.params()
    e = estimate(PLANNED, cluster("h100-sxm"), ClusterLayout(data=4), global_batch=4)
    total = e.memory["parameters"] + e.memory["gradients"] + e.memory["optimizer"]
    assert total == pytest.approx(16 * n)  # 4 weights + 4 gradients + 8 moments
    z = estimate(PLANNED, cluster("h100-sxm"), ClusterLayout(data=4, zero1=True), global_batch=4)
    assert z.memory["optimizer"] == pytest.approx(8 * n / 4)
