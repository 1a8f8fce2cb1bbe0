"""Lowering passes: pure ``Program -> Program`` functions with keyword-only options.

A generator produces a *compute-only* program (F/B/I/W/R). The passes here rewrite it, one
concern at a time, into what the interpreter runs::

    lower(p, split=True, recompute=[0], reduce="data")
      == add_communication(add_reduce(add_recompute(split_backward(p), stages=[0]), group="data"))

- :func:`split_backward` / :func:`merge_backward`: B <-> I + W.
- :func:`weights_after_sends`: on a lowered program, a B whose gradient SENDs follow it becomes
  I, the communication after it, W: the input gradient leaves before the weight gradient is
  computed.
- :func:`add_recompute`: R before the backward of chosen stages.
- :func:`add_reduce`: REDUCE after a stage's last gradient contribution (and Chimera replica sums).
- :func:`add_communication`: SEND/RECV for every cross-rank edge (always the last pass).
- :func:`strip_communication`: remove SEND/RECV/REDUCE again.

Every pass places what it inserts so that the passes commute with :func:`add_communication`
(``add_communication(split_backward(p)) == split_backward(add_communication(p))``, likewise for
recompute and reduce), which the tests check: on a lowered program a pass inserts only between
two non-communication instructions or after the run of SEND/RECVs that follows one, never inside
a communication group (``+``), and W, R and REDUCE exchange no messages, so
:func:`add_communication` steps over them. :func:`weights_after_sends` is the exception: it reads
where the SENDs are, so it runs after :func:`add_communication`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable

from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.schedule.ir import (
    ACT,
    BACKWARD_OPS,
    COLLECTIVE_OPS,
    COMM_OPS,
    COMPUTE_OPS,
    GRAD,
    Instr,
    Op,
    Program,
    backward,
    backward_input,
    backward_weight,
    recompute,
    recv,
    reduce,
    send,
)
from funcpipe.schedule.lowering import Message, place

__all__ = [
    "add_communication",
    "add_recompute",
    "add_reduce",
    "lower",
    "merge_backward",
    "messages",
    "split_backward",
    "strip_communication",
    "weights_after_sends",
]

# (kind, (producer, consumer), microbatch): what one message carries
MessageKey = tuple[str, tuple[int, int], int]
# (op, stage, microbatch) -> (rank, step) of a compute instruction
Where = dict[tuple[Op, int, int], tuple[int, int]]

_GROUP_RE = re.compile(r"[A-Za-z_][\w:.\-]*")


# --------------------------------------------------------------------------------- helpers
def _program(program: object, fn: str) -> Program:
    if not isinstance(program, Program):
        raise InvalidArgument(
            f"{fn} takes a funcpipe.schedule.ir.Program, got {type(program).__name__}; "
            "build one with the ir constructors or parse_program(text)"
        )
    return program


def _stage_set(program: Program, stages: Iterable[int] | None, fn: str) -> frozenset[int]:
    """``stages`` checked against the program (``None``: every stage)."""
    if stages is None:
        return frozenset(range(program.n_stages))
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Iterable):
        raise InvalidArgument(
            f"{fn}: stages={stages!r} must be an iterable of stage indices (or None for all)"
        )
    out = set()
    for s in stages:
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < program.n_stages:
            raise InvalidArgument(
                f"{fn}: stages={stages!r} holds {s!r}; stage indices are ints in "
                f"0..{program.n_stages - 1}"
            )
        out.add(s)
    return frozenset(out)


def _need_training(program: Program, fn: str) -> None:
    if not program.training:
        raise InvalidArgument(
            f"{fn}: program {program.name or '(unnamed)'} is an eval (forward-only) program and "
            "has no backward; use it only on training programs (mode train)"
        )


def _locate(program: Program) -> Where:
    """(op, stage, microbatch) -> (rank, step) of every compute instruction."""
    where: Where = {}
    for r, instrs in enumerate(program.ranks):
        for t, i in enumerate(instrs):
            if i.op in COMPUTE_OPS:
                where.setdefault((i.op, i.stage, i.microbatch), (r, t))
    return where


def messages(program: Program) -> tuple[tuple[MessageKey, int, int], ...]:
    """Every message a lowered ``program`` needs: ``((kind, edge, microbatch), src, dst)``.

    One activation per cross-rank edge (producer, consumer) and microbatch that visits the
    producer, from the producer's rank to the consumer's; in training also its gradient, back.
    Same-rank edges need no message. Sorted by microbatch, then edge, then kind.
    """
    program = _program(program, "messages")
    out = []
    kinds = (ACT, GRAD) if program.training else (ACT,)
    for m in range(program.microbatches):
        visits = program.visits(m)
        for a, b in program.edges or ():
            ra, rb = program.placement[a], program.placement[b]
            if a not in visits or ra == rb:
                continue
            for kind in kinds:
                src, dst = (ra, rb) if kind == ACT else (rb, ra)
                out.append(((kind, (a, b), m), src, dst))
    return tuple(out)


# --------------------------------------------------------------------------------- communication
def _producer(program: Program, key: MessageKey, where: Where) -> tuple[int, int]:
    """(rank, step) of the instruction that produces a message's data."""
    kind, (a, b), m = key
    if kind == ACT:
        candidates, stage, what = [(Op.F, a, m)], a, f"F s{a} m{m}"
    else:
        candidates, stage, what = [(Op.B, b, m), (Op.I, b, m)], b, f"B or I s{b} m{m}"
    return _find(program, candidates, stage, what, f"it produces {kind} s{a}>s{b} m{m}", where)


