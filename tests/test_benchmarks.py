"""The benchmark scripts run at a tiny size (so they cannot rot) and their gradients agree.

Nothing here asserts a time: timings on a shared two-core machine are not test material.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from benchmarks import _common as C
from benchmarks import (
    _raw,
    auto_bytes,
    auto_executed,
    backward_costs,
    backward_split,
    chart,
    cpu_use,
    kernels,
    memory,
    overhead,
    profile_step,
    vs_peer,
    vs_simulated,
    vs_single,
    weight_batching,
    weight_memory,
)

Pool = Callable[[int], Any]


@pytest.mark.timeout(120)
def test_vs_peer_gradients_agree(pool: Pool, tmp_path: Any) -> None:
    out = tmp_path / "peer.json"
    argv = ["--sizes", "tiny", "--ranks", "2", "--schedules", "1f1b", "zbv"]
    rows = vs_peer.main([*argv, "--pairs", "2", "--warmup", "1", "--json", str(out)], pool=pool)
    assert out.exists()
    assert [r["schedule"] for r in rows] == ["1f1b", "zbv"]
    for r in rows:
        assert r["note"] == "", r["note"]
        assert r["grad_diff"] < 1e-10 and r["grad_ref"] < 1e-10 and r["peer_ref"] < 1e-10
        assert len(r["funcpipe_times"]) == len(r["peer_times"]) == 2
        assert r["floor_ms"] > 0 and r["raw_floor_ms"] > 0 and r["raw_floor_ratio"] > 0
        assert r["staged_floor_ms"] > 0 and r["staged_floor_ratio"] > 0
    pytest.importorskip("matplotlib")
    chart.main([str(out), "--out", str(tmp_path / "peer.png")])
    assert (tmp_path / "peer.png").stat().st_size > 0


@pytest.mark.timeout(120)
def test_vs_peer_with_kept_peer_gradients_and_extra_weight_memory(pool: Pool) -> None:
    argv = ["--sizes", "tiny", "--ranks", "2", "--schedules", "1f1b", "--peer-grads", "zeros"]
    argv += ["--batch-weights-extra", "2", "--peer-onednn", "off"]
    (row,) = vs_peer.main([*argv, "--pairs", "2", "--warmup", "1", "--floor-reps", "0"], pool=pool)
    assert row["note"] == "" and row["peer_grads"] == "zeros" and row["batch_weights_extra"] == 2
    assert row["peer_onednn"] == "off"
    assert row["grad_diff"] < 1e-10 and len(row["peer_times"]) == 2


@pytest.mark.parametrize("n_stages", [1, 2, 4])
def test_raw_stages_compute_the_models_gradients(n_stages: int) -> None:
    """The raw floors time the same arithmetic: their kernels give autograd's gradients (B and
    the I/W split alike, the loss included; staged or not)."""
    for size in ("tiny", "small"):
        assert _raw.check(C.SIZES[size], n_stages) < 1e-12
        assert _raw.check(C.SIZES[size], n_stages, staged=True) < 1e-12
    staged, sums = _raw.measure_staged(C.SIZES["tiny"], n_stages, reps=1)
    for costs in (_raw.measure(C.SIZES["tiny"], n_stages, reps=1), staged):
        assert all(len(v) == n_stages and min(v) > 0 for v in costs.as_dict().values())
    assert len(sums) == n_stages and min(sums) > 0


@pytest.mark.timeout(120)
def test_vs_single(pool: Pool) -> None:
    argv = ["--sizes", "tiny", "--ranks", "2", "--schedules", "1f1b", "--pairs", "2"]
    (row,) = vs_single.main([*argv, "--warmup", "1", "--cost-reps", "2"], pool=pool)
    assert row["ideal"] > 0 and row["ideal_uniform"] > 0 and row["speedup"] > 0


@pytest.mark.timeout(120)
def test_vs_simulated(pool: Pool) -> None:
    argv = ["--size", "tiny", "--schedules", "1f1b", "zb-h1", "--steps", "2", "--warmup", "1"]
    rows = vs_simulated.main([*argv, "--cost-reps", "2", "--comm-reps", "2"], pool=pool)
    assert [r["schedule"] for r in rows] == ["1f1b", "zb-h1"]
    assert all(r["simulated_ms"] > 0 and r["executed_ms"] > 0 for r in rows)
    argv = ["--size", "tiny", "--schedules", "1f1b", "--steps", "4", "--warmup", "1"]
    argv += ["--cost-reps", "2", "--comm-reps", "2", "--traced", "0", "--repeat", "3"]
    (row,) = vs_simulated.main(argv, pool=pool)
    # the least noisy of 3 runs is reported; every run's ratio is kept
    assert row["repeats"] == 3 and len(row["ratio_runs"]) == len(row["iqr_runs"]) == 3
    best = min(range(3), key=lambda k: row["iqr_runs"][k])
    assert row["ratio"] == row["ratio_runs"][best] and row["iqr"] == row["iqr_runs"][best]


def test_in_step_costs_keep_whole_backwards_of_mixed_programs() -> None:
    """DualPipeV mixes whole B's with I and W: the simulator gets each stage's executed B as its
    full backward (not I + W, which in-step costs more), as costs_for gives it measured ones."""
    program = C.program_for("dualpipev", ranks=2, microbatches=4)
    n = program.n_stages
    durations = {f"F {s}": 1.0 for s in range(n)}
    durations |= {f"I {s}": 1.5 for s in range(n)} | {f"W {s}": 1.0 for s in range(n)}
    durations |= {f"B {s}": 2.0 for s in range(n - 1)}  # the last stage: no whole B seen
    costs = vs_simulated.in_step_costs(program, durations, 0.0)
    assert costs.full == (2.0,) * (n - 1) + (2.5,)
    assert list(costs.b) == [1.5] * n and list(costs.w) == [1.0] * n


def test_vs_simulated_refuses_repeat_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):  # before any process starts
        vs_simulated.main(["--repeat", "0"])
    assert ">= 1" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_auto_executed_runs_every_program_with_exact_gradients(pool: Pool) -> None:
    argv = ["--size", "tiny", "--rounds", "2", "--warmup", "1", "--memory", "p", "2p"]
    argv += ["--tune-count", "2", "--tune-rounds", "1"]
    rows = auto_executed.main([*argv, "--cost-reps", "2", "--comm-reps", "2"], pool=pool)
    for mem in ("p", "2p"):
        cell = {r["schedule"]: r for r in rows if r["memory"] == mem}
        assert {"auto", "auto-v", "1f1b", "zb-h1", "zbv"} <= set(cell)
        limit = 2 if mem == "p" else 4  # full-stage activations per rank, 2 ranks
        for r in cell.values():
            assert r["peak"] <= limit, r["schedule"]
            assert r["grad_ref"] < 1e-10, r["schedule"]
            assert len(r["executed_times"]) == 2
        assert cell["1f1b"]["best_builtin"] in cell and cell["auto"]["vs_best"] > 0
        body = auto_executed._body  # a program's text without its name line
        for name, r in cell.items():
            same = {b for b in cell if b != name and body(cell[b]["program"]) == body(r["program"])}
            assert set(filter(None, r["same_as"].split(", "))) == same - {
                "auto",
                "auto-v",
                "auto-tuned",
            }
        tuned = cell["auto-tuned"]  # funcpipe.tune.fastest's pick: auto's candidates, built-ins
        assert tuned["picked"] in tuned["tune_medians_ms"] and tuned["grad_ref"] < 1e-10
        assert tuned["picked"].split(":")[0] in ("auto", "auto-v", "built-in")
    assert {r["schedule"] for r in rows if r["memory"] == "2p"} >= {"interleaved", "zb-h2"}


@pytest.mark.timeout(120)
def test_weight_memory_runs_and_gradients_agree(pool: Pool) -> None:
    argv = ["--sizes", "tiny", "--schedules", "1f1b", "--extra", "2", "--pairs", "2"]
    (row,) = weight_memory.main([*argv, "--warmup", "1"], pool=pool)
    assert row["grad_diff"] < 1e-12 and len(row["extra_times"]) == len(row["default_times"]) == 2
    assert row["peaks_default"] == "2,1" and row["peaks_extra"] == "4,3"  # 1F1B's last rank: 1 + 2
    assert row["variant"] == "batch_weights_extra=2"
    argv = ["--sizes", "tiny", "--schedules", "1f1b", "zbv", "--unstaged", "--pairs", "2"]
    rows = weight_memory.main([*argv, "--warmup", "1"], pool=pool)
    assert [r["variant"] for r in rows] == ["stage_weights=False"] * 2
    for r in rows:  # the same peaks: staging keeps nothing alive
        assert r["grad_diff"] < 1e-12 and r["peaks_default"] == r["peaks_extra"]
    argv = ["--sizes", "tiny", "--schedules", "interleaved", "--idle", "off", "--pairs", "2"]
    (row,) = weight_memory.main([*argv, "--warmup", "1"], pool=pool)
    assert row["variant"] == "idle_weights=False"
    assert row["grad_diff"] < 1e-12 and row["peaks_default"] == row["peaks_extra"]
    argv = ["--sizes", "tiny", "--schedules", "zbv", "--no-chains", "--pairs", "2"]
    (row,) = weight_memory.main([*argv, "--warmup", "1"], pool=pool)
    assert row["variant"] == "chains=False"
    assert row["grad_diff"] < 1e-12 and row["peaks_default"] == row["peaks_extra"]


@pytest.mark.timeout(120)
def test_cpu_use_runs_and_gradients_agree(pool: Pool) -> None:
    argv = ["--sizes", "tiny", "--ranks", "2", "--schedules", "1f1b", "zbv", "--steps", "2"]
    rows = cpu_use.main([*argv, "--rounds", "2", "--warmup", "1", "--raw-reps", "2"], pool=pool)
    assert [r["schedule"] for r in rows] == ["1f1b", "zbv"]
    for r in rows:
        assert r["grad_diff"] < 1e-12
        for lib in ("funcpipe", "peer"):
            blocks = r[f"{lib}_blocks"]
            assert len(blocks["step_s"]) == len(blocks["cpu_s"]) == 2
            assert (
                r[f"{lib}_cpu_ms"] > 0 and r[f"{lib}_bound_ms"] == r[f"{lib}_cpu_ms"] / r["cores"]
            )
        assert r["raw_cpu_ms"] > 0 and r["raw_cpu_ratio"] > 0


@pytest.mark.timeout(120)
def test_kernels_runs_replays_every_kernel_and_gradients_agree(pool: Pool) -> None:
    argv = ["--sizes", "tiny", "--ranks", "2", "--schedules", "1f1b", "zbv", "--steps", "2"]
    rows, extras = kernels.main(
        [*argv, "--warmup", "1", "--hot-reps", "3", "--sweep", "1", "2"], pool=pool
    )
    assert [(r["schedule"], r["lib"]) for r in rows] == [
        ("1f1b", "funcpipe"),
        ("1f1b", "peer"),
        ("zbv", "funcpipe"),
        ("zbv", "peer"),
    ]
    for r in rows:
        assert r["grad_diff"] < 1e-12
        seen = {k["kernel"] for k in r["kernels"]}
        assert {"aten::addmm", "aten::mm", "aten::gelu", "aten::gelu_backward"} <= seen
        # every kernel the step ran was replayed hot with its recorded shapes
        assert r["not_replayed_ms"] == 0 and all(k["hot_us"] > 0 for k in r["kernels"])
        assert r["kernels_ms"] > 0 and r["hot_ms"] > 0 and r["cpu_ms"] > 0
        assert r["others_ms"] > 0 and "aten::t" in r["other_ops"]
        assert r["outside_ms"] == pytest.approx(r["rest_ms"] - r["others_ms"])
    assert "aten::addmm_" in {k["kernel"] for k in rows[0]["kernels"]}  # funcpipe's W sums
    assert rows[0]["kernels_vs_peer_cpu"] == rows[0]["kernels_ms"] / rows[1]["cpu_ms"]
    assert [s["mib"] for s in extras["sweep"]] == [1, 2] and extras["sweep"][0]["vs_smallest"] == 1


def test_kernels_replays_the_recorded_shapes() -> None:
    import torch

    cases = {
        "aten::addmm": ([[5], [3, 4], [4, 5], [], []], (3, 5)),
        "aten::addmm_": ([[5, 4], [5, 3], [3, 4], [], []], (5, 4)),
        "aten::mm": ([[3, 5], [5, 4]], (3, 4)),
        "aten::gelu": ([[3, 4], []], (3, 4)),
        "aten::gelu_backward": ([[3, 4], [3, 4], []], (3, 4)),
    }
    for name, (shapes, want) in cases.items():
        ops = kernels._operands(name, shapes, torch.float32)
        assert ops is not None, name
        assert tuple(kernels._CALLS[name](*ops).shape) == want, name
    assert kernels._operands("aten::addmm", [[5], [3, 4]], torch.float32) is None
    assert kernels.hot_us("aten::bmm", [[2, 3, 4]], torch.float32, 3) is None


def test_kernels_summary_keeps_unreplayed_kernels_out_of_the_ratio() -> None:
    def rank(hot: float | None) -> dict[str, Any]:
        lib = {
            "wall": 0.1,
            "cpu": 0.05,
            "kernels": [
                {
                    "kernel": "aten::mm",
                    "shapes": [[2, 2], [2, 2]],
                    "calls": 4,
                    "us": 800.0,
                    "hot_us": 100.0,
                },
                {
                    "kernel": "aten::gelu",
                    "shapes": [[2, 2]],
                    "calls": 2,
                    "us": 200.0,
                    "hot_us": hot,
                },
            ],
            "others": {"aten::t": {"calls": 10, "us": 1000.0}},
        }
        return {"rank": 0, "grad_diff": 0.0, "funcpipe": lib, "peer": lib}

    fp_row, _ = kernels.summarize([rank(50.0), rank(None)], steps=2)
    # per step over both ranks: mm 800 us in step, 400 hot; gelu 200, rank 1 could not replay it
    assert fp_row["kernels_ms"] == pytest.approx(1.0) and fp_row["hot_ms"] == pytest.approx(0.4)
    assert fp_row["not_replayed_ms"] == pytest.approx(0.2)
    assert fp_row["in_step_vs_hot"] == pytest.approx(2.0)
    assert fp_row["cpu_ms"] == pytest.approx(50.0) and fp_row["others_ms"] == pytest.approx(1.0)
    assert fp_row["outside_ms"] == pytest.approx(48.0)
    gelu = next(k for k in fp_row["kernels"] if k["kernel"] == "aten::gelu")
    assert gelu["hot_us"] is None and gelu["calls_per_step"] == 2


def test_weight_memory_refuses_n_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):  # before any process starts
        weight_memory.main(["--extra", "0"])
    assert "0: must be >= 1 (N = 0 is the default" in capsys.readouterr().err


def test_memory_with_extra_weight_memory(pool: Pool) -> None:
    """batch_weights_extra=1: 1F1B's last rank keeps one more activation's worth, never more."""
    argv = ["--size", "tiny", "--ranks", "2", "--schedules", "1f1b", "--batch-weights-extra", "1"]
    rows = memory.main(argv, pool=pool)
    last = next(r for r in rows if r["rank"] == 1)
    assert last["count"] == last["count_sim"] + 1 and last["batch_weights_extra"] == 1
    for r in rows:
        assert r["count"] <= r["count_sim"] + 1 and r["leak_kib"] == 0
        assert r["figure_kib"] < r["measured_kib"] <= r["figure_kib"] + r["mb_kib"]


def test_memory_counts_match_the_schedule(pool: Pool) -> None:
    argv = ["--size", "tiny", "--ranks", "2", "--schedules", "1f1b", "zbv", "zb-h1"]
    rows = memory.main(argv, pool=pool)
    assert len(rows) == 6
    for r in rows:
        assert r["count"] == r["count_sim"]
        # bytes are deterministic: the step keeps exactly what peak_memory predicts
        assert 0 < r["measured_kib"] == r["figure_kib"] <= r["count_figure_kib"]
        assert r["leak_kib"] == 0


@pytest.mark.timeout(120)
def test_overhead(pool: Pool) -> None:
    argv = ["--ranks", "2", "--gloo-ranks", "2", "--schedules", "1f1b", "--reps", "3"]
    rows = overhead.main(argv, pool=pool)
    assert [r["transport"] for r in rows] == ["local", "gloo"]
    assert all(r["us_per_instr"] > 0 for r in rows)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cprofile_steps", ["0", "1"])
def test_profile_step(pool: Pool, cprofile_steps: str) -> None:
    argv = ["--size", "tiny", "--steps", "2", "--warmup", "1", "--cprofile-steps", cprofile_steps]
    rows = profile_step.main(argv, pool=pool)
    step = next(r for r in rows if r["phase"] == "step")
    assert step["calls0"] == 1 and step["ms0"] > 0
    # the interpreter's loop is a generator: timed while running, not while suspended
    loop = next(r for r in rows if r["phase"].strip().startswith("interpreter loop"))
    forward = next(r for r in rows if r["phase"].strip().startswith("F "))
    assert loop["calls0"] == 1 and forward["ms0"] <= loop["ms0"] <= step["ms0"]


def test_profile_step_times_generators_and_passes_everything_through() -> None:
    from collections import defaultdict

    def gen(x):  # type: ignore[no-untyped-def]
        got = yield x
        time.sleep(0.02)  # inside the generator: counted
        try:
            yield got + 1
        except KeyError:
            return "caught"
        return "done"

    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    timed = profile_step._wrap(totals, counts, "g", gen)
    g = timed(5)
    assert next(g) == 5
    time.sleep(0.05)  # suspended: not counted
    assert g.send(10) == 11
    with pytest.raises(StopIteration) as stop:
        g.throw(KeyError("k"))
    assert stop.value.value == "caught" and counts["g"] == 1
    assert 0.02 <= totals["g"] < 0.05
    g = timed(1)
    next(g)
    g.send(1)
    with pytest.raises(StopIteration) as stop:
        next(g)
    assert stop.value.value == "done"


def test_backward_split_gives_the_same_gradients() -> None:
    (row,) = backward_split.main(["--width", "16", "--batch", "4", "--reps", "2"])
    assert row["grads_equal"] and row["B_ms"] > 0 and row["ratio"] > 0


def test_weight_batching_agrees() -> None:
    (row,) = weight_batching.main(["--shapes", "16x2", "--microbatches", "3", "--reps", "2"])
    assert row["same"] and row["per_microbatch_ms"] > 0 and row["batched_ms"] > 0


def test_backward_costs() -> None:
    (row,) = backward_costs.main(["--sizes", "tiny", "--reps", "2"])
    assert row["grad_add_ms"] > 0 and row["dot_grad_ms"] > 0


def test_help_of_every_script(capsys: pytest.CaptureFixture[str]) -> None:
    for mod in (
        vs_peer,
        vs_single,
        vs_simulated,
        memory,
        overhead,
        backward_costs,
        chart,
        auto_executed,
    ):
        with pytest.raises(SystemExit) as e:
            mod.main(["--help"])
        assert e.value.code == 0
    assert "--json" in capsys.readouterr().out


def test_auto_bytes() -> None:
    rows = auto_bytes.main(["--ranks", "2", "--heads", "2", "--keep", "1", "0.25"])
    assert rows and {r["placement"] for r in rows} == {"v", "loop"}
    # every program was checked against the bytes in the script; on this grid the byte limit
    # never loses to the count, and what an I frees never makes auto's answer longer
    # (deterministic: simulated makespans)
    assert all(r["bytes"] <= r["count"] for r in rows)
    keys = ("ranks", "microbatches", "placement", "head", "budget")
    whole = {tuple(r[k] for k in keys): r["bytes"] for r in rows if r["keep"] == 1}
    for r in rows:
        if r["keep"] < 1:
            assert r["bytes"] <= whole[tuple(r[k] for k in keys)]
