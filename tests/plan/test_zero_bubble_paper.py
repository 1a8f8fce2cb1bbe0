"""The Zero Bubble paper (Qi et al., ICLR 2024) pinned: its Table 5 bubble rates recomputed by the
simulator from its Table 6 times, and the planner's Table 4 throughputs (docs/planner.md)."""

from __future__ import annotations

import pytest

from funcpipe.planner import cluster, estimate
from funcpipe.planner.published import (
    ZERO_BUBBLE_2024_BUBBLE,
    ZERO_BUBBLE_2024_MODELS,
    ZERO_BUBBLE_2024_PROFILED_MS,
    ZERO_BUBBLE_2024_STANDINS,
    ZERO_BUBBLE_2024_SYNCHRONIZED,
    ZERO_BUBBLE_2024_THROUGHPUT,
    zero_bubble_run,
)
from funcpipe.schedule.generators import generate
from funcpipe.schedule.passes import add_communication
from funcpipe.schedule.simulate import Costs, simulate

SETTINGS = [(name, k) for name in ZERO_BUBBLE_2024_MODELS for k in range(3)]


def _id(setting: tuple[str, int]) -> str:
    name, k = setting
    return f"{name}-m{ZERO_BUBBLE_2024_MODELS[name][6][k]}"


def paper_bubble_rate(schedule: str, name: str, k: int) -> float:
    """The paper's measure (Section 5.3): (cost - m(F + B + W)) / cost, cost the longest span
    (first start to last end) of any stage, with Table 6's times and messages of T_comm."""
    p, m = ZERO_BUBBLE_2024_MODELS[name][4], ZERO_BUBBLE_2024_MODELS[name][6][k]
    f, b, w, comm = ZERO_BUBBLE_2024_PROFILED_MS[name][k]
    program = add_communication(generate(schedule, ranks=p, microbatches=m))
    timeline = simulate(program, Costs(f=f, b=b, w=w, comm=comm))
    cost = max(max(e.end for e in r) - min(e.start for e in r) for r in timeline.events)
    return (cost - m * (f + b + w)) / cost


@pytest.mark.parametrize("setting", SETTINGS, ids=_id)
def test_table_5_1f1b_and_zb_1p_from_table_6_to_four_decimals(setting: tuple[str, int]) -> None:
    name, k = setting
    published = ZERO_BUBBLE_2024_BUBBLE[name]
    ours_1f1b = paper_bubble_rate("1f1b", name, k)
    ours_h1 = paper_bubble_rate("zb-h1", name, k)
    assert round(ours_1f1b, 4) == published["1f1b"][k]
    assert round(ours_h1, 4) == published["zb-h1"][k] == published["zb-1p"][k]


@pytest.mark.parametrize("setting", SETTINGS, ids=_id)
def test_table_5_zb_h2_matches_only_where_w_is_half_of_f(setting: tuple[str, int]) -> None:
    """funcpipe's ZB-H2 is ordered for F = I = W; the paper's for its measured times. In the
    paper's per-stage measure they agree for the 1.5B model (W = 0.50 F) and funcpipe's bubble
    is larger for the others (W = 0.65-0.74 F); its makespan, what a synchronous step costs,
    meets the bound m(F + B + W) + (p - 1)(F + T_comm) all the same (docs/planner.md)."""
    name, k = setting
    ours = paper_bubble_rate("zb-h2", name, k)
    published = ZERO_BUBBLE_2024_BUBBLE[name]["zb-h2"][k]
    if name == "1.5B":
        assert round(ours, 4) == published
    else:
        assert published + 0.01 < ours < published + 0.05
    p, m = ZERO_BUBBLE_2024_MODELS[name][4], ZERO_BUBBLE_2024_MODELS[name][6][k]
    f, b, w, comm = ZERO_BUBBLE_2024_PROFILED_MS[name][k]
    program = add_communication(generate("zb-h2", ranks=p, microbatches=m))
    makespan = simulate(program, Costs(f=f, b=b, w=w, comm=comm)).makespan
    assert makespan <= (m * (f + b + w) + (p - 1) * (f + comm)) * 1.001


@pytest.mark.parametrize("schedule", list(ZERO_BUBBLE_2024_STANDINS))
@pytest.mark.parametrize("setting", SETTINGS, ids=_id)
def test_table_4_throughput_within_15_percent(setting: tuple[str, int], schedule: str) -> None:
    name, k = setting
    model, layout, batch = zero_bubble_run(name, ZERO_BUBBLE_2024_MODELS[name][6][k], schedule)
    e = estimate(model, cluster("a100-80gb"), layout, global_batch=batch, simulate=True)
    samples_per_gpu_s = batch / e.step_time_s / layout.gpus
    ratio = samples_per_gpu_s / ZERO_BUBBLE_2024_THROUGHPUT[name][schedule][k]
    assert e.fits
    assert abs(ratio - 1) <= 0.15, ratio


@pytest.mark.parametrize("name", list(ZERO_BUBBLE_2024_SYNCHRONIZED))
def test_table_7_synchronized_zb_2p_within_15_percent(name: str) -> None:
    """funcpipe steps synchronously (every gradient reduced before the optimizer): the paper's
    ZB-2p with an all-reduce synchronization is the like-for-like run."""
    m, _, synchronized = ZERO_BUBBLE_2024_SYNCHRONIZED[name]
    model, layout, batch = zero_bubble_run(name, m, "zb-2p")
    e = estimate(model, cluster("a100-80gb"), layout, global_batch=batch, simulate=True)
    ratio = batch / e.step_time_s / layout.gpus / synchronized
    assert abs(ratio - 1) <= 0.15, ratio