def _consumer(program: Program, key: MessageKey, where: Where) -> tuple[int, int]:
    """(rank, step) of the instruction that consumes a message's data."""
    kind, (a, b), m = key
    if kind == ACT:
        candidates, stage, what = [(Op.F, b, m)], b, f"F s{b} m{m}"
    else:
        candidates, stage, what = [(Op.B, a, m), (Op.I, a, m)], a, f"B or I s{a} m{m}"
    return _find(program, candidates, stage, what, f"it consumes {kind} s{a}>s{b} m{m}", where)


def _find(
    program: Program,
    candidates: list[tuple[Op, int, int]],
    stage: int,
    what: str,
    why: str,
    where: Where,
) -> tuple[int, int]:
    rank = program.placement[stage]
    for key in candidates:
        loc = where.get(key)
        if loc is not None and loc[0] == rank:
            return loc
    raise ScheduleError(
        f"add_communication: {what} is not on rank {rank} (the rank holding stage {stage}) but "
        f"{why}; complete the compute-only program first (funcpipe.schedule.check.check(program) "
        "names the first problem)",
        rank=rank,
        instruction=what,
        rule="every (stage, microbatch) a microbatch visits has its F (and, in training, its backward)",
    )


def _comm_instrs(program: Program) -> list[list[Instr]]:
    return [[i for i in instrs if i.op in COMM_OPS] for instrs in program.ranks]


def _already_lowered(program: Program) -> Program:
    """Return a fully lowered program unchanged; reject a partially lowered one."""
    want: list[list[Instr]] = [[] for _ in program.ranks]
    for key, src, dst in messages(program):
        want[src].append(send(key[0], key[1], key[2], dst))
        want[dst].append(recv(key[0], key[1], key[2], src))
    have = _comm_instrs(program)
    for r in range(program.n_ranks):
        have_r = {i.join(False) for i in have[r]}  # the group markers do not matter here
        missing = set(want[r]) - have_r
        extra = have_r - set(want[r])
        if missing or extra:
            detail = (
                f"'{min(missing, key=str)}' is missing"
                if missing
                else f"'{min(extra, key=str)}' is not needed"
            )
            raise InvalidArgument(
                f"add_communication: program {program.name or '(unnamed)'} is partially lowered: on "
                f"rank {r}, {detail}; lower a compute-only program: "
                "add_communication(strip_communication(program))"
            )
    return program


