"""`funcpipe demo` end to end at a tiny size, and an interrupted run resumed exactly."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--d-model",
    "16",
    "--layers",
    "2",
    "--heads",
    "2",
    "--context",
    "16",
    "--batch",
    "4",
    "--microbatches",
    "2",
    "--eval-every",
    "2",
    "--eval-batches",
    "1",
    "--corpus-bytes",
    "200000",
]


def _demo(*args: str, timeout: float = 170) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "funcpipe", "demo", *TINY, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(180)
def test_demo_runs_end_to_end(tmp_path: Path) -> None:
    out = _demo("--pipeline", "2", "--tensor", "2", "--steps", "4", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["final_val_loss"] < summary["first_val_loss"]
    for key in ("trace", "loss_curve", "timeline"):
        assert Path(summary["files"][key]).stat().st_size > 0
    assert (tmp_path / "checkpoint").is_dir()
    assert "bubble" in out.stdout and "tokens/s" in out.stdout


@pytest.mark.timeout(300)
def test_interrupted_demo_resumes_with_the_same_losses_and_at_another_layout(
    tmp_path: Path,
) -> None:
    """Stopped at step 3 at pipeline 2 x tensor 1 x data 2 (sharded optimizer state: --zero 1 by
    default) and resumed: exactly the uninterrupted run's losses, step by step. The same stopped
    run resumed at pipeline 1 x tensor 2 unsharded (--zero 0; the checkpoint is keyed by the
    model's names, the optimizer state by flat regions): the losses go on as the uninterrupted
    run's, to float32 rounding (the tensor-parallel sums add in another order)."""
    straight, interrupted, moved = (
        tmp_path / "straight",
        tmp_path / "interrupted",
        tmp_path / "moved",
    )
    common = ["--data", "2", "--steps", "6", "--eval-every", "0"]
    here = ["--pipeline", "2", "--tensor", "1"]
    a = _demo(*common, *here, "--out", str(straight))
    assert a.returncode == 0, a.stderr[-3000:]
    b = _demo(*common, *here, "--out", str(interrupted), "--stop-after", "3")
    assert b.returncode == 0, b.stderr[-3000:]
    assert not (interrupted / "summary.json").exists()
    shutil.copytree(interrupted, moved)  # (the one stopped run, resumed two ways)
    c = _demo(*common, *here, "--out", str(interrupted), "--resume")
    assert c.returncode == 0, c.stderr[-3000:]
    first = json.loads((straight / "history.json").read_text())["train"]
    second = json.loads((interrupted / "history.json").read_text())["train"]
    assert second == first  # exactly the same losses, step by step
    there = ["--pipeline", "1", "--tensor", "2", "--zero", "0"]
    d = _demo(*common, *there, "--out", str(moved), "--resume")
    assert d.returncode == 0, d.stderr[-3000:]
    third = json.loads((moved / "history.json").read_text())["train"]
    assert [row[0] for row in third] == [row[0] for row in first]
    assert third[:3] == first[:3]  # before the stop: the same run
    for (_, want, *_), (_, got, *_) in zip(first[3:], third[3:], strict=True):
        assert got == pytest.approx(want, rel=1e-4)


def test_demo_rejects_bad_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    from funcpipe.cli.app import main

    assert main(["demo", "--tensor", "3"]) == 2
    assert "divisible" in capsys.readouterr().err
    assert main(["demo", "--stop-after", "99", "--steps", "5"]) == 2


def test_demo_builds_its_program_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The program validation generates is the one every rank runs (passed through launch)."""
    from funcpipe.cli.app import main
    from funcpipe.cli.demo import train_rank
    from funcpipe.distributed import launcher
    from funcpipe.schedule import generators
    from funcpipe.schedule.ir import Program

    built: list[Program] = []
    generate = generators.generate

    def counted(*args: Any, **kwargs: Any) -> Program:
        built.append(generate(*args, **kwargs))
        return built[-1]

    launched: list[tuple[Any, ...]] = []

    def fake_launch(fn: Any, n: int, *args: Any, **options: Any) -> list[None]:
        launched.append((fn, *args))
        return [None]

    monkeypatch.setattr(generators, "generate", counted)
    monkeypatch.setattr(launcher, "launch", fake_launch)
    assert main(["demo", "--device", "cpu", "--schedule", "zbv", "--out", str(tmp_path)]) == 0
    assert len(built) == 1
    [(fn, options, program)] = launched
    assert fn is train_rank and program is built[0] and options.schedule == "zbv"


# ------------------------------------------------------------------------------ options
@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """This host as one without GPUs (whatever it has)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def _gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """This host as one with ``n`` GPUs (nothing runs on them: only the options are resolved)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_sizes_fill_the_model_and_given_options_override(no_cuda: None) -> None:
    from funcpipe.cli.demo import SIZES, DemoOptions, parse

    o = parse([])
    assert (o.device, o.size, o.precision, o.compile) == ("cpu", "small", "fp32", False)
    d = DemoOptions()  # the CPU default is the model it always was
    assert (o.d_model, o.layers, o.heads, o.context, o.batch, o.lr) == (
        d.d_model,
        d.layers,
        d.heads,
        d.context,
        d.batch,
        d.lr,
    )
    o = parse(["--size", "medium", "--d-model", "128", "--precision", "bf16", "--compile"])
    assert o.d_model == 128 and o.layers == SIZES["medium"].layers and o.size == "medium"
    assert o.precision == "bf16" and o.compile and o.compile_backend == "inductor"


@pytest.mark.timeout(300)
def test_sharded_demo_matches_the_unsharded_one(tmp_path: Path) -> None:
    """--data 2 shards the params and AdamW state (--zero 1, the default there): the same
    losses as full copies (--zero 0), to float32 rounding, and the summary says which ran."""
    runs = {}
    for zero in ("1", "0"):
        where = tmp_path / f"zero{zero}"
        argv = ["--pipeline", "2", "--tensor", "1", "--data", "2", "--steps", "5"]
        out = _demo(*argv, *(["--zero", "0"] if zero == "0" else []), "--out", str(where))
        assert _summary(out, where)["zero"] == int(zero)
        assert ("ZeRO-1" in out.stdout) == (zero == "1")
        runs[zero] = json.loads((where / "history.json").read_text())
    for key in ("train", "val"):
        assert [row[0] for row in runs["1"][key]] == [row[0] for row in runs["0"][key]]
        for (_, got), (_, want) in zip(runs["1"][key], runs["0"][key], strict=True):
            assert got == pytest.approx(want, rel=1e-4)


def test_zero_options(capsys: pytest.CaptureFixture[str]) -> None:
    """--zero: a level nothing can shard is refused (no data copies; Chimera with one
    microbatch, whose up pipeline sees none); the default gives way there, with a note."""
    from funcpipe.cli.app import main
    from funcpipe.cli.demo_options import DemoOptions, zero_level
    from funcpipe.schedule.generators import generate

    assert main(["demo", "--data", "1", "--zero", "2"]) == 2
    assert "--data" in capsys.readouterr().err
    one = ["--schedule", "chimera", "--microbatches", "1", "--batch", "2"]
    assert main(["demo", "--data", "2", "--zero", "1", *one]) == 2
    assert "at least 2 microbatches" in capsys.readouterr().err
    chimera, plain = (
        generate("chimera", ranks=2, microbatches=2),
        generate("1f1b", ranks=2, microbatches=2),
    )
    o = DemoOptions(data=2, schedule="chimera")
    assert zero_level(o, plain) == (1, "") and zero_level(DemoOptions(), plain) == (0, "")
    assert zero_level(DemoOptions(data=2, zero=0), plain) == (0, "")
    assert zero_level(DemoOptions(data=2, zero=2), plain) == (2, "")
    assert zero_level(o, chimera) == (1, "")
    level, note = zero_level(o, generate("chimera", ranks=2, microbatches=1))
    assert level == 0 and "at least 2 microbatches" in note


@pytest.mark.timeout(180)
def test_chimera_demo_trains_on_its_model_stages(tmp_path: Path) -> None:
    """Chimera's 2p program stages are replicas of p model stages: the demo cuts the GPT into
    the model stages (each rank holds both here) and, with --data 2, shards them (ZeRO-2
    here: every rank's replicas gathered and scattered, the replica sums adding pieces)."""
    import math

    argv = ["--schedule", "chimera", "--pipeline", "2", "--tensor", "1", "--data", "2"]
    out = _demo(*argv, "--zero", "2", "--steps", "3", "--eval-every", "0", "--out", str(tmp_path))
    s = _summary(out, tmp_path)
    assert s["zero"] == 2 and "zero_note" not in s and len(s["stages"]) == 2
    assert "ZeRO-2" in out.stdout
    losses = [loss for _, loss in json.loads((tmp_path / "history.json").read_text())["train"]]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] and s["final_val_loss"] < s["first_val_loss"]


def test_clip_weights_count_the_replicas() -> None:
    """A model stage k pipeline ranks hold (Chimera's replicas, each with the summed
    gradients) weighs 1/k in the global norm; the tied embedding another 1/2."""
    from funcpipe.cli.demo_loop import _clip_weights, _holders
    from funcpipe.cli.demo_options import DemoOptions
    from funcpipe.models import gpt
    from funcpipe.schedule.generators import generate

    chimera = generate("chimera", ranks=2, microbatches=2)
    assert _holders(chimera) == [2, 2]
    assert _holders(generate("chimera", ranks=3, microbatches=2)) == [2, 1, 2]
    assert _holders(generate("1f1b", ranks=2, microbatches=2)) == [1, 1]
    cfg = gpt.GPTConfig(vocab=256, context=16, d_model=16, heads=2, layers=2)
    w = _clip_weights(gpt.shardings(cfg, 2), _holders(chimera), DemoOptions(tensor=1), 0)
    assert w[0]["wte"] == 0.25 and w[1]["wte"] == 0.25


@pytest.mark.parametrize(
    ("layout", "split"),
    [
        ({"pipeline": 2, "data": 2, "tensor": 1, "expert": 2}, "width"),
        ({"pipeline": 1, "data": 2, "tensor": 2, "expert": 1}, "width"),
        ({"pipeline": 1, "data": 2, "tensor": 2, "expert": 2}, "width"),
        ({"pipeline": 1, "data": 2, "tensor": 2, "expert": 2}, "tokens"),
    ],
)
def test_clip_weights_give_every_moe_leaf_its_norm_once(layout: dict[str, int], split: str) -> None:
    """Summed over every process of the layout, each leaf's weight times the squared norm of
    the block that process holds is the leaf's squared norm: the experts split over expert
    copies and over tensor ranks (each expert's width) counted once, replicas divided (the
    embedding's two tied copies at pipeline 2 half each)."""
    from funcpipe.cli.demo_loop import _clip_weights, _holders
    from funcpipe.cli.demo_options import DemoOptions
    from funcpipe.models import gpt
    from funcpipe.parallel.mesh import ParallelConfig
    from funcpipe.parallel.sharding import shard_tree
    from funcpipe.schedule.generators import generate
    from funcpipe.tree import tree_leaves

    n = layout["pipeline"]
    o = DemoOptions(**layout, experts=4, shared_experts=1, moe_tensor=split)
    cfg = gpt.GPTConfig(vocab=256, context=16, d_model=16, heads=2, layers=2, experts=4,
                        shared_experts=1, moe_tensor=split)  # fmt: skip
    lays = gpt.shardings(cfg, n)
    full = gpt.split(gpt.init(cfg, seed=0), cfg, n)
    weights = _clip_weights(lays, _holders(generate("1f1b", ranks=n, microbatches=2)), o, 0)
    config = ParallelConfig.from_dict(layout, world_size=o.world)
    got = [0.0] * len(tree_leaves(full))
    for place in config.places():
        s = place.coords["pipe"]
        mine = tree_leaves(shard_tree(full[s], lays[s], place))
        offset = sum(len(tree_leaves(full[i])) for i in range(s))
        for j, (leaf, w) in enumerate(zip(mine, tree_leaves(weights[s]), strict=True)):
            got[offset + j] += w * float(leaf.double().pow(2).sum())
    tied = 0.5 if n > 1 else 1.0
    want = [
        float(leaf.double().pow(2).sum()) * (tied if leaf is part["wte"] else 1.0)
        for part in full
        for leaf in tree_leaves(part)
    ]
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--device", "tpu"], ["--device", "invalid choice: 'tpu'"]),
        (["--precision", "fp16"], ["--precision", "invalid choice: 'fp16'"]),
        (["--size", "huge"], ["--size", "invalid choice: 'huge'"]),
        (["--moe-tensor", "rows"], ["--moe-tensor", "invalid choice: 'rows'"]),
    ],
)
def test_demo_refuses_bad_choices(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from funcpipe.cli.app import main

    with pytest.raises(SystemExit) as e:
        main(["demo", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_cuda_without_cuda_names_the_fix(no_cuda: None, capsys: pytest.CaptureFixture[str]) -> None:
    from funcpipe.cli.app import main
    from funcpipe.cli.demo import DemoOptions, parse, run
    from funcpipe.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"is_available\(\) is False.*use --device cpu"):
        parse(["--device", "cuda"])
    with pytest.raises(InvalidArgument, match="--device cpu"):  # also when built in code
        run(DemoOptions(device="cuda"))
    assert main(["demo", "--device", "cuda"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def test_cuda_needs_a_gpu_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from funcpipe.cli.demo import parse
    from funcpipe.errors import InvalidArgument

    _gpus(monkeypatch, 2)
    with pytest.raises(InvalidArgument, match="= 4 ranks on this host.*sees 2 GPUs.*<= 2"):
        parse(["--device", "cuda"])  # pipeline 2 x tensor 2
    o = parse(["--device", "cuda", "--tensor", "1"])
    assert (o.device, o.size, o.precision) == ("cuda", "large", "bf16")  # the GPU defaults
    assert (o.d_model, o.layers, o.context) == (1024, 24, 1024)


def test_auto_takes_the_gpus_only_when_there_is_one_per_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from funcpipe.cli.demo import parse

    _gpus(monkeypatch, 4)
    assert parse([]).device == "cuda"
    _gpus(monkeypatch, 2)
    o = parse([])
    assert (o.device, o.size, o.precision) == ("cpu", "small", "fp32")
    assert "4 ranks but 2 GPUs here: running on the CPU" in capsys.readouterr().err
    assert parse(["--precision", "bf16", "--size", "tiny"]).precision == "bf16"


def test_help_lists_device_size_precision_compile(capsys: pytest.CaptureFixture[str]) -> None:
    from funcpipe.cli.app import main

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = capsys.readouterr().out
    for flag in ("--device {auto,cpu,cuda}", "--size {tiny,small,medium,large}"):
        assert flag in out
    assert "--precision {fp32,bf16,bf16-autocast}" in out and "--compile " in out
    assert "--compile-backend" not in out  # the tests' option stays hidden


# ------------------------------------------------------------------------------ throughput
def test_model_flops_of_the_gpu_default() -> None:
    """6 N + 12 L d T for d_model 1024, 24 layers, context 1024, byte vocabulary: N counts
    each layer's 12 d^2 + 13 d (q, k, v, o, fc1, fc2 with biases, two norms), the tied
    embedding once and the final norm; not the position embedding."""
    from funcpipe.models import gpt

    cfg = gpt.GPTConfig(vocab=256, context=1024, d_model=1024, heads=16, layers=24)
    d, L = 1024, 24
    n = L * (12 * d * d + 13 * d) + 256 * d + 2 * d
    assert gpt.matmul_params(cfg) == n == 302_573_568
    assert gpt.flops_per_token(cfg) == 6 * n + 12 * L * d * 1024 == 2_117_431_296
    assert gpt.flops_per_token(cfg, training=False) == 2 * n + 4 * L * d * 1024


def test_matmul_params_are_all_but_the_position_embedding() -> None:
    from funcpipe.models import gpt
    from funcpipe.tree import tree_leaves

    cfg = gpt.GPTConfig(vocab=256, context=20, d_model=32, heads=4, layers=3, mlp=80)
    full = gpt.init(cfg)
    total = sum(t.numel() for t in tree_leaves(full))
    assert gpt.matmul_params(cfg) == total - full["wpe"].numel()


def test_throughput_and_mfu() -> None:
    from funcpipe.train.throughput import throughput

    got = throughput([0.5, 0.5], tokens_per_step=1000, flops_per_token=1e9, peak=1e13, devices=2)
    assert got["tokens_per_s"] == pytest.approx(2000.0)
    assert got["model_flops_per_s"] == pytest.approx(2e12)
    assert got["mfu"] == pytest.approx(2e12 / (1e13 * 2))
    unknown = throughput([0.25], tokens_per_step=1000, flops_per_token=1e9, peak=None, devices=1)
    assert unknown["tokens_per_s"] == pytest.approx(4000.0) and unknown["mfu"] is None
    none = throughput([], tokens_per_step=1000, flops_per_token=1e9, peak=1e13, devices=1)
    assert none["tokens_per_s"] is None and none["mfu"] is None and none["timed_steps"] == 0


def test_peak_flops_by_device_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from funcpipe.train.throughput import peak_flops

    assert peak_flops("cpu", "bf16") is None and peak_flops("cpu", "fp32") is None
    names = iter(
        [
            "NVIDIA H100 80GB HBM3",
            "NVIDIA H100 PCIe",
            "NVIDIA H200",
            "NVIDIA A100-SXM4-80GB",
            "NVIDIA GeForce RTX 4090",
            "NVIDIA H100 80GB HBM3",
        ]
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    assert peak_flops("cuda:0", "bf16") == 989e12
    assert peak_flops("cuda:0", "bf16") == 756e12
    assert peak_flops("cuda:0", "fp32") == 67e12
    assert peak_flops("cuda:0", "bf16") == 312e12
    assert peak_flops("cuda:0", "bf16") is None  # not in the table: MFU n/a
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 matmuls
    try:
        assert peak_flops("cuda:0", "fp32") == 494e12
    finally:
        torch.set_float32_matmul_precision(before)


def test_warmup_steps_left_out() -> None:
    from funcpipe.train.throughput import warmup_steps

    assert [warmup_steps(n, False) for n in (1, 2, 4, 150)] == [0, 1, 1, 37]
    assert [warmup_steps(n, True) for n in (2, 3, 4, 150)] == [1, 2, 2, 37]


# ------------------------------------------------------------------------------ bf16, compile
def _summary(out: subprocess.CompletedProcess[str], where: Path) -> dict:
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((where / "summary.json").read_text())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("precision", ["bf16", "bf16-autocast"])
def test_bf16_demo_trains(tmp_path: Path, precision: str) -> None:
    """Pipeline 2 x tensor 2 in bf16 (bf16 all-reduces inside the stages): bf16 parameters with
    float32 sums and master weights, or float32 parameters under bf16 autocast."""
    import math

    out = _demo(
        "--pipeline", "2", "--tensor", "2", "--steps", "4", "--precision", precision,
        "--device", "cpu", "--out", str(tmp_path),
    )  # fmt: skip
    s = _summary(out, tmp_path)
    assert s["precision"] == precision and s["device"] == "cpu" and not s["compile"]
    autocast = precision == "bf16-autocast"
    assert all(("bfloat16" in r and "autocast(" in r) == autocast for r in s["stages"])
    assert math.isfinite(s["last_loss"]) and s["final_val_loss"] < s["first_val_loss"]
    assert s["tokens_per_s"] > 0 and s["mfu"] is None and s["peak_memory_bytes_per_rank"] is None
    assert s["warmup_steps_excluded"] == 1 and s["timed_steps"] == 3
    assert "MFU n/a" in out.stdout and f"cpu, {precision}" in out.stdout


@pytest.mark.timeout(120)
def test_compiled_demo_trains(tmp_path: Path) -> None:
    """Every stage through compile_stage (aot_eager here: inductor's C++ build takes minutes on
    two cores; the user's --compile keeps torch.compile's default backend)."""
    import math

    out = _demo(
        "--pipeline", "2", "--tensor", "1", "--steps", "3", "--eval-every", "0", "--compile",
        "--compile-backend", "aot_eager", "--out", str(tmp_path),
    )  # fmt: skip
    s = _summary(out, tmp_path)
    assert s["compile"] and s["precision"] == "fp32"
    assert all("compile(" in r and "aot_eager" in r for r in s["stages"])
    assert math.isfinite(s["last_loss"]) and s["final_val_loss"] < s["first_val_loss"]
    assert s["warmup_steps_excluded"] == 2 and s["timed_steps"] == 1 and s["tokens_per_s"] > 0


def test_on_a_gpu_the_planner_picks_the_microbatches() -> None:
    """One H100: the whole batch in one microbatch (the planner predicts it fits in half the
    memory and is fastest); pipeline ranks: at least one microbatch per rank; a GPU the planner
    does not know: None (the size's count stays)."""
    from funcpipe.cli.demo_options import SIZES, DemoOptions, planned_microbatches, planner_gpu

    s = SIZES["large"]
    shape = {k: getattr(s, k) for k in ("layers", "d_model", "heads", "context", "batch")}
    one = DemoOptions(device="cuda", pipeline=1, tensor=1, microbatches=s.microbatches, **shape)
    assert planned_microbatches(one, "NVIDIA H100 80GB HBM3") == 1
    assert planned_microbatches(one, "NVIDIA A100-SXM4-40GB") == 4  # 20 GB: 8 sequences
    assert planned_microbatches(one, "Tesla T4") is None
    four = DemoOptions(device="cuda", pipeline=4, tensor=1, microbatches=s.microbatches, **shape)
    assert planned_microbatches(four, "NVIDIA H100 80GB HBM3") >= 4
    assert [planner_gpu(n) for n in ("NVIDIA H200", "NVIDIA H100 PCIe", "A100 80GB PCIe")] == [
        "h200", "h100-pcie", "a100-80gb"
    ]  # fmt: skip
