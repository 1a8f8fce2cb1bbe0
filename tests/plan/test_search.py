"""The search against brute force, the API and the CLI, and the published runs pinned."""

from __future__ import annotations

import json
import time
from functools import lru_cache
from math import isclose

import pytest

import funcpipe
from funcpipe.cli.app import main
from funcpipe.errors import InvalidArgument
from funcpipe.planner import (
    ClusterLayout,
    Estimate,
    Transformer,
    candidates,
    cluster,
    estimate,
    search,
)
from funcpipe.planner.published import MEGATRON_2021

TINY = Transformer(layers=4, hidden=256, heads=4, vocab=1000, seq=128)


SPACE = {"microbatches": (1, 2, 4), "interleaves": (2,)}


@lru_cache(maxsize=1)
def _brute_force() -> tuple[Estimate, ...]:
    """Every candidate of the search below (sharding levels 0, 1, 2 where data > 1: the
    default), priced with the simulator."""
    where = cluster("h100-sxm", gpus_per_node=4)
    lays = list(candidates(TINY, 8, 16, gpus_per_node=4, **SPACE))  # type: ignore[arg-type]
    assert {lay.zero for lay in lays} == {0, 1, 2}
    return tuple(estimate(TINY, where, lay, global_batch=16, simulate=True) for lay in lays)


@pytest.mark.parametrize("share", [None, 0.3, 0.7])
def test_search_finds_the_brute_force_optimum(share: float | None) -> None:
    """Every candidate priced with the simulator; with a memory limit that only ``share`` of
    them meet (the fastest ones among those cut, by construction: the limit sits below them).
    At 0.3 the closed-form memory of some layouts that fit is above the limit (the search drops
    by a lower bound of the simulated memory); at 0.7 a ZeRO-2 layout is the optimum."""
    where = cluster("h100-sxm", gpus_per_node=4)  # 8 GPUs on 2 nodes: the links differ
    every = _brute_force()
    limit = None
    if share is not None:
        limit = sorted(e.memory_bytes_per_gpu for e in every)[int(share * len(every))]
    fitting = [e for e in every if limit is None or e.memory_bytes_per_gpu <= limit]
    assert fitting
    best = min(fitting, key=lambda e: e.step_time_s)
    fastest = min(every, key=lambda e: e.step_time_s)
    if share is not None:
        assert fastest.step_time_s < best.step_time_s  # the limit changes the answer
    got = search(TINY, where, gpus=8, global_batch=16, memory_limit=limit, top=3, **SPACE)
    assert isclose(got[0].step_time_s, best.step_time_s)
    tied = [e.layout for e in fitting if isclose(e.step_time_s, best.step_time_s)]
    assert got[0].layout in tied  # the optimum itself (one of several when they tie)
    assert [e.step_time_s for e in got] == sorted(e.step_time_s for e in got)
    assert all(e.fits for e in got)
    if share == 0.7:
        assert got[0].layout.zero == 2, got[0].layout.short()
    if share == 0.3:  # what the closed-form memory filter dropped: layouts that fit
        wrong = [e for e in fitting if not estimate(TINY, where, e.layout, global_batch=16,
                                                    memory_limit=limit).fits]  # fmt: skip
        assert wrong


def test_candidates_are_the_valid_layouts() -> None:
    lays = list(candidates(TINY, 8, 16, schedules=("1f1b",), recompute=("none",)))
    assert lays and all(lay.gpus == 8 for lay in lays)
    assert all(TINY.layers % (lay.pipeline * lay.interleave) == 0 for lay in lays)
    assert all(16 % (lay.data * lay.microbatch) == 0 for lay in lays)
    assert {lay.tensor for lay in lays} == {1, 2, 4}  # 8 does not divide 4 heads


def test_plan_is_callable_from_the_package() -> None:
    got = funcpipe.plan(TINY, gpus=4, global_batch=8, gpu="a100-40gb", top=2)
    assert len(got) == 2 and got[0].step_time_s <= got[1].step_time_s
    one = funcpipe.plan(TINY, gpus=4, global_batch=8, layout=ClusterLayout(pipeline=2, data=2))
    assert one[0].layout == ClusterLayout(pipeline=2, data=2) and one[0].simulated
    with pytest.raises(InvalidArgument, match="gpus=4"):
        funcpipe.plan(TINY, gpus=4, global_batch=8, layout=ClusterLayout(pipeline=2))


ARGS = ["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000",
        "--seq", "128", "--global-batch", "16", "--gpus", "8", "--gpu", "h100-sxm"]  # fmt: skip


