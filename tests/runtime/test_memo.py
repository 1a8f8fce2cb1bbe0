"""The rank plans a Pipeline keeps across steps (RankInputs.memo): made once per rank and
setting, made again when a setting or the program changes, and the steps' gradients unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funcpipe as fp
from funcpipe.runtime import interpreter
from funcpipe.schedule import generate


def _setup() -> tuple[nn.Module, fp.Partition, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.GELU())]).double()
    part = fp.partition(model, stages=2)
    x, y = torch.randn(16, 32, dtype=torch.float64), torch.randn(16, 32, dtype=torch.float64)
    return model, part, x, y


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def test_plans_are_made_once_per_rank_and_again_for_new_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made = {"deferral": 0, "prefetch": 0}
    deferral, prefetch = interpreter._deferral_plan, interpreter._prefetch_plan

    def counted_deferral(*a, **k):  # type: ignore[no-untyped-def]
        made["deferral"] += 1
        return deferral(*a, **k)

    def counted_prefetch(*a, **k):  # type: ignore[no-untyped-def]
        made["prefetch"] += 1
        return prefetch(*a, **k)

    monkeypatch.setattr(interpreter, "_deferral_plan", counted_deferral)
    monkeypatch.setattr(interpreter, "_prefetch_plan", counted_prefetch)
    _, part, x, y = _setup()
    pipe = fp.Pipeline(part.stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=_mse)
    first = pipe.step(part.params, x, y)
    assert made == {"deferral": 2, "prefetch": 2}  # one per rank
    again = pipe.step(part.params, x, y)
    assert made == {"deferral": 2, "prefetch": 2}  # kept
    for a, b in zip(
        torch.utils._pytree.tree_leaves(first.grads),
        torch.utils._pytree.tree_leaves(again.grads),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    pipe.batch_weights_extra = 2  # a setting the plan depends on: made again
    pipe.step(part.params, x, y)
    assert made == {"deferral": 4, "prefetch": 2}


def test_a_memo_kept_for_another_program_or_rank_is_emptied() -> None:
    a, b = generate("1f1b", ranks=2, microbatches=4), generate("gpipe", ranks=2, microbatches=4)
    x = interpreter.RankInputs(
        program=a,
        rank=0,
        stages={},
        params={},
        entry=[],
        side=[],
        targets=None,
        layouts=[],
        loss_fn=None,
    )
    memo = interpreter._memo(x)
    memo["prefetch"] = "kept"
    assert interpreter._memo(x)["prefetch"] == "kept"
    x.rank = 1
    assert "prefetch" not in interpreter._memo(x)
    memo["prefetch"] = "kept"
    x.program = b
    assert "prefetch" not in interpreter._memo(x)


def test_kept_plans_give_the_reference_gradients_step_after_step() -> None:
    model, part, x, y = _setup()
    ref = torch.autograd.grad(_mse(model(x), y), list(model.parameters()))
    pipe = fp.Pipeline(part.stages, generate("1f1b", ranks=2, microbatches=4), loss_fn=_mse)
    for _ in range(3):
        got = torch.utils._pytree.tree_leaves(pipe.step(part.params, x, y).grads)
        assert len(got) == len(ref)
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b)
