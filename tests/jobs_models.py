"""Rank functions for test_models.py: a third-party model split with split_module over processes."""

from __future__ import annotations

import torch

import funcpipe as fp
from funcpipe.schedule import generate
from tests import test_models


def run_model_vs_unsplit(rank: int, name: str, schedule: str, ranks: int) -> float:
    """One step of ``name`` under ``schedule`` on this rank (``transport="dist"``); returns the
    largest difference between this rank's gradients and the unsplit model's."""
    _, fields, y, loss_fn = test_models._case(name)
    prog = generate(schedule, ranks=ranks, microbatches=test_models.M)
    n = max(prog.replica_of) + 1 if prog.replica_of else prog.n_stages
    sp = test_models._split(name, n)
    pipe = fp.Pipeline(sp.stages, prog, loss_fn=loss_fn, ties=sp.ties, side_inputs=sp.side_inputs)
    batch = fields["x"] if name == "vit" else sp.batch(fields)
    loss, grads = pipe.step(sp.params, batch, y)
    ref_loss, ref = test_models._unsplit(name)
    worst = float((loss - ref_loss).abs())
    held = 0
    for g in grads:
        if g is None:
            continue
        for k, v in g.items():
            worst = max(worst, float((v - ref[k]).abs().max()))
            held += 1
    assert held > 0, f"rank {rank} holds no stage"
    return worst if torch.isfinite(torch.tensor(worst)) else float("inf")
