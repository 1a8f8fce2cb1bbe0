"""funcpipe on CUDA: every test takes a device and runs its CPU cell everywhere (CI) and its CUDA
cell where torch sees a GPU (skipped with the reason otherwise). ``make gpu-check`` runs this
file and tests/test_devices.py on a GPU machine and writes the report (tools/gpu_check.py).

Tolerances, against ``reference_step`` on the same device: float32 ``rtol=1e-4, atol=1e-5``
(the GPT, split into stages against the unsplit model: ``rtol=1e-3``), bf16 autocast ``rtol=1e-2,
atol=1e-3`` (funcpipe.testing's bf16 defaults), float64 funcpipe.testing's defaults. The second
part tests the clocks of traced steps and profiling: with fake CUDA events on the CPU, and for
kernel times on a GPU. The last part runs the gpu-check command itself on the CPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed as dist

import funcpipe as fp
from funcpipe.models import gpt
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.runtime import clock, interpreter
from funcpipe.schedule import generate
from funcpipe.schedule.ir import Op
from funcpipe.testing import assert_trees_close
from funcpipe.train import checkpoint, optim
from funcpipe.tree import tree_leaves, tree_map
from tests.jobs_runtime import CUDA, DEVICES, data, mse, toy

F32 = {"rtol": 1e-4, "atol": 1e-5}
GPT32 = {"rtol": 1e-3, "atol": 1e-5}
BF16 = {"rtol": 1e-2, "atol": 1e-3}
ROOT = Path(__file__).resolve().parent.parent


def _load_gpu_check() -> Any:
    """tools/gpu_check.py is a script of the repository, not a module of the package."""
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _load_gpu_check()


def on(device: str, tree: Any, dtype: torch.dtype | None = None) -> Any:
    return tree_map(lambda t: t.to(device=device, dtype=dtype or t.dtype), tree)


def toy_on(device: str, program: Any, dtype: torch.dtype) -> tuple[Any, Any, Any, Any]:
    stages, params = toy(len(set(program.replica_of or range(program.n_stages))))
    x, y = data(9)  # uneven microbatches
    return stages, on(device, params, dtype), x.to(device, dtype), y.to(device, dtype)


def all_on(device: str, *trees: Any) -> bool:
    return all(t.device.type == device for t in tree_leaves(trees) if isinstance(t, torch.Tensor))


# ------------------------------------------------------------------------ steps on a device
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zbv"])
def test_bf16_autocast_matches_the_reference(device: str, name: str) -> None:
    program = generate(name, ranks=2, microbatches=4)
    plain, params, x, y = toy_on(device, program, torch.float32)
    stages = [fp.autocast_stage(s, torch.bfloat16) for s in plain]
    got = Pipeline(stages, program, loss_fn=mse).step(params, x, y)
    ref = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    assert_trees_close((got.loss, got.grads), ref, **BF16)
    assert all_on(device, got.loss, got.grads)
    assert all(g.dtype == torch.float32 for g in tree_leaves(got.grads))  # params' dtype
    # bf16 really ran: the float32 step's loss is another number
    f32 = Pipeline(plain, program, loss_fn=mse).step(params, x, y)
    assert not torch.equal(got.loss, f32.loss)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_bf16_compiled_stages_match_the_reference(device: str, name: str) -> None:
    """bf16 autocast inside torch.compile'd stages (inductor on CUDA; aot_eager on the CPU, where
    inductor's compile time would cost the suite minutes), I/W split included (ZB-V)."""
    torch._dynamo.reset()
    program = generate(name, ranks=2, microbatches=4)
    plain, params, x, y = toy_on(device, program, torch.float32)
    eager = [fp.autocast_stage(s, torch.bfloat16) for s in plain]
    backend = "inductor" if device == "cuda" else "aot_eager"
    stages = [fp.compile_stage(s, backend=backend) for s in eager]
    got = Pipeline(stages, program, loss_fn=mse).step(params, x, y)
    ref = fp.reference_step(eager, params, x, mse, targets=y, microbatches=4)
    assert_trees_close((got.loss, got.grads), ref, **BF16)
    assert all_on(device, got.loss, got.grads)


