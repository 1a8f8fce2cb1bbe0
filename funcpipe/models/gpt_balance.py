"""Balancing a GPT's experts (:class:`funcpipe.models.gpt.GPTConfig` with ``experts``) with
values, under any schedule and over any layout.

Both ways are inputs of the stages (batch fields every microbatch gets whole: ``dim={"inputs":
0, "route_bias": "whole", "route_load": "whole"}``, passed by ``Pipeline(side_inputs=
side_inputs(config, n, fields=...))``) computed from a step's tallies (``result.tallies``:
each MoE block's token counts, summed over microbatches and data copies):

- **DeepSeek-V3's auxiliary-loss-free bias**: ``"route_bias"`` (:func:`route_bias`) chooses
  the experts, not their weights; :func:`update_route_bias` moves it after each step from that
  step's counts. No hidden buffer: the bias goes in, the counts come out.
- **The Switch auxiliary loss over the whole batch**: ``"route_load"`` (:func:`batch_load` of
  a counting pass, an evaluation step over the same batch) is each expert's fraction of the
  batch's assignments; each microbatch's auxiliary loss then uses it in place of its own, so
  the step's loss is the cross-entropy plus the *batch's* Switch loss and each microbatch's
  backward carries its exact share of that loss's gradient, under every schedule (1F1B, ZB-V
  and DualPipeV run a microbatch's backward before later forwards: the load could not be known
  then otherwise). The price: the counting pass, a forward of the batch without a backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from funcpipe.errors import InvalidArgument
from funcpipe.models import moe
from funcpipe.models.gpt import GPTConfig, blocks_per_stage

__all__ = ["batch_load", "route_bias", "side_inputs", "update_route_bias"]


def route_bias(config: GPTConfig, *, dtype: torch.dtype = torch.float32) -> Tensor:
    """DeepSeek-V3's routing bias of every MoE block, zero: ``[MoE blocks, experts]``, passed
    to the stages as the batch field ``"route_bias"`` (:func:`side_inputs`, not split:
    ``dim={"inputs": 0, "route_bias": "whole"}``) and moved by :func:`update_route_bias`."""
    if not config.experts:
        raise InvalidArgument("route_bias: the GPTConfig has no experts (experts=0)")
    return torch.zeros(len(config.moe_blocks), config.experts, dtype=dtype)


def update_route_bias(
    bias: Tensor, tallies: dict[str, Tensor], config: GPTConfig, *, rate: float = 1e-3
) -> Tensor:
    """The next step's routing bias: each block's row moved by
    :func:`funcpipe.models.moe.update_bias` from the step's token counts (``result.tallies``,
    ``"blocks.<i>.moe.counts"``: summed over microbatches and copies). Over processes a step
    returns the counts of this process's blocks only: the other rows stay (no stage of this
    process reads them)."""
    rows = list(bias.unbind(0))
    for j, i in enumerate(config.moe_blocks):
        counts = tallies.get(f"blocks.{i}.moe.counts")
        if counts is not None:
            rows[j] = moe.update_bias(bias[j], counts.to(bias.device), rate=rate)
    return torch.stack(rows)


def batch_load(
    tallies: dict[str, Tensor], config: GPTConfig, *, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``[MoE blocks, experts]``: each expert's fraction of its block's assignments, from a
    step's tallies (a counting pass over the batch: an evaluation step); passed to the stages
    as ``"route_load"`` it makes the auxiliary loss the whole batch's (:func:`moe.moe`'s
    ``load``). A block whose counts are not here (another process's) gets an even load: no
    stage of this process reads it."""
    rows = []
    for i in config.moe_blocks:
        counts = tallies.get(f"blocks.{i}.moe.counts")
        if counts is None:
            rows.append(torch.full((config.experts,), 1.0 / config.experts, dtype=dtype))
        elif tuple(counts.shape) != (config.experts,):
            raise InvalidArgument(
                f"batch_load: the tally blocks.{i}.moe.counts has shape {tuple(counts.shape)}, "
                f"the model {config.experts} experts: counts from another model or layout "
                "(pass the tallies of a step of this model)"
            )
        else:
            rows.append(counts.to(dtype) / counts.sum().clamp(min=1).to(dtype))
    return torch.stack([r.cpu() for r in rows])


def side_inputs(
    config: GPTConfig,
    n_stages: int,
    *,
    blocks: Sequence[int] | None = None,
    fields: Sequence[str] = ("route_bias",),
) -> dict[int, list[str]]:
    """``Pipeline(side_inputs=...)`` passing ``fields`` (``"route_bias"``, ``"route_load"``)
    to the stages with MoE blocks."""
    return {
        s: list(fields)
        for s, held in enumerate(blocks_per_stage(config, n_stages, blocks))
        if any(i in config.moe_blocks for i in held)
    }
