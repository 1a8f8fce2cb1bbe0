"""funcpipe.train.checkpoint: round trips, atomicity under SIGKILL, exact resume, resharding over gloo
ranks, and a metadata file that tries to run code."""

from __future__ import annotations

import glob
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optree
import pytest
import torch

from funcpipe.errors import FuncpipeError, InvalidArgument
from funcpipe.testing import assert_trees_close
from funcpipe.train import checkpoint, optim
from funcpipe.train.data import load_corpus
from tests import jobs_train

ROOT = Path(__file__).resolve().parents[1]
EXACT = {"rtol": 0.0, "atol": 0.0}


def _state(seed: int = 0) -> dict[str, Any]:
    _, params = jobs_train.byte_model(seed)
    opt = optim.adamw(1e-2)
    corpus = load_corpus(max_bytes=100_000)
    params, opt_state, _ = jobs_train.train(corpus, params, opt.init(params), opt, start=0, steps=1)
    return {"params": params, "opt": opt_state, "step": 1, "lr": 0.5, "done": False}


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return optree.tree_map(
        lambda t: torch.zeros_like(t) if torch.is_tensor(t) else type(t)(), state
    )


def test_round_trip_with_scalars_and_none(tmp_path: Path) -> None:
    state = _state()
    path = checkpoint.save(tmp_path / "ck", state, step=1)
    like = _zeros_like(state)
    before = optree.tree_map(lambda t: t.clone() if torch.is_tensor(t) else t, like)
    loaded = checkpoint.load(path, like)
    assert_trees_close(loaded, state, **EXACT)
    assert type(loaded["step"]) is int and type(loaded["done"]) is bool
    assert_trees_close(like, before, **EXACT)  # like is only a template
    # load part of it: a stage given as None or as meta tensors is not read
    meta = optree.tree_map(lambda t: t.to("meta"), state["params"][1])
    part = checkpoint.load(path, {"params": (like["params"][0], meta), "step": 0})
    assert_trees_close(part["params"][0], state["params"][0], **EXACT)
    got, want = optree.tree_leaves(part["params"][1]), optree.tree_leaves(meta)
    assert all(a is b for a, b in zip(got, want, strict=True))
    assert checkpoint.load(path, {"params": (None, like["params"][1])})["params"][0] is None
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_latest_orders_by_step_then_time_and_skips_unfinished(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path / "missing") is None
    assert checkpoint.latest(tmp_path) is None
    small = {"x": torch.ones(2)}
    checkpoint.save(tmp_path / "a", small, step=5)
    checkpoint.save(tmp_path / "b", small, step=2)
    checkpoint.save(tmp_path / "c", small)
    assert checkpoint.latest(tmp_path) == str(tmp_path / "a")
    checkpoint.save(tmp_path / "d", small, step=5)
    assert checkpoint.latest(tmp_path) == str(tmp_path / "d")
    # an unfinished save with a larger step, a stray directory and a file are not checkpoints
    os.rename(checkpoint.save(tmp_path / "e", small, step=9), tmp_path / "e.tmp-1234")
    (tmp_path / "stray").mkdir()
    (tmp_path / "notes.txt").write_text("hi")
    assert checkpoint.latest(tmp_path) == str(tmp_path / "d")
    # overwriting replaces it in place and leaves no other directory behind
    checkpoint.save(tmp_path / "d", {"x": torch.zeros(2)}, step=6)
    assert checkpoint.latest(tmp_path) == str(tmp_path / "d")
    assert torch.equal(checkpoint.load(tmp_path / "d", small)["x"], torch.zeros(2))
    assert not glob.glob(str(tmp_path / "d.*"))