@CUDA
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_cuda_graph_stages_match_the_reference_over_steps(name: str) -> None:
    """``compile_stage(mode="reduce-overhead")`` (inductor with CUDA graphs) in a pipeline: a
    stage's graph is replayed for the next microbatch while earlier microbatches' outputs and
    saved activations still wait for their backwards (two in flight on rank 0 under 1F1B; ZB-V
    splits each backward into I and W). Three steps, so later steps replay recorded graphs;
    each against the eager reference. CUDA only: on the CPU there is no CUDA graph to test."""
    torch._dynamo.reset()
    program = generate(name, ranks=2, microbatches=4)
    plain, params, x, y = toy_on("cuda", program, torch.float32)
    stages = [fp.compile_stage(s, mode="reduce-overhead") for s in plain]
    pipe = Pipeline(stages, program, loss_fn=mse)
    for k in range(3):
        xk, yk = x * (1 + k), y - k  # other values each step, same shapes
        got = pipe.step(params, xk, yk)
        ref = fp.reference_step(plain, params, xk, mse, targets=yk, microbatches=4)
        assert_trees_close((got.loss, got.grads), ref, **F32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_gpt_with_tensor_size_1_matches_the_reference(device: str, dtype: torch.dtype) -> None:
    """The demo's GPT split into 4 stages (tied embedding) against the whole model on one
    device."""
    cfg = gpt.GPTConfig(vocab=32, context=8, d_model=16, heads=4, layers=3, mlp=32)
    program = generate("1f1b", ranks=2, microbatches=4)
    n, axis = program.n_stages, gpt.single_axis()
    full = on(device, gpt.init(cfg, seed=0, dtype=dtype))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab, (8, cfg.context + 1), generator=g).to(device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    loss_fn = gpt.loss_fn(axis=axis)
    pipe = Pipeline(gpt.stages(cfg, n, axis=axis), program, loss_fn=loss_fn, ties=gpt.tie_spec(n))
    got = pipe.step(gpt.split(full, cfg, n), x, y)
    loss, (whole,) = fp.reference_step(
        gpt.stages(cfg, 1, axis=axis),
        gpt.split(full, cfg, 1),
        x,
        loss_fn,
        targets=y,
        microbatches=4,
    )
    # cut like the stages; the tied wte's gradient is the sum on both ends
    blocks = [whole["blocks"][str(i)] for i in range(cfg.layers)]
    want = gpt.split({**whole, "blocks": blocks}, cfg, n)
    assert_trees_close(
        (got.loss, got.grads), (loss, want), **(GPT32 if dtype == torch.float32 else {})
    )
    assert all_on(device, got.loss, got.grads)


# ------------------------------------------------------------------------ a one-rank process group
@contextlib.contextmanager
def one_rank_group(device: str) -> Iterator[Any]:
    """A process group of this process alone: NCCL on CUDA (cuda:0), gloo on the CPU."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this process")
    kwargs: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.set_device(0)
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = torch.device("cuda", 0)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zbv"])
def test_a_one_rank_group_runs_the_pipeline_over_dist(device: str, name: str) -> None:
    """``transport="dist"`` over NCCL (gloo on the CPU): the loss reduction and the traced
    step's time gathering go through the backend."""
    program = generate(name, ranks=1, microbatches=4)
    stages, params, x, y = toy_on(device, program, torch.float32)
    ref = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    with one_rank_group(device):
        pipe = Pipeline(stages, program, loss_fn=mse, transport="dist")
        got = pipe.step(params, x, y, trace=True)
    # (over dist the loss comes back as float64, the dtype of the reduced sums)
    assert_trees_close((got.loss.to(ref[0].dtype), got.grads), ref, **F32)
    assert all_on(device, got.loss, got.grads)
    (events,) = got.timeline.events
    assert len(events) == len(pipe.program.ranks[0])
    assert all(e.end >= e.start >= 0 for e in events)


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_loads_back_onto_the_device(device: str, tmp_path: Path) -> None:
    _, params = toy(2)
    state = {"params": on(device, params, torch.float32), "step": 3}
    checkpoint.save(tmp_path / "alone", state, step=3)
    loaded = checkpoint.load(tmp_path / "alone", state)
    assert_trees_close(loaded, state, rtol=0, atol=0)
    assert all_on(device, loaded)
    with one_rank_group(device):
        checkpoint.save(tmp_path / "grouped", state, step=3)
        again = checkpoint.load(tmp_path / "grouped", state)
    assert_trees_close(again, state, rtol=0, atol=0)
    assert all_on(device, again)


@pytest.mark.parametrize("device", DEVICES)
def test_clipping_over_a_one_rank_group_is_torchs_clipping(device: str) -> None:
    _, params = toy(2)
    grads = on(device, tree_map(lambda t: 3 * t, params), torch.float32)
    with one_rank_group(device) as group:
        clipped, norm = optim.clip_by_global_norm(grads, 0.5, group=group)
    alone, alone_norm = optim.clip_by_global_norm(grads, 0.5)
    copies = [t.clone().requires_grad_() for t in tree_leaves(grads)]
    for c, g in zip(copies, tree_leaves(grads), strict=True):
        c.grad = g.clone()
    want = torch.nn.utils.clip_grad_norm_(copies, 0.5)
    assert_trees_close(norm, want, **F32)
    assert_trees_close(norm, alone_norm, rtol=0, atol=0)
    assert_trees_close(tree_leaves(clipped), [c.grad for c in copies], **F32)
    assert_trees_close(clipped, alone, rtol=0, atol=0)
    assert all_on(device, clipped, norm)


# ------------------------------------------------------------------------ clocks
class FakeEvent:
    """``torch.cuda.Event`` on a fake device whose clock is ``FakeEvent.now`` (seconds)."""

    now = 0.0
    log: list[str] = []  # noqa: RUF012  (the fake device's one log)

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self, stream: Any = None) -> None:
        assert stream == "stream-of-cuda"
        self.at = FakeEvent.now
        FakeEvent.log.append("record")

    def synchronize(self) -> None:
        FakeEvent.log.append("event.synchronize")

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None, "both events must be recorded"
        return (end.at - self.at) * 1e3  # milliseconds, as torch's


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> type[FakeEvent]:
    FakeEvent.now, FakeEvent.log = 0.0, []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream-of-{device}")
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda device=None: FakeEvent.log.append("synchronize")
    )
    monkeypatch.setattr(clock, "perf_counter", lambda: 100.0)
    return FakeEvent