def test_cli_json_searches_without_layout_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "mfu", "hardware_tflops_per_gpu", "memory_gib_per_gpu", "layout"):
        assert key in out
    assert out["searched"] is True and len(out["next"]) == 2
    assert out["layout"]["tensor"] * out["layout"]["pipeline"] * out["layout"]["data"] == 8
    assert out["next"][0]["step_time_s"] >= out["step_time_s"]


def test_cli_prices_a_given_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--json", "--tensor", "2", "--pipeline", "2", "--schedule", "zbv",
                 "--recompute", "full", "--sequence-parallel"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["searched"] is False
    assert out["layout"] == {"tensor": 2, "pipeline": 2, "data": 2, "microbatch": 1,
                             "interleave": 2, "recompute": "full", "sequence_parallel": True,
                             "schedule": "zbv", "zero1": False,
                             "stage_layers": None, "zero": 0}  # fmt: skip
    assert main([*ARGS, "--tensor", "2"]) == 0
    table = capsys.readouterr().out
    assert "t2 p1 d4" in table and "MFU" in table
    assert main([*ARGS, "--tensor", "3"]) == 2
    assert "tensor" in capsys.readouterr().err


def _megatron(row: tuple[float, int, int, int, int, int, int, int, float]) -> tuple:  # type: ignore[type-arg]
    size, layers, hidden, heads, t, p, gpus, batch, pub = row
    model = Transformer(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048,
                        flash=False)  # fmt: skip
    v = 2 if size == 145.6 else 1
    lay = ClusterLayout(tensor=t, pipeline=p, data=gpus // (t * p), interleave=v, recompute="full",
                 schedule="interleaved" if v > 1 else "1f1b")  # fmt: skip
    return model, lay, gpus, batch, pub


@pytest.mark.parametrize("row", MEGATRON_2021, ids=lambda r: f"{r[0]}B")
def test_megatron_2021_table_1_within_15_percent(row: tuple) -> None:  # type: ignore[type-arg]
    """docs/planner.md: the closed form here (fast); the docs' table is simulated."""
    model, lay, _, batch, pub = _megatron(row)
    e = estimate(model, cluster("a100-80gb"), lay, global_batch=batch, overlap_grad_reduce=False)
    assert e.fits
    assert abs(e.hardware_tflops_per_gpu / pub - 1) <= 0.15, e.hardware_tflops_per_gpu


@pytest.mark.parametrize("row", MEGATRON_2021[:3], ids=lambda r: f"{r[0]}B")
def test_search_beats_the_published_layout(row: tuple) -> None:  # type: ignore[type-arg]
    model, lay, gpus, batch, _ = _megatron(row)
    a100 = cluster("a100-80gb")
    published = estimate(model, a100, lay, global_batch=batch, overlap_grad_reduce=False,
                         simulate=True)  # fmt: skip
    best = search(model, a100, gpus=gpus, global_batch=batch, overlap_grad_reduce=False)[0]
    assert best.step_time_s <= published.step_time_s


def test_stage_layers_even_split_is_the_default() -> None:
    model = Transformer(layers=8, hidden=512, heads=8, vocab=50000, seq=256)
    a100 = cluster("a100-80gb")
    base = estimate(model, a100, ClusterLayout(pipeline=4, schedule="zb-h1"), global_batch=16,
                    simulate=True)  # fmt: skip
    same = estimate(model, a100, ClusterLayout(pipeline=4, schedule="zb-h1", stage_layers=(2, 2, 2, 2)),
                    global_batch=16, simulate=True)  # fmt: skip
    assert same.step_time_s == base.step_time_s
    assert same.memory_bytes_per_gpu == base.memory_bytes_per_gpu
    # the last stage carries the output layer: moving a block off it shortens the step
    lighter = estimate(model, a100, ClusterLayout(pipeline=4, schedule="zb-h1",
                                           stage_layers=(2, 2, 3, 1)),
                       global_batch=16, simulate=True)  # fmt: skip
    assert lighter.step_time_s < base.step_time_s
    assert "layers 2,2,3,1" in lighter.layout.short()


@pytest.mark.parametrize(
    ("counts", "needle"),
    [
        ((2, 2, 2), "4 of them"),
        ((2, -1, 2, 5), "integer >= 0"),
        ((0, 0, 0, 0), "not all zero"),
        ("2222", "integer"),
        ((2, 2, 2, 2.0), "integer"),
    ],
)
def test_stage_layers_refused_with_the_reason(counts: object, needle: str) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        ClusterLayout(pipeline=4, stage_layers=counts)  # type: ignore[arg-type]


