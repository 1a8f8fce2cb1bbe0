"""Sharded data parallelism (ZeRO-1) as instructions: :func:`shard_data`.

With ``d`` data-parallel copies of a program, each copy holds, between steps, only its shard
(``1/d``) of every stage's parameters, and so of their optimizer state. Two instructions move
between the shards and the full tensors, over the group of the copies (``data``):

- ``GATHER s data``: all-gather every copy's shards of stage s's parameters into the full
  parameters the stage computes with. It opens the rank's program (the GATHERs of a rank in
  the order of its stages' first forwards), so it can run while the rank waits for its first
  input; the stage's first F waits for it.
- ``SCATTER s data``: reduce-scatter stage s's gradient sums, averaged over the copies, so that
  each copy keeps the average of its shard only. It stands where ``REDUCE s data`` would: after
  the stage's last gradient contribution (B or W).

The sharding rule (the runtime's, :mod:`funcpipe.runtime.shards`): every parameter leaf is
flattened and cut with ``torch.tensor_split(leaf.flatten(), d)``; copy ``c`` holds piece ``c``.
Copies run the same program, so each meets the others' SCATTERs and GATHERs in one order: the
checker proves the rest (:mod:`funcpipe.schedule.analysis`: over the copies, not a tie or a
replica group; once per stage; a SCATTER after its stage's gradients, a GATHER before its
forwards; in a training program a stage is gathered if and only if it is scattered, and not
also REDUCEd over the same group).
"""

from __future__ import annotations

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.ir import Op, Program, gather, scatter
from funcpipe.schedule.passes import add_reduce

__all__ = ["shard_data"]


def shard_data(program: Program, *, group: str = "data") -> Program:
    """``program`` with its parameters and gradients sharded over the copies of ``group``.

    A training program gets :func:`~funcpipe.schedule.passes.add_reduce` over ``group`` where it
    has none, then every ``REDUCE s group`` becomes ``SCATTER s group``; every rank's program
    opens with one ``GATHER s group`` per stage it runs (for an eval program too: its
    parameters are shards as well), in the order of the stages' first forwards. Works on
    compute-only and lowered programs alike (no SEND/RECV moves); a program that has SCATTERs
    or GATHERs over ``group`` already is returned as it is. Chimera's replicated stages are
    not supported yet (:class:`InvalidArgument`).
    """
    if not isinstance(program, Program):
        raise InvalidArgument(f"shard_data takes a Program, got {type(program).__name__}")
    if any(i.op in (Op.SCATTER, Op.GATHER) and i.group == group for r in program.ranks for i in r):
        return program
    if program.replica_of and len(set(program.replica_of)) < program.n_stages:
        raise InvalidArgument(
            f"shard_data: program {program.name or '(unnamed)'} replicates stages "
            "(replica_of, Chimera); sharded data parallelism does not support replicas yet: "
            "use another schedule, or no sharding (zero=0)"
        )
    if program.training:
        program = add_reduce(program, group=group)
    ranks = []
    for instrs in program.ranks:
        firsts: list[int] = []
        for i in instrs:
            if i.op is Op.F and i.stage not in firsts:
                firsts.append(i.stage)
        head = [gather(s, group) for s in firsts]
        body = [
            scatter(i.stage, group) if i.op is Op.REDUCE and i.group == group else i for i in instrs
        ]
        ranks.append(tuple(head + body))
    return program.replace(ranks=tuple(ranks))
