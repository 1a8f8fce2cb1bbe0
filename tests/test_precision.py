"""Mixed precision and compiled stages with every schedule (issue 27).

Every generator x {bf16 autocast on CPU, bf16 parameters, torch.compile with aot_eager}, with
and without recompute, against ``reference_step`` of the same stages (tolerances per mode in
tests/jobs_precision.py), in one process and over gloo; shape inference under autocast; float32
gradient sums for bf16 parameters; loss scaling; no recompilation after the first step.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import funcpipe as fp
from funcpipe.models import gpt
from funcpipe.schedule.generators import generate
from tests import jobs_precision as J
from tests.jobs_runtime import TRAINING as NAMES

CROSSING = {"compile": "torch.float64", "inductor": "torch.float32"}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside inductor's imports
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("mode", list(J.MODES))
@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_in_one_process(name: str, mode: str, recompute: bool) -> None:
    got = J.vs_reference(0, name, mode, recompute=recompute)
    want = CROSSING.get(mode, "torch.bfloat16")
    assert got["crossing"] == [want]  # what the stages really produce crosses stages


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside inductor's imports
@pytest.mark.parametrize("mode", list(J.MODES))
def test_overlapped_pairs_in_every_mode(mode: str) -> None:
    """DualPipeV's pairs (the backward on a second thread, its first one per stage under the
    dispatch mode that refuses random draws) with compiled, autocast and bf16 stages."""
    got = J.vs_reference(0, "dualpipev", mode, overlap=True)
    assert got["crossing"] == [CROSSING.get(mode, "torch.bfloat16")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["compile", "autocast", "bf16"])
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_over_gloo(pool, name: str, mode: str) -> None:
    for got in pool(2).run(J.vs_reference, name, mode, recompute=name == "zbv"):
        assert got["crossing"] == [CROSSING.get(mode, "torch.bfloat16")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_shape_inference_sees_autocast(dtype: torch.dtype) -> None:
    """The issue's failure: inference on meta saw float32 where the stage returns bf16."""
    stages = [fp.autocast_stage(fp.Stage(J.layer, name=f"l{k}"), dtype) for k in range(2)]
    specs = fp.infer_specs(stages, J.params(2, torch.float32), torch.zeros(4, J.D))
    short = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    assert repr(specs[0].outputs) == f"{short}[4, 8]" == repr(specs[1].inputs[0])
    assert specs[0].method == "fake"


# dynamo reads .grad of a non-leaf input while building guards (reference_step passes one stage's
# output to the next) and torch warns about its own access
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_compiled_split_backward_after_a_plain_backward() -> None:
    """A compiled region whose backward was first compiled by a plain backward (reference_step)
    donates its saved buffers; I/W (ZB-H1) must still run, with the same gradients."""
    torch._dynamo.reset()
    stages = [
        fp.compile_stage(fp.Stage(J.layer, name=f"c{k}"), backend="aot_eager") for k in range(2)
    ]
    ps = J.params(2, torch.float32)
    x, y = J.batch(8, torch.float32)
    ref_loss, ref_grads = fp.reference_step(stages, ps, x, J.mse, targets=y, microbatches=4)
    pipe = fp.Pipeline(stages, generate("zb-h1", ranks=2, microbatches=4), loss_fn=J.mse)
    loss, grads = pipe.step(ps, x, y)
    fp.testing.assert_trees_close(loss, ref_loss, rtol=1e-6, atol=1e-7)
    fp.testing.assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside inductor's imports
def test_inductor_with_a_split_backward() -> None:
    """The default backend (inductor: generated C++ on CPU); float32 within 1e-5."""
    torch._dynamo.reset()
    stages = [fp.compile_stage(fp.Stage(J.layer, name=f"i{k}")) for k in range(2)]
    ps = J.params(2, torch.float32)
    x, y = J.batch(8, torch.float32)
    pipe = fp.Pipeline(stages, generate("zb-h1", ranks=2, microbatches=4), loss_fn=J.mse)
    loss, grads = pipe.step(ps, x, y)
    plain = [fp.Stage(J.layer, name=f"p{k}") for k in range(2)]
    ref_loss, ref_grads = fp.reference_step(plain, ps, x, J.mse, targets=y, microbatches=4)
    fp.testing.assert_trees_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    fp.testing.assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-5)


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def test_no_recompilation_after_the_first_step() -> None:
    """8 GPT stages (closures of one function) compiled per stage, ZB-V on 4 ranks with
    recompute: every graph is made in the first step; the next steps compile nothing. With a
    batch of 8 in 4 microbatches, one graph per stage and grad mode; with a batch of 7 (the last
    microbatch smaller) the first step also makes each stage's graphs for the new size."""
    torch._dynamo.reset()
    counters.clear()
    cfg = gpt.GPTConfig(vocab=32, context=8, d_model=16, heads=2, layers=8)
    program = generate("zbv", ranks=4, microbatches=4)
    stages = [
        fp.compile_stage(s, backend="aot_eager") for s in gpt.stages(cfg, 8, axis=gpt.single_axis())
    ]
    params = list(gpt.split(gpt.init(cfg), cfg, 8))
    pipe = fp.Pipeline(
        stages,
        program,
        loss_fn=gpt.loss_fn(axis=gpt.single_axis()),
        ties=gpt.tie_spec(8),
        recompute=True,
    )
    g = torch.Generator().manual_seed(0)

    def step(b: int) -> None:
        x = torch.randint(0, 32, (b, 8), generator=g)
        pipe.step(params, x, torch.randint(0, 32, (b, 8), generator=g))

    step(8)
    first = _graphs()
    assert first == 16  # 8 stages x (forward without a graph for recompute, with a graph)
    step(8)
    assert _graphs() == first
    step(7)  # microbatches of 2, 2, 2 and 1 sequences: a new shape, compiled in this step
    uneven = _graphs()
    assert uneven > first
    step(7)
    step(8)
    assert _graphs() == uneven