def add_communication(program: Program) -> Program:
    """Insert the SEND/RECV of every cross-rank edge, for every microbatch that uses it, in
    communication groups that cannot hang under NCCL's rules (:mod:`funcpipe.schedule.lowering`
    has the rules and why they hold):

    - each SEND goes right after the instruction producing its data (F for an activation, B or I
      of the consumer stage for a gradient);
    - each RECV is posted as its data is sent: right after the last instruction of its rank
      that sends or receives and that, in a reference run of the program, starts before the
      instruction producing the data (W, R and REDUCE are stepped over). Both ends of every pair
      of ranks then post the pair's messages in the same order (messages match in sending
      order: NCCL has no tags), and the data can arrive while the receiver computes;
    - the SENDs after one instruction for one peer and the RECVs of the first instruction that
      reads any of the RECVs there form one group (``+``), like ``batch_isend_irecv`` per step;
      RECVs read by later instructions get their own groups (a group completes as one).

    The lowered program passes ``check(..., p2p="nccl")`` whenever the compute-only one passes
    :func:`~funcpipe.schedule.check.check`, runs as fast under ``p2p="gloo"``, and under
    ``p2p="nccl"`` too with the reference run's costs (``Costs(f=1, b=2, w=0)``).

    Same-rank edges stay local. A program that is already fully lowered (it holds exactly the
    SEND/RECV set this pass would insert, wherever they are) is returned unchanged; a partially
    lowered one raises :class:`InvalidArgument`. REDUCE instructions are kept where they are.
    Raises :class:`ScheduleError` when an instruction producing or consuming a message is missing
    or the program cannot run (the checker's error).
    """
    program = _program(program, "add_communication")
    if program.lowered:
        return _already_lowered(program)
    msgs = messages(program)
    if not msgs:
        return program
    where = _locate(program)
    placed = [
        Message(key, src, dst, _producer(program, key, where)[1], _consumer(program, key, where)[1])
        for key, src, dst in msgs
    ]
    return program.replace(ranks=place(program, placed))


def strip_communication(program: Program) -> Program:
    """Remove every SEND, RECV, REDUCE, SCATTER and GATHER: the compute-only program lowering
    started from."""
    program = _program(program, "strip_communication")
    drop = COMM_OPS | COLLECTIVE_OPS
    return program.replace(
        ranks=tuple(tuple(i for i in instrs if i.op not in drop) for instrs in program.ranks)
    )


# --------------------------------------------------------------------------------- backward split
def _after_comm(instrs: tuple[Instr, ...], t: int) -> int:
    """Index just past the SEND/RECVs right after step ``t`` (its groups are not split)."""
    u = t + 1
    while u < len(instrs) and instrs[u].op in COMM_OPS:
        u += 1
    return u


def _pairs_next(instrs: tuple[Instr, ...], t: int) -> bool:
    """Whether step ``t`` is the first half of an overlapped pair."""
    return t + 1 < len(instrs) and instrs[t + 1].joined and instrs[t + 1].op in COMPUTE_OPS


def split_backward(program: Program, *, stages: Iterable[int] | None = None) -> Program:
    """Replace each B(s, m) of ``stages`` (default: all) by I(s, m) followed by W(s, m).

    The W goes right after the I; in a lowered program, after the SEND/RECVs that follow the I
    (its gradient SENDs and the RECVs posted with them), so the gradient leaves before the
    weight work starts. The timeline is unchanged (I costs
    b, W costs w, B costs b + w); moving Ws later is a generator's job (zero-bubble schedules).
    """
    program = _program(program, "split_backward")
    _need_training(program, "split_backward")
    chosen = _stage_set(program, stages, "split_backward")
    ranks = []
    for instrs in program.ranks:
        out: list[Instr] = []
        t = 0
        while t < len(instrs):
            i = instrs[t]
            if i.op is Op.B and i.stage in chosen:
                # (the W goes after the pair the B is the first half of)
                u = _after_comm(instrs, t + 1 if _pairs_next(instrs, t) else t)
                out.append(backward_input(i.stage, i.microbatch).join(i.joined))
                out.extend(instrs[t + 1 : u])
                out.append(backward_weight(i.stage, i.microbatch))
                t = u
            else:
                out.append(i)
                t += 1
        ranks.append(tuple(out))
    return program.replace(ranks=tuple(ranks))


