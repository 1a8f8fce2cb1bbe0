"""Expert parallelism in the Pipeline: the experts of residual MoE stages split over the
data-parallel copies (``ParallelConfig(expert=2)``), expert gradients summed over the copies
holding the same experts and dense ones over all, under every schedule generator at pipeline 2
x expert 2 (4 processes) and pipeline 2 x expert 2 x 2 copies of each expert (8 processes),
under the strict (NCCL-rules) transport: loss and every gradient equal the same stages with
every expert on one device, in float64."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import jobs_experts as J
from tests.parallel.strategies import scaled

EVERY = ("gpipe", "1f1b", "interleaved", "looped-bfs", "zb-h1", "zb-h2", "zbv", "dualpipev",
         "chimera")  # fmt: skip
# float64, relative to the largest value of each leaf compared. Not 1e-12: a drawn routing (top-1
# with a shared expert, sigmoid scores, seed 248, under interleaved) grows the residual stream
# until the loss is 1.1e8, and a dense leaf's sums cancel down to 3.7e-12 of its largest value
# (the order of summation differs across processes); a wrong route or sum is off by O(1)
TOL = 1e-10


def _check(results: list[list[dict[str, Any]]], names: tuple[str, ...]) -> None:
    for rank, rows in enumerate(results):
        assert [r["name"] for r in rows] == list(names)
        for row in rows:
            assert row["held"], f"process {rank} held no stage under {row['name']}"
            for kind, diff in row["worst"].items():
                assert diff < TOL, f"{row['name']}: process {rank}'s {kind} differ by {diff}"


@pytest.mark.timeout(300)
def test_every_schedule_at_pipeline_2_expert_2_equals_one_device(pool: Any) -> None:
    _check(pool(4).run(J.expert_pipelines_vs_one_device, EVERY), EVERY)


@pytest.mark.timeout(300)
def test_recomputation_with_experts_split_equals_one_device(pool: Any) -> None:
    names = ("1f1b", "zbv")
    _check(pool(4).run(J.expert_pipelines_vs_one_device, names, recompute=True), names)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_overlapped_pairs_with_experts_split_equal_one_device(pool: Any, recompute: bool) -> None:
    """Each pair's forward on the process's thread, its backward on a second one, both calling
    the expert all-to-all on one process group, taking turns at each (and on every process
    with pairs, the turn changed hands)."""
    names = ("dualpipev", "zbv", "1f1b")
    got = pool(4).run(
        J.expert_pipelines_vs_one_device, names, microbatches=6, overlap=True, recompute=recompute
    )
    _check(got, names)


@pytest.mark.timeout(300)
def test_pairs_over_stages_that_checkpoint_their_dropout_equal_one_device(pool: Any) -> None:
    """Each block under torch.utils.checkpoint with dropout: a paired backward recomputes the
    block, its all-to-alls and its masks, and the turn changes hands inside the recomputation;
    each half keeps its own generator state across the other's turns, so the masks, the loss
    and every gradient are the one-device step's (seeded)."""
    names = ("dualpipev", "1f1b")
    got = pool(4).run(
        J.expert_pipelines_vs_one_device, names, microbatches=6, overlap=True, dropout=0.3
    )
    _check(got, names)


@pytest.mark.timeout(300)
def test_a_traced_step_shows_one_halfs_all_to_all_under_the_other(pool: Any) -> None:
    """The executed timeline's spans: every all-to-all and split-size exchange the stages
    called; in every pair the backward's first all-to-all was in flight while the forward ran
    (the halves take turns at their collectives, the backward first: funcpipe.runtime.turns),
    and in some the forward's while the backward ran (not in all: the backward of the first
    stage, whose input needs no gradient, calls one all-to-all and ends before the forward's)."""
    results = pool(4).run(J.traced_pairs)
    for got in results:
        assert got["pairs"] > 0, got
        assert {"all_to_all expert (forward)", "all_to_all expert (backward)"} <= set(got["names"])
        assert "split sizes expert (forward)" in got["names"]
        assert got["inside"]["backward"] == got["pairs"], got
        assert got["inside"]["forward"] > 0, got