def test_stage_layers_must_add_up_to_the_model() -> None:
    model = Transformer(layers=8, hidden=512, heads=8, vocab=5000, seq=256)
    with pytest.raises(InvalidArgument, match="add up to 9 blocks but the model has layers=8"):
        estimate(model, cluster("a100-80gb"), ClusterLayout(pipeline=4, stage_layers=(3, 2, 2, 2)),
                 global_batch=16)  # fmt: skip


def test_cli_stage_layers(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--layers", "22", "--hidden", "2304", "--heads", "24", "--vocab", "50304",
            "--seq", "1024", "--global-batch", "48", "--gpus", "8", "--gpu", "a100-80gb",
            "--pipeline", "8", "--schedule", "zb-h1", "--json"]  # fmt: skip
    assert main([*args, "--stage-layers", "2,3,3,3,3,3,3,2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["stage_layers"] == [2, 3, 3, 3, 3, 3, 3, 2]
    assert main([*args, "--stage-layers", "2,3,x"]) == 2
    assert "--stage-layers '2,3,x'" in capsys.readouterr().err


# ------------------------------------------------------------------ issue 42: sizes and batches
HUGE = ["--hidden", "4096", "--heads", "32", "--vocab", "50000", "--seq", "2048", "--gpu",
        "h100-sxm"]  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "status", "needles"),
    [
        # the search walked every number up to the GPU count looking for divisors
        (["--layers", "32", "--global-batch", "512", "--gpus", "1000000000"], 2,
         ["gpus=1000000000", "up to 1,048,576 GPUs"]),
        # a fixed layout of 10**7 stages was simulated without a limit
        (["--layers", "10000000", "--global-batch", "512", "--gpus", "10000000", "--pipeline",
          "10000000"], 2, ["gpus=10000000", "up to 1,048,576 GPUs"]),
        (["--layers", "10000000", "--global-batch", "512", "--gpus", "1000000", "--pipeline",
          "1000000"], 2, ["1,000,000 stages", "at most 1,024 pipeline stages"]),
        # at the limits: priced with the closed form (a program of 1,024 ranks is not simulated)
        (["--layers", "1024", "--global-batch", "4096", "--gpus", "1024", "--pipeline", "1024"],
         0, ["closed form"]),
        (["--layers", "32", "--global-batch", "2097152", "--gpus", "1048576"], 0, ["searched"]),
        # many common divisors: 157,680 layouts (52,560 without sharding), some of hundreds of
        # stages (was minutes)
        (["--layers", "720720", "--global-batch", "5765760", "--gpus", "720720"], 2,
         ["more than 20,000 layouts", "narrow it", "--pipeline"]),
    ],
)  # fmt: skip
def test_absurd_sizes_answer_within_seconds(
    argv: list[str], status: int, needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """funcpipe plan with sizes far beyond any cluster used to run for minutes; now it answers
    at once: refused with the limit, or priced with the closed form."""
    start = time.perf_counter()
    assert main(["plan", *HUGE, *argv]) == status
    took = time.perf_counter() - start
    seen = capsys.readouterr()
    text = seen.out + seen.err
    assert all(n in text for n in needles), text
    assert took < 10.0, f"{took:.1f} s"  # measured: under 0.5 s each


def test_a_batch_no_data_size_divides_names_the_data_sizes() -> None:
    """2 layers and 2 heads leave 64 GPUs at least 16 data ranks, and none divides 7
    sequences: memory was blamed ('add GPUs, allow recompute, or ...')."""
    model = Transformer(layers=2, hidden=256, heads=2, vocab=1000, seq=128)
    with pytest.raises(InvalidArgument) as caught:
        funcpipe.plan(model, gpus=64, global_batch=7)
    text = str(caught.value)
    assert "global_batch=7 is not a multiple of any data size" in text, text
    assert "16, 32 or 64" in text and "a multiple of 16" in text, text
    assert "memory" not in text, text


def test_the_search_prunes_by_a_true_lower_bound() -> None:
    """``Estimate.bound_s`` (closed-form path) is never above the simulated step time, zbv's
    extrapolated runs (m > 3p) included: the search's exactness rests on it."""
    where = cluster("h100-sxm", gpus_per_node=4)
    space = {"microbatches": (1, 2)}  # and every sharding level (the default)
    for lay in candidates(TINY, 8, 64, gpus_per_node=4, **space):  # type: ignore[arg-type]
        low = estimate(TINY, where, lay, global_batch=64).bound_s
        sim = estimate(TINY, where, lay, global_batch=64, simulate=True).step_time_s
        assert low <= sim * (1 + 1e-12), lay.short()
