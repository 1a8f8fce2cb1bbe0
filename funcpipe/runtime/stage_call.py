"""One (stage, microbatch) as the flat function the interpreter runs and differentiates.

:func:`stage_fn` builds ``fn(params, leaves) -> outputs`` over flat lists of tensors: the
stage's inputs rebuilt from the leaves (the batch's, or its producers' outputs as shape
inference laid them out), its parameter leaves (in the dtype it computes with: the
interpreter's copies where the pipeline keeps a leaf in another), the stage called, and what it returns checked against shape inference (the receiving
rank sized its buffers from it); after a sink stage, ``loss_fn`` (and ``metric_fn``) called and
their result checked (:mod:`funcpipe.runtime.loss_terms`): the outputs then start with the
loss, its count when ``loss_fn`` returned ``(sum, count)``, and the metric. With a step seed the
stage runs under its random key (:mod:`funcpipe.stages.keys`). :func:`note` says on a user
function's exception where funcpipe called it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from funcpipe.errors import InvalidArgument
from funcpipe.runtime.loss_terms import loss_and_count, metric_terms
from funcpipe.runtime.rank_io import RankInputs
from funcpipe.stages.boundaries import rebuild
from funcpipe.stages.keys import keyed, stage_key
from funcpipe.stages.shapes import TensorSpec
from funcpipe.stages.stage import as_inputs
from funcpipe.tree import tree_flatten, tree_unflatten

__all__ = ["backward_noted", "note", "stage_fn"]

Tensor = torch.Tensor


def stage_fn(
    x: RankInputs, owner: int, s: int, m: int
) -> Callable[[Sequence[Tensor], Sequence[Tensor]], list[Tensor]]:
    """Stage ``s`` on microbatch ``m`` as ``fn(params, leaves) -> outputs`` (flat lists), with
    ``owner`` the stage whose parameters it uses; after a sink stage with ``loss_fn`` the
    outputs start with the loss (then its count, for a ``(sum, count)`` loss, and the
    metric)."""
    p = x.program
    stage = x.stages[s]
    _, ptree = x.params[owner]
    producers = p.producers(s)
    kwargs = x.side[m].get(s, {})
    sink = not p.consumers(s)
    layout = x.layouts[m]
    want = layout[s]
    target = x.targets[m] if (sink and x.targets is not None) else None
    entry_tree = tree_flatten(x.entry[m])[1] if not producers else None
    # every run of this call (F, a recomputation) draws the same random numbers
    key = None if x.seed is None else stage_key(x.seed, owner, x.microbatch_offset + m)

    def fn(params: Sequence[Tensor], leaves: Sequence[Tensor]) -> list[Tensor]:
        if entry_tree is not None:
            args = tree_unflatten(entry_tree, list(leaves))
        else:
            args, k = [], 0
            for q in producers:
                n = len(layout[q].leaves)
                args.extend(as_inputs(rebuild(layout[q], leaves[k : k + n])))
                k += n
            args = tuple(args)
        try:
            with nullcontext() if key is None else keyed(key, x.device):
                out = stage(tree_unflatten(ptree, list(params)), *args, **kwargs)
        except Exception as e:
            note(e, f"stage {s} ({stage.name!r}), microbatch {m}, rank {x.rank}; inputs", leaves)
            raise
        flat, tree = tree_flatten(out)
        if tree != want.tree or len(flat) != len(want.leaves):
            raise InvalidArgument(
                f"stage {s} ({stage.name!r}) returned outputs of structure {tree} for "
                f"microbatch {m}, but shape inference saw {want.tree}; a stage must return "
                "the same structure for inputs of the same shapes"
            )
        for j, (t, spec) in enumerate(zip(flat, want.leaves, strict=True)):
            if not isinstance(t, torch.Tensor) or t.shape != spec.shape or t.dtype != spec.dtype:
                got = TensorSpec.from_tensor(t) if isinstance(t, torch.Tensor) else repr(t)
                raise InvalidArgument(
                    f"stage {s} ({stage.name!r}) returned output #{j} = {got} for "
                    f"microbatch {m}, but shape inference (run without data) saw {spec}; "
                    "a stage must return the same shapes and dtypes for inputs of the same "
                    "shapes and dtypes (the receiving rank sized its buffers from them)"
                )
        if sink and x.loss_fn is not None and (target is not None or p.training):
            try:
                loss = x.loss_fn(out, target) if target is not None else x.loss_fn(out)
            except Exception as e:
                what = f"loss_fn after stage {s}, microbatch {m}, rank {x.rank}; outputs"
                note(e, what, flat, tree_flatten(target)[0])
                raise
            where = f"loss_fn after stage {s}, microbatch {m}, rank {x.rank}"
            loss, count = loss_and_count(loss, where)
            if (
                not loss.requires_grad
                and torch.is_grad_enabled()
                and any(t.requires_grad for t in flat)
            ):
                raise InvalidArgument(
                    f"{where} returned a "
                    "tensor that does not require grad, though the stage's outputs do: it "
                    "is cut off from them (.detach(), .item(), torch.tensor(...) or "
                    "torch.no_grad() inside loss_fn), so every gradient would be zero. "
                    "Compute the loss from the outputs with differentiable torch operations"
                )
            extra = [] if count is None else [count]
            if x.metric_fn is not None:
                with torch.no_grad():
                    mv = x.metric_fn(out, target) if target is not None else x.metric_fn(out)
                extra.append(metric_terms(mv, f"metric_fn after stage {s}, microbatch {m}"))
            return [loss, *extra, *flat]
        return list(flat)

    return fn


def note(e: BaseException, where: str, inputs: Sequence[Any], targets: Sequence[Any] = ()) -> None:
    """Say on a user function's exception where funcpipe called it, and on what (a traceback
    note: the exception keeps its type)."""
    if not hasattr(e, "add_note"):  # Python < 3.11
        return

    def specs(ts: Sequence[Any]) -> str:
        return ", ".join(str(TensorSpec.from_tensor(t)) for t in ts if isinstance(t, torch.Tensor))

    text = f"funcpipe: raised by {where} {specs(inputs)}"
    if targets:
        text += f"; targets {specs(targets)}"
    e.add_note(text)


@contextmanager
def backward_noted(x: RankInputs, op: str, s: int, m: int) -> Iterator[None]:
    """Say on an exception raised in a backward (B, I or W ``op``) which stage, microbatch and
    rank it was; with a reentrant ``torch.utils.checkpoint`` inside the stage, what to do."""
    try:
        yield
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(
                f"funcpipe: raised by the backward ({op}) of stage {s} ({x.stages[s].name!r}), "
                f"microbatch {m}, rank {x.rank}"
            )
            if "use_reentrant=True" in str(e):
                e.add_note(
                    "funcpipe: its backward differentiates with respect to the stage's own "
                    "inputs and parameters only (inputs=), which a reentrant checkpoint cannot "
                    "do; checkpoint with torch.utils.checkpoint.checkpoint(..., "
                    "use_reentrant=False) (transformers: model.gradient_checkpointing_enable("
                    "gradient_checkpointing_kwargs={'use_reentrant': False})), or let funcpipe "
                    "recompute the stage: Pipeline(recompute=...)"
                )
        raise