@pytest.mark.timeout(300)
def test_the_gpt_with_experts_in_overlapped_pairs_equals_one_device(pool: Any) -> None:
    names = ("dualpipev", "zbv")
    _check(pool(4).run(J.gpt_with_experts_vs_one_device, names, 6, True), names)


@pytest.mark.timeout(300)
def test_two_copies_of_each_expert_over_eight_processes_equal_one_device(pool: Any) -> None:
    """pipeline 2 x expert 2 x 2 copies of each expert: the expert gradients are summed over
    the copies holding the same experts (a group of their own), the dense ones over all 4."""
    names = ("1f1b", "zbv")
    _check(pool(8).run(J.expert_pipelines_vs_one_device, names), names)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_schedule_over_eight_processes_equals_one_device(pool: Any) -> None:
    _check(pool(8).run(J.expert_pipelines_vs_one_device, EVERY), EVERY)


@pytest.mark.timeout(300)
def test_the_gpt_with_experts_split_equals_one_device(pool: Any) -> None:
    """GPTConfig(experts=4): the MoE blocks' experts over the expert axis, the auxiliary loss
    in the loss, ties, the embedding and the head: every gradient leaf as on one device."""
    names = ("1f1b", "zbv", "interleaved")
    _check(pool(4).run(J.gpt_with_experts_vs_one_device, names), names)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("layout", "scatter_gather"),
    [
        ({"pipeline": 2, "tensor": 2}, False),
        ({"pipeline": 2, "tensor": 2}, True),
        ({"pipeline": 1, "tensor": 2, "expert": 2}, False),
    ],
    ids=["pipeline2-tensor2", "pipeline2-tensor2-scatter-gather", "tensor2-expert2"],
)
def test_the_gpt_with_experts_split_over_tensor_ranks_equals_one_device(
    pool: Any, layout: dict[str, int], scatter_gather: bool
) -> None:
    """Each expert's width (and the shared expert's) split over 2 tensor ranks, the experts
    whole (pipeline 2 x tensor 2; also with each tensor rank sending its slice of the stage
    boundary) or split over 2 expert ranks (tensor 2 x expert 2, one stage): loss and every
    gradient leaf, router included, equal one device in float64; each tensor rank holds half
    of every expert's width (expert_ffn 32: 16 rows of w_out)."""
    names = ("gpipe", "1f1b", "zbv") if layout["pipeline"] == 2 else ("gpipe", "1f1b")
    got = pool(4).run(
        J.gpt_with_experts_vs_one_device, names, 2, False, layout, None, scatter_gather
    )
    _check(got, names)
    assert sorted(rows[0]["held"][0] for rows in got) == [0, 0, 1, 1]
    assert {rows[0]["held"][1] for rows in got} == {16}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("layout", "experts_held"),
    [({"pipeline": 2, "tensor": 2}, 2), ({"pipeline": 1, "tensor": 2, "expert": 2}, 1)],
    ids=["pipeline2-tensor2", "tensor2-expert2"],
)
def test_the_gpt_with_its_moe_tokens_split_over_tensor_ranks_equals_one_device(
    pool: Any, layout: dict[str, int], experts_held: int
) -> None:
    """GPTConfig(moe_tensor="tokens"): each tensor rank routes its half of the tokens, the 4
    experts spread over the expert x tensor ranks (2 each over tensor 2, 1 each over tensor 2
    x expert 2), the shared expert's width over tensor: loss and every gradient leaf, the
    router's included, equal one device in float64."""
    names = ("gpipe", "1f1b", "zbv") if layout["pipeline"] == 2 else ("gpipe", "1f1b")
    model = {"moe_tensor": "tokens"}
    got = pool(4).run(J.gpt_with_experts_vs_one_device, names, 2, False, layout, model)
    _check(got, names)
    assert {rows[0]["held"][1] for rows in got} == {experts_held}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("split", "held"), [("width", 16), ("tokens", 1)])
def test_the_gpt_with_experts_over_pipeline_tensor_and_expert_ranks_equals_one_device(
    pool: Any, split: str, held: int
) -> None:
    """Pipeline 2 x tensor 2 x expert 2 (8 processes): the experts split over the expert ranks
    and their width over the tensor ranks at once (each holds 16 of the 32 rows of its 2
    experts' w_out), or the tokens split over the tensor ranks and the 4 experts over the 4
    expert x tensor ranks (one each)."""
    names = ("1f1b", "zbv")
    layout = {"pipeline": 2, "tensor": 2, "expert": 2}
    got = pool(8).run(
        J.gpt_with_experts_vs_one_device, names, 2, False, layout, {"moe_tensor": split}
    )
    _check(got, names)
    assert {rows[0]["held"][1] for rows in got} == {held}


