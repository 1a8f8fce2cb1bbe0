"""Bad inputs that used to give a silently wrong result (issue 33): each is now either refused
with a funcpipe error before any work, or gives the true result (checked against
:func:`funcpipe.reference_step`)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import funcpipe as fp
from funcpipe.errors import InvalidArgument, ShapeInferenceError, ShapeInferenceWarning
from funcpipe.pipeline.agreement import fingerprint
from funcpipe.pipeline.checks import poison, shared_storage, tensor_loss_scale
from funcpipe.schedule import generate
from funcpipe.testing import assert_trees_close
from tests import jobs_runtime

F64 = torch.float64


def _layer(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ params["w"])


def _branchy(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Control flow on values, output shape fixed: cannot run on tensors without data."""
    if x.sum() > 0:
        return torch.tanh(x @ params["w"])
    return torch.sin(x @ params["w"])


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _setup(fn: Any = _layer, **kw: Any) -> tuple[fp.Pipeline, list[fp.Stage], Any, Any, Any]:
    g = torch.Generator().manual_seed(0)
    stages = [fp.Stage(fn, name="a"), fp.Stage(fn, name="b")]
    params = tuple({"w": torch.randn(4, 4, generator=g, dtype=F64)} for _ in range(2))
    x = torch.randn(8, 4, generator=g, dtype=F64)
    y = torch.randn(8, 4, generator=g, dtype=F64)
    kw.setdefault("loss_fn", _mse)
    pipe = fp.Pipeline(stages, generate("1f1b", ranks=2, microbatches=2), **kw)
    return pipe, stages, params, x, y


def _reference(stages: list[fp.Stage], params: Any, x: Any, y: Any) -> Any:
    return fp.reference_step(stages, params, x, _mse, targets=y, microbatches=2)


# ------------------------------------------------------------------------------ autograd context
@pytest.mark.parametrize("recompute", [False, True])
def test_step_inside_no_grad_gives_the_true_gradients(recompute: bool) -> None:
    pipe, stages, params, x, y = _setup(recompute=recompute)
    loss, grads = _reference(stages, params, x, y)[:2]
    with torch.no_grad():
        got = pipe.step(params, x, y)
    assert got.grads[0]["w"].abs().sum() > 0
    assert_trees_close(got.loss, loss)
    assert_trees_close(got.grads, grads)


def test_no_grad_is_restored_after_the_step() -> None:
    pipe, _, params, x, y = _setup()
    with torch.no_grad():
        pipe.step(params, x, y)
        assert not torch.is_grad_enabled()


def test_step_inside_inference_mode_is_refused() -> None:
    pipe, _, params, x, y = _setup()
    with torch.inference_mode(), pytest.raises(InvalidArgument, match="inference_mode"):
        pipe.step(params, x, y)


def test_inference_tensors_are_refused_by_name() -> None:
    pipe, _, params, x, y = _setup()
    with torch.inference_mode():
        frozen = x.clone()
    with pytest.raises(InvalidArgument, match=r"batch is an inference tensor"):
        pipe.step(params, frozen, y)
    pipe, _, params, x, y = _setup()
    with torch.inference_mode():
        w = params[1]["w"].clone()
    with pytest.raises(InvalidArgument, match=r"params\[1\]\['w'\] is an inference tensor"):
        pipe.step((params[0], {"w": w}), x, y)


def test_eval_program_runs_inside_inference_mode() -> None:
    _, stages, params, x, _ = _setup()
    program = fp.schedule.to_eval(generate("1f1b", ranks=2, microbatches=2))
    pipe = fp.Pipeline(stages, program)
    with torch.inference_mode():
        out = pipe.step(params, x, return_outputs=True).outputs
    assert_trees_close(out, _layer(params[1], _layer(params[0], x)))


# ------------------------------------------------------------------------------------- loss_fn
def test_detached_loss_is_refused() -> None:
    pipe, _, params, x, y = _setup(loss_fn=lambda o, t: _mse(o, t).detach())
    with pytest.raises(InvalidArgument, match="loss_fn .* does not require grad"):
        pipe.step(params, x, y)


