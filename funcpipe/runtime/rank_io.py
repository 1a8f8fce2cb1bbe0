"""What one rank's step takes and gives back: the interface between :class:`funcpipe.Pipeline`
and the interpreter (:func:`funcpipe.runtime.interpreter.run_rank`).

:class:`RankInputs` is everything one rank needs for one step (the pipeline builds it);
:class:`RankResult` is what the rank hands back (loss and metric sums, gradient sums as values,
outputs, peak activations, the trace, the scalars' reduction in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from funcpipe.errors import InvalidArgument
from funcpipe.runtime.transport_common import Handle
from funcpipe.schedule.ir import Program
from funcpipe.stages.boundaries import BoundarySpecs
from funcpipe.stages.stage import Stage
from funcpipe.tree import PyTreeSpec

__all__ = ["SCALARS", "RankInputs", "RankResult"]

Tensor = torch.Tensor


@dataclass
class RankInputs:
    """Everything one rank needs for one step (built by :class:`funcpipe.Pipeline`)."""

    program: Program
    rank: int
    stages: Mapping[int, Stage]  # program stage -> function (replicas resolved)
    params: Mapping[int, tuple[list[Tensor], PyTreeSpec]]  # owner stage -> (leaves, tree)
    entry: Sequence[tuple[Any, ...]]  # per microbatch: entry stage positional inputs
    side: Sequence[Mapping[int, Mapping[str, Any]]]  # per microbatch: stage -> keyword inputs
    targets: Sequence[Any] | None  # per microbatch, or None
    layouts: Sequence[BoundarySpecs]  # per microbatch: stage -> output specs
    loss_fn: Callable[..., Tensor] | None
    metric_fn: Callable[..., Tensor] | None = None
    recompute: frozenset[int] = frozenset()
    keep_outputs: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ties: Mapping[str, Sequence[tuple[int, int]]] = field(
        default_factory=dict
    )  # name -> (owner, leaf)
    data_size: int = 1
    trace: bool = False  # record when each instruction starts and ends (runtime.clock)
    check_finite: bool = False  # raise NonFiniteError at the first NaN/inf (stage, microbatch)
    # owner stage -> per parameter leaf, the dtype the stage computes with when the leaf is kept
    # in another (Pipeline(grad_dtype=...): float32 leaves summing float32 gradients; the
    # interpreter casts each to bf16 once per step); None: the leaf as it is
    casts: Mapping[int, tuple[torch.dtype | None, ...]] = field(default_factory=dict)
    # the loss's gradient is multiplied by this (loss scaling); a tensor stays on its device
    loss_scale: float | Tensor = 1.0
    # reduce (loss sum, metric sum, has loss) over this transport group once this rank has run
    # its last instruction (every rank; never earlier: see _Rank.run); None: the caller does it
    scalars_group: str | None = None
    # over processes: sum this rank's tallies (funcpipe.stages.tally) over this transport group
    # (its data copies), then over Chimera's replica ranks (funcpipe.runtime.tallies), once its
    # reductions are done; None: in one process, where the caller sums every rank's
    tally_group: str | None = None
    # the step's seed: each stage call runs under stage_key(seed, stage, microbatch_offset + m)
    # (funcpipe.stages.keys); None: under no key. microbatch_offset: this data copy's first
    # microbatch in the whole batch (copy c of M microbatches each: c * M)
    seed: int | None = None
    microbatch_offset: int = 0
    # sharded data parallelism (ZeRO-1, GATHER/SCATTER): owner stage -> this copy's pieces of
    # its parameter leaves (funcpipe.runtime.shards); ``params`` then holds full leaves to
    # gather into, and the owner's gradients come back as pieces. ``copy``: this rank's
    # position in its data group (the piece it holds)
    shards: Mapping[int, Sequence[Tensor]] = field(default_factory=dict)
    copy: int = 0
    # owner stage -> its leaves split over the expert axis (mixture-of-experts weights): the
    # data REDUCE sums them over the transport group EXPERT_DATA (the copies holding the same
    # experts), not over every copy
    experts: Mapping[int, frozenset[int]] = field(default_factory=dict)
    expert_size: int = 1  # the mesh's expert axis: the copies among which experts are split

    @property
    def layout(self) -> tuple[int, int, int]:
        """``(data_size, copy, expert_size)``: how this rank's sharded leaves are cut."""
        return self.data_size, self.copy, self.expert_size


EXPERT_DATA = "expert_data"  # the transport group of the copies that hold the same experts


