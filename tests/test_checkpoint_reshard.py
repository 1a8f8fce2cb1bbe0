"""A checkpoint of the GPT saved at pipeline 2 x tensor 2 x data 1 (two AdamW steps, float64)
loads at other layouts, and the next step's loss, params and optimizer state equal the saved
run's own continuation (no save and load) to 1e-12. So does one saved at pipeline 2 x data 2
with sharded optimizer state (ZeRO-1), resumed over another number of processes and shards."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from funcpipe.train import checkpoint
from funcpipe.train.checkpoint_regions import Region, assemble
from tests import jobs_reshard

Pieces = dict[str, list[tuple[Region, torch.Tensor]]]


@pytest.fixture(scope="module")
def saved(pool: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """The run at pipeline 2 x tensor 2: saved after step 2, then its own step 3."""
    path = str(tmp_path_factory.mktemp("reshard") / "ck")
    return path, pool(4).run(jobs_reshard.run, 2, 2, "1f1b", path, True)


def _pieces(results: list[dict]) -> Pieces:
    """Every tensor's pieces, by name, over the ranks of a run."""
    out: Pieces = {}
    for r in results:
        for key, t in r["pieces"].items():
            name, at, text = key.rpartition("@")
            if at:
                out.setdefault(name, []).append((Region.parse(text, r["shapes"][name]), t))
    return out


def _check(saved: tuple[str, list[dict]], results: list[dict]) -> None:
    reference = saved[1]
    assert len({r["losses"][2] for r in reference}) == 1
    ref = _pieces(reference)
    got = _pieces(results)
    assert got.keys() == ref.keys()  # params, mu and nu of every model tensor
    for r in results:
        assert r["losses"][-1] == pytest.approx(reference[0]["losses"][2], abs=1e-12, rel=0)
        assert int(r["pieces"]["opt/step"]) == 3
    for name, pieces in got.items():
        for region, t in pieces:
            torch.testing.assert_close(t, assemble(region, ref[name]), atol=1e-12, rtol=0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("ranks", "pipeline", "tensor", "schedule", "blocks"),
    [
        (2, 1, 1, "1f1b", None),  # pipeline 1 x tensor 1 x data 2
        (4, 4, 1, "interleaved", None),  # pipeline 4, 2 stages per rank: 8 stages, 1 block each
        (4, 2, 1, "1f1b", (1, 6)),  # an uneven split (saved: 3 and 4 blocks), x data 2
        (4, 4, 1, "1f1b", None),  # 2, 2, 2 and 1 blocks
        (4, 1, 4, "1f1b", None),  # tensor 4
    ],
)
def test_resumed_at_another_layout_equals_the_continued_run(
    pool: Any,
    saved: tuple[str, list[dict]],
    ranks: int,
    pipeline: int,
    tensor: int,
    schedule: str,
    blocks: tuple[int, ...] | None,
) -> None:
    results = pool(ranks).run(jobs_reshard.run, pipeline, tensor, schedule, saved[0], False, blocks)
    _check(saved, results)


def test_the_saved_run_learns_and_resumes_at_its_own_layout(
    pool: Any, saved: tuple[str, list[dict]]
) -> None:
    losses = saved[1][0]["losses"]
    assert losses[2] < losses[0]
    _check(saved, pool(4).run(jobs_reshard.run, 2, 2, "1f1b", saved[0], False))


@pytest.fixture(scope="module")
def saved_zero(pool: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict]]:
    """The run at pipeline 2 x data 2 with ZeRO-1 (optimizer state in flat halves): saved after
    step 2, then its own step 3."""
    path = str(tmp_path_factory.mktemp("reshard_zero") / "ck")
    return path, pool(4).run(jobs_reshard.run_zero, 2, 1, path, True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("ranks", "pipeline", "zero"),
    [
        (4, 2, 1),  # its own layout
        (4, 1, 2),  # data 4, ZeRO-2: quarters of the state, every stage on each process
        (2, 1, 1),  # data 2 over 2 processes: the same halves, other stages per process
        (2, 2, 0),  # data 1, unsharded: the halves joined
    ],
)
def test_sharded_state_resumes_over_another_number_of_processes(
    pool: Any, saved_zero: tuple[str, list[dict]], ranks: int, pipeline: int, zero: int
) -> None:
    """Saved over 4 processes with the optimizer state sharded 2 ways (ZeRO-1), resumed over 4
    or 2 processes, sharded 4 or 2 ways or not at all: the next step's loss, params and
    moments equal the saved run's own continuation (the batch's rows summed in another order
    across data copies: float64 rounding, far under the tolerance)."""
    got = pool(ranks).run(jobs_reshard.run_zero, pipeline, zero, saved_zero[0], False)
    _check(saved_zero, got)


def test_two_ranks_save_shards_and_copies_and_refuse_a_mismatch_together(
    pool: Any, tmp_path: Any
) -> None:
    path = str(tmp_path / "ck")
    errors = [r["error"] for r in pool(2).run(jobs_reshard.two_ranks, path)]
    assert "'params/w' was saved as torch.float32 of full shape (3, 4), this run has" in errors[0]
    assert "1 other rank(s) of the group rejected their arguments" in errors[1]
    got = checkpoint.load_model(path, ({"w": torch.zeros(3, 4), "b": torch.zeros(5)},))
    assert torch.equal(got.params[0]["w"], torch.arange(12.0).reshape(3, 4)) and got.step == 5
    info = json.loads((tmp_path / "ck" / "funcpipe.json").read_text())
    assert sorted(info["checksums"]) == ["params/b@0:5", "params/w@0:3,0:2", "params/w@0:3,2:4"]