def test_float32_gradient_sums_for_bf16_parameters() -> None:
    """grad_dtype=float32: bf16 parameters' gradients come back in float32, summed without
    bf16 rounding between microbatches: closer to the float64 truth than bf16 sums."""
    m = 16
    stages = J.stages(2, "bf16")
    ps = J.params(2, torch.bfloat16)
    x, y = J.batch(4 * m, torch.bfloat16)
    program = generate("1f1b", ranks=2, microbatches=m)
    wide = fp.Pipeline(stages, program, loss_fn=J.mse, grad_dtype=torch.float32).step(ps, x, y)
    narrow = fp.Pipeline(stages, program, loss_fn=J.mse).step(ps, x, y)
    # the truth: each microbatch's bf16 gradients, summed in float64
    truth = None
    for k in range(m):
        sl = slice(4 * k, 4 * k + 4)
        _, gk = fp.reference_step(stages, ps, x[sl], J.mse, targets=y[sl])
        gk = [{n: v.double() / m for n, v in g.items()} for g in gk]
        truth = (
            gk
            if truth is None
            else [{n: a[n] + b[n] for n in a} for a, b in zip(truth, gk, strict=True)]
        )
    err_wide = err_narrow = 0.0
    for w, n, t in zip(wide.grads, narrow.grads, truth, strict=True):
        for k in t:
            assert w[k].dtype == torch.float32 and n[k].dtype == torch.bfloat16
            err_wide = max(err_wide, float((w[k].double() - t[k]).abs().max()))
            err_narrow = max(err_narrow, float((n[k].double() - t[k]).abs().max()))
    assert err_wide < 1e-6 < err_narrow, (err_wide, err_narrow)


def test_grad_dtype_leaves_float32_parameters_alone() -> None:
    stages = J.stages(2, "autocast")
    ps = J.params(2, torch.float32)
    x, y = J.batch(8, torch.float32)
    program = generate("zb-h1", ranks=2, microbatches=4)
    a = fp.Pipeline(stages, program, loss_fn=J.mse, grad_dtype=torch.float32).step(ps, x, y)
    b = fp.Pipeline(stages, program, loss_fn=J.mse).step(ps, x, y)
    fp.testing.assert_trees_close(a.grads, b.grads, rtol=0, atol=0)


def test_loss_scale_scales_the_gradients_not_the_loss() -> None:
    stages = J.stages(2, "none")
    ps = J.params(2, torch.float64)
    x, y = J.batch(8, torch.float64)
    pipe = fp.Pipeline(stages, generate("zbv", ranks=1, microbatches=4), loss_fn=J.mse)
    plain = pipe.step(ps, x, y)
    scaled = pipe.step(ps, x, y, loss_scale=torch.tensor(1024.0))
    assert float(scaled.loss) == float(plain.loss)
    fp.testing.assert_trees_close(
        scaled.grads,
        tuple({k: v * 1024 for k, v in g.items()} for g in plain.grads),
        rtol=0,
        atol=0,
    )
    for bad in (0, -1.0, float("inf"), torch.ones(2), "2"):
        with pytest.raises(fp.InvalidArgument, match="loss_scale"):
            pipe.step(ps, x, y, loss_scale=bad)


@pytest.mark.parametrize("bad", [torch.int32, "float32", 2])
def test_grad_dtype_is_checked(bad) -> None:
    with pytest.raises(fp.InvalidArgument, match="grad_dtype"):
        fp.Pipeline(
            J.stages(2, "none"),
            generate("1f1b", ranks=2, microbatches=2),
            loss_fn=J.mse,
            grad_dtype=bad,
        )


def test_stage_transforms_check_their_arguments() -> None:
    with pytest.raises(fp.InvalidArgument, match="dtype"):
        fp.autocast_stage(fp.Stage(J.layer), torch.float32)
    with pytest.raises(fp.InvalidArgument, match="Stage"):
        fp.autocast_stage(J.layer)  # type: ignore[arg-type]
    with pytest.raises(fp.InvalidArgument, match="Stage"):
        fp.compile_stage(J.layer)  # type: ignore[arg-type]
    assert "autocast(layer, bfloat16)" in repr(fp.autocast_stage(fp.Stage(J.layer)))
    assert "compile(layer, backend='aot_eager')" in repr(
        fp.compile_stage(fp.Stage(J.layer), backend="aot_eager")
    )