# where each scalar of a step's one float64 reduction sits (summed over every rank)
SCALARS = {
    "loss": 0,  # sum over sink microbatches of the loss (or of the sums of (sum, count))
    "metric": 1,
    "loss_items": 2,  # microbatches with a loss
    "count": 3,  # sum of the counts of (sum, count) losses
    "counted_items": 4,  # microbatches whose loss came with a count
    "metric_count": 5,
    "metric_counted": 6,  # microbatches whose metric came as (sum, count)
    "bad_counts": 7,  # counts that were negative, infinite or NaN (refused once read)
}


@dataclass
class RankResult:
    loss_sum: Tensor | None = None  # sum over this rank's sink microbatches of the loss
    metric_sum: Tensor | None = None  # a scalar, or [sum, count] for a (sum, count) metric
    count_sum: Tensor | None = None  # float64: sum of the counts of (sum, count) losses
    # float64: how many of those counts were negative, infinite or NaN (found on the device, no
    # sync: the step refuses them when it reads its loss)
    bad_counts: Tensor | None = None
    loss_items: int = 0  # sink microbatches with a loss on this rank
    counted_items: int = 0  # of those, the ones whose loss came as (sum, count)
    # owner stage -> flat grads (sharded owners: this copy's pieces of the averaged gradients)
    grads: dict[int, list[Tensor]] = field(default_factory=dict)
    outputs: dict[int, Any] = field(default_factory=dict)  # microbatch -> sink outputs
    peak_activations: int = 0  # most (stage, microbatch) activations alive at once
    # with trace: start, end of each instruction, perf_counter seconds (CUDA: from events)
    times: list[float] = field(default_factory=list)
    # with trace: (name, start, end) of each collective the stages called (an all-to-all...)
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    # with RankInputs.scalars_group: (float64 buffer laid out as SCALARS, its reduction)
    scalars: tuple[Tensor, Handle] | None = None
    # name -> the sum of what this rank's forwards tallied (funcpipe.stages.tally); with
    # RankInputs.tally_group, over its data copies and replica ranks too
    tallies: dict[str, Tensor] = field(default_factory=dict)

    def add_loss(self, extras: Sequence[Tensor], has_metric: bool, rank: int) -> None:
        """Add one sink microbatch's loss (``[loss, count?, metric?]``, as
        :func:`funcpipe.runtime.stage_call.stage_fn` returns them) into these sums."""
        loss = extras[0].detach()
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        self.loss_items += 1
        if len(extras) - (2 if has_metric else 1) == 1:  # counted
            c = extras[1]
            self.count_sum = c if self.count_sum is None else self.count_sum + c
            bad = ((c < 0) | ~torch.isfinite(c)).to(torch.float64)
            self.bad_counts = bad if self.bad_counts is None else self.bad_counts + bad
            self.counted_items += 1
        if self.counted_items not in (0, self.loss_items):
            raise InvalidArgument(
                f"loss_fn returned a (sum, count) pair for some microbatches and a scalar for "
                f"others on rank {rank}; return one kind for every microbatch."
            )
        if has_metric:
            mv = extras[-1]
            if self.metric_sum is not None and self.metric_sum.shape != mv.shape:
                raise InvalidArgument(
                    f"metric_fn returned a (sum, count) pair for some microbatches and a "
                    f"scalar for others on rank {rank}; return one kind for every "
                    "microbatch."
                )
            self.metric_sum = mv if self.metric_sum is None else self.metric_sum + mv

    def scalar_buffer(self, device: torch.device) -> Tensor:
        """This rank's loss and metric sums (final once its sink forwards ran) in one float64
        buffer laid out as :data:`SCALARS`, for the step's one reduction."""
        buf = torch.zeros(len(SCALARS), dtype=torch.float64, device=device)
        if self.loss_sum is not None:
            buf[SCALARS["loss"]] = self.loss_sum.detach().to(torch.float64)
            buf[SCALARS["loss_items"]] = self.loss_items
        if self.count_sum is not None:
            buf[SCALARS["count"]] = self.count_sum
            buf[SCALARS["counted_items"]] = self.counted_items
            if self.bad_counts is not None:
                buf[SCALARS["bad_counts"]] = self.bad_counts
        if self.metric_sum is not None:
            msum = self.metric_sum.detach().to(torch.float64)
            if msum.ndim:  # (sum, count)
                buf[SCALARS["metric"]], buf[SCALARS["metric_count"]] = msum[0], msum[1]
                buf[SCALARS["metric_counted"]] = self.loss_items
            else:
                buf[SCALARS["metric"]] = msum
        return buf
