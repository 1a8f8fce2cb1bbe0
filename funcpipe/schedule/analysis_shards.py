"""The checker's rules for sharded data parallelism: SCATTER and GATHER (ZeRO-1 and ZeRO-2,
:mod:`funcpipe.schedule.zero`).

They run over the program's data-parallel copies, which run this very program, so each copy
meets the others' in one order; what is left to prove is where they stand:

- one GATHER per stage and group, before every forward of its stage (where a rank holds
  several replicas of one stage, ``replica_of``: one for all of them, before all their
  forwards: they compute with the same parameters);
- either one SCATTER per stage and group (ZeRO-1), after every gradient contribution (B or W)
  of its stage, or one per microbatch that visits the stage (ZeRO-2: ``SCATTER s mJ``), each
  after microbatch J's contribution (a SCATTER takes what the stage gathered since the one
  before it, so every contribution is taken by the first SCATTER after it);
- in a training program a stage is gathered over a group (its parameters are shards) if and
  only if it is scattered over it (its gradients come back as shards), and not also REDUCEd
  (replicas on one rank: gathered once, each scattered);
- a program shards every stage a microbatch visits, or none, over one group; and on a rank
  that SCATTERs, the tie and replica REDUCEs come after its SCATTERs (they add the copies'
  pieces).
"""

from __future__ import annotations

from typing import Any

from funcpipe.schedule.ir import Op, in_program

__all__ = ["check_shards"]

Key = tuple[Op, tuple[int, int], str]  # (op, (rank, the stage whose parameters), group)


def _owner(p: Any, s: int) -> int:
    """The stage whose parameters stage ``s`` computes with (itself, or what it replicates)."""
    return p.replica_of[s] if p.replica_of else s


def check_shards(a: Any) -> None:
    """Raise the first broken rule of the module docstring (``a``: the checker's analyser,
    with ``p``, ``where``, ``fail`` and ``need_local``)."""
    p = a.p
    seen: dict[Key, tuple[int, int]] = {}  # (op, stage, group) -> its first (rank, step)
    tagged: dict[tuple[int, str], dict[int, tuple[int, int]]] = {}  # ZeRO-2's, per microbatch
    untagged: set[tuple[int, str]] = set()
    sharding_group: tuple[str, int, int] | None = None  # (group, where it was first named)
    reduced = {  # (rank, owner, group): replicas on one rank share one gradient sum
        (r, _owner(p, i.stage), i.group)
        for r, instrs in enumerate(p.ranks)
        for i in instrs
        if i.op is Op.REDUCE
    }
    for r, instrs in enumerate(p.ranks):
        for t, i in enumerate(instrs):
            if i.op is not Op.SCATTER and i.op is not Op.GATHER:
                continue
            s, g = i.stage, i.group
            if in_program(g):
                raise a.fail(
                    r,
                    t,
                    "SCATTER and GATHER run over the data-parallel copies of the program",
                    f"group {g!r} names ranks of this program; use 'data'",
                )
            if sharding_group is None:
                sharding_group = (g, r, t)
            elif g != sharding_group[0]:
                raise a.fail(
                    r,
                    t,
                    "a program shards over one group (its copies hold one set of pieces)",
                    f"{i.op.value} over {g!r}, where rank {sharding_group[1]} step "
                    f"{sharding_group[2]} shards over {sharding_group[0]!r}; use one group",
                )
            if i.op is Op.SCATTER:
                _scatter(a, r, t, i, tagged, untagged)
            else:
                _gather(a, r, t, i, seen)
            seen.setdefault((i.op, (r, _owner(p, s)), g), (r, t))
            if i.op is Op.SCATTER and (r, _owner(p, s), g) in reduced:
                raise a.fail(
                    r,
                    t,
                    "a stage's gradients are REDUCEd or SCATTERed over a group, not both",
                    f"stage {s} (or a replica of its stage on rank {r}) also has a REDUCE "
                    f"over {g}; remove one",
                )
    _every_microbatch(a, tagged)
    _all_or_none(a, seen)
    for (op, key, g), (r, t) in seen.items():
        other = Op.SCATTER if op is Op.GATHER else Op.GATHER
        if p.training and (other, key, g) not in seen:
            s = p.ranks[r][t].stage
            raise a.fail(
                r,
                t,
                "in a training program a stage is GATHERed over a group if and only if it "
                "is SCATTERed over it (shard parameters, shard gradients)",
                f"add {other.value} s{s} {g} (funcpipe.schedule.shard_data places both)",
            )
    if p.training:
        _every_stage_scattered(a, seen, tagged, untagged)


def _gather(a: Any, r: int, t: int, i: Any, seen: dict[Key, tuple[int, int]]) -> None:
    p, o = a.p, _owner(a.p, i.stage)
    key = (Op.GATHER, (r, o), i.group)
    if key in seen:
        r0, t0 = seen[key]
        raise a.fail(
            r,
            t,
            "a stage has at most one GATHER per group (on each rank that holds it)",
            f"duplicate of rank {r0}, step {t0} ({p.ranks[r0][t0]}); remove one",
        )
    for s in (s for s in p.stages_on(r) if _owner(p, s) == o):
        for mb in (mb for mb in range(p.microbatches) if s in p.visits(mb)):
            if (f := a.where.get((Op.F, s, mb))) is not None and f[1] < t:
                raise a.fail(
                    r,
                    t,
                    "GATHER comes before every forward of its stage",
                    f"F s{s} m{mb} runs earlier (step {f[1]}); move the GATHER before it",
                )


