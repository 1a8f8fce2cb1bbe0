"""The single-device reference: what every pipeline schedule must reproduce.

:func:`reference_step` runs the stages one after the other on each microbatch, on one device,
and returns the loss and the gradients of every stage's params. Pipeline schedules are tested
against it (loss, outputs and every gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from funcpipe.errors import InvalidArgument
from funcpipe.pipeline.checks import side_input_stages, step_seed
from funcpipe.pipeline.microbatch import _batch_size, _split_named, merge
from funcpipe.pipeline.rank_inputs import split_batch
from funcpipe.runtime.loss_terms import count_factor, loss_and_count
from funcpipe.stages.keys import keyed, stage_key
from funcpipe.stages.stage import Stage, as_inputs
from funcpipe.stages.ties import TiePath, check_ties, resolve, tie_values
from funcpipe.tree import check_tensor_tree, leaf_paths, tree_flatten, tree_unflatten

__all__ = ["reference_step"]


def _check_params(stages: Sequence[Any], params: Sequence[Any]) -> None:
    if not stages:
        raise InvalidArgument("stages is empty; reference_step needs at least one stage.")
    if len(stages) != len(params):
        raise InvalidArgument(
            f"stages and params must have one entry per stage; got {len(stages)} stages and "
            f"{len(params)} params."
        )
    for i, (stage, p) in enumerate(zip(stages, params, strict=True)):
        if not isinstance(stage, Stage):
            raise InvalidArgument(f"stages[{i}] must be a Stage; got {stage!r}.")
        check_tensor_tree(p, name=f"params[{i}]")
        leaves, _ = tree_flatten(p)
        for path, t in zip(leaf_paths(p, name=f"params[{i}]"), leaves, strict=True):
            if not (t.is_floating_point() or t.is_complex()):
                raise InvalidArgument(
                    f"params of stage {i} ({stage.name!r}) must be floating point to be "
                    f"differentiated; got {path} with dtype {t.dtype}. Keep integer tensors out "
                    "of params (capture them in the stage function, or pass them as inputs)."
                )


def reference_step(
    stages: Sequence[Stage],
    params: Sequence[Any],
    batch: Any,
    loss_fn: Callable[..., torch.Tensor],
    *,
    targets: Any = None,
    microbatches: int = 1,
    dim: Any = 0,
    targets_dim: Any = None,
    outputs_dim: Any = None,
    return_outputs: bool = False,
    ties: Mapping[str, Sequence[TiePath]] | None = None,
    seed: int | None = None,
    side_inputs: Mapping[int, Sequence[str]] | None = None,
) -> tuple[Any, ...]:
    """One training step on one device: the loss and the gradients of every stage's params.

    The batch is split into microbatches as a pytree (:func:`funcpipe.split`); each microbatch
    then goes through the chaining convention, so a tuple ``batch=(x, mask)`` gives the first
    stage two positional inputs ``(x_mb, mask_mb)`` and anything else is one input.

    For each microbatch j (of m): ``outputs_j = stages[-1](...stages[0](params[0], *inputs_j))``
    and ``loss_j = loss_fn(outputs_j, targets_j)`` (``loss_fn(outputs_j)`` without targets),
    which is a scalar tensor or a pair ``(sum_j, count_j)``
    (:mod:`funcpipe.runtime.loss_terms`). For scalars the step's loss is ``mean_j loss_j``, the
    mean over microbatches of the per-microbatch loss: with a ``loss_fn`` that averages over
    items, a mean of means, which is the mean over all items only when every microbatch counts
    as many. For pairs it is ``sum_j sum_j / sum_j count_j``: the full batch's mean over its
    items, however they fall into microbatches (padding, ``ignore_index``, uneven sizes).
    Gradients are those of that loss (``sum_j grad(loss_j / m)``, or
    ``sum_j grad(sum_j) / sum_j count_j``). ``Pipeline.step`` returns the same.

    Args:
        stages, params: the stages and one params pytree per stage. Params are never
            modified: gradients are taken with ``torch.autograd.grad`` on detached aliases.
        batch: the first stage's inputs for the whole batch (a pytree of tensors).
        loss_fn: ``loss_fn(outputs, targets) -> scalar`` or ``-> (sum, count)`` (or
            ``loss_fn(outputs)``).
        targets: optional pytree of tensors split like the batch.
        microbatches: m, the number of microbatches (uneven sizes allowed).
        dim: batch dim of the batch's leaves (int or pytree of ints, see :func:`funcpipe.split`).
        targets_dim, outputs_dim: batch dims of targets and of the merged outputs; they default
            to ``dim`` when it is an int, else to 0.
        return_outputs: also return the last stage's outputs, merged over microbatches.
        ties: ``{"name": [(stage, path), ...]}`` as ``Pipeline`` takes them: the first listed
            value is used for every member and each member's gradient is the sum over the
            members (what the pipeline returns). ``funcpipe.find_ties(params)`` finds them
            from shared storage.
        seed: stage ``i`` on microbatch ``j`` runs under the random key ``stage_key(seed, i,
            j)`` (:mod:`funcpipe.stages.keys`), as in a :class:`funcpipe.Pipeline` step with
            that seed; ``None``: one drawn from torch's default CPU generator, as the pipeline
            draws it (``torch.manual_seed(s)`` before each gives both the same masks).
        side_inputs: ``{stage: ["mask", ...]}`` as ``Pipeline`` takes them: the batch is then a
            dict whose ``"inputs"`` is the first stage's input, and each named field, split
            into microbatches like it, is passed to that stage as a keyword argument
            (``split_module``'s ``parts.side_inputs`` and ``parts.batch(fields)``).

    Returns:
        ``(loss, grads)``, or ``(loss, grads, outputs)`` with ``return_outputs=True``. ``loss``
        is a detached scalar; ``grads`` is a tuple with one pytree per stage, of the same
        structure as ``params`` (params that the loss does not use get zero gradients).
    """
    stages, params = list(stages), list(params)
    _check_params(stages, params)
    tied = check_ties(ties, len(stages))
    if tied:
        params = list(tie_values(tuple(params), tied))
    if not callable(loss_fn):
        raise InvalidArgument(
            f"loss_fn must be callable as loss_fn(outputs, targets) or loss_fn(outputs); got "
            f"loss_fn={loss_fn!r}."
        )
    key_seed = step_seed(seed, True) or 0  # (never None for a training step)
    default_dim = dim if isinstance(dim, int) and not isinstance(dim, bool) else 0
    targets_dim = default_dim if targets_dim is None else targets_dim
    outputs_dim = default_dim if outputs_dim is None else outputs_dim

    batches, sides, target_mbs = _microbatches(
        batch, targets, side_inputs, len(stages), microbatches, dim, targets_dim
    )

    flat = [tree_flatten(p) for p in params]
    leaves = [[t.detach().requires_grad_(True) for t in ls] for ls, _ in flat]
    stage_params = [tree_unflatten(spec, ls) for ls, (_, spec) in zip(leaves, flat, strict=True)]
    all_leaves = [t for ls in leaves for t in ls]
    grads: list[torch.Tensor] = [torch.zeros_like(t) for t in all_leaves]

    m = len(batches)
    losses: list[torch.Tensor] = []
    counts: list[torch.Tensor] = []
    outputs_mbs: list[Any] = []
    for j, (inputs, target_mb) in enumerate(zip(batches, target_mbs, strict=True)):
        outputs: Any = None
        with torch.enable_grad():
            for i, stage in enumerate(stages):
                with keyed(stage_key(key_seed, i, j), _device(leaves[i], inputs)):
                    outputs = stage(stage_params[i], *inputs, **sides[j].get(i, {}))
                inputs = as_inputs(outputs)
            loss = loss_fn(outputs) if targets is None else loss_fn(outputs, target_mb)
        loss, counted = _microbatch_loss(loss, j, counts)
        if all_leaves and loss.requires_grad:
            with torch.enable_grad():
                scaled = loss if counted else loss / m
            step = torch.autograd.grad(scaled, all_leaves, allow_unused=True)
            grads = [g if s is None else g + s for g, s in zip(grads, step, strict=True)]
        losses.append(loss.detach())
        if return_outputs:
            outputs_mbs.append(_detach(outputs))

    loss_mean, grads = _combine(losses, counts, grads)
    out_grads = _stage_grads(params, leaves, flat, grads, tied)
    if return_outputs:
        check_tensor_tree(outputs_mbs[0], name="outputs")
        return loss_mean, tuple(out_grads), merge(outputs_mbs, dim=outputs_dim)
    return loss_mean, tuple(out_grads)


def _microbatches(
    batch: Any,
    targets: Any,
    side_inputs: Mapping[int, Sequence[str]] | None,
    n_stages: int,
    microbatches: int,
    dim: Any,
    targets_dim: Any,
) -> tuple[list[tuple[Any, ...]], list[dict[int, dict[str, Any]]], list[Any]]:
    """Per microbatch: the first stage's positional inputs, each stage's side inputs (keyword
    arguments) and the targets (``None`` without), as a pipeline step splits them."""
    if not side_inputs:
        entries = [as_inputs(mb) for mb in _split_named(batch, microbatches, dim=dim, name="batch")]
        sides: list[dict[int, dict[str, Any]]] = [{} for _ in entries]
    else:
        named = side_input_stages(side_inputs, n_stages)
        entries, sides, batch = split_batch(batch, named, microbatches, dim)
    if targets is None:
        return entries, sides, [None] * len(entries)
    return entries, sides, _split_targets(batch, targets, microbatches, dim, targets_dim)


def _microbatch_loss(loss: Any, j: int, counts: list[torch.Tensor]) -> tuple[Any, bool]:
    """Microbatch ``j``'s loss, checked; a ``(sum, count)`` pair's count goes to ``counts``."""
    counted = isinstance(loss, tuple | list)
    if counted:  # (sum, count): weighted by the counts
        loss, count = loss_and_count(loss, f"loss_fn for microbatch {j}")
        if count is not None:  # (always, for a pair)
            counts.append(count)
    _check_loss(loss, j)
    if counts and len(counts) != j + 1:
        raise InvalidArgument(
            "loss_fn returned a (sum, count) pair for some microbatches and a scalar for "
            "others; return one kind for every microbatch."
        )
    return loss, counted


def _combine(
    losses: list[torch.Tensor], counts: list[torch.Tensor], grads: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The step's loss and gradients from the microbatches': the mean of the losses (gradients
    summed over ``loss_j / m``), or for ``(sum, count)`` losses the total over the total count
    (gradients summed over ``sum_j``, then divided by it)."""
    if not counts:
        return torch.stack(losses).mean(), grads
    n_items = torch.stack(counts).sum()
    factor = count_factor(float(n_items), 1, 1)
    return torch.stack(losses).sum() / n_items.to(losses[0].dtype), [g * factor for g in grads]


def _stage_grads(
    params: Sequence[Any],
    leaves: Sequence[Sequence[torch.Tensor]],
    flat: Sequence[tuple[Any, Any]],
    grads: list[torch.Tensor],
    tied: Mapping[str, Sequence[TiePath]],
) -> list[Any]:
    """The flat gradients as one pytree per stage, each tied member holding the members' sum."""
    offsets = [sum(len(ls) for ls in leaves[:i]) for i in range(len(leaves))]
    for name, members in tied.items():
        where = [offsets[s] + resolve(params[s], path, f"ties[{name!r}]") for s, path in members]
        total = sum((grads[k] for k in where[1:]), grads[where[0]])
        for k in where:
            grads[k] = total
    out_grads, start = [], 0
    for ls, (_, spec) in zip(leaves, flat, strict=True):
        out_grads.append(tree_unflatten(spec, grads[start : start + len(ls)]))
        start += len(ls)
    return out_grads


def _split_targets(
    batch: Any, targets: Any, microbatches: int, dim: Any, targets_dim: Any
) -> list[Any]:
    """``targets`` split into microbatches, once they hold as many samples as ``batch``."""
    n_batch = _batch_size(batch, dim=dim, name="batch")
    n_targets = _batch_size(targets, dim=targets_dim, name="targets")
    if n_batch != n_targets:
        raise InvalidArgument(
            f"batch and targets must have the same number of samples; batch has {n_batch} "
            f"and targets has {n_targets} (targets_dim={targets_dim!r})."
        )
    return _split_named(targets, microbatches, dim=targets_dim, name="targets")


def _check_loss(loss: Any, j: int) -> None:
    """``loss_fn``'s result for microbatch ``j`` is a scalar tensor."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        got = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else repr(loss)
        )
        raise InvalidArgument(
            f"loss_fn must return a scalar tensor; for microbatch {j} it returned {got}. "
            "Reduce it, e.g. with .mean() or .sum()."
        )


def _detach(tree: Any) -> Any:
    leaves, spec = tree_flatten(tree)
    return tree_unflatten(spec, [t.detach() if isinstance(t, torch.Tensor) else t for t in leaves])


def _device(params: Sequence[torch.Tensor], inputs: Sequence[Any]) -> torch.device:
    """Where a stage runs: its parameters' device, else its first tensor input's, else the CPU."""
    for t in [*params, *tree_flatten(list(inputs))[0]]:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")