def test_loss_from_item_is_refused() -> None:
    pipe, _, params, x, y = _setup(loss_fn=lambda o, t: torch.tensor(_mse(o, t).item()))
    with pytest.raises(InvalidArgument, match="does not require grad"):
        pipe.step(params, x, y)


def test_step_without_the_targets_the_loss_needs() -> None:
    pipe, _, params, x, _ = _setup()
    with pytest.raises(InvalidArgument, match=r"loss_fn=_mse needs 2 .* without targets"):
        pipe.step(params, x)


def test_targets_for_a_loss_of_outputs_only() -> None:
    pipe, _, params, x, y = _setup(loss_fn=lambda out: out.square().mean())
    with pytest.raises(InvalidArgument, match="takes 1 positional argument"):
        pipe.step(params, x, y)


# ------------------------------------------------------------------------------- tensor scales
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -2.0])
def test_bad_tensor_loss_scale_is_refused(bad: float) -> None:
    pipe, _, params, x, y = _setup()
    with pytest.raises(InvalidArgument, match="finite and > 0"):
        pipe.step(params, x, y, loss_scale=torch.tensor(bad))


def test_good_tensor_loss_scale_scales_the_gradients() -> None:
    pipe, _, params, x, y = _setup()
    plain = pipe.step(params, x, y)
    scaled = pipe.step(params, x, y, loss_scale=torch.tensor(8.0, dtype=F64))
    assert_trees_close(scaled.grads[0]["w"], plain.grads[0]["w"] * 8)


def test_accelerator_scale_is_poisoned_not_read() -> None:
    """Off the CPU a scale is not read (that would wait for the device): validate.poison turns
    a bad one into NaN on the device instead; here it runs on CPU tensors."""
    for bad, want in ((0.0, "nan"), (-1.0, "nan"), (float("nan"), "nan"), (4.0, "4.0")):
        assert str(float(poison(torch.tensor(bad)))) == want
    assert float(poison(torch.tensor(float("inf")))) == float("inf")  # non-finite gradients too
    assert float(tensor_loss_scale(torch.tensor([3.0]))) == 3.0


# ------------------------------------------------------------------------------ shared storage
def test_shared_storage_without_a_tie_is_refused() -> None:
    pipe, _, params, x, y = _setup()
    w = params[0]["w"]
    with pytest.raises(InvalidArgument, match=r"params\[0\]\['w'\] and params\[1\]\['w'\]") as e:
        pipe.step(({"w": w}, {"w": w}), x, y)
    assert "ties={'shared': [(0, 'w'), (1, 'w')]}" in str(e.value)


def test_a_view_of_another_stage_is_refused() -> None:
    pipe, _, _, x, y = _setup()
    big = torch.randn(8, 4, dtype=F64)
    with pytest.raises(InvalidArgument, match="share memory"):
        pipe.step(({"w": big[:4]}, {"w": big[2:6]}), x, y)


def test_disjoint_views_and_declared_ties_are_fine() -> None:
    pipe, stages, _, x, y = _setup()
    flat = torch.randn(8, 4, dtype=F64)
    parts = ({"w": flat[:4]}, {"w": flat[4:]})
    got = pipe.step(parts, x, y)
    assert_trees_close(got.grads, _reference(stages, parts, x, y)[1])
    tied, _, params, _, _ = _setup(ties={"w": [(0, "w"), (1, "w")]})
    w = params[0]["w"]
    tied.step(({"w": w}, {"w": w}), x, y)
    shared_storage(({"w": w}, {"w": w}), {(0, 0): "w", (1, 0): "w"})
    with pytest.raises(InvalidArgument):
        shared_storage(({"w": w}, {"w": w}), {(0, 0): "w", (1, 0): "other"})