def _contribution(a: Any, s: int, mb: int) -> tuple[Op, int, int]:
    """The instruction that adds microbatch ``mb``'s weight gradients of stage ``s``."""
    return (Op.B, s, mb) if (Op.B, s, mb) in a.where else (Op.W, s, mb)


def _scatter(
    a: Any,
    r: int,
    t: int,
    i: Any,
    tagged: dict[tuple[int, str], dict[int, tuple[int, int]]],
    untagged: set[tuple[int, str]],
) -> None:
    p, s, g, mb = a.p, i.stage, i.group, i.microbatch
    mine = tagged.get((s, g), {})
    if mb < 0:
        if (s, g) in untagged or mine:
            rule = "a stage has one SCATTER per group (ZeRO-1) or one per microbatch (ZeRO-2)"
            what = "another" if (s, g) in untagged else "per-microbatch ones"
            raise a.fail(r, t, rule, f"stage {s} has {what} over {g!r} too; remove one")
        untagged.add((s, g))
        for m in (m for m in range(p.microbatches) if s in p.visits(m)):
            key = _contribution(a, s, m)
            a.need_local(
                r,
                t,
                key,
                "SCATTER comes after every gradient contribution (B or W) of its stage",
                f"{key[0].value} s{s} m{m}",
            )
        return
    if (s, g) in untagged or mb in mine:
        r0, t0 = mine.get(mb, (r, t))
        raise a.fail(
            r,
            t,
            "a stage has one SCATTER per group (ZeRO-1) or one per microbatch (ZeRO-2)",
            f"stage {s} is also SCATTERed over {g!r} at rank {r0}, step {t0}; remove one",
        )
    tagged.setdefault((s, g), {})[mb] = (r, t)
    key = _contribution(a, s, mb)
    a.need_local(
        r,
        t,
        key,
        "SCATTER s mJ comes after microbatch J's gradient contribution (B or W) of its stage",
        f"{key[0].value} s{s} m{mb}",
    )


def _every_microbatch(a: Any, tagged: dict[tuple[int, str], dict[int, tuple[int, int]]]) -> None:
    p = a.p
    for (s, g), mine in tagged.items():
        if not mine:
            continue
        missing = [m for m in range(p.microbatches) if s in p.visits(m) and m not in mine]
        if missing:
            r, t = max(mine.values())
            raise a.fail(
                r,
                t,
                "a stage SCATTERed per microbatch has one SCATTER for each microbatch that "
                "visits it",
                f"stage {s} has none over {g!r} for microbatches {missing}; add "
                f"SCATTER s{s} m{missing[0]} {g} after its gradient contribution",
            )


def _every_stage_scattered(
    a: Any,
    seen: dict[Key, tuple[int, int]],
    tagged: dict[tuple[int, str], dict[int, tuple[int, int]]],
    untagged: set[tuple[int, str]],
) -> None:
    """In training, every visited stage whose parameters its rank GATHERs over a group has a
    SCATTER of its own over it: replicas on one rank gather once but each adds gradients, and
    a replica left out would lose its microbatches' gradients silently."""
    p = a.p
    visited = set().union(*(p.visits(m) for m in range(p.microbatches)))
    for (op, (r, o), g), at in seen.items():
        if op is not Op.GATHER:
            continue
        for s in sorted(p.stages_on(r)):
            if (
                s in visited
                and _owner(p, s) == o
                and (s, g) not in untagged
                and (s, g) not in tagged
            ):
                raise a.fail(
                    *at,
                    "every stage a rank GATHERs adds its gradients with a SCATTER of its own "
                    "(replicas of one stage on a rank too)",
                    f"stage {s} computes with the parameters gathered here and has no SCATTER "
                    f"over {g!r}; add SCATTER s{s} {g} after its last B or W (shard_data does)",
                )


def _all_or_none(a: Any, seen: dict[Key, tuple[int, int]]) -> None:
    p = a.p
    gathers = {(key, g): at for (op, key, g), at in seen.items() if op is Op.GATHER}
    visited = set().union(*(p.visits(m) for m in range(p.microbatches)))
    for g in sorted({g for _, g in gathers}):
        have = {key for key, h in gathers if h == g}
        missing = sorted(s for s in visited if (p.placement[s], _owner(p, s)) not in have)
        if missing:
            r, t = min(at for (_, h), at in gathers.items() if h == g)
            raise a.fail(
                r,
                t,
                "a program shards every stage a microbatch visits, or none",
                f"stages {missing} have no GATHER over {g!r}; "
                "funcpipe.schedule.shard_data places one per stage",
            )
    for r, instrs in enumerate(p.ranks):
        last = max((t for t, i in enumerate(instrs) if i.op is Op.SCATTER), default=0)
        for t, i in enumerate(instrs[:last]):
            if i.op is Op.REDUCE and in_program(i.group):
                raise a.fail(
                    r,
                    t,
                    "with sharded gradients a tie or replica REDUCE comes after its rank's "
                    "SCATTERs (it adds the copies' pieces)",
                    f"move it after step {last} ({instrs[last]})",
                )