@pytest.mark.timeout(300)
@settings(max_examples=scaled(3), deadline=None)
@given(
    top_k=st.integers(1, 4),
    shared=st.integers(0, 1),
    seed=st.integers(0, 10_000),
    name=st.sampled_from(["gpipe", "1f1b"]),
)
def test_drawn_gpts_over_tensor_2_expert_2_equal_one_device(
    pool: Any, top_k: int, shared: int, seed: int, name: str
) -> None:
    """Hypothesis draws the routing (top-1 to top-4 of 4 experts, a shared expert or none, the
    weights' seed): with each expert's width over 2 tensor ranks and the experts over 2 expert
    ranks, loss and every gradient leaf equal one device in float64."""
    model = {"top_k": top_k, "shared_experts": shared, "seed": seed}
    got = pool(4).run(
        J.gpt_with_experts_vs_one_device, (name,), 2, False, {"tensor": 2, "expert": 2}, model
    )
    _check(got, (name,))


@pytest.mark.timeout(300)
def test_checkpoints_reshard_the_experts(pool: Any, tmp_path: Any) -> None:
    """Saved at pipeline 2 x expert 2 (each process 2 of the 4 experts of its stage's
    blocks), loaded at expert 1 (every expert), at expert 4 (one each: a data axis of 4) and
    at pipeline 2 x expert 1: each process gets exactly its block of every saved tensor, and
    the optimizer state with it."""
    loads = [{"pipeline": 1, "expert": 1}, {"pipeline": 1, "expert": 4},
             {"pipeline": 2, "expert": 1}, {"pipeline": 2, "expert": 2}]  # fmt: skip
    got = pool(4).run(
        J.reshard_experts, str(tmp_path / "ckpt"), {"pipeline": 2, "expert": 2}, loads
    )
    assert all(d == 0.0 for per in got for d in per), got


