"""The demo's GPT: pipeline x tensor and pipeline x data against the single-device reference."""

from __future__ import annotations

import pytest
import torch

from funcpipe.errors import InvalidArgument
from funcpipe.models import gpt
from funcpipe.parallel.mesh import Place
from funcpipe.parallel.sharding import gather_tree
from funcpipe.testing import assert_trees_close
from tests import jobs_gpt


def _check(results: list[dict], schedule: str, pipeline: int, steps: int) -> None:
    ref_losses, ref_grads = jobs_gpt.reference(steps, schedule, pipeline)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-10, abs=1e-10)
    assert ref_losses[-1] < ref_losses[0]  # and it learns
    n = len(ref_grads)
    lay = gpt.shardings(jobs_gpt.CFG, n)
    for s in range(n):
        holders = [r for r in results if s in r["stages"] and r["place"].coords["data"] == 0]
        # the shardings name only the tensor axis: gather over it alone
        places = [
            Place(
                k, {"tensor": r["place"].coords["tensor"]}, {"tensor": r["place"].sizes["tensor"]}
            )
            for k, r in enumerate(holders)
        ]
        got = gather_tree([r["grads"][s] for r in holders], lay[s], places)
        expected = ref_grads[s]
        if n > 1 and "wte" in expected:  # tied: the pipeline returns the sum on both ends
            total = ref_grads[0]["wte"]
            expected = {**expected, "wte": total}
        assert_trees_close(got, expected, rtol=1e-9, atol=1e-10)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("pipeline", "tensor", "schedule"),
    [(2, 2, "1f1b"), (1, 4, "1f1b"), (2, 1, "1f1b"), (2, 1, "zbv")],
)
def test_gpt_matches_the_single_device_reference(
    pool, pipeline: int, tensor: int, schedule: str
) -> None:
    results = pool(4).run(jobs_gpt.pipeline_step, pipeline, tensor, schedule, 3)
    _check(results, schedule, pipeline, 3)


def test_gpt_config_errors() -> None:
    with pytest.raises(ValueError, match="divisible by heads"):
        gpt.GPTConfig(d_model=10, heads=4)
    with pytest.raises(ValueError, match="tensor-parallel size 3"):
        gpt.GPTConfig().check_tensor(3)
    with pytest.raises(ValueError, match="some stage would be empty"):
        gpt.blocks_per_stage(gpt.GPTConfig(layers=2), 5)


def test_blocks_spread_evenly_middle_first() -> None:
    cfg = gpt.GPTConfig(layers=5)
    assert [len(r) for r in gpt.blocks_per_stage(cfg, 4)] == [1, 2, 1, 1]
    assert [len(r) for r in gpt.blocks_per_stage(cfg, 1)] == [5]
    full = gpt.init(cfg, seed=0)
    logits = gpt.full_forward(full, cfg, torch.randint(0, 256, (2, 7)))
    assert logits.shape == (2, 7, 256)


@pytest.mark.timeout(240)
def test_blocks_given_per_stage() -> None:
    cfg = gpt.GPTConfig(layers=7)
    assert gpt.blocks_per_stage(cfg, 3, (1, 0, 6)) == [range(0, 1), range(1, 1), range(1, 7)]
    stages = gpt.split(gpt.init(cfg), cfg, 2, blocks=(1, 6))
    assert list(stages[0]["blocks"]) == ["0"] and list(stages[1]["blocks"]) == [
        str(i) for i in range(1, 7)
    ]
    assert gpt.stages(cfg, 3, axis=gpt.single_axis(), blocks=(1, 0, 6))[1].name.endswith(
        "no blocks"
    )
    for bad in ((1, 5), (1, 6, 0), (-1, 8), [1.0, 6.0]):
        with pytest.raises(InvalidArgument, match=r"blocks=.*add up to layers=7"):
            gpt.split(gpt.init(cfg), cfg, 2, blocks=bad)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scatter_gather", [False, True], ids=["whole", "scatter-gather"])
def test_tensor_parallel_stages_in_overlapped_pairs_match(pool, scatter_gather: bool) -> None:
    """Pipeline 2 x tensor 2, DualPipeV with pairs (on rank 1 a forward whose input is a
    RECV, paired with a backward): each half's tensor-parallel all-reduces are its
    waiting points, the halves taking turns at them on the one tensor group (the turn changed
    hands on the ranks with pairs); with scatter-gather, waiting for the forward's message
    all-gathers it over that group, in the forward's turn. (When that wait ran on the rank's
    thread outside the turns, beside the backward's all-reduces on the same group, this hung
    2 times in 3.)"""
    results = pool(4).run(jobs_gpt.pipeline_step, 2, 2, "dualpipev", 2, scatter_gather, True)
    _check(results, "dualpipev", 2, 2)
    assert any(r["handovers"] > 0 for r in results), [r["handovers"] for r in results]


def test_scatter_gather_sends_a_tensor_share_and_matches(pool) -> None:
    """Pipeline 2 x tensor 2: each tensor rank sends half of every boundary tensor."""
    whole = pool(4).run(jobs_gpt.pipeline_step, 2, 2, "1f1b", 2, False)
    split = pool(4).run(jobs_gpt.pipeline_step, 2, 2, "1f1b", 2, True)
    _check(split, "1f1b", 2, 2)
    for a, b in zip(whole, split, strict=True):
        assert a["bytes_sent"] > 0 and b["bytes_sent"] * 2 == a["bytes_sent"]


def test_init_lands_on_the_asked_device_with_the_same_tree() -> None:
    """``device="meta"`` stands in for a GPU: every leaf is there, with the CPU init's shapes and
    dtypes; the CPU init is the same on every call (every rank draws the same params)."""
    from funcpipe.errors import InvalidArgument
    from funcpipe.tree import tree_leaves, tree_structure

    cfg = gpt.GPTConfig(layers=3, d_model=32, heads=4, context=20)
    cpu = gpt.init(cfg, seed=5, dtype=torch.bfloat16)
    meta = gpt.init(cfg, seed=5, dtype=torch.bfloat16, device="meta")
    assert tree_structure(meta) == tree_structure(cpu)
    for a, b in zip(tree_leaves(meta), tree_leaves(cpu), strict=True):
        assert a.device.type == "meta" and b.device.type == "cpu"
        assert a.shape == b.shape and a.dtype == b.dtype == torch.bfloat16
    assert_trees_close(gpt.init(cfg, seed=5, dtype=torch.bfloat16), cpu, rtol=0, atol=0)
    on = gpt.init(cfg, seed=5, device=torch.device("cpu"))
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tree_leaves(on))
    with pytest.raises(InvalidArgument, match="device='nowhere'"):
        gpt.init(cfg, device="nowhere")
    with pytest.raises(InvalidArgument, match="dtype=torch.int64"):
        gpt.init(cfg, dtype=torch.int64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_init_on_cuda_is_the_cpu_init_moved() -> None:
    from funcpipe.tree import tree_leaves

    cfg = gpt.GPTConfig(layers=2, d_model=32, heads=4, context=16)
    gpu, cpu = gpt.init(cfg, seed=1, device="cuda"), gpt.init(cfg, seed=1)
    for a, b in zip(tree_leaves(gpu), tree_leaves(cpu), strict=True):
        assert a.device.type == "cuda" and torch.equal(a.cpu(), b)