def weights_after_sends(program: Program) -> Program:
    """Send each B's input gradient before computing its weight gradient.

    On a lowered program (after :func:`add_communication`), every ``B s m`` immediately followed
    by SEND/RECVs among which is a SEND of that B's input gradient becomes ``I s m``, those
    SEND/RECVs, then ``W s m``, so the peer can start its backward while this rank computes the
    weight gradient::

        rank 1: B s1 m0; SEND grad s0>s1 m0 to r0; + RECV act s0>s1 m2 from r0; F s1 m2
             -> I s1 m0; SEND grad s0>s1 m0 to r0; + RECV act s0>s1 m2 from r0; W s1 m0; F s1 m2

    A B with no such SEND right after it (stage 0, a consumer on the same rank, another
    instruction in between) stays whole, and nothing else moves: the messages, their groups,
    their order and every RECV are unchanged, and a REDUCE placed after those SEND/RECVs
    (:func:`add_reduce`) now follows the W. Idempotent;
    ``merge_backward(weights_after_sends(p)) == merge_backward(p)``.

    The runtime runs a program as written and moves no work itself: this pass is how a program
    asks for its gradients to leave first, where the checker, the simulator (an I costs ``b``
    and a W ``w`` where the B cost ``full``), the trace and the timeline all see it. A
    compute-only program that needs messages is rejected (lower it first); a program without
    any (one rank, or forward-only) is returned unchanged.
    """
    program = _program(program, "weights_after_sends")
    if not program.training or not program.lowered:
        if program.training and messages(program):
            raise InvalidArgument(
                f"weights_after_sends: program {program.name or '(unnamed)'} is compute-only (no "
                "SEND/RECV), so no gradient SEND follows any B; lower it first: "
                "weights_after_sends(add_communication(program))"
            )
        return program
    ranks = []
    for instrs in program.ranks:
        out: list[Instr] = []
        t = 0
        while t < len(instrs):
            i = instrs[t]
            u = _after_comm(instrs, t) if i.op is Op.B else t + 1
            if any(_gradient_of(j, i) for j in instrs[t + 1 : u]):
                out.append(backward_input(i.stage, i.microbatch).join(i.joined))
                out.extend(instrs[t + 1 : u])
                out.append(backward_weight(i.stage, i.microbatch))
            else:
                out.extend(instrs[t:u])
            t = u
        ranks.append(tuple(out))
    return program.replace(ranks=tuple(ranks))


def _gradient_of(j: Instr, i: Instr) -> bool:
    """Whether ``j`` SENDs an input gradient that backward ``i`` produced."""
    return (
        j.op is Op.SEND and j.kind == GRAD and j.stage == i.stage and j.microbatch == i.microbatch
    )


def merge_backward(program: Program, *, stages: Iterable[int] | None = None) -> Program:
    """Replace each I(s, m) ... W(s, m) pair of ``stages`` (default: all) by one B at the I.

    The I becomes a B and the W is dropped; nothing else moves. That is always sound: B needs
    exactly what I needs, and only REDUCEs (which come after the W) wait for the weight gradient.
    (Dropping a W between two communication groups leaves them adjacent but separate.)
    ``merge_backward(split_backward(p)) == p``. Raises :class:`ScheduleError` for an I without its
    W on the same rank (or a W before its I).
    """
    program = _program(program, "merge_backward")
    _need_training(program, "merge_backward")
    chosen = _stage_set(program, stages, "merge_backward")
    ranks = []
    for r, instrs in enumerate(program.ranks):
        opened: dict[tuple[int, int], int] = {}
        out: list[Instr] = []
        for t, i in enumerate(instrs):
            if i.stage not in chosen or i.op not in (Op.I, Op.W):
                out.append(i)
            elif i.op is Op.I:
                opened[(i.stage, i.microbatch)] = t
                out.append(backward(i.stage, i.microbatch).join(i.joined))
            elif opened.pop((i.stage, i.microbatch), None) is None:
                raise ScheduleError(
                    f"merge_backward: rank {r}, step {t} ({i}) has no I s{i.stage} m{i.microbatch} "
                    "before it on this rank; put the I first, or leave this stage out (stages=...)",
                    rank=r,
                    step=t,
                    instruction=i,
                    rule="W comes after the I of the same stage and microbatch",
                )
        if opened:
            (s, m), t = min(opened.items(), key=lambda kv: kv[1])
            raise ScheduleError(
                f"merge_backward: rank {r}, step {t} (I s{s} m{m}) has no W s{s} m{m} after it on "
                "this rank; add the W, or leave this stage out (stages=...)",
                rank=r,
                step=t,
                instruction=instrs[t],
                rule="in training every (stage, microbatch) has one backward: a B, or an I then a W",
            )
        ranks.append(tuple(out))
    return program.replace(ranks=tuple(ranks))


