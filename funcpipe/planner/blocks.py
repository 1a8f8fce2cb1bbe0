"""The blocks of a model by kind, what each costs on one GPU, and how many of each a stage holds.

A dense transformer has one kind of block; a mixture of experts up to four: dense-MLP blocks
(the first ``dense_layers``) and MoE blocks, each with full or sliding-window attention. A
stage's F, I and W are the sums over its blocks (blocks are assigned to stages in order, the
first stage taking the first ``stage_layers[0]`` of them), each block's with its communication:
the tensor-parallel collectives and, in an MoE block, the expert all-to-alls.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from funcpipe.planner import comm
from funcpipe.planner.calibration import Calibration
from funcpipe.planner.cluster import Cluster
from funcpipe.planner.compute import OpCosts, layer_costs
from funcpipe.planner.layout import ClusterLayout
from funcpipe.planner.model import Transformer
from funcpipe.planner.moe import moe_comm, moe_layer_costs

__all__ = ["Block", "Kind", "block_table", "stage_kinds"]

Kind = tuple[bool, bool]
"""(MoE block, windowed attention)."""


@dataclass(frozen=True)
class Block:
    """One kind of block on one GPU for one microbatch: its compute ``costs``, tensor-parallel
    seconds in F and I (``tp_f``, ``tp_i``), all-to-all seconds in F and I (``a2a_f``,
    ``a2a_i``), and its ``dense`` and ``expert`` parameters (whole: the dense ones are split
    over ``tensor``, the experts over ``tensor x expert``)."""

    costs: OpCosts
    tp_f: float
    tp_i: float
    a2a_f: float
    a2a_i: float
    dense: int
    expert: int

    @property
    def f(self) -> float:
        return self.costs.f + self.tp_f + self.a2a_f

    @property
    def i(self) -> float:
        return self.costs.i + self.tp_i + self.a2a_i


def _dense_tp(model: Transformer, layout: ClusterLayout, cluster: Cluster) -> float:
    """A dense block's tensor-parallel seconds in F: two all-reduces of its activation, or with
    sequence parallelism an all-gather and a reduce-scatter around each half."""
    t = layout.tensor
    tlink = cluster.link(stride=1, size=t)
    act_bytes = layout.microbatch * model.seq * model.hidden * model.bytes
    if layout.sequence_parallel:  # all-gather before, reduce-scatter after each block half
        return 2 * (comm.all_gather(act_bytes, t, tlink) + comm.reduce_scatter(act_bytes, t, tlink))
    return 2 * comm.all_reduce(act_bytes, t, tlink)  # one after attention, one after the MLP


def block_table(
    model: Transformer, layout: ClusterLayout, cluster: Cluster, cal: Calibration
) -> dict[Kind, Block]:
    """Every kind of block the model has, priced."""
    kinds = _kinds(model)
    again = 2 if layout.recompute == "full" else 1  # a full recompute runs F's collectives again
    table: dict[Kind, Block] = {}
    for moe, windowed in sorted(kinds):
        if moe:
            costs = moe_layer_costs(model, layout, cluster, cal, windowed=windowed)
            tp_f, a2a_f = moe_comm(model, layout, cluster)
            dense, expert = model.moe_layer_params()
            table[moe, windowed] = Block(
                costs, tp_f, tp_f * again, a2a_f, a2a_f * again, dense, expert
            )
        else:
            costs = layer_costs(model, layout, cluster, cal, windowed=windowed)
            tp_f = _dense_tp(model, layout, cluster)
            table[moe, windowed] = Block(
                costs, tp_f, tp_f * again, 0.0, 0.0, model.layer_params(), 0
            )
    return table


def _kinds(model: Transformer) -> set[Kind]:
    if not model.experts and model.window is None:
        return {(False, False)}  # a dense model's one kind, without walking its blocks
    return {(model.is_moe(n), model.windowed(n)) for n in range(model.layers)}


def stage_kinds(model: Transformer, counts: Sequence[int]) -> list[tuple[tuple[Kind, int], ...]]:
    """Per stage, how many blocks of each kind it holds: ``counts[s]`` blocks in order."""
    one = _kinds(model)
    if len(one) == 1:
        (kind,) = one
        return [((kind, n),) if n else () for n in counts]
    out = []
    start = 0
    for n in counts:
        seen: dict[Kind, int] = {}
        for block in range(start, start + n):
            kind = (model.is_moe(block), model.windowed(block))
            seen[kind] = seen.get(kind, 0) + 1
        out.append(tuple(seen.items()))
        start += n
    return out
