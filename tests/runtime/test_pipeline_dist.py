"""The same programs over real gloo processes (a pool started once per session)."""

from __future__ import annotations

import time

import pytest

from funcpipe.errors import RankFailed
from tests import jobs_resources, jobs_runtime

NAMES = jobs_runtime.TRAINING  # every training schedule of the registry (GENERATORS)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_on_two_gloo_ranks(pool, name: str, recompute: bool) -> None:
    worst = pool(2).run(
        jobs_runtime.run_pipeline_vs_reference,
        name,
        2,
        5,
        [11, 6, 11],  # uneven microbatches; the batch size changes between steps
        tied=True,
        recompute=recompute,
    )
    assert max(worst) < 1e-10


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zb-h1", "zbv", "dualpipev", "chimera"])
def test_main_schedules_on_four_gloo_ranks(pool, name: str) -> None:
    worst = pool(4).run(jobs_runtime.run_pipeline_vs_reference, name, 4, 8, [16, 9], tied=True)
    assert max(worst) < 1e-10


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", NAMES)
def test_every_schedule_under_nccl_rules_over_gloo(pool, name: str) -> None:
    """FUNCPIPE_STRICT_P2P=1: the transport enforces NCCL's point-to-point rules between the
    processes (rendezvous sends, one queue per pair, groups complete as one)."""
    worst = pool(2).run(
        jobs_runtime.run_pipeline_vs_reference, name, 2, 5, [11, 6], tied=True, strict=True
    )
    assert max(worst) < 1e-10


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["dualpipev", "zbv", "1f1b"])
def test_overlapped_pairs_under_nccl_rules_over_gloo(pool, name: str) -> None:
    worst = pool(4).run(
        jobs_runtime.run_pipeline_vs_reference,
        name,
        4,
        8,
        [16, 9],
        tied=True,
        strict=True,
        overlap=True,
        recompute=name == "zbv",
    )
    assert max(worst) < 1e-10


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["1f1b", "zbv"])
def test_four_ranks_under_nccl_rules_over_gloo(pool, name: str) -> None:
    worst = pool(4).run(
        jobs_runtime.run_pipeline_vs_reference, name, 4, 8, [16, 9], tied=True, strict=True
    )
    assert max(worst) < 1e-10


@pytest.mark.timeout(180)
def test_data_parallel_over_gloo(pool) -> None:
    """Four processes, a 2-rank program: two data-parallel copies averaging their gradients."""
    worst = pool(4).run(jobs_runtime.data_parallel_vs_reference, "1f1b", 2, 2)
    assert max(worst) < 1e-10


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_rank_that_raises_is_named_by_everyone(pool, where: str) -> None:
    p = pool(2)
    p.run(jobs_resources.ready)  # started before the clock: a pool's start is not what is timed
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1") as info:
        p.run(jobs_runtime.raise_in_step, 1, where)
    assert info.value.rank == 1
    assert "injected failure" in str(info.value)
    assert time.monotonic() - start < 30


@pytest.mark.timeout(120)
def test_trace_over_gloo_is_the_same_on_every_rank(pool) -> None:
    (a, b) = pool(2).run(jobs_runtime.traced_step)
    assert a == b and a[0] > 0 and 0 <= a[1] < 1


@pytest.mark.timeout(120)
def test_an_auto_program_under_a_byte_limit_keeps_to_it(pool) -> None:
    """Searched with auto(max_memory=..., memory=measure_memory(...)), run over gloo: the loss
    and every gradient match the single-device reference (checked in the job), and each
    rank's saved bytes in the step are what peak_memory says, within the limit."""
    for measured, figure, cap in pool(2).run(jobs_runtime.auto_bytes_step):
        assert 0 < measured == figure <= cap


@pytest.mark.timeout(120)
def test_value_dependent_shapes_inferred_differently_are_refused_on_every_rank(pool) -> None:
    r0, r1 = pool(2).run(jobs_runtime.value_dependent_width, False)
    for got in (r0, r1):
        assert "inferred different outputs for stage 0 ('narrow')" in got, got
    assert "f64[2, 4]" in r0 and "f64[2, 0]" in r1
    # where every process holds the parameters the inference agrees and the step runs
    assert pool(2).run(jobs_runtime.value_dependent_width, True) == ["ok", "ok"]


@pytest.mark.timeout(120)
def test_shape_inference_failing_on_one_rank_stops_every_rank(pool) -> None:
    r0, r1 = pool(2).run(jobs_runtime.inference_fails_on_one_rank)
    assert r1.startswith("ShapeInferenceError: stage 0 ('broken')"), r1
    assert "shape inference failed on process(es) [1]" in r0, r0


# ------------------------------------------------------------------ issue 42: ranks that disagree
@pytest.mark.timeout(120)
def test_batches_of_different_sizes_are_named_not_blamed_on_a_stage(pool) -> None:
    """Rank 0 has 8 samples, rank 1 has 6, at the first step: every rank names both processes
    and both batches (it blamed a stage whose "output shapes depend on values")."""
    r0, r1 = pool(2).run(jobs_runtime.batches_per_rank, [[(8,), (6,)]], timeout=60)
    for got in (r0, r1):
        assert got.startswith("InvalidArgument: the processes were given batches"), got
        assert "process 0 has batch f64[8, 6]" in got and "process 1 has batch f64[6, 6]" in got
        assert "depend on values" not in got


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("first", "theirs"),
    [((8,), (6,)), ((8, 16), (8, 12))],
    ids=["batch-size", "sequence-length"],
)
def test_a_batch_that_changes_on_one_rank_fails_within_seconds(
    pool, first: tuple[int, ...], theirs: tuple[int, ...]
) -> None:
    """Both ranks step one shape, then rank 1 alone another: it used to enter the shape
    agreement alone and both waited until the job's deadline."""
    p = pool(2)
    p.run(jobs_resources.ready)  # started before the clock
    start = time.monotonic()
    steps = [[first, first], [first, theirs]]
    r0, r1 = p.run(jobs_runtime.batches_per_rank, steps, timeout=30)
    assert time.monotonic() - start < 15
    want = f"process 1 has batch f64[{', '.join(map(str, (*theirs, 6)))}]"
    for got in (r0, r1):
        assert "the processes were given batches" in got and want in got, got


@pytest.mark.timeout(120)
def test_tied_copies_that_differ_across_processes_are_refused(pool) -> None:
    """Each rank seeded its own tied copy: refused at the first step on every rank, naming both
    copies' processes (it trained each rank's own value); equal copies give the reference."""
    p = pool(2)
    for got in p.run(jobs_runtime.tied_copies_per_rank, [0, 1], timeout=60):
        assert got.startswith("InvalidArgument: ties['E']: the tied copies hold different"), got
        assert "stage 0 'E' on process 0 and stage 1 'E' on process 1" in got, got
    assert p.run(jobs_runtime.tied_copies_per_rank, [0, 0], timeout=60) == ["ok", "ok"]
