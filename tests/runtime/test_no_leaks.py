"""A step leaves no reference cycles behind: dropping its result frees its gradients at once,
without the cyclic garbage collector (which, with torch imported, runs a full collection only
every many thousand steps: cyclic per-step state showed up as a slow RSS creep in the soak)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import funcpipe as fp
from funcpipe.models import gpt
from funcpipe.schedule.generators import generate
from funcpipe.tree import tree_flatten

CFG = gpt.GPTConfig(vocab=32, context=8, d_model=8, heads=2, layers=2, mlp=16)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_a_step_leaves_no_cyclic_garbage(name: str, tied: bool) -> None:
    """Forgetting a step's result frees its gradients and the ranks' state at once."""
    program = generate(name, ranks=2, microbatches=4)
    axis = gpt.single_axis()
    params = gpt.split(gpt.init(CFG, seed=0, dtype=torch.float64), CFG, program.n_stages)
    pipe = fp.Pipeline(
        gpt.stages(CFG, program.n_stages, axis=axis),
        program,
        loss_fn=gpt.loss_fn(axis=axis),
        ties=gpt.tie_spec(program.n_stages) if tied else None,
    )
    tokens = torch.randint(
        0, CFG.vocab, (8, CFG.context + 1), generator=torch.Generator().manual_seed(0)
    )
    pipe.step(params, tokens[:, :-1], tokens[:, 1:])  # warm caches (layouts, compiled specs)
    gc.collect()
    gc.disable()
    try:
        loss, grads = pipe.step(params, tokens[:, :-1], tokens[:, 1:])
        refs = [weakref.ref(g) for tree in grads if tree is not None for g in tree_flatten(tree)[0]]
        del loss, grads
        alive = sum(r() is not None for r in refs)
        ranks = [o for o in gc.get_objects() if type(o).__name__ == "_Rank"]
    finally:
        gc.enable()
    assert not ranks, f"{len(ranks)} interpreter rank(s) of a finished step kept alive by a cycle"
    assert alive == 0, f"{alive} of {len(refs)} gradient tensors outlive the step's result"
