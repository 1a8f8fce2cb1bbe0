"""The planner's formulas, each against an independent hand count (docs/planner.md)."""

from __future__ import annotations

import ast
from math import isclose
from pathlib import Path

import pytest

from funcpipe.errors import InvalidArgument
from funcpipe.planner import (
    GPU,
    GPUS,
    Calibration,
    Cluster,
    ClusterLayout,
    Link,
    Transformer,
    cluster,
    comm,
)
from funcpipe.planner.compute import layer_costs
from funcpipe.planner.estimate import estimate
from funcpipe.planner.pipeline import closed_form, in_flight, program
from funcpipe.schedule import Costs, peak_activations, simulate

GPT = Transformer(layers=24, hidden=2304, heads=24, vocab=51200, seq=2048, flash=False)


def test_flops_per_token_is_6n_plus_attention() -> None:
    L, h, s, V = 24, 2304, 2048, 51200
    n = 12 * L * h * h + V * h  # matrices of the blocks and the output layer
    assert isclose(GPT.model_flops_per_token(), 6 * n + 12 * L * h * s)
    # Megatron-LM's form: 72 B s L h^2 (1 + s / 6h + V / 12 L h) model FLOPs for B sequences
    megatron = 72 * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)) / s
    assert isclose(GPT.model_flops_per_token(), megatron)


def test_parameters_of_a_gpt() -> None:
    # GPT-2 small: 12 layers, 768 wide, 50257 vocabulary, 1024 positions -> 124.4M with the
    # position table; without it (the planner's embedding is the token table) 123.7M
    gpt2 = Transformer(layers=12, hidden=768, heads=12, vocab=50257, seq=1024)
    assert gpt2.params() + 1024 * 768 == 124_439_808


def test_ring_collectives() -> None:
    link = Link(bandwidth=100e9, latency=0.0)
    for n in (2, 4, 8):
        assert isclose(comm.all_reduce(1e9, n, link), 2 * (n - 1) / n * 1e9 / 100e9)
        assert isclose(comm.reduce_scatter(1e9, n, link), (n - 1) / n * 1e9 / 100e9)
        assert isclose(
            comm.all_gather(1e9, n, link) + comm.reduce_scatter(1e9, n, link),
            comm.all_reduce(1e9, n, link),
        )
    slow = Link(bandwidth=1e9, latency=1e-5)
    assert isclose(comm.all_reduce(0.0, 8, slow), 0.0)
    assert isclose(comm.all_reduce(1e6, 1, slow), 0.0)
    assert isclose(comm.all_reduce(1e6, 4, slow), 1.5e6 / 1e9 + 6 * 1e-5)
    assert isclose(comm.p2p(1e6, slow), 1e-5 + 1e-3)


def test_axis_links() -> None:
    a100 = cluster("a100-80gb")
    assert a100.link(stride=1, size=8) is a100.intra
    assert a100.link(stride=1, size=16) is a100.inter
    assert a100.link(stride=8, size=2) is a100.inter
    assert a100.link(stride=2, size=4) is a100.intra


def test_presets_are_datasheet_figures_and_editable() -> None:
    assert set(GPUS) == {"a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200"}
    assert cluster("a100-80gb").gpu.peak("bf16") == 312e12
    assert cluster("h100-sxm").gpu.peak("bf16") == 989e12
    assert cluster("h200").gpu.memory == 141e9
    big = cluster("a100-80gb", gpus_per_node=16)
    assert big.gpus_per_node == 16 and cluster("a100-80gb").gpus_per_node == 8
    with pytest.raises(InvalidArgument, match="gpu='v100'"):
        cluster("v100")


def test_matmuls_are_flops_over_calibrated_peak() -> None:
    """With free memory traffic and no launch cost, F is the block's FLOPs at the matmul share;
    I and W each repeat the weight products (I also the scores); tensor parallelism divides."""
    gpu = GPU("ideal", {"bf16": 100e12}, 80e9, float("inf"))
    where = Cluster(gpu)
    cal = Calibration(matmul=0.5, matmul_overhead=0.0)
    h, s, f = 1024, 512, 4096
    model = Transformer(layers=1, hidden=h, heads=8, vocab=1000, seq=s, flash=False)
    for t in (1, 2, 4):
        c = layer_costs(model, ClusterLayout(tensor=t), where, cal)
        linear = 2 * s * (4 * h * h + 2 * h * f) / t
        scores = 4 * s * s * h / t
        assert isclose(c.f, (linear + scores) / 50e12)
        assert isclose(c.w, linear / 50e12)
        assert isclose(c.i, (linear + 2 * scores) / 50e12)


