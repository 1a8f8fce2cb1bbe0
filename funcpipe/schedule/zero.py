"""Sharded data parallelism (ZeRO-1 and ZeRO-2) as instructions: :func:`shard_data`.

With ``d`` data-parallel copies of a program, each copy holds, between steps, only its shard
(``1/d``) of every stage's parameters, and so of their optimizer state. Two instructions move
between the shards and the full tensors, over the group of the copies (``data``):

- ``GATHER s data``: all-gather every copy's shards of stage s's parameters into the full
  parameters the stage computes with. It opens the rank's program (the GATHERs of a rank in
  the order of its stages' first forwards), so it can run while the rank waits for its first
  input; the stage's first F waits for it.
- ``SCATTER s data`` (ZeRO-1): reduce-scatter stage s's gradient sums, averaged over the
  copies, so that each copy keeps the average of its shard only. It stands where
  ``REDUCE s data`` would: after the stage's last gradient contribution (B or W). The full
  gradient sums live from the stage's first backward to here.
- ``SCATTER s mJ data`` (ZeRO-2): one per microbatch, right after the instruction that adds
  microbatch J's weight gradients (its W, or its B where the backward is not split): what the
  stage gathered since its previous SCATTER is reduce-scattered and added into the copy's
  shard of the sum. A full gradient then lives only from one backward to the next SCATTER, at
  the price of one reduce-scatter per (stage, microbatch) instead of one per stage.

The sharding rule (the runtime's, :mod:`funcpipe.runtime.shards`): every parameter leaf is
flattened and cut with ``torch.tensor_split(leaf.flatten(), d)``; copy ``c`` holds piece ``c``.
Copies run the same program, so each meets the others' SCATTERs and GATHERs in one order: the
checker proves the rest (:mod:`funcpipe.schedule.analysis`: over the copies, not a tie or a
replica group; one GATHER per stage, and one SCATTER or one per microbatch; a SCATTER after
the gradients it takes, a GATHER before its forwards; in a training program a stage is
gathered if and only if it is scattered, and not also REDUCEd over the same group).
"""

from __future__ import annotations

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.ir import Instr, Op, Program, gather, in_program, scatter
from funcpipe.schedule.passes import _after_comm, _pairs_next, add_reduce

__all__ = ["shard_data"]


def shard_data(program: Program, *, group: str = "data", zero: int = 1) -> Program:
    """``program`` with its parameters and gradients sharded over the copies of ``group``.

    A training program gets :func:`~funcpipe.schedule.passes.add_reduce` over ``group`` where it
    has none; with ``zero=1`` every ``REDUCE s group`` then becomes ``SCATTER s group``; with
    ``zero=2`` it goes, and every microbatch's weight-gradient instruction of stage s (W, or B)
    is followed (after the SEND/RECVs right after it) by ``SCATTER s mJ group``. At either
    level the rank's tie and replica REDUCEs move after its last SCATTER (they add the pieces). Every rank's
    program opens with one ``GATHER s group`` per stage it runs (for an eval program too: its
    parameters are shards as well), in the order of the stages' first forwards. Works on
    compute-only and lowered programs alike (no SEND/RECV moves); a program that has SCATTERs
    or GATHERs over ``group`` already is returned as it is.

    Replicated stages (``replica_of``, Chimera): each rank gathers and scatters the stages it
    holds as any other; its replica REDUCEs then add the copies' pieces of the replicas (every
    member of a replica group is the same data copy, so holds the same pieces). Refused
    (:class:`InvalidArgument`): a replica that no microbatch visits (Chimera with one
    microbatch). A rank that holds two replicas of one stage (Chimera at an odd pipeline
    size) gathers it once, before the first forward of either, and scatters each.
    """
    if not isinstance(program, Program):
        raise InvalidArgument(f"shard_data takes a Program, got {type(program).__name__}")
    if isinstance(zero, bool) or zero not in (1, 2):
        raise InvalidArgument(
            f"shard_data(zero={zero!r}): 1 (one SCATTER per stage: ZeRO-1) or 2 (one per "
            "microbatch: ZeRO-2)"
        )
    if any(i.op in (Op.SCATTER, Op.GATHER) and i.group == group for r in program.ranks for i in r):
        return program
    if program.replica_of and len(set(program.replica_of)) < program.n_stages:
        _check_replicas(program)
    if program.training:
        program = add_reduce(program, group=group)
    owners = program.replica_of or tuple(range(program.n_stages))
    ranks = []
    for instrs in program.ranks:
        firsts: dict[int, int] = {}  # owner -> its first forwarded stage (replicas: one)
        for i in instrs:
            if i.op is Op.F:
                firsts.setdefault(owners[i.stage], i.stage)
        head = [gather(s, group) for s in firsts.values()]
        if zero == 1:
            body = [
                scatter(i.stage, group) if i.op is Op.REDUCE and i.group == group else i
                for i in instrs
            ]
        else:
            body = _per_microbatch(instrs, group)
        ranks.append(tuple(head + _sums_after_scatters(body)))
    return program.replace(ranks=tuple(ranks))


def _per_microbatch(instrs: tuple[Instr, ...], group: str) -> list[Instr]:
    """One rank's instructions with ZeRO-2's SCATTERs in place of its ``REDUCE s group``."""
    sharded = {i.stage for i in instrs if i.op is Op.REDUCE and i.group == group}
    split = {(i.stage, i.microbatch) for i in instrs if i.op is Op.W}
    after: dict[int, list[Instr]] = {}  # index -> the SCATTERs that go just before it
    for t, i in enumerate(instrs):
        if i.stage in sharded and (
            i.op is Op.W or (i.op is Op.B and (i.stage, i.microbatch) not in split)
        ):
            end = t + 1 if _pairs_next(instrs, t) else t  # (after a pair the B heads)
            after.setdefault(_after_comm(instrs, end), []).append(
                scatter(i.stage, group, i.microbatch)
            )
    body: list[Instr] = []
    for t, i in enumerate(instrs):
        body.extend(after.get(t, ()))
        if not (i.op is Op.REDUCE and i.group == group):
            body.append(i)
    body.extend(after.get(len(instrs), ()))
    return body


def _sums_after_scatters(body: list[Instr]) -> list[Instr]:
    """A rank's tie and replica REDUCEs moved after its last SCATTER, in their order (they add
    this copy's pieces, which the SCATTERs make)."""
    last = max((t for t, i in enumerate(body) if i.op is Op.SCATTER), default=-1)
    early = {t for t, i in enumerate(body[:last]) if i.op is Op.REDUCE and in_program(i.group)}
    if not early:
        return body
    rest = [i for t, i in enumerate(body) if t not in early]
    at = last - len(early) + 1
    return [*rest[:at], *(body[t] for t in sorted(early)), *rest[at:]]


def _check_replicas(program: Program) -> None:
    visited = frozenset().union(*(program.visits(m) for m in range(program.microbatches)))
    name = program.name or "(unnamed)"
    for r in range(program.n_ranks):
        held = sorted(program.stages_on(r))
        idle = [s for s in held if s not in visited]
        if idle and program.training:
            raise InvalidArgument(
                f"shard_data: program {name} leaves replica stage(s) {idle} on rank {r} "
                "unvisited (Chimera with one microbatch runs no up pipeline), and a sharded "
                "replica sum needs every replica's pieces: use at least 2 microbatches, or no "
                "sharding (zero=0)"
            )
