"""Overlapped pairs in the planner (issue 54): ``ClusterLayout(overlap=True)`` hides a stage's
expert all-to-all in the pairs of the ``zbv`` and ``dualpipev`` programs; DualPipeV's closed
form; the bound the search prunes paired layouts by; the search and the CLI choosing the
overlap (docs/planner.md, "Overlapped pairs")."""

from __future__ import annotations

import json
import random
from math import isclose

import pytest

from funcpipe.cli.app import main
from funcpipe.errors import InvalidArgument
from funcpipe.planner import (
    SCHEDULES,
    ClusterLayout,
    Transformer,
    candidates,
    cluster,
    estimate,
    search,
)
from funcpipe.planner.layout import PAIRING
from funcpipe.planner.pipeline import (
    closed_form,
    in_flight,
    pipeline_bound,
    placement,
    program,
    simulated,
)
from funcpipe.planner.published import MEGATRON_BRIDGE_MODELS, megatron_bridge_run
from funcpipe.schedule import Costs, generate, peak_activations, simulate

QWEN3 = MEGATRON_BRIDGE_MODELS["Qwen3-30B-A3B"]
H100 = cluster("h100-sxm")
# a small mixture of experts, its expert axis over two nodes of 2 GPUs
SMALL = Transformer(layers=8, hidden=1024, heads=8, vocab=32000, seq=2048, ffn=4096,
                    mlp="swiglu", tied=False, experts=16, top_k=4, moe_ffn=1024)  # fmt: skip


def _qwen3(schedule: str, overlap: bool) -> float:
    lay = ClusterLayout(pipeline=4, data=16, expert=16, interleave=2, zero=1, schedule=schedule,
                        overlap=overlap)  # fmt: skip
    return estimate(QWEN3, H100, lay, global_batch=1024, simulate=True).step_time_s


# ------------------------------------------------------------------------------- the layout
def test_overlap_is_a_layout_field() -> None:
    lay = ClusterLayout(pipeline=2, data=8, expert=8, interleave=2, schedule="dualpipev",
                        overlap=True)  # fmt: skip
    assert lay.short() == "t1 p2 d8 e8 b1 v2 none overlap dualpipev"
    assert lay.as_dict()["overlap"] is True
    off = ClusterLayout(pipeline=2, data=8, expert=8, interleave=2, schedule="zbv")
    assert "overlap" not in off.as_dict() and "overlap" not in off.short()
    assert "dualpipev" in SCHEDULES and PAIRING == ("zbv", "dualpipev")
    for name in ("GPT-OSS 120B", "Qwen3-30B-A3B"):  # the published runs overlapped nothing
        assert megatron_bridge_run(name)[1].overlap is False


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"schedule": "1f1b"}, ["overlap=True, schedule='1f1b'", "schedule='dualpipev'"]),
        ({"schedule": "interleaved", "interleave": 2}, ["schedule='interleaved'", "zbv"]),
        ({"expert": 1}, ["overlap=True, expert=1", "pass expert > 1"]),
        ({"pipeline": 1, "data": 16}, ["overlap=True, pipeline=1", "pipeline > 1"]),
        ({"overlap": 1}, ["overlap=1", "True or False"]),
    ],
)
def test_a_layout_without_pairs_is_refused(kwargs: dict[str, object], needles: list[str]) -> None:
    base: dict[str, object] = {"pipeline": 2, "data": 8, "expert": 8, "interleave": 2,
                               "schedule": "dualpipev", "overlap": True}  # fmt: skip
    with pytest.raises(InvalidArgument) as e:
        ClusterLayout(**{**base, **kwargs})  # type: ignore[arg-type]
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_a_dense_model_cannot_overlap() -> None:
    dense = Transformer(layers=4, hidden=256, heads=4, vocab=1000, seq=128)
    lay = ClusterLayout(pipeline=2, data=4, expert=2, interleave=2, schedule="zbv", overlap=True)
    with pytest.raises(InvalidArgument, match="no experts"):
        estimate(dense, H100, lay, global_batch=8)