def test_recompute_trades_time_for_memory() -> None:
    a100 = cluster("a100-80gb")
    costs = {rc: layer_costs(GPT, ClusterLayout(recompute=rc), a100, Calibration()) for rc in
             ("none", "selective", "full")}  # fmt: skip
    assert costs["none"].recompute == 0
    assert 0 < costs["selective"].recompute < costs["full"].recompute
    assert isclose(costs["full"].recompute, costs["full"].f)
    assert costs["full"].activation < costs["selective"].activation < costs["none"].activation
    # Korthikanti et al.: s b h (34 + 5 a s / h) bytes without parallelism, 2 s b h under full
    s, h, a = 2048, 2304, 24
    assert isclose(costs["none"].activation, s * h * (34 + 5 * a * s / h))
    assert isclose(costs["full"].activation, 2 * s * h)


def test_closed_forms_equal_the_simulator_on_balanced_stages() -> None:
    for name, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-h2", 1),
                    ("zbv", 2)):  # fmt: skip
        for p, m in ((2, 8), (4, 8), (4, 12)):
            for f, i, w in ((1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (2.0, 1.5, 1.0), (1.0, 0.8, 0.9)):
                prog = program(name, p, m, v)
                tl = simulate(prog, Costs(f=f / v, b=i / v, w=w / v, full=(i + w) / v))
                assert isclose(closed_form(name, p, m, v, f, i, w), tl.makespan), (name, p, m)
                peaks = peak_activations(prog)
                assert [in_flight(name, p, m, v, r) for r in range(p)] == list(peaks), name


def test_memory_counts_the_mixed_precision_state() -> None:
    """18 bytes per parameter (bf16 weights, fp32 gradients, fp32 master + Adam moments);
    ZeRO-1 divides the 12 optimizer bytes by data."""
    a100 = cluster("a100-80gb")
    lay = ClusterLayout(data=8, recompute="full")
    e = estimate(GPT, a100, lay, global_batch=64)
    n = GPT.params()
    assert isclose(e.memory["parameters"] + e.memory["gradients"] + e.memory["optimizer"],
                   18 * n, rel_tol=1e-6)  # fmt: skip
    z = estimate(GPT, a100, ClusterLayout(data=8, recompute="full", zero1=True), global_batch=64)
    assert isclose(z.memory["optimizer"], 12 * n / 8, rel_tol=1e-6)
    assert z.memory_bytes_per_gpu < e.memory_bytes_per_gpu


def test_estimate_rejects_layouts_that_do_not_fit_the_model() -> None:
    a100 = cluster("a100-80gb")
    with pytest.raises(InvalidArgument, match="layers=24"):
        estimate(GPT, a100, ClusterLayout(pipeline=5), global_batch=5)
    with pytest.raises(InvalidArgument, match="heads=24"):
        estimate(GPT, a100, ClusterLayout(tensor=16), global_batch=16)
    with pytest.raises(InvalidArgument, match="global_batch=10"):
        estimate(GPT, a100, ClusterLayout(data=4), global_batch=10)
    with pytest.raises(InvalidArgument, match="interleave"):
        ClusterLayout(schedule="1f1b", interleave=2)
    with pytest.raises(InvalidArgument, match="sequence_parallel"):
        ClusterLayout(sequence_parallel=True)


def test_plan_package_imports_no_torch() -> None:
    root = Path(__file__).resolve().parents[2] / "funcpipe" / "plan"
    allowed = ("funcpipe.errors", "funcpipe.planner", "funcpipe.schedule")
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("funcpipe"):
                    assert name.startswith(allowed), (path.name, name)
                else:
                    assert name.split(".")[0] not in ("torch", "numpy"), (path.name, name)


def test_zbv_closed_form_is_close_outside_its_exact_regime() -> None:
    """I > F and W < I (full recompute): the fill is low, the step within 6% at m = 4p."""
    for p in (2, 4, 6):
        for f, i, w in ((1.0, 2.0, 0.5), (3.0, 1.0, 1.0), (1.0, 1.2, 1.0)):
            m = 4 * p
            tl = simulate(program("zbv", p, m, 2), Costs(f=f / 2, b=i / 2, w=w / 2))
            got = closed_form("zbv", p, m, 2, f, i, w)
            assert got <= tl.makespan * (1 + 1e-9)
            assert got >= 0.94 * tl.makespan, (p, f, i, w)