# --------------------------------------------------------------------------------- recompute
def add_recompute(program: Program, *, stages: Iterable[int]) -> Program:
    """Insert R(s, m) right before each B(s, m) or I(s, m) of ``stages`` (activation recompute).

    The forward of those stages then keeps only its input; R runs it again just before the
    backward. In a lowered program the RECVs the backward needs are posted before that (a RECV
    only posts; the backward waits for the data), so the recompute overlaps the wait for the
    gradient, and the pass commutes with :func:`add_communication`, which steps over R. A
    stage-microbatch pair that already has its R is left alone.
    """
    program = _program(program, "add_recompute")
    _need_training(program, "add_recompute")
    chosen = _stage_set(program, stages, "add_recompute")
    have = {(i.stage, i.microbatch) for instrs in program.ranks for i in instrs if i.op is Op.R}
    ranks = []
    for instrs in program.ranks:
        out: list[Instr] = []
        for i in instrs:
            if i.op in BACKWARD_OPS and i.stage in chosen and (i.stage, i.microbatch) not in have:
                # before the pair the backward is the second half of
                out.insert(len(out) - 1 if i.joined else len(out), recompute(i.stage, i.microbatch))
            out.append(i)
        ranks.append(tuple(out))
    return program.replace(ranks=tuple(ranks))


# --------------------------------------------------------------------------------- reduce
def _owner(program: Program, stage: int) -> int:
    """Follow ``replica_of`` to the stage that owns the parameters."""
    seen = [stage]
    s = stage
    replica_of = program.replica_of or ()
    while replica_of[s] != s:
        s = replica_of[s]
        if s in seen:
            raise ScheduleError(
                f"replica_of has a cycle {' -> '.join(map(str, [*seen, s]))}; every chain of "
                "replicas must end at a stage that is its own owner",
                rule="replica_of names the params-owner stage",
            )
        seen.append(s)
    return s


