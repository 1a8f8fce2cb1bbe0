"""ZeRO-2 in the planner (``ClusterLayout(zero=2)``): its gradient memory and reduce-scatters as
arithmetic, the sharding levels the search walks, and the memory floor the search filters by
(never above the simulated memory, so no layout that fits is dropped before it is priced)."""

from __future__ import annotations

import random

import pytest

from funcpipe.errors import InvalidArgument
from funcpipe.planner import ClusterLayout, Estimate, Transformer, candidates, cluster, estimate
from funcpipe.planner.estimate import GRADIENT_BYTES, data_parallel_seconds, gradient_bytes
from funcpipe.planner.pipeline import activation_floor, simulated

TINY = Transformer(layers=4, hidden=256, heads=4, vocab=1000, seq=128)
EIGHT = Transformer(layers=8, hidden=256, heads=4, vocab=1000, seq=128, tied=False, dtype="fp32")
WHERE = cluster("h100-sxm", gpus_per_node=4)


def test_zero_levels_and_the_old_spelling() -> None:
    assert ClusterLayout(data=2, zero1=True) == ClusterLayout(data=2, zero=1)
    one = ClusterLayout(data=2, zero1=True)
    assert (one.zero, one.zero1) == (1, True) and "zero1" in one.short()
    two = ClusterLayout(data=2, zero=2)
    assert two.zero1 is True  # the optimizer state is sharded at level 2 too
    assert "zero2" in two.short() and "zero1" not in two.short()
    assert two.as_dict()["zero"] == 2 and two.as_dict()["zero1"] is True
    assert "zero" not in ClusterLayout(data=2).short()
    assert ClusterLayout(data=2, zero1=True, zero=2) == two


def test_replace_changes_the_zero_level_of_a_layout() -> None:
    """dataclasses.replace passes the layout's zero1 (True when sharded) again: zero=0 beside
    it is refused, not left sharded without a word (it used to stay at 1); with zero1=False it
    unshards, whichever spelling made the layout."""
    import dataclasses

    for sharded in (ClusterLayout(data=2, zero1=True), ClusterLayout(data=2, zero=1)):
        with pytest.raises(
            InvalidArgument,
            match=r"to unshard, pass zero1=False too \(replace\(layout, zero=0, zero1",
        ):
            dataclasses.replace(sharded, zero=0)
        off = dataclasses.replace(sharded, zero=0, zero1=False)
        assert (off.zero, off.zero1) == (0, False) and off == ClusterLayout(data=2)
        assert dataclasses.replace(sharded, zero=2).zero == 2
        assert dataclasses.replace(sharded, data=4) == ClusterLayout(data=4, zero=1)
    assert dataclasses.replace(ClusterLayout(data=2), zero=2).zero == 2
    with pytest.raises(InvalidArgument, match=r"ClusterLayout\(zero=0, zero1=True\)"):
        dataclasses.replace(ClusterLayout(data=2), zero1=True)  # zero=0 is passed with it
    assert ClusterLayout(data=2, zero1=True, zero=2).zero == 2