@pytest.mark.timeout(300)
def test_the_step_returns_each_blocks_counts_summed_over_copies(pool: Any) -> None:
    """With the experts split over 2 copies and a routing bias: each process's tallies are the
    counts of its stage's blocks over the whole batch (both copies, every microbatch), as the
    same model counts them on one device."""
    from funcpipe.models import gpt
    from funcpipe.stages.tally import collecting

    got = pool(4).run(J.gpt_tallies_over_processes)
    cfg = J.TALLY_CFG
    x, _, bias = J.tally_batch()
    full = gpt.init(cfg, seed=5, dtype=J.F64)
    fn = gpt.stages(cfg, 1, axis=gpt.single_axis())[0]
    counts: dict[str, Any] = {}
    with collecting(counts):  # (the one-device model's own counts, with the bias)
        fn(gpt.split(full, cfg, 1)[0], x, route_bias=bias)
    want = {k: v.tolist() for k, v in counts.items()}
    assert sorted(want) == [f"blocks.{i}.moe.counts" for i in range(3)]
    held = [["blocks.0.moe.counts", "blocks.1.moe.counts"], ["blocks.2.moe.counts"]]
    for rank, tallies in enumerate(got):  # world rank: (pipe rank * 2 + copy)
        assert sorted(tallies) == held[rank // 2]
        assert tallies == {k: want[k] for k in tallies}


@pytest.mark.timeout(300)
def test_the_batch_switch_loss_over_processes_equals_one_device(pool: Any) -> None:
    """The auxiliary loss of the whole batch (both copies' tokens) at pipeline 2 x expert 2:
    a counting pass over the processes, then the step; loss and every gradient as the one
    device's cross-entropy + 0.01 x the batch's Switch loss, under 1F1B, ZB-V and DualPipeV
    (whose backwards run before later forwards)."""
    names = ("1f1b", "zbv", "dualpipev")
    _check(pool(4).run(J.gpt_batch_aux_over_processes, names), names)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("zero", [1, 2])
def test_zero_with_experts_split_equals_one_device(pool: Any, zero: int) -> None:
    """ZeRO-1 and -2 with the experts split over 2 of 4 copies (8 processes): the dense leaves
    cut over the 4 copies, the expert leaves over the 2 copies holding the same experts;
    the gathered gradients equal one device's."""
    names = ("1f1b", "zbv")
    _check(pool(8).run(J.expert_pipelines_vs_one_device, names, zero=zero), names)


@pytest.mark.timeout(300)
def test_zero_with_each_expert_on_one_copy_equals_one_device(pool: Any) -> None:
    """expert = data = 2: an expert leaf is held whole by one copy (a piece of one)."""
    names = ("1f1b",)
    _check(pool(4).run(J.expert_pipelines_vs_one_device, names, zero=1), names)


@st.composite
def _routings(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    return draw(st.sampled_from(EVERY)), {
        "top_k": draw(st.integers(1, 4)),
        "shared": draw(st.integers(0, 1)),
        "score": draw(st.sampled_from(["softmax", "sigmoid"])),
        "seed": draw(st.integers(0, 10**6)),
    }


@pytest.mark.timeout(300)
@settings(max_examples=scaled(3), deadline=None)
@given(st.lists(_routings(), min_size=2, max_size=3))
def test_drawn_routings_at_pipeline_2_expert_2_equal_one_device(
    pool: Any, drawn: list[tuple[str, dict[str, Any]]]
) -> None:
    """Routings hypothesis draws (top-k 1 to 4 of 4 experts, shared experts, softmax or sigmoid
    scores, weights and tokens from a drawn seed: experts left empty or overfull), each under a
    drawn schedule, at pipeline 2 x expert 2 under the strict transport."""
    names = tuple(name for name, _ in drawn)
    got = pool(4).run(J.expert_pipelines_vs_one_device, names, routing=[r for _, r in drawn])
    _check(got, names)


@pytest.mark.timeout(300)
def test_tallies_sum_over_chimeras_replicas_with_one_copy(pool: Any) -> None:
    """Chimera over 2 processes, one copy: each process's tallies are both model stages' over
    every microbatch (its own replica's and the other's)."""
    got = pool(2).run(J.tallies_of_programs, ("chimera",))
    for rank in range(2):
        for j in range(2):  # the step and the evaluation
            assert got[rank][j]["rows"] == [16 * 2, 4 * 2], (rank, j, got[rank][j])


@pytest.mark.timeout(300)
def test_tallies_sum_over_copies_and_chimeras_replicas(pool: Any) -> None:
    """A step's tallies over 2 ranks x 2 copies equal the in-process step's over the whole
    batch: summed over the copies, and under Chimera over the two replica ranks of each model
    stage too (training and evaluation programs)."""
    import torch

    import funcpipe as fp
    from funcpipe.schedule import generate
    from funcpipe.schedule.generators import to_eval

    names = ("1f1b", "chimera")
    got = pool(4).run(J.tallies_of_programs, names)
    x = torch.randn(16, 3, dtype=J.F64, generator=torch.Generator().manual_seed(3))
    for k, name in enumerate(names):
        program = generate(name, ranks=2, microbatches=4)
        n = len(set(program.replica_of or range(program.n_stages)))
        stages = [fp.Stage(J._rows_tallied) for _ in range(n)]
        params = tuple({"w": torch.eye(3, dtype=J.F64) * (1 + s)} for s in range(n))
        for j, prog in enumerate((program, to_eval(program))):
            pipe = fp.Pipeline(stages, prog, loss_fn=lambda o: o.sum(), data=2)
            want = {t: v.tolist() for t, v in pipe.step(params, x).tallies.items()}
            assert want["rows"] == [16 * n, 8 * n]  # (2 copies x 4 microbatches x n stages)
            for rank in range(4):  # every process: each of its stages' sums, n stages here
                mine = got[rank][2 * k + j]
                stages_here = 1 if name == "1f1b" else 2  # (Chimera: each rank holds both)
                assert mine["rows"] == [16 * stages_here, 8 * stages_here], (name, rank, mine)
                if name == "chimera":  # each process: both model stages, every microbatch
                    assert mine["rows"] == want["rows"], (name, rank)
                    assert mine["sum"] == pytest.approx(want["sum"], rel=1e-12), (name, rank)