# ------------------------------------------------------------------ inputs, devices, stage outputs
def test_meta_batch_is_refused() -> None:
    pipe, _, params, x, y = _setup()
    with pytest.raises(InvalidArgument, match="batch is on the meta device"):
        pipe.step(params, x.to("meta"), y)
    with pytest.raises(InvalidArgument, match="targets is on the meta device"):
        pipe.step(params, x, y.to("meta"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_device_without_cuda_fails_at_construction() -> None:
    with pytest.raises(InvalidArgument, match="device='cuda'.* no CUDA device"):
        _setup(device="cuda")


def test_stage_returning_none_is_named() -> None:
    def forgot(params: dict[str, torch.Tensor], x: torch.Tensor) -> None:
        torch.tanh(x @ params["w"])

    pipe, _, params, x, y = _setup(forgot)
    with pytest.raises(InvalidArgument, match=r"stage 0 \('a'\) returned None.*forget to return"):
        pipe.step(params, x, y)


# ------------------------------------------------------------------- data-dependent control flow
def test_data_dependent_control_flow_runs_on_a_real_microbatch() -> None:
    pipe, stages, params, x, y = _setup(_branchy)
    x = torch.cat([x[:4].abs(), -x[4:].abs()])  # one branch per microbatch
    with pytest.warns(ShapeInferenceWarning, match="one real microbatch"):
        got = pipe.step(params, x, y)
    loss, grads = _reference(stages, params, x, y)[:2]
    assert_trees_close(got.loss, loss)
    assert_trees_close(got.grads, grads)
    with warnings.catch_warnings():  # the layout is cached: no second inference
        warnings.simplefilter("error")
        pipe.step(params, x, y)


def test_a_stage_that_fails_for_real_says_so() -> None:
    def picky(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 1e9:
            return x
        raise ValueError("picky stage")

    pipe, _, params, x, y = _setup(picky)
    with pytest.raises(ShapeInferenceError, match="nor on one real microbatch .*picky stage"):
        pipe.step(params, x, y)


def test_fingerprint_is_stable_and_distinguishes() -> None:
    a = generate("1f1b", ranks=2, microbatches=4).to_text()
    b = generate("gpipe", ranks=2, microbatches=4).to_text()
    assert fingerprint(a) == fingerprint(a) and fingerprint(a) != fingerprint(b)
    assert 0 <= fingerprint(a) < 2**62


def test_real_fallback_without_the_other_stages_params() -> None:
    """Over processes a rank holds only its stages (the rest are meta): the fallback feeds a
    branching stage zeros of its producer's inferred outputs, and materialises meta params."""
    from funcpipe.stages.boundaries import infer_boundaries

    program = generate("1f1b", ranks=2, microbatches=2)
    stages = [fp.Stage(_layer, name="a"), fp.Stage(_branchy, name="b")]
    w = torch.randn(4, 6, dtype=F64)
    for params in (
        ({"w": w.to("meta")}, {"w": torch.randn(6, 3, dtype=F64)}),
        ({"w": w}, {"w": torch.empty(6, 3, dtype=F64, device="meta")}),
    ):
        with pytest.warns(ShapeInferenceWarning, match=r"stage 1 \('b'\)"):
            layout = infer_boundaries(program, stages, params, (torch.randn(5, 4, dtype=F64),), {})
        assert [repr(s) for s in layout[0].leaves] == ["f64[5, 6]"]
        assert [repr(s) for s in layout[1].leaves] == ["f64[5, 3]"]


def test_cli_refuses_a_schedule_too_large_to_build_in_seconds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import time

    from funcpipe.cli.app import main

    start = time.monotonic()
    assert main(["schedule", "1f1b", "-p", "2", "-m", "4000000"]) == 2
    assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert "8,000,000 (stage, microbatch) pairs" in err and "--no-size-limit" in err
    assert main(["schedule", "1f1b", "-p", "2", "-m", "8"]) == 0  # small sizes still run


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("m", [1, 2])
def test_chimera_with_one_microbatch_is_accepted_and_right(ranks: int, m: int) -> None:
    """Chimera with m=1 gave wrong weight gradients (found in review; its idle replicas were
    left out of the replica sums) and was refused for a while; it now runs, as m=2 does, to the
    reference."""
    stages = [fp.Stage(_layer, name=f"s{k}") for k in range(ranks)]
    g = torch.Generator().manual_seed(1)
    params = tuple({"w": torch.randn(4, 4, generator=g, dtype=F64)} for _ in range(ranks))
    x, y = torch.randn(4, 4, generator=g, dtype=F64), torch.randn(4, 4, generator=g, dtype=F64)
    got = fp.Pipeline(stages, generate("chimera", ranks=ranks, microbatches=m), loss_fn=_mse)
    ref = fp.reference_step(stages, params, x, _mse, targets=y, microbatches=m)
    assert_trees_close(got.step(params, x, y)[:2], ref)


def test_a_tie_with_two_members_in_one_stage() -> None:
    """Ties resolved by position, not identity: after the values are tied, two paths of one
    stage hold one tensor object, and each must still get the whole parameter's gradient."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 4, generator=g, dtype=F64)

    def two(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ p["a"]) @ p["b"]

    stages = [fp.Stage(two, name="two"), fp.Stage(_layer, name="one")]
    params = ({"a": w.clone(), "b": w.clone()}, {"w": w.clone()})
    ties = {"w": [(0, "a"), (0, "b"), (1, "w")]}
    x, y = torch.randn(4, 4, generator=g, dtype=F64), torch.randn(4, 4, generator=g, dtype=F64)
    whole = w.clone().requires_grad_()
    losses = [
        _mse(torch.tanh((torch.tanh(xs @ whole) @ whole) @ whole), ys)
        for xs, ys in zip(x.chunk(2), y.chunk(2), strict=True)
    ]
    torch.stack(losses).mean().backward()
    _, ref = fp.reference_step(stages, params, x, _mse, targets=y, microbatches=2, ties=ties)
    pipe = fp.Pipeline(stages, generate("1f1b", ranks=2, microbatches=2), loss_fn=_mse, ties=ties)
    got = pipe.step(params, x, y).grads
    for grads in (ref, got):
        for s, path in ties["w"]:
            assert_trees_close(grads[s][path], whole.grad)


# ------------------------------------------------------------------------- issue 42: arguments
def test_the_same_params_for_every_stage_asks_for_each_stages_own() -> None:
    """The full state_dict passed as every stage's params: not a tie to declare."""
    pipe, _, _, x, y = _setup()
    whole = {"w": torch.randn(4, 4, dtype=F64), "v": torch.randn(4, 4, dtype=F64)}
    for params in ((whole, whole), (whole, dict(whole))):  # one dict, or one per stage
        with pytest.raises(
            InvalidArgument, match=r"params\[0\] and params\[1\] hold the same"
        ) as e:
            pipe.step(params, x, y)
        assert "parts.params" in str(e.value) and "declare" not in str(e.value).split(";")[0]


@pytest.mark.parametrize(
    ("ties", "want"),
    [
        ({"w": [[0, "w"], [1, "w"]]}, r"ties\['w'\]\[0\]=\[0, 'w'\] is a list.*\(0, 'w'\)"),
        ([(0, "w"), (1, "w")], r"ties=\[\(0, 'w'\), \(1, 'w'\)\] is a list.*ties=\{'tied': "),
    ],
    ids=["members-as-lists", "not-a-dict"],
)
def test_ties_in_the_wrong_containers_are_named(ties: Any, want: str) -> None:
    with pytest.raises(InvalidArgument, match=want):
        _setup(ties=ties)


@pytest.mark.parametrize(
    ("side", "want"),
    [
        ({1: "mask"}, r"side_inputs\[1\]='mask' is a string.*side_inputs=\{1: \['mask'\]\}"),
        ("mask", r"side_inputs='mask' is a str.*\{stage: \[field, ...\]\}"),
    ],
    ids=["field-as-string", "not-a-dict"],
)
def test_side_inputs_as_a_string_is_named(side: Any, want: str) -> None:
    with pytest.raises(InvalidArgument, match=want):
        _setup(side_inputs=side)


@pytest.mark.parametrize(("batch", "m"), [(8, 6), (3, 2), (1, 2)])
def test_microbatches_beyond_a_data_copys_share_count_the_share(batch: int, m: int) -> None:
    stages = [fp.Stage(_layer, name="a"), fp.Stage(_layer, name="b")]
    pipe = fp.Pipeline(stages, generate("1f1b", ranks=2, microbatches=m), loss_fn=_mse, data=2)
    params = tuple({"w": torch.randn(4, 4, dtype=F64)} for _ in range(2))
    x = torch.randn(batch, 4, dtype=F64)
    with pytest.raises(InvalidArgument) as e:
        pipe.step(params, x, x)
    text = str(e.value)
    assert f"the batch has {batch} samples" in text and "data=2" in text, text
    assert f"smallest share {batch // 2}" in text and f"at least {2 * m} samples" in text, text


# ------------------------------------------------------------------ issue 42: over processes
def test_tied_copies_with_different_values_over_processes_are_refused() -> None:
    """Over processes each stage uses its own copy: copies that differ are refused at the first
    step, naming the tie, both copies and their processes (here one process holds both)."""
    from tests.jobs_runtime import tied_copies_in_one_process, toy

    assert tied_copies_in_one_process(toy(2, tied=True)[1][0]["E"].clone()) > 0  # equal: runs
    with pytest.raises(InvalidArgument, match=r"ties\['E'\]: the tied copies hold different") as e:
        tied_copies_in_one_process()
    assert "stage 0 'E' on process 0 and stage 1 'E' on process 0" in str(e.value)
    with pytest.raises(InvalidArgument, match=r"f64\[6, 6\] on process 0, .* f64\[6, 5\]"):
        tied_copies_in_one_process(torch.randn(6, 5, dtype=F64))


def test_one_agreement_per_step_over_processes(pool: Any) -> None:
    """The step's shapes are agreed by one small all-gather per step (every process enters it,
    whatever its batch); nothing else but each step's loss sum."""
    for calls in pool(2).run(jobs_runtime.agreement_calls, [8, 8, 6, 8]):
        gathers = [n for name, n in calls if name != "all_reduce"]
        # one per step, of four int64s: two fingerprints, the step's seed, whether it was passed
        assert gathers == [4, 4, 4, 4], calls
        assert len(calls) == 8, calls  # and each step's loss (an all-reduce, as before)


def test_a_world_of_one_process_agrees_without_a_collective(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One process has no one to agree with: no all-gather at construction or per step (on
    NCCL each would wait for the GPU), only each step's loss sum; its own seed is the step's."""
    import torch.distributed as dist

    calls: list[str] = []
    for name in ("all_gather", "all_gather_single", "all_gather_into_tensor", "all_reduce"):
        if hasattr(dist, name):
            real = getattr(dist, name)
            monkeypatch.setattr(
                dist, name, lambda *a, _n=name, _r=real, **kw: (calls.append(_n), _r(*a, **kw))[1]
            )
    g = torch.Generator().manual_seed(0)
    stages = [fp.Stage(_layer, name="a"), fp.Stage(_layer, name="b")]
    params = tuple({"w": torch.randn(4, 4, generator=g, dtype=F64)} for _ in range(2))
    program = generate("zbv", ranks=1, microbatches=2)
    batches = [torch.randn(size, 4, generator=g, dtype=F64) for size in (8, 6)]
    local = fp.Pipeline(stages, program, loss_fn=_mse)  # no process group: no agreement
    want = [local.step(params, x, x, seed=7) for x in batches]
    calls.clear()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with fp.Pipeline(stages, program, loss_fn=_mse, transport="dist") as pipe:
            for x, ref in zip(batches, want, strict=True):
                got = pipe.step(params, x, x, seed=7)
                assert_trees_close((got.loss, got.grads), (ref.loss, ref.grads), atol=0, rtol=0)
    finally:
        dist.destroy_process_group()
    assert calls == ["all_reduce", "all_reduce"], calls
