"""How a Pipeline lowers the schedule it is given into the program it runs, and checks it.

A compute-only schedule gets what running it needs, and nothing else: recomputation where asked,
the sums of tied parameters, the data-parallel (and Chimera replica) gradient reductions, and
the point-to-point communication; the result (or a program given lowered already) is checked
under the point-to-point rules of the transport it will run on (:func:`p2p_rules`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from funcpipe.schedule.check import check
from funcpipe.schedule.ir import COLLECTIVE_OPS, Program
from funcpipe.schedule.passes import add_communication, add_recompute, add_reduce
from funcpipe.schedule.zero import shard_data
from funcpipe.stages.ties import add_tie_reduce

__all__ = ["local_groups", "lower_program", "p2p_rules"]


def lower_program(
    schedule: Program,
    *,
    recompute: bool | Sequence[int],
    ties: Mapping[str, Sequence[Any]],
    data_parallel: bool,
    p2p: str,
    layout: Any,
    zero: int = 0,
) -> Program:
    """``schedule`` lowered for a Pipeline (``recompute``, ``ties``, ``data_parallel`` and
    ``zero`` as it was given them) and checked under the point-to-point rules ``p2p`` on the
    communicator ``layout``; a lowered ``schedule`` is only checked (with ``zero`` 1 or 2,
    sharded first: :func:`funcpipe.schedule.zero.shard_data`)."""
    p = schedule
    if p.lowered:
        p = shard_data(p, zero=zero) if zero else p
        check(p, p2p=p2p, layout=layout)
        return p
    if recompute and p.training:
        stages = range(p.n_stages) if recompute is True else recompute
        p = add_recompute(p, stages=stages)
    # ties first: their sums complete the tied leaves, which the replica sums then skip
    if p.training and ties:
        p = add_tie_reduce(p, ties)
    if p.training and (data_parallel or len(set(p.replica_of or ())) < p.n_stages):
        p = add_reduce(p, group="data")  # also adds the replica sums (Chimera)
    p = add_communication(p)
    if zero:  # GATHERs before the forwards, SCATTERs in place of the data REDUCEs
        p = shard_data(p, zero=zero)
    check(p, p2p=p2p, layout=layout)
    return p


def p2p_rules(device: torch.device | None, transport: str) -> str:
    """The point-to-point rules a pipeline's program must hold to on its transport
    (``check(..., p2p=..., layout=Pipeline.p2p_layout)``): NCCL's where it runs over NCCL or on
    CUDA devices, gloo's (buffered sends) otherwise. Programs funcpipe lowers hold to NCCL's
    everywhere."""
    if device is not None and device.type == "cuda":
        return "nccl"
    if transport == "dist":
        import torch.distributed as dist

        if dist.get_backend() == "nccl":
            return "nccl"
    return "gloo"


def local_groups(p: Program, data: int) -> dict[str, list[list[int]]]:
    """The reduction groups of ``p``'s ranks run in one process with ``data`` copies (copy
    ``d``'s rank ``r`` is ``d * n_ranks + r``)."""
    n = p.n_ranks
    groups: dict[str, list[list[int]]] = {}
    names = {i.group for r in p.ranks for i in r if i.op in COLLECTIVE_OPS}
    for name in names:
        if name == "data":
            groups[name] = [[d * n + r for d in range(data)] for r in range(n)]
        else:
            members = sorted(
                {r for r, instrs in enumerate(p.ranks) for i in instrs if i.group == name}
            )
            groups[name] = [[d * n + r for r in members] for d in range(data)]
    return groups