# ---------------------------------------------------------------- closed forms and the bound
def test_dualpipev_closed_form_equals_the_simulator_where_i_is_at_most_f() -> None:
    for p, m in ((2, 8), (3, 9), (4, 8), (4, 12), (6, 24)):
        for f, i, w in ((1.0, 1.0, 1.0), (1.0, 0.8, 0.9), (2.0, 1.5, 1.0), (1.0, 0.5, 1.5)):
            tl = simulate(program("dualpipev", p, m, 2), Costs(f=f / 2, b=i / 2, w=w / 2))
            assert isclose(closed_form("dualpipev", p, m, 2, f, i, w), tl.makespan), (p, m)
        for f, i, w in ((1.0, 1.2, 1.0), (1.0, 2.0, 0.5), (1.0, 1.5, 1.5)):  # I > F: low
            tl = simulate(program("dualpipev", p, m, 2), Costs(f=f / 2, b=i / 2, w=w / 2))
            got = closed_form("dualpipev", p, m, 2, f, i, w)
            assert 0.95 * tl.makespan <= got <= tl.makespan * (1 + 1e-9), (p, m, f, i, w)


def test_dualpipev_in_flight_is_the_programs_count() -> None:
    for p in (2, 3, 4, 6):
        for m in (1, 2, p, 2 * p - 1, 2 * p, 3 * p):
            peaks = peak_activations(program("dualpipev", p, m, 2))
            assert [in_flight("dualpipev", p, m, 2, r) for r in range(p)] == list(peaks), (p, m)


def test_a_paired_dualpipev_adds_the_pairs_ideal_overlap_per_microbatch() -> None:
    """In the steady state each microbatch adds ``max(F + I + W, Fc + Ic, F + Fc, I + W + Ic)``
    (a rank's F of one chunk beside the full B of the other, balanced stages): the slope the
    simulator's extrapolation takes, and all of the all-to-all hidden where compute covers it."""
    for p in (2, 4):
        for f, i, w, fc, ic in ((1, 1, 1, 0.5, 0.5), (1, 1, 1, 2, 2), (2, 1.5, 1, 0.3, 0.6)):
            c = Costs(f=f / 2, b=i / 2, w=w / 2, f_comm=fc / 2, b_comm=ic / 2)
            t = [simulate(program("dualpipev", p, m, 2, True), c).makespan
                 for m in (2 * p, 3 * p)]  # fmt: skip
            step = max(f + i + w, fc + ic, f + fc, i + w + ic)
            assert isclose((t[1] - t[0]) / p, step), (p, f, i, w, fc, ic)


def test_the_bound_is_below_every_paired_run() -> None:
    """:func:`pipeline_bound` with the all-to-alls apart, on random uneven stages, is never above
    the paired program's simulated makespan (the search prunes paired layouts by it), nor above
    :func:`simulated`'s extrapolation; and the pairs hide time where there is communication."""
    rng = random.Random(54)
    for _ in range(60):
        sched = rng.choice(PAIRING)
        p, m = rng.choice(((2, 4), (2, 9), (3, 7), (4, 8), (4, 13)))
        n = 2 * p
        f, i, w, fc, ic = ([rng.uniform(0.1, 2.0) for _ in range(n)] for _ in range(5))
        tl = simulate(program(sched, p, m, 2, True), Costs(f=f, b=i, w=w, f_comm=fc, b_comm=ic))
        bound = pipeline_bound(sched, placement(sched, p, 2), m, f, i, w, fc, ic)
        assert bound <= tl.makespan * (1 + 1e-9), (sched, p, m)
        assert tl.hidden > 0
        priced, _ = simulated(sched, p, m, 2, f, i, w, [1.0] * n, f_comm=fc, i_comm=ic)
        assert bound <= priced * (1 + 1e-9)
        if m <= 3 * p:
            assert isclose(priced, tl.makespan)
    with pytest.raises(ValueError, match="together"):
        simulated("zbv", 2, 4, 2, [1.0] * 4, [1.0] * 4, [1.0] * 4, [1.0] * 4, f_comm=[1.0] * 4)


def test_without_communication_a_pair_hides_nothing() -> None:
    """``f_comm = b_comm = 0``: a pair costs its halves' sum (nothing hidden), and waiting for
    both halves' inputs makes the paired program no faster (docs/planner.md: 27.0 against 25.5)."""
    costs = Costs(f=0.5, b=0.5, w=0.5)
    for sched in PAIRING:
        for p, m in ((2, 8), (4, 8), (4, 12)):
            paired = simulate(program(sched, p, m, 2, True), costs)
            assert paired.hidden == 0.0
            assert paired.makespan >= simulate(program(sched, p, m, 2), costs).makespan
    assert simulate(program("dualpipev", 4, 8, 2, True), costs).makespan == 27.0
    assert simulate(program("dualpipev", 4, 8, 2), costs).makespan == 25.5


