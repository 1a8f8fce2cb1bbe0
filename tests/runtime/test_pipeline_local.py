"""Every schedule, run with all ranks in this process, against the single-device reference."""

from __future__ import annotations

import itertools

import pytest
import torch

import funcpipe as fp
from funcpipe.errors import InvalidArgument
from funcpipe.pipeline import pipeline as pipeline_module
from funcpipe.pipeline.pipeline import Pipeline
from funcpipe.runtime.interpreter import RankResult
from funcpipe.schedule.generators import forward_only, generate, to_eval
from funcpipe.schedule.ir import Program, chain, pairs
from funcpipe.stages.stage import Stage
from funcpipe.testing import assert_trees_close
from funcpipe.tree import tree_flatten
from tests.jobs_runtime import (
    F64,
    TRAINING,
    D,
    accuracy,
    data,
    graph_reference,
    mse,
    one_by_one_1f1b,
    run_pipeline_vs_reference,
    tied_reference,
    toy,
)

NAMES = TRAINING  # every training schedule of the registry (GENERATORS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_every_schedule_matches_the_reference(
    name: str, ranks: int, recompute: bool, tied: bool
) -> None:
    # microbatches: equal to ranks, and more than ranks with uneven microbatches (batch 13);
    # the second step changes the batch size
    for m in sorted({ranks, 2 * ranks + 1}):
        run_pipeline_vs_reference(
            0, name, ranks, m, [13, 7 if m <= 7 else 9], recompute=recompute, tied=tied
        )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_every_schedule_with_overlapped_pairs_matches_the_reference(
    name: str, recompute: bool
) -> None:
    """``generate(..., overlap=True)``: DualPipeV's and ZB-V's own pairs, the ``overlap`` pass
    for the others; a pair whose stages expose no waiting point runs its halves in sequence."""
    for ranks, m in ((2, 5), (4, 8)):
        run_pipeline_vs_reference(
            0, name, ranks, m, [13, 9], recompute=recompute, tied=True, overlap=True
        )


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "chimera"])
def test_split_backward_everywhere_matches(name: str) -> None:
    run_pipeline_vs_reference(0, name, 2, 4, [8], split_all=True, tied=True)


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 3])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("copies", [1, 2], ids=["one-copy", "data-2"])
def test_chimera_with_few_microbatches_matches_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, ranks: int, microbatches: int, tied: bool, copies: int
) -> None:
    """Chimera with one microbatch leaves its up pipeline idle: those replicas see no
    microbatch, still join their stage's replica sum (adding zeros), and every rank ends with
    the whole gradient of each stage it holds, as a process over ``"dist"`` reports it. (The
    idle replicas were left out of the sums: the rank holding one reported zeros, and the step
    returned them, 0.13 off at 2 ranks.)"""
    program = generate("chimera", ranks=ranks, microbatches=microbatches)
    stages, params = toy(ranks, tied=tied)
    ties = {"E": [(0, "E"), (ranks - 1, "E")]} if tied else None
    pipe = Pipeline(stages, program, loss_fn=mse, ties=ties, data=copies)
    per_rank: list[dict[int, list[torch.Tensor]]] = []
    real = pipeline_module.stage_grads

    def keep(
        program: Program, prm: tuple[object, ...], results: list[RankResult], *rest: object
    ) -> tuple[object, ...]:
        per_rank.extend(dict(res.grads) for res in results)
        return real(program, prm, results, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline_module, "stage_grads", keep)
    x, y = data(6 * copies)
    loss, grads = pipe.step(params, x, y)
    want_loss, want = tied_reference(stages, params, x, y, microbatches * copies, ties)
    assert_trees_close((loss, grads), (want_loss, want), rtol=1e-12, atol=1e-12)
    owners = program.replica_of or ()
    for r, got in enumerate(per_rank):  # what each rank returns over "dist"
        held = {owners[s] for s in program.stages_on(r)}
        assert set(got) == held
        for o in held:
            assert_trees_close(
                got[o], tree_flatten(want[o])[0], rtol=1e-12, atol=1e-12, msg=f"rank {r} stage {o}"
            )
    if copies == 1:  # under NCCL's point-to-point rules too, two batch sizes
        run_pipeline_vs_reference(
            0, "chimera", ranks, microbatches, [13, 7], tied=tied, strict=True
        )