def test_errors_name_the_problem(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path / "ck", {"w": torch.ones(3), "n": 2})
    with pytest.raises(InvalidArgument, match=r"has no key\(s\) \['v'\]"):
        checkpoint.load(path, {"v": torch.ones(3)})
    with pytest.raises(InvalidArgument, match=r"'w'.*shape \(3,\).*like has .* shape \(4,\)"):
        checkpoint.load(path, {"w": torch.ones(4)})
    with pytest.raises(InvalidArgument, match="torch.float64"):
        checkpoint.load(path, {"w": torch.ones(3, dtype=torch.float64)})
    with pytest.raises(InvalidArgument, match="not a complete funcpipe checkpoint"):
        checkpoint.load(tmp_path, {"w": torch.ones(3)})
    (tmp_path / "mine").mkdir()
    with pytest.raises(InvalidArgument, match="refusing to replace"):
        checkpoint.save(tmp_path / "mine", {"w": torch.ones(3)})
    with pytest.raises(InvalidArgument, match=r"state\['name'\]='x' is a str"):
        checkpoint.save(tmp_path / "s", {"name": "x"})
    with pytest.raises(InvalidArgument, match="key 'a/b'"):
        checkpoint.save(tmp_path / "s", {"a/b": torch.ones(1), "a": {"b": torch.ones(1)}})
    with pytest.raises(InvalidArgument, match="step"):
        checkpoint.save(tmp_path / "s", {"w": torch.ones(1)}, step=-1)
    assert sorted(os.listdir(tmp_path)) == ["ck", "mine"]


class _Evil:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self) -> Any:
        return (os.makedirs, (self.target,))


def test_metadata_is_never_unpickled_beyond_dcp_types(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path / "ck", {"w": torch.ones(3)})
    victim = tmp_path / "pwned"
    (Path(path) / ".metadata").write_bytes(pickle.dumps(_Evil(str(victim))))
    with pytest.raises(FuncpipeError, match="os.makedirs|posix.makedirs"):
        checkpoint.load(path, {"w": torch.ones(3)})
    assert not victim.exists()


# ------------------------------------------------------------------------- kill mid-save
_SAVER = """
import sys, torch
from funcpipe.train import checkpoint
state = {"w": torch.full((512, 1024), 2.0, dtype=torch.float64), "step": 2}
checkpoint.save(sys.argv[1], state, step=2)
"""


@pytest.mark.timeout(120)
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """SIGKILL (a) after every file of the new checkpoint is written, before the rename, and (b)
    between moving the old checkpoint aside and renaming the new one in."""
    old = {"w": torch.full((512, 1024), 1.0, dtype=torch.float64), "step": 1}
    procs = {}
    for stage in ("written", "aside"):
        checkpoint.save(tmp_path / stage / "ck", old, step=1)
        env = {**os.environ, "FUNCPIPE_TEST_CHECKPOINT_PAUSE": f"{stage}:600"}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        procs[stage] = subprocess.Popen(
            [sys.executable, "-c", _SAVER, str(tmp_path / stage / "ck")], env=env, cwd=ROOT
        )
    marks = {
        "written": str(tmp_path / "written" / "ck.tmp-*" / "funcpipe.json"),
        "aside": str(tmp_path / "aside" / "ck.old-*"),
    }
    deadline = time.monotonic() + 90
    try:
        for stage, proc in procs.items():
            while not glob.glob(marks[stage]):
                assert proc.poll() is None, f"the saver ({stage}) exited early"
                assert time.monotonic() < deadline, f"the saver ({stage}) never paused"
                time.sleep(0.05)
            proc.kill()
            proc.wait()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    like = {"w": torch.zeros(512, 1024, dtype=torch.float64), "step": 0}
    # (a) the old checkpoint is still in place; the complete but uncommitted one is ignored
    found = checkpoint.latest(tmp_path / "written")
    assert found == str(tmp_path / "written" / "ck")
    assert_trees_close(checkpoint.load(found, like), old, **EXACT)
    # (b) the old checkpoint was moved aside: latest finds it there, and it loads
    assert not (tmp_path / "aside" / "ck").exists()
    found = checkpoint.latest(tmp_path / "aside")
    assert found is not None and ".old-" in found
    assert_trees_close(checkpoint.load(found, like), old, **EXACT)
    # the next save at the same path succeeds and removes the leftovers
    for stage in ("written", "aside"):
        checkpoint.save(tmp_path / stage / "ck", old, step=3)
        assert os.listdir(tmp_path / stage) == ["ck"]