def test_the_cuda_clock_resolves_events_against_its_anchor(fake_cuda: type[FakeEvent]) -> None:
    fake_cuda.now = 7.0  # the device's clock has nothing to do with the host's
    c = clock.step_clock(torch.device("cuda"))
    assert isinstance(c, clock.CudaClock)
    assert fake_cuda.log == ["synchronize", "record"]  # idle stream, then the anchor
    stamps = []
    for dt in (0.25, 0.5, 0.5, 1.0):
        fake_cuda.now += dt
        stamps.append(c.stamp())
    assert fake_cuda.log == ["synchronize"] + ["record"] * 5  # no waits during the step
    assert c.resolve(stamps) == pytest.approx([100.25, 100.75, 101.25, 102.25])
    assert fake_cuda.log[-1] == "event.synchronize"
    assert fake_cuda.log.count("event.synchronize") == 1  # one wait for the whole step
    assert c.resolve([]) == []


def test_the_clock_follows_the_device() -> None:
    for device in ("cpu", torch.device("cpu"), "meta", None):
        assert isinstance(clock.step_clock(device), clock.HostClock)
        assert clock.timer(device) is time.perf_counter
    host = clock.step_clock("cpu")
    stamps = [host.stamp(), host.stamp()]
    assert host.resolve(stamps) is stamps and stamps[0] <= stamps[1]


def test_the_timer_waits_for_the_device(fake_cuda: type[FakeEvent]) -> None:
    now = clock.timer("cuda:0")
    assert now() == 100.0
    assert fake_cuda.log == ["synchronize"]


