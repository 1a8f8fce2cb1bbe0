"""The same steps on every device this machine has: CPU always, CUDA when it is there (skipped
with a reason otherwise; CI has no GPU). Each is checked against ``reference_step`` on that
device, and everything the step returns must be on the device it was given. Traced steps and
profiling time each instruction with the device's clock (funcpipe.runtime.clock: CUDA events
on a GPU). tests/test_cuda.py has the rest of the CUDA checks (``make gpu-check`` runs both)."""

from __future__ import annotations

import itertools

import pytest
import torch

import funcpipe as fp
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.schedule import generate
from funcpipe.schedule.ir import COMPUTE_OPS
from funcpipe.testing import assert_trees_close
from tests.jobs_runtime import DEVICES, TRAINING, data, mse, one_by_one_1f1b, toy

NAMES = TRAINING


# float64: funcpipe.testing's tolerances; float32 (what GPUs run): kernels round differently
TOLERANCES = {torch.float64: {}, torch.float32: {"rtol": 1e-4, "atol": 1e-5}}


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=["float64", "float32"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_on_the_device_matches_the_reference(
    device: str, name: str, dtype: torch.dtype
) -> None:
    program = generate(name, ranks=2, microbatches=4)
    stages, params = toy(len(set(program.replica_of or range(program.n_stages))))
    params = [{k: v.to(device, dtype) for k, v in p.items()} for p in params]
    x, y = (t.to(device, dtype) for t in data(9))  # uneven microbatches
    got = Pipeline(stages, program, loss_fn=mse).step(params, x, y)
    ref = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    assert_trees_close((got.loss, got.grads), ref, **TOLERANCES[dtype])
    leaves = [got.loss, *(t for g in got.grads for t in g.values())]
    assert all(t.device.type == device for t in leaves)


def test_a_cuda_pipeline_checks_its_program_under_nccl_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Pipeline for CUDA checks its program under NCCL's rules when it is built, so a program
    that only gloo's buffered sends can run is refused before anything runs, while the same
    program is accepted for CPU (gloo). CUDA is faked as present (building runs nothing on it);
    without it, device="cuda" is refused first (tests/test_validate.py)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    stages, _ = toy(2)
    bad = one_by_one_1f1b()
    Pipeline(stages, bad, loss_fn=mse)  # CPU: gloo's rules
    with pytest.raises(fp.ScheduleError, match="r0-r1"):
        Pipeline(stages, bad, loss_fn=mse, device="cuda")
    lowered = Pipeline(stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=mse).program
    Pipeline(stages, lowered, loss_fn=mse, device="cuda")  # funcpipe's lowering: accepted


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_a_traced_step_on_the_device_times_every_instruction(device: str, name: str) -> None:
    program = generate(name, ranks=2, microbatches=4)
    stages, params = toy(len(set(program.replica_of or range(program.n_stages))))
    params = [{k: v.to(device) for k, v in p.items()} for p in params]
    x, y = (t.to(device) for t in data(8))
    pipe = Pipeline(stages, program, loss_fn=mse)
    got = pipe.step(params, x, y, trace=True)
    ref = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    assert_trees_close((got.loss, got.grads), ref)  # tracing changes nothing computed
    tl = got.timeline
    assert [len(r) for r in tl.events] == [len(r) for r in pipe.program.ranks]
    for events in tl.events:
        assert all(e.end >= e.start >= 0 for e in events)
        assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(events))
        if device == "cuda":  # each compute instruction runs kernels: events time them
            assert all(e.end > e.start for e in events if e.instr.op in COMPUTE_OPS)
    assert 0 <= tl.bubble_fraction < 1 and tl.makespan > 0


@pytest.mark.parametrize("device", DEVICES)
def test_profiling_on_the_device_times_every_stage(device: str) -> None:
    stages, params = toy(3)
    params = [{k: v.to(device) for k, v in p.items()} for p in params]
    x, _ = data(8)
    times = fp.measure_stages(stages, params, x.to(device), repeats=2)
    for name in ("f", "i", "w", "b"):
        values = getattr(times, name)
        assert len(values) == 3 and all(0 <= t < 10 for t in values), (name, values)
    assert all(t > 0 for t in times.f + times.b)