# --------------------------------------------------------------------------- exact resume
def test_resume_reproduces_the_uninterrupted_losses_exactly(tmp_path: Path) -> None:
    corpus = load_corpus(max_bytes=100_000)
    opt = optim.adamw(optim.warmup_cosine(3e-2, warmup=2, total=6), weight_decay=0.1)
    _, params = jobs_train.byte_model(0)
    _, _, straight = jobs_train.train(corpus, params, opt.init(params), opt, start=0, steps=6)

    p, s, first = jobs_train.train(corpus, params, opt.init(params), opt, start=0, steps=3)
    checkpoint.save(tmp_path / "step-3", {"params": p, "opt": s, "step": 3}, step=3)
    del p, s
    # a fresh process would rebuild the model with other values and load over them
    _, fresh = jobs_train.byte_model(seed=123)
    like = {"params": fresh, "opt": opt.init(fresh), "step": 0}
    resumed = checkpoint.load(checkpoint.latest(tmp_path), like)
    assert resumed["step"] == resumed["opt"].step == 3
    _, _, second = jobs_train.train(
        corpus, resumed["params"], resumed["opt"], opt, start=resumed["step"], steps=3
    )
    assert first + second == straight


# ------------------------------------------------------------------------------ resharding
@pytest.mark.timeout(120)
def test_two_ranks_one_stage_each_to_one_process_and_back(pool, tmp_path: Path) -> None:
    state = _state()
    state = {"params": state["params"], "opt": state["opt"], "step": 1}
    like = _zeros_like(state)
    # saved by two ranks holding one stage each, loaded by this process holding both
    two = str(tmp_path / "two")
    pool(2).run(jobs_train.save_stage_per_rank, two, state)
    assert_trees_close(checkpoint.load(two, like), state, **EXACT)
    # and loaded again by the two ranks, one stage each (the other stage as meta tensors)
    # then saved by this process and loaded by the two ranks
    one = checkpoint.save(tmp_path / "one", state, step=1)
    for path in (two, one):
        views = pool(2).run(jobs_train.load_stage_per_rank, path, like)
        for rank, view in enumerate(views):
            assert_trees_close(view, jobs_train._view(state, rank), **EXACT)


@pytest.mark.timeout(120)
def test_a_rank_with_bad_arguments_makes_every_rank_raise(pool, tmp_path: Path) -> None:
    r0, r1 = pool(2).run(jobs_train.one_rank_errs, str(tmp_path / "ck"))
    assert "other rank(s)" in r0[0] and "state['name']='x' is a str" in r1[0]
    assert "has no key(s) ['v']" in r0[1] and "other rank(s)" in r1[1]
    assert r0[2] == r1[2] == "[1.0, 1.0]"


@pytest.mark.timeout(120)
def test_corruption_found_by_one_rank_makes_every_rank_raise(pool, tmp_path: Path) -> None:
    (e0, s0), (e1, s1) = pool(2).run(jobs_train.one_rank_finds_corruption, str(tmp_path / "ck"))
    assert "is corrupt: the data of key 'b'" in e1
    assert "is corrupt: 1 other rank(s) found data" in e0
    assert s0 == s1 == 2.0  # the group still works after the error


@pytest.mark.timeout(120)
def test_replicas_with_different_values_are_not_saved(pool, tmp_path: Path) -> None:
    path = tmp_path / "ck"
    (e0, x0), (e1, x1) = pool(2).run(jobs_train.replicas_that_differ, str(path))
    assert e0 == e1 and "ranks 0 and 1 both hold key 'w' with different values" in e0
    assert not x0 and not x1 and list(tmp_path.iterdir()) == []