def test_a_traced_step_takes_its_times_from_the_device_clock(
    fake_cuda: type[FakeEvent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interpreter stamps every instruction with its rank's clock and resolves the stamps
    once: here a CUDA clock of fake events (1 ms of device time per stamp) on a CPU step."""
    made: list[clock.CudaClock] = []
    resolved: list[int] = []

    class Ticking(clock.CudaClock):
        __slots__ = ()

        def stamp(self) -> Any:
            fake_cuda.now += 1e-3
            return super().stamp()

        def resolve(self, stamps: list[Any]) -> list[float]:
            resolved.append(len(stamps))
            return super().resolve(stamps)

    def fake_step_clock(device: Any) -> Any:
        if device is None:  # an untraced step
            return clock.step_clock(None)
        made.append(Ticking(torch.device("cuda")))
        return made[-1]

    monkeypatch.setattr(interpreter, "step_clock", fake_step_clock)
    program = generate("1f1b", ranks=2, microbatches=4)
    stages, params, x, y = toy_on("cpu", program, torch.float64)
    pipe = Pipeline(stages, program, loss_fn=mse)
    assert not made and pipe.step(params, x, y).timeline is None  # untraced: no clock
    timeline = pipe.step(params, x, y, trace=True).timeline
    assert len(made) == 2 and resolved == [2 * len(r) for r in pipe.program.ranks]
    for events in timeline.events:
        assert [e.end - e.start for e in events] == pytest.approx([1e-3] * len(events))
    assert fake_cuda.log.count("event.synchronize") == 2  # once per rank, at its end


def test_times_from_another_machine_are_moved_through_the_wall_clock() -> None:
    from funcpipe.distributed.world import _on_my_clock

    nan = float("nan")
    mine = torch.tensor([1.0, 2.0, nan, nan, 7.0, 1000.0], dtype=torch.float64)
    same = torch.tensor([5.0, 6.0, 8.0, 9.0, 7.0, 1234.0], dtype=torch.float64)
    other = torch.tensor([5.0, 6.0, 8.0, 9.0, 3.0, 1010.5], dtype=torch.float64)
    assert _on_my_clock(same, mine, 4) == [5.0, 6.0, 8.0, 9.0]  # one machine: one clock
    assert _on_my_clock(other, mine, 2) == [15.5, 16.5]  # perf + (its wall - perf) - (ours)


# ------------------------------------------------------------------------ kernel times (CUDA)
def heavy_stage(n: int) -> tuple[fp.Stage, dict[str, torch.Tensor]]:
    """A stage of four ``n x n`` matmuls: milliseconds of kernels behind microseconds of
    launches."""

    def fn(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = x @ p["W"]
        return x

    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, n, generator=g) / n**0.5).cuda()
    return fp.Stage(fn, name="matmuls"), {"W": w}


def launch_and_kernel_seconds(stage: fp.Stage, params: Any, x: torch.Tensor) -> tuple[float, float]:
    """The stage's forward timed by the host without waiting (its launches), and with a
    synchronize (its kernels); the minimum of three each, after a warm-up."""
    launch, kernel = [], []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stage(params, x)
        launch.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        kernel.append(time.perf_counter() - t0)
    return min(launch[1:]), min(kernel[1:])


@CUDA
def test_a_traced_cuda_step_times_kernels_not_launches() -> None:
    stage, params = heavy_stage(4096)
    x = torch.randn(8192, 4096, device="cuda") / 64
    y = torch.zeros(8192, 4096, device="cuda")
    pipe = Pipeline([stage], generate("gpipe", ranks=1, microbatches=2), loss_fn=mse)
    pipe.step([params], x, y)  # warm-up (cuBLAS handles, the allocator)
    timeline = pipe.step([params], x, y, trace=True).timeline
    launch, kernel = launch_and_kernel_seconds(stage, params, x[:4096])
    (events,) = timeline.events
    assert all(e.end - e.start > 0 for e in events if e.instr.op in (Op.F, Op.B))
    forwards = [e.end - e.start for e in events if e.instr.op is Op.F]
    assert forwards and min(forwards) > 10 * launch, (forwards, launch)
    assert min(forwards) > 0.5 * kernel, (forwards, kernel)


@CUDA
def test_profiling_on_cuda_times_kernels_not_launches() -> None:
    stage, params = heavy_stage(4096)
    x = torch.randn(4096, 4096, device="cuda") / 64
    launch, kernel = launch_and_kernel_seconds(stage, params, x)
    times = fp.measure_stages([stage], [params], x, repeats=3)
    assert times.f[0] > 10 * launch, (times.f, launch)
    assert times.f[0] > 0.5 * kernel, (times.f, kernel)
    assert times.b[0] > times.f[0]  # a backward of matmuls: two products per one


# ------------------------------------------------------------------------ the gpu-check command
def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path: Path) -> None:
    """``CUDA_VISIBLE_DEVICES=""`` hides any GPU, so this runs the same on every machine."""
    out = tmp_path / "report"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("no CUDA device: gpu-check skipped ("), lines
    report = (out / "gpu-check.md").read_text()
    assert "no CUDA device: gpu-check skipped" in report
    assert f"torch: {torch.__version__}" in report and "date: " in report
    assert "Nothing ran on a GPU" in report


def test_gpu_check_reads_each_tests_result(tmp_path: Path) -> None:
    """The report's checks come from pytest's JUnit XML: pass, fail, skip with its reason."""
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no CUDA device here')\n"
        "def test_later():\n    pass\n"
    )
    xml = tmp_path / "junit.xml"
    args = ["-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        timeout=120,
    )
    checks = {c.name.split("::")[-1]: c for c in gpu_check.parse_junit(str(xml))}
    assert checks["test_ok"].result == "pass"
    assert checks["test_bad"].result == "fail" and "one is not two" in checks["test_bad"].detail
    assert checks["test_later"] == gpu_check.Check(
        checks["test_later"].name, "skip", "no CUDA device here"
    )
    assert checks["test_ok"].name.endswith("test_sample.py::test_ok")


def test_gpu_check_report_lists_checks_and_demo_numbers() -> None:
    env = {"date": "2026-11-26 10:00 UTC", "torch": "2.11.0+cu130", "cuda:0": "NVIDIA H100"}
    checks = [
        gpu_check.Check("tests/test_cuda.py::test_a[cuda]", "pass"),
        gpu_check.Check("tests/test_cuda.py::test_b[cuda]", "fail", "x | y"),
        gpu_check.Check("tests/test_cuda.py::test_c[cpu]", "skip", "why"),
    ]
    demo = gpu_check.Demo(
        ran=True,
        ok=True,
        command="funcpipe demo --device cuda --steps 20",
        tokens_per_s=123456.0,
        mfu=0.3141,
        numbers={"bubble_measured": 0.25},
        peaks={0: 3 * 2**30},
    )
    text = gpu_check.render(env, checks=checks, demo=demo)
    assert "**Result: FAIL**: 1 passed, 1 failed, 1 skipped; demo ok." in text
    assert "| `tests/test_cuda.py::test_b[cuda]` | fail | x \\| y |" in text
    assert "- throughput: 123,456 tokens/s" in text and "utilisation: 31.41%" in text
    assert "- peak memory, rank 0: 3.00 GiB" in text and "- bubble_measured: 0.25" in text
    assert gpu_check.failed(checks[:1], demo) is False
    assert gpu_check.failed(checks[:1], gpu_check.Demo(ran=True, ok=False)) is True
    not_run = gpu_check.render(env, checks=checks[:1], demo=gpu_check.Demo(note="no --device"))
    assert "**Result: PASS**" in not_run and "Not run: no --device." in not_run


def test_gpu_check_runs_the_demo_and_reads_its_summary(tmp_path: Path) -> None:
    """The demo step of the check, on the CPU (the check itself passes ``--device cuda``)."""
    tiny = "--d-model 16 --layers 1 --heads 2 --context 16 --batch 2 --microbatches 2"
    tiny += " --eval-every 0 --eval-batches 1 --corpus-bytes 200000"
    demo = gpu_check.run_demo(
        str(tmp_path),
        device="cpu",
        steps=3,
        pipeline=1,
        tensor=1,
        extra=tiny.split(),
        timeout=300,
    )
    if not demo.ran:
        pytest.skip(f"the demo cannot be run on a device: {demo.note}")
    assert demo.ok, demo.tail
    assert demo.tokens_per_s is not None and demo.tokens_per_s > 0
    assert "bubble_measured" in demo.numbers and demo.peaks == {}  # no CUDA memory on the CPU
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert summary["tokens_per_s"] == demo.tokens_per_s


def test_gpu_check_with_a_device_runs_the_tests_and_reports_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check's path on a GPU machine, with the device faked and a test file of its own."""
    sample = tmp_path / "test_sample.py"
    sample.write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='later')\n"
        "def test_later():\n    pass\n"
    )
    monkeypatch.setattr(gpu_check, "no_cuda_reason", lambda: None)
    monkeypatch.setattr(gpu_check, "TESTS", (str(sample),))
    out = tmp_path / "gpu-check"
    assert gpu_check.main(["--out", str(out), "--no-demo"]) == 1  # a test failed
    printed = capsys.readouterr().out
    report_path = out / "gpu-check.md"
    assert "1 passed, 1 failed, 1 skipped" in printed and f"report: {report_path}" in printed
    assert (out / "junit.xml").exists() and "test_sample.py::test_bad FAILED" in (
        out / "pytest.log"
    ).read_text()
    report = report_path.read_text()
    assert "**Result: FAIL**: 1 passed, 1 failed, 1 skipped; demo not run." in report
    assert "test_sample.py::test_bad` | fail | AssertionError: one is not two" in report
    assert "test_sample.py::test_later` | skip | later |" in report
    assert "Not run: --no-demo was given." in report