def test_a_paired_program_is_the_generators() -> None:
    assert program("dualpipev", 4, 8, 2, True) == generate("dualpipev", ranks=4, microbatches=8,
                                                           overlap=True)  # fmt: skip
    assert program("zbv", 4, 8, 2) == generate("zbv", ranks=4, microbatches=8)


# ------------------------------------------------------------------------------ the pricing
def test_overlap_hides_a_significant_all_to_all() -> None:
    """Qwen3-30B-A3B on 64 H100s, PP4 EP16 (the expert group over two nodes): the all-to-all is
    70 ms of a microbatch's 141 ms; hidden in DualPipeV's pairs the step takes 5.69 s instead of
    9.18 s, in ZB-V's 7.73 s instead of 9.15 s (docs/planner.md quotes these)."""
    for sched, off, on in (("dualpipev", 9.177, 5.688), ("zbv", 9.153, 7.732)):
        plain, paired = _qwen3(sched, False), _qwen3(sched, True)
        assert isclose(plain, off, abs_tol=5e-4) and isclose(paired, on, abs_tol=5e-4), sched
        assert paired < plain


def test_overlap_changes_only_the_pipeline_time() -> None:
    """Same microbatches, memory, compute and all-to-all per microbatch; only the pipeline's
    time (and so the step's) moves, and unpaired layouts keep their closed-form price."""
    where = cluster("h100-sxm", gpus_per_node=2)
    for sched in PAIRING:
        kw = {"pipeline": 2, "data": 8, "expert": 4, "interleave": 2, "schedule": sched}
        plain = estimate(SMALL, where, ClusterLayout(**kw), global_batch=64, simulate=True)
        paired = estimate(SMALL, where, ClusterLayout(**kw, overlap=True), global_batch=64,
                          simulate=True)  # fmt: skip
        assert paired.step_time_s < plain.step_time_s
        assert paired.memory == plain.memory and paired.microbatches == plain.microbatches
        for key, value in plain.breakdown.items():
            if key != "pipeline":
                assert isclose(paired.breakdown[key], value), key
        closed = estimate(SMALL, where, ClusterLayout(**kw, overlap=True), global_batch=64)
        plain_closed = estimate(SMALL, where, ClusterLayout(**kw), global_batch=64)
        assert closed.step_time_s == plain_closed.step_time_s  # no credit without the simulator
        assert closed.bound_s <= paired.step_time_s


# ------------------------------------------------------------------------------- the search
def test_the_candidates_pair_where_a_layout_may() -> None:
    lays = list(candidates(SMALL, 16, 32, recompute=("none",), zero=(0,), microbatches=(1,)))
    paired = [lay for lay in lays if lay.overlap]
    assert paired and all(
        lay.schedule in PAIRING and lay.expert > 1 and lay.pipeline > 1 for lay in paired
    )
    assert {lay.schedule for lay in lays} >= {"dualpipev", "zbv", "1f1b"}
    for lay in paired:  # each paired layout beside its unpaired twin
        twin = ClusterLayout(**{**lay.as_dict(), "overlap": False, "zero1": False})
        assert twin in lays
    only = list(candidates(SMALL, 16, 32, recompute=("none",), zero=(0,), overlap=(True,)))
    assert only and all(lay.overlap for lay in only)
    none = candidates(SMALL, 16, 32, recompute=("none",), zero=(0,), overlap=(False,))
    assert not any(lay.overlap for lay in none)
    dense = Transformer(layers=4, hidden=128, heads=4, vocab=1000, seq=64)
    assert not any(lay.overlap or lay.schedule == "dualpipev" for lay in candidates(dense, 8, 16))


@pytest.mark.parametrize(
    ("model", "space", "needle"),
    [
        (Transformer(layers=4, hidden=128, heads=4, vocab=1000, seq=64), {"overlap": (True,)},
         "the model has no experts"),
        (SMALL, {"overlap": (True,), "schedules": ("1f1b",)}, "add one of them to schedules"),
        (SMALL, {"overlap": "yes"}, "a sequence of True/False"),
        (SMALL, {"overlap": ()}, "a sequence of True/False"),
    ],
)  # fmt: skip
def test_the_search_refuses_overlap_where_there_can_be_none(
    model: Transformer, space: dict[str, object], needle: str
) -> None:
    with pytest.raises(InvalidArgument, match=needle):
        list(candidates(model, 8, 16, **space))  # type: ignore[arg-type]


