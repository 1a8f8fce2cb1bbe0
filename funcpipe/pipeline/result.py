"""What a step returns: :class:`StepResult`, put together from the ranks' results.

The gradients by stage, the outputs merged over microbatches, the loss (and metric) of the
whole batch, and with ``trace=True`` the executed :class:`~funcpipe.schedule.Timeline`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from funcpipe.errors import InvalidArgument
from funcpipe.pipeline.microbatch import merge
from funcpipe.runtime.interpreter import RankResult
from funcpipe.runtime.loss_terms import count_factor, scale_grads
from funcpipe.runtime.rank_io import SCALARS
from funcpipe.schedule.ir import Program
from funcpipe.schedule.simulate import Event, Span, Timeline
from funcpipe.tree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "StepResult",
    "dist_scalars",
    "executed_timeline",
    "local_scalars",
    "merged_outputs",
    "merged_tallies",
    "stage_grads",
    "total",
]

Tensor = torch.Tensor


class StepResult(tuple[Any, Any]):
    """``(loss, grads)``, with ``.metric`` and ``.outputs`` when they were asked for."""

    loss: Tensor | None
    grads: tuple[Any, ...]
    metric: Tensor | None
    outputs: Any
    peak_activations: dict[int, int]  # program rank -> most activations it kept at once
    timeline: Any  # with trace=True: the executed funcpipe.schedule.Timeline
    # name -> what the stages tallied (funcpipe.stages.tally), summed over microbatches and
    # data copies; over processes, the tallies of this process's stages
    tallies: dict[str, Tensor]

    def __new__(
        cls,
        loss: Tensor | None,
        grads: tuple[Any, ...],
        metric: Tensor | None = None,
        outputs: Any = None,
    ) -> StepResult:
        self = super().__new__(cls, (loss, grads))
        self.loss, self.grads, self.metric, self.outputs = loss, grads, metric, outputs
        self.peak_activations = {}
        self.timeline = None
        self.tallies = {}
        return self

    def __repr__(self) -> str:
        return f"StepResult(loss={self.loss!r}, metric={self.metric!r}, grads=<{len(self.grads)} stages>)"


def stage_grads(
    program: Program,
    params: tuple[Any, ...],
    results: Sequence[RankResult],
    factor: float | None = None,
) -> tuple[Any, ...]:
    """One gradient pytree per stage, shaped like its params, from the first rank result that
    holds it (``None`` for a stage none holds; all ``None`` for an eval program), multiplied
    by ``factor`` where one is given (a ``(sum, count)`` loss: :mod:`funcpipe.runtime.loss_terms`)."""
    if not program.training:
        return tuple(None for _ in params)
    found: dict[int, list[Tensor]] = {}
    for res in results:
        for o, g in res.grads.items():
            found.setdefault(o, g)
    out = []
    for o, prm in enumerate(params):
        if o in found:
            _, tree = tree_flatten(prm)
            out.append(tree_unflatten(tree, found[o]))
        else:
            out.append(None)
    if factor is not None:
        scale_grads(out, factor)
    return tuple(out)


def merged_outputs(program: Program, results: Sequence[RankResult]) -> Any:
    """The last stage's outputs of every microbatch, merged along dim 0 (``None`` unless the
    results hold all of them); a 0-dim output (a per-microbatch scalar, such as a transformers
    MoE model's ``aux_loss``) comes back as one value per microbatch."""
    by_mb: dict[int, Any] = {}
    for res in results:
        by_mb.update(res.outputs)
    if len(by_mb) < program.microbatches:
        return None
    rows = [tree_map(_one_row, by_mb[k]) for k in range(program.microbatches)]
    return merge(rows, dim=0)


def _one_row(t: Any) -> Any:
    return t.unsqueeze(0) if isinstance(t, Tensor) and t.dim() == 0 else t


def dist_scalars(
    result: RankResult,
    microbatches: int,
    copies: int,
    tensor: int,
    *,
    has_loss: bool,
    has_metric: bool,
) -> tuple[Tensor | None, Tensor | None, float | None]:
    """The step's loss and metric over processes, from the sums the rank's scalar reduction
    gathered over every rank of every copy (each tensor coordinate adds the same values), and
    the factor the gradients take for a ``(sum, count)`` loss (``None`` for a scalar one):
    see :mod:`funcpipe.runtime.loss_terms`."""
    if not (has_loss or has_metric):
        return None, None, None
    if result.scalars is None:  # every rank posts it once per step (interpreter.run)
        raise RuntimeError("funcpipe internal error: the step's loss reduction was not posted")
    buf, handle = result.scalars
    handle.wait()  # over every rank of every copy: the loss of the whole batch
    v = buf.tolist()  # (one read of the device)
    if v[SCALARS["loss_items"]] == 0:
        return None, None, None
    counted = _counted(v[SCALARS["counted_items"]], v[SCALARS["loss_items"]], "loss_fn")
    _check_counts(v[SCALARS["bad_counts"]] / tensor)
    mean = microbatches * copies * tensor
    factor = None
    if counted:
        loss = buf[SCALARS["loss"]] / buf[SCALARS["count"]]
        factor = count_factor(v[SCALARS["count"]] / tensor, microbatches, copies)
    else:
        loss = buf[SCALARS["loss"]] / mean
    metric = None
    if has_metric:
        if _counted(v[SCALARS["metric_counted"]], v[SCALARS["loss_items"]], "metric_fn"):
            metric = buf[SCALARS["metric"]] / buf[SCALARS["metric_count"]]
        else:
            metric = buf[SCALARS["metric"]] / mean
    return (loss if has_loss else None), metric, factor


def _check_counts(bad: float) -> None:
    """Refuse the step when any (sum, count) loss gave a count that is negative, infinite or NaN
    (its loss and gradients would be silently wrong: a negative count offsets the others)."""
    if bad:
        raise InvalidArgument(
            f"loss_fn returned (sum, count) with {bad:g} count(s) that are negative, infinite "
            "or NaN; a count is the number of items the sum adds up (>= 0, finite), e.g. "
            "(labels != -100).sum(). The step's loss and gradients are refused."
        )


def _counted(counted: float, items: float, name: str) -> bool:
    """Whether every item returned ``(sum, count)``; a mix of both kinds is refused (on every
    rank alike: the values are the reduced ones)."""
    if counted and counted != items:
        raise InvalidArgument(
            f"{name} returned a (sum, count) pair on some ranks or microbatches and a scalar "
            "on others; return one kind everywhere."
        )
    return bool(counted)


def local_scalars(
    results: Sequence[RankResult], microbatches: int, copies: int
) -> tuple[Tensor | None, Tensor | None, float | None]:
    """:func:`dist_scalars` for ranks run in one process: the loss keeps its dtype."""
    loss = total([res.loss_sum for res in results])
    metric = total([res.metric_sum for res in results])
    items = sum(res.loss_items for res in results)
    counted = _counted(sum(res.counted_items for res in results), items, "loss_fn")
    mean = microbatches * copies
    factor = None
    count = total([res.count_sum for res in results]) if counted else None
    bad = total([res.bad_counts for res in results]) if counted else None
    _check_counts(0.0 if bad is None else float(bad))
    if loss is not None and count is not None:
        factor = count_factor(float(count), microbatches, copies)
        loss = loss / count.to(loss.dtype)
    elif loss is not None:
        loss = loss * (1.0 / mean)
    if metric is not None:
        pairs = sum(1 for res in results if res.metric_sum is not None and res.metric_sum.ndim)
        with_metric = sum(1 for res in results if res.metric_sum is not None)
        if _counted(pairs, with_metric, "metric_fn"):
            metric = metric[0] / metric[1]
        else:
            metric = metric * (1.0 / mean)
    return loss, metric, factor


def executed_timeline(
    program: Program,
    times: Sequence[Sequence[float]],
    spans: Sequence[Sequence[tuple[str, float, float]]] = (),
) -> Timeline:
    """A :class:`Timeline` from each rank's flat (start, end, start, end, ...) times, in
    seconds from the earliest start, and its stages' collectives (``spans``)."""
    t0 = min((t[0] for t in times if t), default=0.0)
    events = tuple(
        tuple(
            Event(r, k, instr, ts[2 * k] - t0, ts[2 * k + 1] - t0)
            for k, instr in enumerate(program.ranks[r])
        )
        for r, ts in enumerate(times)
    )
    calls = tuple(tuple(Span(r, n, a - t0, b - t0) for n, a, b in s) for r, s in enumerate(spans))
    return Timeline(program=program, events=events, spans=calls)


def traced_timeline(program: Program, per_rank: Sequence[RankResult]) -> Timeline:
    """The executed timeline of a step whose ranks all ran in this process."""
    return executed_timeline(program, [r.times for r in per_rank], [r.spans for r in per_rank])


def total(values: Sequence[Tensor | None]) -> Tensor | None:
    """The sum of the values that are not ``None`` (``None`` when all are)."""
    got = [v for v in values if v is not None]
    if not got:
        return None
    total = got[0]
    for v in got[1:]:
        total = total + v
    return total


def merged_tallies(results: Iterable[RankResult]) -> dict[str, Tensor]:
    """Every rank's tallies summed by name (one process: all ranks of all copies)."""
    out: dict[str, Tensor] = {}
    for res in results:
        for name, value in res.tallies.items():
            got = out.get(name)
            out[name] = value if got is None else got + value.to(got.device)
    return dict(sorted(out.items()))