def test_zero_with_one_data_copy_is_refused() -> None:
    """There is nothing to shard over: as Pipeline(zero=...) with one copy."""
    for kwargs in ({"zero": 1}, {"zero": 2}, {"zero1": True}):
        with pytest.raises(InvalidArgument, match=r"data=1\): ZeRO shards over the data-parallel"):
            ClusterLayout(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"zero": 3}, "zero=3"), ({"zero": True}, "zero=True"), ({"zero": "1"}, "zero='1'"),
     ({"zero1": "yes"}, "zero1='yes'")],
)  # fmt: skip
def test_zero_levels_refused_with_the_reason(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        ClusterLayout(data=2, **kwargs)  # type: ignore[arg-type]


def test_gradient_bytes() -> None:
    """Whole float32 sums (0, 1); a 1/d shard plus one chunk's whole gradient (2)."""
    assert gradient_bytes(0, 4, 1000, 300) == gradient_bytes(1, 4, 1000, 300) == 4000
    assert gradient_bytes(2, 4, 1000, 300) == (250 + 300) * GRADIENT_BYTES


def test_data_parallel_seconds() -> None:
    """Hand-worked: an all-reduce (0) or reduce-scatter (1) of 10 / 5 s once a step against a
    4 s backward in 5 buckets; zero 2's reduce-scatters of 2 + 3 s per microbatch."""
    assert data_parallel_seconds(0, 4, 10.0, [], 0.0, 8.0, 4.0, 5, True) == (6.0, 10.0)
    assert data_parallel_seconds(1, 4, 5.0, [], 5.0, 8.0, 4.0, 5, True) == (6.0, 10.0)
    # under 8 s of compute per microbatch the first 3 hide; the last sticks out as zero 1's
    assert data_parallel_seconds(2, 4, 0.0, [2.0, 3.0], 5.0, 8.0, 4.0, 5, True) == (6.0, 25.0)
    # under 3 s each of the first 3 adds its 2 s beyond the compute
    assert data_parallel_seconds(2, 4, 0.0, [2.0, 3.0], 5.0, 3.0, 4.0, 5, True) == (12.0, 25.0)
    # one microbatch: zero 2 is zero 1; not overlapped: everything after the drain
    assert data_parallel_seconds(2, 1, 0.0, [5.0], 5.0, 3.0, 4.0, 5, True) == (6.0, 10.0)
    assert data_parallel_seconds(2, 4, 0.0, [2.0, 3.0], 5.0, 8.0, 4.0, 5, False) == (25.0, 25.0)


def _zero(level: int, schedule: str, batch: int) -> Estimate:
    lay = ClusterLayout(pipeline=2, data=4, schedule=schedule,
                        interleave=2 if schedule == "zbv" else 1, zero=level)  # fmt: skip
    return estimate(EIGHT, WHERE, lay, global_batch=batch, simulate=True)


def test_zero2_in_an_estimate() -> None:
    """EIGHT in float32 on 2 ranks x 4 copies: parameters, optimizer and gather as zero 1;
    gradients a 1/4 shard plus the largest chunk's; m reduce-scatters per stage."""
    z1, z2 = _zero(1, "zbv", 32), _zero(2, "zbv", 32)  # 8 microbatches a copy
    for key in ("parameters", "optimizer", "activations", "buffers"):
        assert z2.memory[key] == z1.memory[key]
    params = z1.memory["parameters"] / 4
    block = EIGHT.layer_params()
    table = EIGHT.vocab * EIGHT.hidden
    # zbv: rank 0 holds stage 0 (2 blocks + embedding) and stage 3 (2 blocks + output layer)
    assert params == pytest.approx(4 * block + 2 * table + 2 * EIGHT.hidden)
    chunk = 2 * block + table + 2 * EIGHT.hidden
    assert z2.memory["gradients"] == pytest.approx((params / 4 + chunk) * 4)
    assert z2.memory["gradients"] < z1.memory["gradients"]
    assert z2.memory_bytes_per_gpu < z1.memory_bytes_per_gpu
    assert z2.step_time_s >= z1.step_time_s
    assert z2.breakdown["data_parallel_total"] > z1.breakdown["data_parallel_total"]
    # one chunk per rank: the transient gradient is the whole rank's, ZeRO-2 saves nothing
    one_chunk = _zero(2, "1f1b", 32).memory["gradients"], _zero(1, "1f1b", 32).memory["gradients"]
    assert one_chunk[0] > one_chunk[1]
    # one microbatch a copy, one chunk per rank: one reduce-scatter a step, as zero 1 (zbv's
    # two chunks post two, each with its latency)
    assert _zero(2, "1f1b", 4).step_time_s == pytest.approx(_zero(1, "1f1b", 4).step_time_s)
    assert _zero(2, "zbv", 4).step_time_s > _zero(1, "zbv", 4).step_time_s


def test_candidates_walk_the_zero_levels() -> None:
    lays = list(candidates(TINY, 8, 16, schedules=("1f1b",), recompute=("none",)))
    levels = {(lay.data > 1, lay.zero) for lay in lays}
    assert levels == {(False, 0), (True, 0), (True, 1), (True, 2)}
    old = list(
        candidates(TINY, 8, 16, schedules=("1f1b",), recompute=("none",), zero1=(False, True))
    )
    assert {lay.zero for lay in old} == {0, 1}
    only = list(candidates(TINY, 8, 16, schedules=("1f1b",), recompute=("none",), zero=(2,)))
    assert {lay.zero for lay in only if lay.data > 1} == {2}
    refused = [({"zero": (0,), "zero1": (True,)}, "once"), ({"zero": (3,)}, r"zero=\(3,\)"),
               ({"zero1": (2,)}, r"zero1=\(2,\)"), ({"zero": 2}, r"zero=2\): a sequence")]  # fmt: skip
    for kw, needle in refused:
        with pytest.raises(InvalidArgument, match=needle):
            list(candidates(TINY, 8, 16, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1", "zb-h2", "zbv", "interleaved"])
def test_activation_floor_is_the_programs_peak(schedule: str) -> None:
    """Random uneven per-stage bytes: the floor equals the simulated peak of every rank up to
    3p microbatches and is never above it beyond (where the run of 2p is read)."""
    rng = random.Random(0)
    for p in (2, 3, 4):
        for v in (2, 3) if schedule == "interleaved" else (2,) if schedule == "zbv" else (1,):
            for m in range(1, 4 * p + 2):
                act = [rng.uniform(0.1, 3.0) for _ in range(p * v)]
                ones = [1.0] * (p * v)
                _, peaks = simulated(schedule, p, m, v, ones, ones, ones, act)
                floor = activation_floor(schedule, p, m, v, act)
                for r in range(p):
                    assert floor[r] <= peaks[r] * (1 + 1e-12), (schedule, p, m, v, r)
                    if m <= 3 * p:
                        assert floor[r] == pytest.approx(peaks[r]), (schedule, p, m, v, r)


def _grid() -> list[tuple[Transformer, ClusterLayout, int]]:
    space = {"microbatches": (1, 2), "interleaves": (2, 4), "recompute": ("none", "full")}
    grid = [
        (model, lay, batch)
        for model in (TINY, EIGHT)
        for batch in (8, 64)
        for lay in candidates(model, 8, batch, gpus_per_node=4, **space)  # type: ignore[arg-type]
    ]
    for counts in ((1, 3, 3, 1), (3, 1, 1, 3), (0, 4, 4, 0)):  # uneven chunks, 2 per rank
        for sched in ("zbv", "interleaved"):
            lay = ClusterLayout(pipeline=2, data=4, interleave=2, schedule=sched, zero=2,
                                stage_layers=counts)  # fmt: skip
            grid += [(EIGHT, lay, 8), (EIGHT, lay, 64)]
    return grid


def test_the_search_filters_by_a_true_lower_bound_of_memory() -> None:
    """``Estimate.memory_floor_bytes`` (closed-form path) is never above the simulated memory
    over a grid of layouts (zero levels, uneven chunks, m below p and above 3p); it is that
    memory where a rank holds one chunk. The closed-form memory, which the search used to drop
    layouts by, is above the simulated on some of them: the layouts it wrongly dropped."""
    over = 0
    for model, lay, batch in _grid():
        fast = estimate(model, WHERE, lay, global_batch=batch)
        sim = estimate(model, WHERE, lay, global_batch=batch, simulate=True)
        assert fast.memory_floor_bytes <= sim.memory_bytes_per_gpu * (1 + 1e-12), lay.short()
        if lay.interleave == 1:
            assert fast.memory_floor_bytes == pytest.approx(sim.memory_bytes_per_gpu), lay.short()
        over += fast.memory_bytes_per_gpu > sim.memory_bytes_per_gpu * (1 + 1e-9)
    assert over > 0


def test_cli_prices_a_sharding_level(capsys: pytest.CaptureFixture[str]) -> None:
    from funcpipe.cli.app import main

    args = ["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000",
            "--seq", "128", "--global-batch", "16", "--gpus", "8", "--gpu", "h100-sxm",
            "--pipeline", "2", "--schedule", "zbv"]  # fmt: skip
    assert main([*args, "--zero", "2"]) == 0
    assert "t1 p2 d4 b1 v2 none zero2 zbv" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        main([*args, "--zero", "3"])
    assert "--zero" in capsys.readouterr().err
    # one data copy: nothing to shard over, said in the CLI's words
    assert main([*args[:-4], "--pipeline", "8", "--zero", "1"]) == 2
    err = capsys.readouterr().err
    assert "--zero 1: ZeRO shards over the data-parallel copies" in err and "8 / 8" in err


def test_one_tied_stage_holds_one_table() -> None:
    """Pipeline 1, a tied model: the one stage holds the embedding once, so zero 2's whole
    chunk gradient is the rank's gradient (it counted the table twice: the chunk came out
    larger than everything the rank holds)."""
    model = Transformer(layers=4, hidden=256, heads=4, vocab=50_000, seq=128)
    assert model.tied
    h100 = cluster("h100-sxm")
    est0, est2 = (
        estimate(model, h100, ClusterLayout(data=2, zero=z), global_batch=2) for z in (0, 2)
    )
    assert est2.memory["gradients"] == pytest.approx(est0.memory["gradients"] * 1.5)


def test_the_layout_limit_counts_layouts_apart_from_their_sharding_level(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Searching the three sharding levels by default must not refuse a space the search took
    before them: the limit is on layouts, each priced at its levels."""
    import importlib

    search_mod = importlib.import_module("funcpipe.planner.search")

    model = Transformer(layers=4, hidden=256, heads=4, vocab=1000, seq=128)
    h100 = cluster("h100-sxm")
    base = len(list(candidates(model, 8, 16, zero=(0,))))
    assert len(list(candidates(model, 8, 16))) > base  # the levels multiply the space
    monkeypatch.setattr(search_mod, "MAX_LAYOUTS", base)
    assert search_mod.search(model, h100, gpus=8, global_batch=16, simulate=False)
    monkeypatch.setattr(search_mod, "MAX_LAYOUTS", base // 4)
    with pytest.raises(InvalidArgument, match="layouts of 8 GPUs"):
        search_mod.search(model, h100, gpus=8, global_batch=16, simulate=False)