def add_reduce(
    program: Program, *, group: str = "data", stages: Iterable[int] | None = None
) -> Program:
    """Insert ``REDUCE s group`` right after stage s's last gradient contribution (B or W).

    ``stages`` (default: all) chooses the stages; in a lowered program the REDUCE also follows the
    SEND/RECVs right after that B (its gradient SENDs and the RECVs posted with them). A stage
    that already has ``REDUCE s group`` is left alone.

    Replicas (``replica_of``, Chimera): stages sharing a params owner ``o`` must sum their
    gradients. Every rank holding replicas of ``o`` gets one ``REDUCE s replica:o``, naming the
    lowest replica ``s`` it holds: the group ``replica:o`` is an in-program collective that sums
    the gradients of all replicas of ``o`` (those on the same rank first) and leaves the sum in
    each of them. These go at the very end of each rank, ordered by owner, so every rank meets
    its replica groups in the same order (no collective deadlock); they come after the ``group``
    REDUCEs, which is fine because both are sums. Choosing one replica in ``stages`` chooses its
    whole replica set. A stage no microbatch visits has no gradient and gets no ``group``
    REDUCE; a replica no microbatch visits (Chimera's idle up pipeline with one microbatch)
    still joins its replica sum, adding zeros, so that every rank holding a replica ends with
    the whole gradient (only a replica set none of whose members is visited is left out).
    """
    program = _program(program, "add_reduce")
    _need_training(program, "add_reduce")
    if not isinstance(group, str) or not _GROUP_RE.fullmatch(group):
        raise InvalidArgument(
            f"add_reduce: group={group!r} must be a name of letters, digits, '_', ':', '.' or '-' "
            "starting with a letter or '_' (e.g. 'data', 'tie:wte')"
        )
    chosen = _stage_set(program, stages, "add_reduce")
    classes: dict[int, list[int]] = defaultdict(list)
    for s in range(program.n_stages):
        classes[_owner(program, s)].append(s)
    chosen = frozenset(s for members in classes.values() if chosen & set(members) for s in members)
    present = {(i.stage, i.group) for instrs in program.ranks for i in instrs if i.op is Op.REDUCE}
    inserts: dict[tuple[int, int], list[Instr]] = defaultdict(list)  # (rank, index) -> REDUCEs
    visited = frozenset().union(*(program.visits(m) for m in range(program.microbatches)))
    for s in sorted(chosen):
        if (s, group) in present or s not in visited:
            continue
        r = program.placement[s]
        instrs = program.ranks[r]
        last = max(
            (t for t, i in enumerate(instrs) if i.stage == s and i.op in (Op.B, Op.W)), default=None
        )
        if last is None:
            raise ScheduleError(
                f"add_reduce: stage {s} has no B or W on rank {r}, so there is nothing to reduce; "
                "add its backward first, or leave it out (stages=...)",
                rank=r,
                rule="REDUCE comes after every gradient contribution (B or W) of its stage",
            )
        if _pairs_next(instrs, last):  # (after the pair the B is the first half of)
            last += 1
        inserts[(r, _after_comm(instrs, last))].append(reduce(s, group))
    tails: dict[int, list[Instr]] = defaultdict(list)
    for owner, members in sorted(classes.items()):
        # every replica joins, visited or not: a replica that no microbatch visits (Chimera's
        # idle pipeline with one microbatch) adds zeros, and its rank still ends with the whole
        # gradient (a rank reports the gradients of every stage it holds)
        if len(members) < 2 or not chosen & set(members) or not visited & set(members):
            continue
        name = f"replica:{owner}"
        held: dict[int, int] = {}  # rank -> the lowest replica it holds
        for s in members:
            held.setdefault(program.placement[s], s)
        for r, s in sorted(held.items()):
            if not any((t, name) in present for t in members if program.placement[t] == r):
                tails[r].append(reduce(s, name))
    ranks = []
    for r, instrs in enumerate(program.ranks):
        out: list[Instr] = []
        for t, i in enumerate(instrs):
            out.extend(inserts.get((r, t), ()))
            out.append(i)
        out.extend(inserts.get((r, len(instrs)), ()))
        out.extend(tails.get(r, ()))
        ranks.append(tuple(out))
    return program.replace(ranks=tuple(ranks))


# --------------------------------------------------------------------------------- composition
def lower(
    program: Program,
    *,
    split: bool | Iterable[int] | None = None,
    recompute: Iterable[int] | None = None,
    reduce: bool | str | None = None,
) -> Program:
    """The usual pipeline of passes, communication last.

    - ``split``: ``True`` splits every B into I + W; a list of stages splits those; ``None`` /
      ``False`` keeps B.
    - ``recompute``: stages whose forward is recomputed before the backward (:func:`add_recompute`).
    - ``reduce``: a group name (``"data"``) or ``True`` for ``"data"`` adds :func:`add_reduce`.

    Then :func:`add_communication`. Eval programs accept only the defaults.
    """
    program = _program(program, "lower")
    if split is True:
        program = split_backward(program)
    elif split is not None and split is not False:
        program = split_backward(program, stages=split)
    if recompute is not None:
        program = add_recompute(program, stages=recompute)
    if reduce is True:
        program = add_reduce(program)
    elif isinstance(reduce, str):
        program = add_reduce(program, group=reduce)
    elif reduce is not None and reduce is not False:
        raise InvalidArgument(
            f"lower: reduce={reduce!r} must be a group name (e.g. 'data'), True for 'data', or None"
        )
    return add_communication(program)