def test_gpu_check_writes_the_report_before_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kill during the demo (the device session's limit) still leaves the tests' results."""
    sample = tmp_path / "test_sample.py"
    sample.write_text("def test_ok():\n    pass\n")
    monkeypatch.setattr(gpu_check, "no_cuda_reason", lambda: None)
    monkeypatch.setattr(gpu_check, "TESTS", (str(sample),))
    out = tmp_path / "gpu-check"
    seen: dict[str, str] = {}

    def demo(work: str, **kwargs: Any) -> gpu_check.Demo:
        seen["report"] = (out / "gpu-check.md").read_text()
        return gpu_check.Demo(ran=True, ok=True, tokens_per_s=1.0)

    monkeypatch.setattr(gpu_check, "run_demo", demo)
    assert gpu_check.main(["--out", str(out)]) == 0
    assert "1 passed, 0 failed" in seen["report"]
    assert "running (the check was killed here)" in seen["report"]
    assert "**Result: PASS**" in (out / "gpu-check.md").read_text()


def test_gpu_check_kills_every_process_of_a_part_that_runs_too_long(tmp_path: Path) -> None:
    """The demo's rank processes die with it: the whole process session is killed."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(c.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(120)\n"
    )
    log = tmp_path / "part.log"
    start = time.perf_counter()
    code, text = gpu_check.run_logged([sys.executable, "-c", script], str(log), timeout=3)
    assert code == -1 and "started" in text and time.perf_counter() - start < 30
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.1)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_gpu_check_reads_verbose_results_when_pytest_was_killed() -> None:
    text = (
        "tests/test_cuda.py::test_a[cuda] PASSED      [ 10%]\n"
        "tests/test_cuda.py::test_b[cuda] FAILED      [ 20%]\n"
        "tests/test_cuda.py::test_c[cpu] SKIPPED (why) [ 30%]\n"
        "some other line\n"
    )
    got = [(c.name.split("::")[1], c.result) for c in gpu_check.parse_verbose(text)]
    assert got == [("test_a[cuda]", "pass"), ("test_b[cuda]", "fail"), ("test_c[cpu]", "skip")]