def test_the_search_chooses_the_overlap_where_the_all_to_all_is_significant() -> None:
    """Qwen3-30B-A3B, 64 H100s, EP16: every layout's all-to-all crosses nodes; the best layout
    pairs (DualPipeV), its price the simulator's, and every paired candidate's bound is below its
    simulated price (the pruning is exact)."""
    space = {"zero": (1,), "recompute": ("none",), "microbatches": (1,), "expert": (16,)}
    best = search(QWEN3, H100, gpus=64, global_batch=1024, top=3, **space)
    assert best[0].layout.overlap and best[0].layout.schedule == "dualpipev"
    again = estimate(QWEN3, H100, best[0].layout, global_batch=1024, simulate=True)
    assert isclose(again.step_time_s, best[0].step_time_s)
    plain = search(QWEN3, H100, gpus=64, global_batch=1024, overlap=(False,), **space)[0]
    assert not plain.layout.overlap and plain.step_time_s > best[0].step_time_s
    for lay in candidates(QWEN3, 64, 1024, gpus_per_node=8, overlap=(True,), **space):
        e = estimate(QWEN3, H100, lay, global_batch=1024, simulate=True)
        assert e.bound_s <= e.step_time_s * (1 + 1e-9), lay.short()


# ---------------------------------------------------------------------------------- the CLI
QWEN3_ARGS = ["plan", "--layers", "48", "--hidden", "2048", "--heads", "32", "--kv-heads", "4",
              "--head-dim", "128", "--vocab", "151936", "--seq", "4096", "--mlp", "swiglu",
              "--untied", "--experts", "128", "--top-k", "8", "--moe-ffn", "768", "--precision",
              "fp8", "--global-batch", "1024", "--gpus", "64", "--gpu", "h100-sxm"]  # fmt: skip
LAYOUT = ["--pipeline", "4", "--expert-parallel", "16", "--zero", "1", "--schedule", "dualpipev"]


def test_cli_prices_an_overlapped_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*QWEN3_ARGS, *LAYOUT, "--overlap", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"]["overlap"] is True and out["layout"]["interleave"] == 2
    assert out["simulated"] is True and isclose(out["step_time_s"], _qwen3("dualpipev", True))
    assert main([*QWEN3_ARGS, *LAYOUT, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "overlap" not in out["layout"] and isclose(
        out["step_time_s"], _qwen3("dualpipev", False)
    )
    assert main([*QWEN3_ARGS, *LAYOUT, "--overlap"]) == 0
    assert "t1 p4 d16 e16 b1 v2 none zero1 overlap dualpipev" in capsys.readouterr().out


def test_cli_searches_with_and_without_the_overlap(capsys: pytest.CaptureFixture[str]) -> None:
    small = ["plan", "--layers", "8", "--hidden", "1024", "--heads", "8", "--vocab", "32000",
             "--seq", "2048", "--ffn", "4096", "--mlp", "swiglu", "--untied", "--experts", "16",
             "--top-k", "4", "--moe-ffn", "1024", "--global-batch", "32", "--gpus", "16",
             "--gpu", "h100-sxm"]  # fmt: skip
    assert main([*small, "--overlap", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["searched"] is True and out["layout"]["overlap"] is True
    assert main([*small, "--no-overlap", "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all("overlap" not in e["layout"] for e in [out, *out["next"]])


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (["--pipeline", "4", "--expert-parallel", "16", "--overlap"],
         ["--overlap with --schedule 1f1b", "--schedule dualpipev"]),
        (["--pipeline", "4", "--schedule", "zbv", "--overlap"],
         ["--overlap without --expert-parallel", "--expert-parallel EP"]),
    ],
)  # fmt: skip
def test_cli_refuses_an_overlap_without_pairs(
    extra: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*QWEN3_ARGS, *extra]) == 2
    err = capsys.readouterr().err
    assert "funcpipe plan: error:" in err and all(n in err for n in needles), err


def test_cli_refuses_an_overlap_of_a_dense_model(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000",
            "--seq", "128", "--global-batch", "16", "--gpus", "8", "--gpu", "h100-sxm"]  # fmt: skip
    assert main([*args, "--overlap"]) == 2
    err = capsys.readouterr().err
    assert "--overlap" in err and "give --experts E" in err, err
