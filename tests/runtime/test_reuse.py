"""Gradient memory reused across steps: only memory nothing outside funcpipe refers to, and the
gradients are the same as with fresh memory."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import pytest
import torch

import funcpipe as fp
from funcpipe.runtime import reuse
from funcpipe.runtime.reuse import GradMemory, _unshared, take
from funcpipe.schedule import generate
from funcpipe.testing import assert_trees_close
from tests.jobs_runtime import run_pipeline_vs_reference

F64 = torch.float64

HOLDERS: dict[str, Callable[[torch.Tensor], Any]] = {
    "the tensor": lambda t: t,
    "a list of it": lambda t: [t],
    "a view": lambda t: t[1:],
    "a reshape": lambda t: t.reshape(-1),
    "detach()": lambda t: t.detach(),
    "its storage": lambda t: t.untyped_storage(),
    "a NumPy array": lambda t: t.numpy(),
    "a tensor set_ to its storage": lambda t: torch.empty(0).set_(t.untyped_storage()),
    "an autograd graph": lambda t: (torch.ones(3, 3, requires_grad=True) * t).sum(),
}


@pytest.mark.parametrize("holder", list(HOLDERS))
def test_memory_someone_holds_is_not_unshared(holder: str) -> None:
    kept = deque([torch.randn(3, 3)])
    held = HOLDERS[holder](kept[0])
    t = kept.popleft()
    assert not _unshared(t)
    del held


@pytest.mark.parametrize("dropped", ["nothing", "a clone", "a storage handle, dropped"])
def test_memory_nobody_holds_is_unshared(dropped: str) -> None:
    kept = deque([torch.randn(3, 3)])
    if dropped == "a clone":
        held = kept[0].clone()
    elif dropped != "nothing":
        kept[0].untyped_storage()
    t = kept.popleft()
    assert _unshared(t)
    if dropped == "a clone":
        del held


def test_offer_gives_matching_unheld_memory_only() -> None:
    memory = GradMemory()
    a, b = torch.randn(2, 3), torch.randn(4)
    memory.remember({0: [a, b]})
    held = a  # the caller still holds the first gradient
    del b
    leaves = [torch.zeros(2, 3, requires_grad=True), torch.zeros(5, requires_grad=True)]
    memory.offer({0: leaves})
    assert take(leaves[0]) is None  # held
    assert take(leaves[1]) is None  # unheld, but of another shape
    del held, a
    leaves = [torch.zeros(2, 3, requires_grad=True), torch.zeros(4, requires_grad=True)]
    memory.offer({0: leaves})
    spare = take(leaves[0])
    assert spare is not None and spare.shape == (2, 3)
    assert take(leaves[0]) is None  # taken once
    assert take(leaves[1]) is not None


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(6, 6, dtype=F64), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _mse(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((out - t) ** 2).mean()


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zbv", "interleaved"])
def test_steps_reuse_dropped_gradients_and_never_write_held_ones(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight steps on different batches. Some results are kept whole, one only through a view,
    one through NumPy; the rest are dropped. Every kept result still equals its own step's
    reference at the end, and later steps did write into memory of dropped ones."""
    program = generate(name, ranks=2, microbatches=4)
    part = fp.partition(_model(0), stages=program.n_stages)
    stages, params = list(part.stages), list(part.params)
    pipe = fp.Pipeline(stages, program, loss_fn=_mse)
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 6, generator=g, dtype=F64), torch.randn(8, 6, generator=g, dtype=F64))
        for _ in range(8)
    ]
    taken: list[int] = []

    def counted(leaf: torch.Tensor) -> torch.Tensor | None:
        spare = take(leaf)
        if spare is not None:
            taken.append(spare.data_ptr())
        return spare

    monkeypatch.setattr(reuse, "take", counted)
    kept: dict[int, Any] = {}
    views: dict[int, torch.Tensor] = {}
    arrays: dict[int, Any] = {}
    pointers: list[set[int]] = []
    for k, (x, y) in enumerate(data):
        loss, grads = pipe.step(params, x, y)
        leaves = [t for tree in grads for t in fp.tree.tree_flatten(tree)[0]]
        pointers.append({t.data_ptr() for t in leaves})
        if k % 3 == 0:
            kept[k] = grads
        elif k == 1:
            views[k] = leaves[0][1:]  # only a view of the first weight's gradient survives
        elif k == 2:
            arrays[k] = leaves[0].numpy()
        del loss, grads, leaves
    for k, grads in kept.items():
        ref = fp.reference_step(
            stages, params, data[k][0], _mse, targets=data[k][1], microbatches=4
        )
        assert_trees_close(grads, ref[1])
    for k, view in views.items():
        ref = fp.reference_step(
            stages, params, data[k][0], _mse, targets=data[k][1], microbatches=4
        )
        first = fp.tree.tree_flatten(ref[1])[0][0]
        torch.testing.assert_close(view, first[1:])
    for k, array in arrays.items():
        ref = fp.reference_step(
            stages, params, data[k][0], _mse, targets=data[k][1], microbatches=4
        )
        first = fp.tree.tree_flatten(ref[1])[0][0]
        torch.testing.assert_close(torch.from_numpy(array), first)
    # steps 1, 2, 4, 5 were dropped (whole or but for a view or an array of the first weight's)
    assert len(taken) >= 8, "later steps did not write into dropped steps' gradient memory"
    for k in kept:  # memory a caller holds is never handed out again
        for later in range(k + 1, 8):
            assert not (pointers[k] & pointers[later]), (k, later)


def test_reuse_and_fresh_memory_give_the_same_gradients() -> None:
    program = generate("1f1b", ranks=2, microbatches=4)
    part = fp.partition(_model(3), stages=2)
    stages, params = list(part.stages), list(part.params)
    on = fp.Pipeline(stages, program, loss_fn=_mse)
    off = fp.Pipeline(stages, program, loss_fn=_mse, reuse_grads=False)
    g = torch.Generator().manual_seed(2)
    for _ in range(4):
        x, y = torch.randn(8, 6, generator=g, dtype=F64), torch.randn(8, 6, generator=g, dtype=F64)
        a, b = on.step(params, x, y), off.step(params, x, y)
        assert_trees_close(a.grads, b.grads, rtol=0, atol=0)
        del a, b


@pytest.mark.parametrize("name", ["1f1b", "zbv", "chimera"])
@pytest.mark.parametrize("recompute", [False, True], ids=["keep", "recompute"])
def test_tied_stages_over_several_steps_match_the_reference(name: str, recompute: bool) -> None:
    """Tie reductions write into the gradient sums in place; with reused memory across four
    steps every step still matches the reference."""
    assert (
        run_pipeline_vs_reference(0, name, 2, 5, [11, 6, 11, 6], tied=True, recompute=recompute)
        < 1e-10
    )
