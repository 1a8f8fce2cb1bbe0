"""Checkpoints kept and written in the background (issue 51): ``save_model_async`` writes what
``save_model`` writes while the caller goes on, refuses a tensor modified meanwhile, and runs
its collectives on a group of its own; ``prune`` keeps the newest K; a save whose ranks wrote
to disks of their own fails naming them, on every rank, and leaves nothing behind."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from funcpipe.errors import FuncpipeError, InvalidArgument
from funcpipe.train import checkpoint


def _model(seed: int) -> tuple[list[dict[str, torch.Tensor]], Any]:
    from funcpipe.train import optim

    g = torch.Generator().manual_seed(seed)
    params = [{"w": torch.randn(8, 4, generator=g)}, {"b": torch.randn(4, generator=g)}]
    return params, optim.adamw(lr=1e-3).init(params)


def test_a_background_save_writes_what_save_model_writes(tmp_path: Path) -> None:
    params, state = _model(0)
    checkpoint.save_model(tmp_path / "sync", params, opt_state=state, step=3)
    pending = checkpoint.save_model_async(tmp_path / "async", params, opt_state=state, step=3)
    assert pending.wait() == str(tmp_path / "async") and pending.done()
    like, like_state = _model(1)
    a = checkpoint.load_model(tmp_path / "sync", like, opt_state=like_state)
    b = checkpoint.load_model(tmp_path / "async", like, opt_state=like_state)
    assert a.step == b.step == 3
    for x, y, p in zip(a.params, b.params, params, strict=True):
        for k in p:
            assert torch.equal(x[k], y[k]) and torch.equal(y[k], p[k])
    assert torch.equal(a.opt_state.mu[0]["w"], b.opt_state.mu[0]["w"])


def test_a_tensor_modified_while_it_is_written_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FUNCPIPE_TEST_CHECKPOINT_PAUSE", "background:0.5")
    params, state = _model(0)
    pending = checkpoint.save_model_async(tmp_path / "ck", params, opt_state=state, step=1)
    params[0]["w"].add_(1.0)  # an in-place update before the thread has written it
    with pytest.raises(FuncpipeError, match=r"modified in place .* \(first: 'params/w@0:8,0:4'\)"):
        pending.wait()
    assert not os.path.exists(tmp_path / "ck")
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_the_caller_goes_on_while_the_save_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the call costs the training loop is the gathering of the pieces, not the write (here
    held back 1 s by the test hook)."""
    monkeypatch.setenv("FUNCPIPE_TEST_CHECKPOINT_PAUSE", "background:1.0")
    params, state = _model(0)
    start = time.perf_counter()
    pending = checkpoint.save_model_async(tmp_path / "ck", params, opt_state=state, step=1)
    returned = time.perf_counter() - start
    assert not pending.done() and not os.path.exists(tmp_path / "ck")
    assert "writing" in repr(pending)
    pending.wait()
    assert returned < 0.5 and checkpoint.latest(tmp_path) == str(tmp_path / "ck")


def test_bad_arguments_are_refused_at_the_call(tmp_path: Path) -> None:
    params, state = _model(0)
    with pytest.raises(InvalidArgument, match="naming='names'"):
        checkpoint.save_model_async(tmp_path / "ck", params, opt_state=state, naming="names")
    with pytest.raises(InvalidArgument, match="step=-1"):
        checkpoint.save_model_async(tmp_path / "ck", params, opt_state=state, step=-1)
    with pytest.raises(InvalidArgument, match="path=3"):
        checkpoint.save_model_async(3, params, opt_state=state)  # type: ignore[arg-type]
    assert not any(tmp_path.iterdir())


def test_prune_keeps_the_newest_complete_checkpoints(tmp_path: Path) -> None:
    for step in (3, 1, 4, 2):
        checkpoint.save(tmp_path / f"ck{step}", {"w": torch.ones(2) * step}, step=step)
    (tmp_path / "ck9.tmp-0123").mkdir()  # what a killed save left
    (tmp_path / "notes").mkdir()  # not a checkpoint: never touched
    gone = checkpoint.prune(tmp_path, 2)
    assert sorted(os.path.basename(p) for p in gone) == ["ck1", "ck2", "ck9.tmp-0123"]
    assert sorted(os.listdir(tmp_path)) == ["ck3", "ck4", "notes"]
    assert checkpoint.latest(tmp_path) == str(tmp_path / "ck4")
    with pytest.raises(InvalidArgument, match="keep=0"):
        checkpoint.prune(tmp_path, 0)


# ------------------------------------------------------------------------ over processes
def background_saves(rank: int, where: str, split: bool) -> tuple[Any, ...]:
    """Pool job: two background saves in a row, a training collective (on the world) while the
    first one writes on its own group, then a load of the newest. Rank r holds stage r (the
    other stage as meta tensors); with ``split`` each rank saves into a directory of its own,
    as two nodes saving to their own disks would."""
    import torch.distributed as dist

    params, state = _model(0)

    def held(tree: Any, stage: int) -> Any:
        return tree if stage == rank else {k: v.to("meta") for k, v in tree.items()}

    mine = [held(p, s) for s, p in enumerate(params)]
    opt = type(state)(
        *[[held(t, s) for s, t in enumerate(f)] if isinstance(f, list) else f for f in state]
    )
    root = os.path.join(where, f"node{rank}") if split else where
    outcome: list[Any] = []
    for step in (1, 2):
        pending = checkpoint.save_model_async(
            os.path.join(root, f"ck{step}"), mine, opt_state=opt, step=step
        )
        x = torch.ones(1)
        dist.all_reduce(x)  # training goes on, on the world's group
        try:
            pending.wait()
            outcome.append("saved")
        except FuncpipeError as e:
            outcome.append(str(e))
        outcome.append(float(x))
    if split:
        return (*outcome, sorted(os.listdir(root)))
    like, _ = _model(1)
    got = checkpoint.load_model(checkpoint.latest(where), like)
    same = all(torch.equal(g[k], p[k]) for g, p in zip(got.params, params, strict=True) for k in p)
    return (*outcome, got.step, same)


@pytest.mark.timeout(120)
def test_background_saves_over_processes_run_beside_training(pool: Any, tmp_path: Path) -> None:
    a, b = pool(2).run(background_saves, str(tmp_path), False)
    assert a == b == ("saved", 2.0, "saved", 2.0, 2, True)
    assert sorted(os.listdir(tmp_path)) == ["ck1", "ck2"]


@pytest.mark.timeout(120)
def test_a_save_to_each_nodes_own_disk_fails_naming_the_ranks(pool: Any, tmp_path: Path) -> None:
    """Before: rank 0 committed a checkpoint without rank 1's files, rank 1 kept an orphan
    .tmp- directory, latest() accepted the incomplete one and --resume called it damaged."""
    a, b = pool(2).run(background_saves, str(tmp_path), True)
    for said in (a[0], b[0], a[2], b[2]):
        assert "cannot see the files of rank(s) 1" in said, said
        assert "one filesystem they all see" in said, said
    assert a[4] == [] and b[4] == []  # nothing committed, no .tmp- left on either "disk"
    assert checkpoint.latest(tmp_path / "node0") is None
