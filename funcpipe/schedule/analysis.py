"""The checker's rules: every static rule a sound program keeps, and the dependency graph.

:func:`analyse` accepts compute-only programs (cross-rank data is taken to travel implicitly once
it is produced) and lowered programs (every cross-rank edge has its SEND and RECV). It raises a
:class:`~funcpipe.errors.ScheduleError` naming the rank, the step, the instruction and the rule,
with the rank x step table around the bad step, and returns the cross-rank dependencies and the
collective meetings (an :class:`Analysis`), the graph the simulator runs on.

The rules that need a run (no deadlock) are proved by running that graph:
:func:`funcpipe.schedule.check.check` is this analysis plus the simulator.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from funcpipe.errors import ScheduleError
from funcpipe.schedule.analysis_shards import check_shards
from funcpipe.schedule.ir import (
    ACT,
    BACKWARD_OPS,
    COLLECTIVE_OPS,
    COMM_OPS,
    COMPUTE_OPS,
    GRAD,
    IN_PROGRAM_PREFIXES,
    Instr,
    Op,
    Program,
    in_program,
)
from funcpipe.schedule.pairs import check_pairs

__all__ = ["IN_PROGRAM_PREFIXES", "Analysis", "Dep", "analyse", "fail", "in_program"]

_WINDOW = 6  # steps shown either side of the bad step in an error's table


@dataclass(frozen=True, slots=True)
class Dep:
    """Instruction (rank, step) must have finished; ``message`` adds the communication latency."""

    rank: int
    step: int
    message: bool = False


@dataclass(frozen=True)
class Analysis:
    """What the checker proved: the dependencies, the messages and the collective meetings.

    - ``deps[(rank, step)]``: what that instruction waits for. A compute instruction waits for
      its inputs: a RECV earlier on its rank (lowered), or the producing instruction on another
      rank plus the latency (compute-only). A RECV's one dep is its SEND (``message=True``): the
      RECV is *posted* at its place and completes when the data arrives; only the compute that
      reads it waits.
    - ``partner[(rank, step)]``: the other end of a SEND or RECV.
    - ``meetings[(rank, step)]``: every member of that REDUCE's in-program collective call.
    """

    program: Program
    deps: dict[tuple[int, int], tuple[Dep, ...]]
    meetings: dict[tuple[int, int], tuple[tuple[int, int], ...]]  # (rank, step) -> all members
    partner: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)


def fail(program: Program, rank: int, step: int, rule: str, detail: str) -> ScheduleError:
    """A ScheduleError for (rank, step) with the table around it marked."""
    instrs = program.ranks[rank] if 0 <= rank < program.n_ranks else ()
    instr = instrs[step] if 0 <= step < len(instrs) else None
    where = f"rank {rank}, step {step}" + (f" ({instr})" if instr is not None else " (end of rank)")
    table = program.table(mark=(rank, step), window=_WINDOW)
    name = f" in program {program.name!r}" if program.name else ""
    message = f"{where}{name}: {detail}\nrule: {rule}\n{table}"
    return ScheduleError(message, rank=rank, step=step, instruction=instr, rule=rule)


class _Analyser:
    def __init__(self, program: Program) -> None:
        self.p = program
        self.lowered = program.lowered
        # (op, stage, microbatch) -> (rank, step) for compute ops
        self.where: dict[tuple[Op, int, int], tuple[int, int]] = {}
        # (op, kind, edge, microbatch) -> (rank, step) for SEND/RECV
        self.msg: dict[tuple[Op, str, tuple[int, int], int], tuple[int, int]] = {}
        self.deps: dict[tuple[int, int], list[Dep]] = defaultdict(list)
        self.meetings: dict[tuple[int, int], tuple[tuple[int, int], ...]] = {}
        self.partner: dict[tuple[int, int], tuple[int, int]] = {}

    def fail(self, rank: int, step: int, rule: str, detail: str) -> ScheduleError:
        return fail(self.p, rank, step, rule, detail)

    # ------------------------------------------------------------------ pass 1: each instruction
    def validate_instruction(self, r: int, t: int, i: Instr) -> None:
        p = self.p
        rule = "every instruction names a stage held by its rank and a microbatch that visits it"
        if not 0 <= i.stage < p.n_stages:
            raise self.fail(
                r, t, rule, f"stage {i.stage} does not exist (stages 0..{p.n_stages - 1})"
            )
        if p.placement[i.stage] != r:
            raise self.fail(
                r,
                t,
                rule,
                f"stage {i.stage} is placed on rank {p.placement[i.stage]}, not rank {r}; move the "
                f"instruction to rank {p.placement[i.stage]} or change the placement",
            )
        if i.op in COLLECTIVE_OPS:
            if not p.training and i.op is not Op.GATHER:
                raise self.fail(
                    r, t, "an eval program has no gradients", f"{i.op.value} in an eval program"
                )
            if i.microbatch < 0:  # (ZeRO-2's SCATTERs name one: checked below)
                return
        if not 0 <= i.microbatch < p.microbatches:
            raise self.fail(
                r, t, rule, f"microbatch {i.microbatch} does not exist (0..{p.microbatches - 1})"
            )
        if i.stage not in p.visits(i.microbatch):
            raise self.fail(
                r,
                t,
                rule,
                f"microbatch {i.microbatch} enters at stage {p.entries[i.microbatch]} and never "  # type: ignore[index]
                f"reaches stage {i.stage}",
            )
        if not p.training and (i.op in (Op.B, Op.I, Op.W, Op.R) or i.kind == GRAD):
            raise self.fail(
                r,
                t,
                "an eval (forward-only) program runs only forwards and their activations",
                f"{i.op.value} in an eval program; drop it or set 'mode train'",
            )
        if i.op in COMM_OPS:
            if i.kind not in (ACT, GRAD):
                raise self.fail(
                    r,
                    t,
                    "a message carries an activation ('act') or a gradient ('grad')",
                    f"kind={i.kind!r}",
                )
            rule = "a SEND/RECV moves data along an edge of the stage graph to the rank holding the far stage"
            if not 0 <= i.other < p.n_stages or i.edge not in set(p.edges or ()):
                a, b = i.edge
                raise self.fail(r, t, rule, f"s{a}>s{b} is not an edge of the stage graph")
            if p.placement[i.other] == r:
                raise self.fail(
                    r,
                    t,
                    "same-rank edges stay local (no SEND/RECV to oneself)",
                    f"stage {i.other} is on this rank too; remove this {i.op.value}",
                )
            if i.peer != p.placement[i.other]:
                raise self.fail(
                    r,
                    t,
                    rule,
                    f"the peer is rank {i.peer} but stage {i.other} is placed on rank "
                    f"{p.placement[i.other]}",
                )

    def index(self) -> None:
        p = self.p
        for r, instrs in enumerate(p.ranks):
            for t, i in enumerate(instrs):
                self.validate_instruction(r, t, i)
                if i.op in COMPUTE_OPS:
                    key = (i.op, i.stage, i.microbatch)
                    if key in self.where:
                        r0, t0 = self.where[key]
                        raise self.fail(
                            r,
                            t,
                            "each (stage, microbatch) runs each of F, B, I, W, R at most once",
                            f"duplicate of rank {r0}, step {t0}; remove one",
                        )
                    self.where[key] = (r, t)
                elif i.op in COMM_OPS:
                    mkey = (i.op, i.kind, i.edge, i.microbatch)
                    if mkey in self.msg:
                        r0, t0 = self.msg[mkey]
                        raise self.fail(
                            r,
                            t,
                            "each message is sent once and received once",
                            f"duplicate of rank {r0}, step {t0}; remove one",
                        )
                    self.msg[mkey] = (r, t)

    # ------------------------------------------------------------------ pass 2: completeness
    def complete(self) -> None:
        p = self.p
        for m in range(p.microbatches):
            for s in sorted(p.visits(m)):
                r = p.placement[s]
                end = len(p.ranks[r])
                if (Op.F, s, m) not in self.where:
                    uses = [
                        t for t, i in enumerate(p.ranks[r]) if (i.stage, i.microbatch) == (s, m)
                    ]
                    raise self.fail(
                        r,
                        uses[0] if uses else end,
                        "every (stage, microbatch) has exactly one F",
                        f"F s{s} m{m} is missing on rank {r}",
                    )
                if not p.training:
                    continue
                has_b = (Op.B, s, m) in self.where
                has_i = (Op.I, s, m) in self.where
                has_w = (Op.W, s, m) in self.where
                rule = (
                    "in training every (stage, microbatch) has one backward: a B, or an I then a W"
                )
                if has_b and (has_i or has_w):
                    rr, tt = self.where[(Op.I if has_i else Op.W, s, m)]
                    raise self.fail(
                        rr, tt, rule, f"s{s} m{m} has a B and also an I/W; keep one form"
                    )
                if not has_b and not (has_i and has_w):
                    if has_i or has_w:
                        rr, tt = self.where[(Op.I if has_i else Op.W, s, m)]
                        missing = "W" if has_i else "I"
                        raise self.fail(rr, tt, rule, f"{missing} s{s} m{m} is missing")
                    raise self.fail(r, end, rule, f"no backward (B, or I and W) for s{s} m{m}")
                if (Op.R, s, m) in self.where:
                    rr, tt = self.where[(Op.R, s, m)]
                    back = self.where[(Op.B if has_b else Op.I, s, m)]
                    f = self.where[(Op.F, s, m)]
                    if not f[1] < tt < back[1]:
                        raise self.fail(
                            rr,
                            tt,
                            "R (recompute) comes after the stage's F and before its B or I",
                            f"F s{s} m{m} is at step {f[1]} and its backward at step {back[1]}",
                        )
        if self.lowered:
            self.complete_messages()

    def complete_messages(self) -> None:
        p = self.p
        for m in range(p.microbatches):
            visits = p.visits(m)
            for a, b in p.edges or ():
                if a not in visits or p.placement[a] == p.placement[b]:
                    continue
                kinds = (ACT, GRAD) if p.training else (ACT,)
                for kind in kinds:
                    src, dst = (a, b) if kind == ACT else (b, a)
                    for op, stage, peer_stage in ((Op.SEND, src, dst), (Op.RECV, dst, src)):
                        if (op, kind, (a, b), m) not in self.msg:
                            r = p.placement[stage]
                            raise self.fail(
                                r,
                                len(p.ranks[r]),
                                "a lowered program has a SEND and a RECV for every cross-rank edge",
                                f"{op.value} {kind} s{a}>s{b} m{m} is missing on rank {r} "
                                f"({'to' if op is Op.SEND else 'from'} rank {p.placement[peer_stage]}); "
                                "run funcpipe.schedule.passes.add_communication on the compute-only program",
                            )

    # ------------------------------------------------------------------ pass 3: dependencies
    def need_local(
        self,
        r: int,
        t: int,
        key: tuple[Op, int, int] | tuple[Op, str, tuple[int, int], int],
        rule: str,
        what: str,
    ) -> None:
        loc = self.where.get(key) if len(key) == 3 else self.msg.get(key)
        if loc is None or loc[0] != r or loc[1] >= t:
            if loc is None:
                detail = f"it needs {what}, which is not in the program"
            elif loc[0] != r:
                detail = f"it needs {what}, which is on rank {loc[0]} (step {loc[1]})"
            else:
                detail = f"it needs {what}, which comes later on this rank (step {loc[1]})"
            raise self.fail(r, t, rule, detail)

    def need_data(self, r: int, t: int, kind: str, edge: tuple[int, int], m: int) -> None:
        """Instruction (r, t) consumes the ``kind`` data of ``edge`` for microbatch ``m``."""
        p = self.p
        a, b = edge
        src_stage = a if kind == ACT else b
        rule = "an instruction runs only after its inputs exist"
        if kind == ACT:
            producers = [(Op.F, a, m)]
            what = f"the output of F s{a} m{m}"
        else:
            producers = [(Op.B, b, m), (Op.I, b, m)]
            what = f"the input gradient of stage {b} (B or I s{b} m{m})"
        if p.placement[src_stage] == r:
            key = next((k for k in producers if k in self.where), producers[0])
            self.need_local(r, t, key, rule, what)
        elif self.lowered:
            wanted = (Op.RECV, kind, edge, m)
            self.need_local(
                r,
                t,
                wanted,
                rule,
                f"RECV {kind} s{a}>s{b} m{m} (the data of {what}) earlier on this rank",
            )
            self.deps[(r, t)].append(Dep(r, self.msg[wanted][1]))  # it waits for the data
        else:
            loc = next((self.where[k] for k in producers if k in self.where), None)
            if loc is None:  # completeness already reported missing compute
                raise self.fail(r, t, rule, f"it needs {what}, which is not in the program")
            self.deps[(r, t)].append(Dep(loc[0], loc[1], message=True))

    def dependencies(self) -> None:
        p = self.p
        for r, instrs in enumerate(p.ranks):
            for t, i in enumerate(instrs):
                s, m = i.stage, i.microbatch
                if i.op is Op.F:
                    for a in p.producers(s):
                        self.need_data(r, t, ACT, (a, s), m)
                elif i.op is Op.R:
                    self.need_local(
                        r, t, (Op.F, s, m), "R comes after the stage's F", f"F s{s} m{m}"
                    )
                elif i.op in BACKWARD_OPS:
                    self.need_local(
                        r,
                        t,
                        (Op.F, s, m),
                        "a backward comes after its own F on the same rank",
                        f"F s{s} m{m}",
                    )
                    for c in p.consumers(s):
                        self.need_data(r, t, GRAD, (s, c), m)
                elif i.op is Op.W:
                    self.need_local(
                        r,
                        t,
                        (Op.I, s, m),
                        "W comes after the I of the same stage and microbatch",
                        f"I s{s} m{m}",
                    )
                elif i.op is Op.SEND:
                    a, b = i.edge
                    if i.kind == ACT:
                        self.need_local(
                            r,
                            t,
                            (Op.F, a, m),
                            "a SEND comes after the instruction producing its data",
                            f"F s{a} m{m}",
                        )
                    else:
                        key = (Op.B, b, m) if (Op.B, b, m) in self.where else (Op.I, b, m)
                        self.need_local(
                            r,
                            t,
                            key,
                            "a SEND comes after the instruction producing its data",
                            f"B or I s{b} m{m}",
                        )
                elif i.op is Op.REDUCE:
                    for mb in range(p.microbatches):
                        if s not in p.visits(mb):
                            continue
                        key = (Op.B, s, mb) if (Op.B, s, mb) in self.where else (Op.W, s, mb)
                        self.need_local(
                            r,
                            t,
                            key,
                            "REDUCE comes after every gradient contribution (B or W) of its stage",
                            f"{key[0].value} s{s} m{mb}",
                        )

    # ------------------------------------------------------------------ pass 4: messages, collectives
    def match_messages(self) -> None:
        p = self.p
        sends: dict[tuple[int, int], list[tuple[int, Instr]]] = defaultdict(list)
        recvs: dict[tuple[int, int], list[tuple[int, Instr]]] = defaultdict(list)
        for r, instrs in enumerate(p.ranks):
            for t, i in enumerate(instrs):
                if i.op is Op.SEND:
                    sends[(r, i.peer)].append((t, i))
                elif i.op is Op.RECV:
                    recvs[(i.peer, r)].append((t, i))
        rule = (
            "messages between two ranks are received in the order they were sent "
            "(FIFO per rank pair: NCCL has no tags)"
        )
        for pair in sorted(set(sends) | set(recvs)):
            src, dst = pair
            out, inc = sends.get(pair, []), recvs.get(pair, [])
            for k in range(max(len(out), len(inc))):
                if k >= len(inc):
                    t, i = out[k]
                    raise self.fail(src, t, rule, f"rank {dst} never receives this message")
                if k >= len(out):
                    t, i = inc[k]
                    raise self.fail(dst, t, rule, f"rank {src} never sends this message")
                (ts, si), (tr, ri) = out[k], inc[k]
                if si.key != ri.key:
                    raise self.fail(
                        dst,
                        tr,
                        rule,
                        f"message #{k} from rank {src} to rank {dst} is '{si}' (rank {src}, step "
                        f"{ts}) but this RECV expects {ri.kind} s{ri.edge[0]}>s{ri.edge[1]} "
                        f"m{ri.microbatch}; reorder the RECVs on rank {dst} or the SENDs on rank {src}",
                    )
                self.deps[(dst, tr)].append(Dep(src, ts, message=True))
                self.partner[(src, ts)] = (dst, tr)
                self.partner[(dst, tr)] = (src, ts)

    def match_collectives(self) -> None:
        p = self.p
        calls: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
        for r, instrs in enumerate(p.ranks):
            for t, i in enumerate(instrs):
                if i.op is Op.REDUCE:
                    calls[i.group][r].append(t)
        for group, by_rank in calls.items():
            if not in_program(group) or len(by_rank) < 2:
                continue  # data parallel: it meets the same REDUCE of the program's replicas
            counts = {r: len(ts) for r, ts in by_rank.items()}
            if len(set(counts.values())) > 1:
                r = min(counts, key=lambda x: counts[x])
                raise self.fail(
                    r,
                    by_rank[r][-1],
                    "every member of an in-program REDUCE group calls it equally often",
                    f"group {group!r}: calls per rank {counts}",
                )
            for k in range(next(iter(counts.values()))):
                members = tuple((r, ts[k]) for r, ts in sorted(by_rank.items()))
                for member in members:
                    self.meetings[member] = members
        self.collective_order()

    def collective_order(self) -> None:
        """Two ranks meet in their shared in-program collectives in the same order.

        NCCL runs the calls of one communicator in the order each rank issues them, so rank r
        calling group a then b while rank q calls b then a hangs both (blocking collectives
        hang on gloo too). Checked pairwise; longer cycles are found by running the program.
        """
        p = self.p
        calls: dict[int, list[tuple[int, str]]] = defaultdict(list)  # rank -> (step, group)
        for r, t in sorted(self.meetings):
            calls[r].append((t, p.ranks[r][t].group))
        members_of: dict[str, set[int]] = defaultdict(set)
        for r, t in self.meetings:
            members_of[p.ranks[r][t].group].add(r)
        ranks = sorted(calls)
        for x, r in enumerate(ranks):
            for q in ranks[x + 1 :]:
                shared = {g for g, ms in members_of.items() if {r, q} <= ms}
                mine = [(t, g) for t, g in calls[r] if g in shared]
                theirs = [(u, g) for u, g in calls[q] if g in shared]
                seen: dict[str, int] = defaultdict(int)
                for (t, g), (u, h) in zip(mine, theirs, strict=True):
                    if g != h:
                        k = seen[g]
                        raise self.fail(
                            r,
                            t,
                            "collectives are issued in the same order on every rank of their "
                            "group (NCCL runs one communicator's calls in issue order)",
                            f"rank {r} step {t} `{p.ranks[r][t]}` and rank {q} step {u} "
                            f"`{p.ranks[q][u]}` are the #{k} call each rank makes of the REDUCE "
                            f"groups the two share, but name different groups ({g!r} and {h!r}): "
                            f"each waits for the other's member of its REDUCE group; issue the "
                            f"REDUCEs in the same order on ranks {r} and {q}",
                        )
                    seen[g] += 1

    def run(self) -> Analysis:
        self.index()
        self.complete()
        self.dependencies()
        check_shards(self)
        if self.lowered:
            self.match_messages()
        self.match_collectives()
        check_pairs(self)
        return Analysis(
            program=self.p,
            deps={k: tuple(v) for k, v in self.deps.items()},
            meetings=self.meetings,
            partner=self.partner,
        )


def analyse(program: Program) -> Analysis:
    """Check every static rule and return the dependency graph (raises ScheduleError)."""
    if not isinstance(program, Program):
        raise ScheduleError(f"check takes a Program, got {type(program).__name__}")
    return _Analyser(program).run()