def test_two_steps_are_independent() -> None:
    stages, params = toy(2)
    pipe = Pipeline(stages, generate("1f1b", ranks=2, microbatches=2), loss_fn=mse)
    x, y = data(4)
    first = pipe.step(params, x, y)
    second = pipe.step(params, x, y)
    assert_trees_close(second.grads, first.grads, rtol=0, atol=0)
    assert torch.equal(first.loss, second.loss)


def test_shape_inference_cache_is_bounded_and_keyed_on_params(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import funcpipe.pipeline.pipeline as pipeline_mod

    monkeypatch.setattr(pipeline_mod, "LAYOUT_CACHE", 3)
    stages, params = toy(2)
    pipe = Pipeline(stages, generate("1f1b", ranks=2, microbatches=2), loss_fn=mse)
    for batch in (4, 6, 8, 10, 12, 6):
        x, y = data(batch)
        got = pipe.step(params, x, y)
        want = fp.reference_step(stages, params, x, mse, targets=y, microbatches=2)
        assert_trees_close(got.grads, want[1])
        assert len(pipe._layouts) <= 3


def test_shape_inference_follows_the_params_dtype() -> None:
    """Stages whose outputs take their params' dtype: the same batch with float32 params after
    float64 ones needs new shape inference (the layouts are keyed on the params too)."""

    def scale(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        return h.to(p["w"].dtype) * p["w"]

    stages = [Stage(scale, name="a"), Stage(scale, name="b")]
    pipe = Pipeline(stages, generate("1f1b", ranks=2, microbatches=2), loss_fn=mse)
    x, y = data(4)
    for dtype in (torch.float64, torch.float32):
        params = [{"w": torch.full((D,), 0.5, dtype=dtype)} for _ in stages]
        got = pipe.step(params, x, y)
        assert all(p["w"].dtype == dtype for p in got.grads)
        want = fp.reference_step(stages, params, x, mse, targets=y, microbatches=2)
        assert_trees_close(got.grads, want[1])


def test_handwritten_program_runs() -> None:
    text = """
    # a hand-written GPipe for two ranks and two microbatches, compute only
    placement 0 1
    microbatches 2
    rank 0: F s0 m0; F s0 m1; B s0 m0; B s0 m1
    rank 1: F s1 m0; F s1 m1; B s1 m1; B s1 m0
    """
    program = fp.schedule.parse_program(text)
    stages, params = toy(2)
    x, y = data(6)
    loss, grads = Pipeline(stages, program, loss_fn=mse).step(params, x, y)
    ref_loss, ref_grads = fp.reference_step(stages, params, x, mse, targets=y, microbatches=2)
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


def test_program_from_torch_csv_runs() -> None:
    csv = "0F0,0F1,2F0,2F1,2B0,2B1,0B0,0B1\n1F0,1F1,3F0,3F1,3B0,3B1,1B0,1B1\n"
    program = fp.schedule.read_csv(csv)
    assert program.n_stages == 4 and program.placement == (0, 1, 0, 1)
    stages, params = toy(4)
    x, y = data(6)
    loss, grads = Pipeline(stages, program, loss_fn=mse).step(params, x, y)
    ref_loss, ref_grads = fp.reference_step(stages, params, x, mse, targets=y, microbatches=2)
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


def _masked(p: dict[str, torch.Tensor], *hs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    h = sum(hs[1:], hs[0])
    return torch.tanh(h @ p["W"] + p["b"]) * mask.unsqueeze(-1)


@pytest.mark.parametrize(("name", "ranks"), [("1f1b", 3), ("zbv", 2)])
def test_skip_connection_and_mask_from_the_batch(name: str, ranks: int) -> None:
    program = generate(name, ranks=ranks, microbatches=4)
    n = program.n_stages
    program = program.replace(edges=(*chain(n), (0, 2)))  # stage 0's output also feeds stage 2
    _, params = toy(n)
    stages = [Stage(_masked, name=f"s{k}") for k in range(n)]
    x, y = data(8)
    mask = (torch.arange(8) % 3 != 0).to(F64).unsqueeze(-1).expand(8, 1).reshape(8)
    batch = {"inputs": x, "mask": mask}
    side = {k: ["mask"] for k in range(n)}
    pipe = Pipeline(stages, program, loss_fn=mse, side_inputs=side)
    loss, grads = pipe.step(params, batch, y)
    ref_loss, ref_grads = graph_reference(program, stages, params, batch, y, side)
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("targets", [True, False], ids=["targets", "no-targets"])
def test_evaluation_of_every_schedule(name: str, targets: bool) -> None:
    program = to_eval(generate(name, ranks=2, microbatches=4))
    n = len(set(program.replica_of or ()))
    stages, params = toy(n)
    x, y = data(10)
    pipe = Pipeline(stages, program, loss_fn=mse, metric_fn=accuracy)
    res = pipe.step(params, x, y if targets else None, return_outputs=True)
    with torch.no_grad():
        h = x
        for s, p in zip(stages, params, strict=True):
            h = s(p, h)
    assert_trees_close(res.outputs, h)
    assert all(g is None for g in res.grads)
    if targets:
        ref_loss, _ = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
        assert_trees_close(res.loss, ref_loss)
        assert res.metric is not None
    else:
        assert res.loss is None and res.metric is None


def test_forward_only_v_placement() -> None:
    program = forward_only(ranks=2, microbatches=3, placement="v")
    stages, params = toy(4)
    x, _ = data(5)
    out = Pipeline(stages, program).step(params, x, return_outputs=True).outputs
    with torch.no_grad():
        h = x
        for s, p in zip(stages, params, strict=True):
            h = s(p, h)
    assert_trees_close(out, h)


def test_metric_and_outputs_in_training() -> None:
    stages, params = toy(2)
    x, y = data(6)
    res = Pipeline(
        stages, generate("zbv", ranks=1, microbatches=3), loss_fn=mse, metric_fn=accuracy
    ).step(params, x, y, return_outputs=True)
    with torch.no_grad():
        out = stages[1](params[1], stages[0](params[0], x))
    assert_trees_close(res.outputs, out)
    expected = (
        sum(accuracy(o, t) for o, t in zip(out.tensor_split(3), y.tensor_split(3), strict=True)) / 3
    )
    assert_trees_close(res.metric, expected)


def test_data_parallel_in_process() -> None:
    stages, params = toy(2)
    x, y = data(8)
    pipe = Pipeline(stages, generate("1f1b", ranks=2, microbatches=2), loss_fn=mse, data=2)
    loss, grads = pipe.step(params, x, y)
    ref_loss, ref_grads = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


def test_integer_tensors_and_tuples_cross_stages() -> None:
    def first(p: dict[str, torch.Tensor], ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return p["emb"][ids], (ids % 2 == 0)

    def second(p: dict[str, torch.Tensor], h: torch.Tensor, even: torch.Tensor) -> torch.Tensor:
        return (h @ p["W"]) * even.unsqueeze(-1)

    g = torch.Generator().manual_seed(0)
    params = [
        {"emb": torch.randn(10, D, generator=g, dtype=F64)},
        {"W": torch.randn(D, D, generator=g, dtype=F64)},
    ]
    stages = [Stage(first), Stage(second)]
    ids = torch.randint(0, 10, (6, 3), generator=g)
    y = torch.randn(6, 3, D, generator=g, dtype=F64)
    loss, grads = Pipeline(stages, generate("1f1b", ranks=2, microbatches=3), loss_fn=mse).step(
        params, ids, y
    )
    ref_loss, ref_grads = fp.reference_step(stages, params, ids, mse, targets=y, microbatches=3)
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


def test_bad_arguments_are_named() -> None:
    stages, params = toy(2)
    program = generate("1f1b", ranks=2, microbatches=2)
    with pytest.raises(InvalidArgument, match="loss_fn"):
        Pipeline(stages, program)
    with pytest.raises(InvalidArgument, match="2 model stage"):
        Pipeline(stages[:1], program, loss_fn=mse)
    with pytest.raises(InvalidArgument, match="schedule="):
        Pipeline(stages, "1f1b", loss_fn=mse)  # type: ignore[arg-type]
    pipe = Pipeline(stages, program, loss_fn=mse)
    x, y = data(4)
    with pytest.raises(InvalidArgument, match="one pytree per stage"):
        pipe.step(params[:1], x, y)
    with pytest.raises(InvalidArgument, match="microbatches=2"):
        pipe.step(params, x[:1], y[:1])
    with pytest.raises(InvalidArgument, match="ties"):
        Pipeline(stages, program, loss_fn=mse, ties={"E": [(0, "b")]})


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ranks", [2, 4])
def test_activations_are_freed_as_the_schedule_says(name: str, ranks: int) -> None:
    from funcpipe.schedule.simulate import peak_activations

    program = generate(name, ranks=ranks, microbatches=2 * ranks + 1)
    n = len(set(program.replica_of or ()))
    stages, params = toy(n)
    x, y = data(4 * ranks + 2)
    pipe = Pipeline(stages, program, loss_fn=mse)
    res = pipe.step(params, x, y)
    expected = peak_activations(pipe.program)
    assert tuple(res.peak_activations[r] for r in range(ranks)) == expected


def test_recomputed_stages_keep_only_their_inputs() -> None:
    from funcpipe.schedule.simulate import peak_activations

    stages, params = toy(2)
    x, y = data(8)
    pipe = Pipeline(stages, generate("gpipe", ranks=2, microbatches=4), loss_fn=mse, recompute=True)
    res = pipe.step(params, x, y)
    assert tuple(res.peak_activations.values()) == peak_activations(pipe.program) == (1, 1)


def test_trace_gives_the_executed_timeline() -> None:
    stages, params = toy(2)
    x, y = data(8)
    program = generate("1f1b", ranks=2, microbatches=4)
    res = Pipeline(stages, program, loss_fn=mse).step(params, x, y, trace=True)
    tl = res.timeline
    assert [len(r) for r in tl.events] == [len(r) for r in res.timeline.program.ranks]
    for rank in tl.events:
        assert all(e.end >= e.start >= 0 for e in rank)
        assert all(a.end <= b.start + 1e-9 for a, b in itertools.pairwise(rank))
    assert 0 <= tl.bubble_fraction < 1 and tl.makespan > 0


@pytest.mark.parametrize(
    ("where", "stage", "what"),
    [("forward", 1, "output"), ("loss", 2, "loss"), ("backward", 0, "gradient")],
)
def test_nan_is_reported_with_stage_and_microbatch(where: str, stage: int, what: str) -> None:
    from funcpipe.errors import NonFiniteError

    stages, params = toy(3)
    x, y = data(8)
    if where == "forward":
        x = x.clone()
        x[5, 0] = float("nan")  # row 5 is in microbatch 2 of 4: stage 0's output turns NaN
        stage = 0
    elif where == "loss":
        y = y.clone()
        y[3, 0] = float("inf")  # microbatch 1
    else:
        # finite forward (sqrt(0) = 0), but the gradient of sqrt at 0 is infinite: inf * 0 = NaN
        def sqrt_at_zero(p, h):  # type: ignore[no-untyped-def]
            return torch.tanh(h @ p["W"] + p["b"]) + torch.sqrt((h @ p["W"]) * 0.0)

        stages[0] = Stage(sqrt_at_zero)
    pipe = Pipeline(
        stages, generate("1f1b", ranks=3, microbatches=4), loss_fn=mse, check_finite=True
    )
    with pytest.raises(NonFiniteError, match=f"stage {stage}") as info:
        pipe.step(params, x, y)
    assert what in str(info.value)
    if where == "forward":
        assert info.value.microbatch == 2
    if where == "loss":
        assert info.value.microbatch == 1


def test_check_finite_is_on_in_debug_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    stages, _params = toy(2)
    program = generate("1f1b", ranks=2, microbatches=2)
    monkeypatch.setenv("FUNCPIPE_DEBUG", "1")
    assert Pipeline(stages, program, loss_fn=mse).check_finite
    monkeypatch.setenv("FUNCPIPE_DEBUG", "0")
    assert not Pipeline(stages, program, loss_fn=mse).check_finite


def _record_instructions(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[str]]:
    """Patch the interpreter's per-instruction methods to record, per rank, every instruction
    it executes (a SEND or RECV when its group is posted)."""
    from funcpipe.runtime import interpreter

    ran: dict[int, list[str]] = {}
    for name in (
        "forward",
        "backward",
        "backward_input",
        "backward_weight",
        "recompute",
        "post",
        "reduce",
    ):
        real = getattr(interpreter._Rank, name)

        def patched(self, i, _real=real):  # type: ignore[no-untyped-def]
            group = i if isinstance(i, list) else [i]
            ran.setdefault(self.x.rank, []).extend(str(k) for k in group)
            return _real(self, i)

        monkeypatch.setattr(interpreter._Rank, name, patched)
    return ran


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zbv", "dualpipev", "chimera"])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_what_runs_is_what_the_program_says(
    monkeypatch: pytest.MonkeyPatch, name: str, recompute: bool
) -> None:
    """Every rank executes exactly its instruction list, in order (no weight gradient moved,
    no instruction added or dropped), and a traced step runs the same sequence as an untraced
    one; both give the reference gradients."""
    ran = _record_instructions(monkeypatch)
    program = generate(name, ranks=2, microbatches=4)
    stages, params = toy(len(set(program.replica_of or range(program.n_stages))))
    x, y = data(8)
    pipe = Pipeline(stages, program, loss_fn=mse, recompute=recompute)
    ref = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    plain = pipe.step(params, x, y)
    untraced = {r: list(v) for r, v in ran.items()}
    ran.clear()
    traced = pipe.step(params, x, y, trace=True)
    assert untraced == ran
    want = {r: [str(i) for i in instrs] for r, instrs in enumerate(pipe.program.ranks)}
    assert untraced == {r: v for r, v in want.items() if v}
    assert_trees_close((plain.loss, plain.grads), ref)
    assert_trees_close((traced.loss, traced.grads), ref)
    assert [len(r) for r in traced.timeline.events] == [len(r) for r in pipe.program.ranks]


def test_nan_in_a_parameter_gradient_is_reported() -> None:
    """A NaN that appears only in a parameter gradient is found and named."""
    from funcpipe.errors import NonFiniteError

    stages, params = toy(3)
    x, y = data(8)

    def nan_bias_grad(p, h):  # type: ignore[no-untyped-def]
        # finite forward and input gradient; d/db sqrt(0 * b) = inf * 0 = NaN
        return torch.tanh(h @ p["W"] + p["b"]) + torch.sqrt(p["b"] * 0.0)

    stages[1] = Stage(nan_bias_grad)
    pipe = Pipeline(
        stages, generate("1f1b", ranks=3, microbatches=4), loss_fn=mse, check_finite=True
    )
    with pytest.raises(NonFiniteError, match="stage 1") as info:
        pipe.step(params, x, y)
    assert "parameter gradient" in str(info.value)


# ----------------------------------------------------------------------------- NCCL's rules
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("ranks", [2, 3, 4, 8])
def test_every_schedule_runs_under_nccl_rules(
    monkeypatch: pytest.MonkeyPatch, name: str, ranks: int
) -> None:
    """The strict transport (FUNCPIPE_STRICT_P2P=1: NCCL's rules on the pair layout, one FIFO
    stream per pair of ranks for both directions, sends complete only at rendezvous, a group's
    messages to one peer complete as one) runs every schedule's lowered program to the reference
    gradients: the lowering is NCCL-correct on funcpipe's communicators. (Under one stream per
    rank, one communicator for all, the lowered interleaved and looped BFS programs hang at 3,
    4 and 8 ranks: issue 32.)"""
    monkeypatch.setenv("FUNCPIPE_STRICT_P2P", "1")
    for m in sorted({ranks, 2 * ranks + 1}) if ranks < 8 else [ranks]:
        run_pipeline_vs_reference(0, name, ranks, m, [13, 9], recompute=m > ranks, tied=True)


def test_one_by_one_posting_deadlocks_under_nccl_rules_and_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """1F1B with every SEND and RECV posted on its own (the lowering before groups) passes the
    gloo rules and runs over gloo, but would hang under NCCL: the strict transport stops it with
    an error naming the ranks and the sends that wait for each other; grouped, it runs."""
    from funcpipe.errors import CommunicationError
    from funcpipe.schedule import check

    stages, params = toy(2)
    x, y = data(8)
    grouped = Pipeline(stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=mse).program
    one_by_one = one_by_one_1f1b()  # the lowering before groups, one op at a time

    check(one_by_one)  # fine under gloo's buffered sends
    with pytest.raises(fp.ScheduleError, match="r0-r1"):
        check(one_by_one, p2p="nccl")
    ref = fp.reference_step(stages, params, x, mse, targets=y, microbatches=4)
    got = Pipeline(stages, one_by_one, loss_fn=mse).step(params, x, y)
    assert_trees_close((got.loss, got.grads), ref)
    monkeypatch.setenv("FUNCPIPE_STRICT_P2P", "1")
    with pytest.raises(CommunicationError, match=r"rank 0.*SEND.*rank 1|rank 1.*SEND.*rank 0"):
        Pipeline(stages, one_by_one, loss_fn=mse).step(params, x, y)
    got = Pipeline(stages, grouped, loss_fn=mse).step(params, x, y)
    assert_trees_close((got.loss, got.grads), ref)


class _Boom(torch.autograd.Function):
    """The identity whose backward raises (a stage failing in a paired backward)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom in a backward")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_half_of_a_pair_that_raises_is_reported_after_both_end(where: str) -> None:
    program = generate("1f1b", ranks=2, microbatches=4, overlap=True)
    stages, params = toy(2)
    inner = stages[0].fn

    from torch._subclasses.fake_tensor import is_fake

    assert pairs(program.ranks[0])[0] == (1, 2)  # F s0 m1 & B s0 m0
    real = []

    def failing(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        if not (h.is_meta or is_fake(h)):
            real.append(1)
            if where == "forward" and len(real) == 2:  # F s0 m1: the pair's first half
                raise RuntimeError("boom in a forward")
        out = inner(p, h)
        return _Boom.apply(out) if where == "backward" else out

    stages[0] = Stage(failing, name="failing")
    x, y = data(8)
    with pytest.raises(RuntimeError, match=f"boom in a {where}") as e:
        Pipeline(stages, program, loss_fn=mse).step(params, x, y)
    if where == "backward":
        notes = " ".join(getattr(e.value, "__notes__", []))
        assert "backward (B) of stage 0" in notes and "microbatch 0" in notes
        assert "overlapped with 'F s0 m1'" in notes


@pytest.mark.parametrize("path", ["I", "W"])
def test_a_split_backward_that_raises_names_its_stage_microbatch_and_rank(path: str) -> None:
    """An error raised in an I (through the stage's input) or in a W (through one of its
    parameters only: the I never runs it) is noted with which backward, stage, microbatch and
    rank it was."""
    from funcpipe.schedule.passes import split_backward

    program = split_backward(generate("1f1b", ranks=2, microbatches=2))
    stages, params = toy(2)
    inner = stages[1].fn
    leaf = next(iter(params[1]))

    def failing(p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        if path == "W":
            return inner({**p, leaf: _Boom.apply(p[leaf])}, h)
        return inner(p, _Boom.apply(h))

    stages[1] = Stage(failing, name="failing")
    x, y = data(4)
    with pytest.raises(RuntimeError, match="boom in a backward") as e:
        Pipeline(stages, program, loss_fn=mse).step(params, x, y)
    notes = " ".join(getattr(e.value, "__notes__", []))
    assert f"backward ({path}) of stage 1 ('failing'), microbatch 0, rank 1" in notes, notes
