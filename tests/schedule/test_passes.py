"""The lowering passes: each on its own, their compositions, and random programs (hypothesis)."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.schedule.check import check
from funcpipe.schedule.generators import GENERATORS, generate
from funcpipe.schedule.ir import (
    ACT,
    COMM_OPS,
    GRAD,
    Instr,
    Op,
    Program,
    backward,
    backward_input,
    backward_weight,
    flatten,
    forward,
    groups,
    parse_program,
    recompute,
    recv,
    reduce,
    send,
)
from funcpipe.schedule.passes import (
    add_communication,
    add_recompute,
    add_reduce,
    lower,
    merge_backward,
    messages,
    split_backward,
    strip_communication,
    weights_after_sends,
)
from funcpipe.schedule.simulate import Costs, simulate


# ------------------------------------------------------------------ hand-built programs
def gpipe(p: int, m: int) -> Program:
    ranks = [
        [forward(r, k) for k in range(m)] + [backward(r, k) for k in range(m)] for r in range(p)
    ]
    return Program(ranks=ranks, placement=range(p), microbatches=m, name="gpipe")


def one_f_one_b(p: int, m: int) -> Program:
    ranks = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        instrs = [forward(r, k) for k in range(warm)]
        for k in range(m - warm):
            instrs += [forward(r, warm + k), backward(r, k)]
        instrs += [backward(r, k) for k in range(m - warm, m)]
        ranks.append(instrs)
    return Program(ranks=ranks, placement=range(p), microbatches=m, name="1f1b")


def projected(
    *,
    placement: tuple[int, ...],
    microbatches: int,
    edges: tuple[tuple[int, int], ...] | None = None,
    entries: tuple[int, ...] | None = None,
    replica_of: tuple[int, ...] | None = None,
    training: bool = True,
    split: frozenset[int] = frozenset(),
    rng: random.Random | None = None,
) -> Program:
    """A sound compute-only program: one global order of all work, projected onto the ranks.

    ``rng=None`` takes the first ready instruction each time (GPipe-like); else a random one.
    """
    shape = Program(
        ranks=[()] * (max(placement) + 1),
        placement=placement,
        microbatches=microbatches,
        edges=edges,
        entries=entries,
        replica_of=replica_of,
        training=training,
    )
    deps: dict[Instr, list[Instr]] = {}
    for m in range(microbatches):
        for s in sorted(shape.visits(m)):
            deps[forward(s, m)] = [forward(a, m) for a in shape.producers(s)]
            if not training:
                continue
            grads = [
                backward_input(c, m) if c in split else backward(c, m) for c in shape.consumers(s)
            ]
            if s in split:
                deps[backward_input(s, m)] = [forward(s, m), *grads]
                deps[backward_weight(s, m)] = [backward_input(s, m)]
            else:
                deps[backward(s, m)] = [forward(s, m), *grads]
    done: set[Instr] = set()
    ranks: list[list[Instr]] = [[] for _ in shape.ranks]
    todo = list(deps)
    while todo:
        ready = [i for i in todo if all(d in done for d in deps[i])]
        pick = ready[0] if rng is None else rng.choice(ready)
        todo.remove(pick)
        done.add(pick)
        ranks[placement[pick.stage]].append(pick)
    return shape.replace(ranks=tuple(tuple(r) for r in ranks))


SKIP = {"placement": (0, 1, 2), "edges": ((0, 1), (1, 2), (0, 2))}
# Chimera-like: pipeline down s0 (r0) > s1 (r1); pipeline up s2 (r1) > s3 (r0), replicas of s0, s1
CHIMERA = {
    "placement": (0, 1, 1, 0),
    "edges": ((0, 1), (2, 3)),
    "entries": (0, 2, 0, 2),
    "replica_of": (0, 1, 0, 1),
}


def builtin_programs() -> list[Program]:
    out = [gpipe(1, 1), gpipe(3, 4), one_f_one_b(4, 8), one_f_one_b(2, 1)]
    out.append(projected(microbatches=2, **SKIP))  # type: ignore[arg-type]
    out.append(projected(microbatches=4, **CHIMERA))  # type: ignore[arg-type]
    # V placement, 2 ranks, 4 stages: rank 0 holds the first and the last stage
    out.append(projected(placement=(0, 1, 1, 0), microbatches=3, rng=random.Random(1)))
    out.append(projected(placement=(0, 1, 0, 1), microbatches=3, training=False))
    try:
        from funcpipe.schedule.generators import GENERATORS, generate
    except ImportError:  # the generators are written in parallel: the hand-built ones still run
        return out
    for name in GENERATORS:
        for ranks, microbatches in [(2, 3), (4, 8)]:
            out.append(generate(name, ranks=ranks, microbatches=microbatches))
    return out


PROGRAMS = builtin_programs()


def _ids(p: Program) -> str:
    return f"{p.name or 'program'}-p{p.n_ranks}-m{p.microbatches}"


# ------------------------------------------------------------------ invariants
def fifo_pairs(program: Program) -> dict[tuple[int, int], tuple[list, list]]:  # type: ignore[type-arg]
    pairs: dict[tuple[int, int], tuple[list, list]] = defaultdict(lambda: ([], []))  # type: ignore[type-arg]
    for r, instrs in enumerate(program.ranks):
        for i in instrs:
            if i.op is Op.SEND:
                pairs[(r, i.peer)][0].append(i.key)
            elif i.op is Op.RECV:
                pairs[(i.peer, r)][1].append(i.key)
    return pairs


def talking(program: Program) -> dict[tuple[int, int], Instr]:
    """(rank, step) -> instruction, for every instruction that produces or consumes a message."""
    at = {(i.op, i.stage, i.microbatch): (r, t) for r, t, i in flatten(program)}
    out = {}
    for (kind, (a, b), m), _, _ in messages(program):
        made = [(Op.F, a, m)] if kind == ACT else [(Op.B, b, m), (Op.I, b, m)]
        used = [(Op.F, b, m)] if kind == ACT else [(Op.B, a, m), (Op.I, a, m)]
        for key in (*made, *used):
            if key in at:
                out[at[key]] = program.ranks[at[key][0]][at[key][1]]
    return out


def positions(program: Program) -> dict[tuple[int, int, tuple[str, tuple[int, int], int]], int]:
    """(rank, op as 0 SEND / 1 RECV, message) -> how many non-communication instructions come
    before it on its rank: equal numbers on one pair are one group (one group per peer per run)."""
    out = {}
    for r, instrs in enumerate(program.ranks):
        seen = 0
        for i in instrs:
            if i.op in COMM_OPS:
                out[(r, int(i.op is Op.RECV), i.key)] = seen
            else:
                seen += 1
    return out


def assert_no_crossing(program: Program) -> None:
    """Both ends of every pair post its messages in orders that agree (ties: one group)."""
    at = positions(program)
    for (src, dst), (sent, _) in fifo_pairs(program).items():
        for x in sent:  # src -> dst
            for (s2, d2), (back, _) in fifo_pairs(program).items():
                if (s2, d2) != (dst, src):
                    continue
                for y in back:  # dst -> src
                    on_src = (at[(src, 0, x)], at[(src, 1, y)])
                    on_dst = (at[(dst, 1, x)], at[(dst, 0, y)])
                    assert not (on_src[0] < on_src[1] and on_dst[1] < on_dst[0]), (x, y)
                    assert not (on_src[1] < on_src[0] and on_dst[0] < on_dst[1]), (x, y)


def assert_lowered_well(compute: Program, lowered: Program) -> None:
    check(lowered)
    check(lowered, p2p="nccl")
    assert strip_communication(lowered) == compute
    for (src, dst), (sent, got) in fifo_pairs(lowered).items():
        assert sent == got, f"FIFO broken between rank {src} and rank {dst}"
    assert {(k, s, d) for k, s, d in messages(compute)} == {
        (i.key, r, i.peer)
        for r, instrs in enumerate(lowered.ranks)
        for i in instrs
        if i.op is Op.SEND
    }
    assert_no_crossing(lowered)
    talks = talking(lowered)
    for r, instrs in enumerate(lowered.ranks):
        steps = groups(instrs)
        for g in steps:  # one peer per group, its SENDs first
            members = [instrs[t] for t in g]
            assert len({i.peer for i in members}) == 1, members
            ops = [i.op for i in members]
            assert ops == sorted(ops, key=lambda op: op is Op.RECV), members
        for t, i in enumerate(instrs):
            if i.op not in COMM_OPS:
                continue
            u = t - 1
            while u >= 0 and instrs[u].op in COMM_OPS:
                u -= 1
            # every run of SEND/RECVs follows an instruction that talks (or starts the rank)
            assert u < 0 or (r, u) in talks, f"rank {r} step {t}: {i} follows {instrs[u]}"
            if i.op is Op.SEND:  # in the run right after its producer
                a, b = i.edge
                made = (Op.F, a) if i.kind == ACT else (instrs[u].op, b)
                assert (instrs[u].op, instrs[u].stage) == made and instrs[u].op is not Op.W
                assert instrs[u].microbatch == i.microbatch


# ------------------------------------------------------------------ add_communication
@pytest.mark.parametrize("program", PROGRAMS, ids=_ids)
def test_lowering_builtin_programs(program: Program) -> None:
    lowered = add_communication(program)
    assert_lowered_well(program, lowered)
    assert add_communication(lowered) is lowered  # idempotent on a fully lowered program


def test_two_stage_1f1b_exactly() -> None:
    got = add_communication(one_f_one_b(2, 2))
    want = parse_program(
        """
        placement 0 1
        microbatches 2
        rank 0
          F s0 m0; SEND act s0>s1 m0 to r1
          F s0 m1; SEND act s0>s1 m1 to r1; + RECV grad s0>s1 m0 from r1
          B s0 m0; RECV grad s0>s1 m1 from r1  # posted as rank 1 sends it, before B s0 m1
          B s0 m1
        rank 1
          RECV act s0>s1 m0 from r0
          RECV act s0>s1 m1 from r0  # sent while rank 1 waits: posted at once, its own group
          F s1 m0; B s1 m0; SEND grad s0>s1 m0 to r0
          F s1 m1; B s1 m1; SEND grad s0>s1 m1 to r0
        """
    )
    assert got == want.replace(name="1f1b")


def test_skip_edges_get_their_own_messages() -> None:
    p = projected(microbatches=1, **SKIP)  # type: ignore[arg-type]
    got = add_communication(p)
    assert [str(i) for i in got.ranks[0]] == [
        "F s0 m0",
        "SEND act s0>s1 m0 to r1",  # one group per peer
        "+ RECV grad s0>s1 m0 from r1",
        "SEND act s0>s2 m0 to r2",
        "+ RECV grad s0>s2 m0 from r2",
        "B s0 m0",
    ]
    assert [str(i) for i in got.ranks[1]] == [
        "RECV act s0>s1 m0 from r0",
        "F s1 m0",
        "SEND act s1>s2 m0 to r2",
        "+ RECV grad s1>s2 m0 from r2",
        "B s1 m0",
        "SEND grad s0>s1 m0 to r0",
    ]
    assert [str(i) for i in got.ranks[2]] == [
        "RECV act s0>s2 m0 from r0",
        "RECV act s1>s2 m0 from r1",
        "F s2 m0",
        "B s2 m0",
        "SEND grad s0>s2 m0 to r0",
        "SEND grad s1>s2 m0 to r1",
    ]
    check(got)
    check(got, p2p="nccl")


def test_same_rank_edges_stay_local() -> None:
    p = projected(placement=(0, 0, 1), microbatches=2)
    got = add_communication(p)
    edges = {i.edge for r in got.ranks for i in r if i.op in COMM_OPS}
    assert edges == {(1, 2)}
    check(got)


def test_chimera_entries_route_each_microbatch_through_its_pipeline() -> None:
    p = projected(microbatches=4, **CHIMERA)  # type: ignore[arg-type]
    got = add_communication(p)
    check(got)
    sent = {(str(i), r) for r, instrs in enumerate(got.ranks) for i in instrs if i.op is Op.SEND}
    assert ("SEND act s0>s1 m0 to r1", 0) in sent
    assert ("SEND act s2>s3 m1 to r0", 1) in sent
    assert ("SEND grad s2>s3 m1 to r1", 0) in sent
    assert not any("s0>s1 m1" in s or "s2>s3 m0" in s for s, _ in sent)
    assert len(sent) == 4 * 2  # one edge per microbatch, act + grad


def test_fifo_pulls_earlier_messages_forward() -> None:
    # rank 1 runs microbatch 1 before microbatch 0, but rank 0 sent m0 first: both RECVs go
    # before F s1 m1, in sending order
    p = parse_program(
        "placement 0 1\nmicrobatches 2\nmode eval\nrank 0: F s0 m0; F s0 m1\nrank 1: F s1 m1; F s1 m0"
    )
    got = add_communication(p)
    assert [str(i) for i in got.ranks[1]] == [
        "RECV act s0>s1 m0 from r0",
        "RECV act s0>s1 m1 from r0",
        "F s1 m1",
        "F s1 m0",
    ]
    check(got)


def test_partially_lowered_program_is_rejected() -> None:
    lowered = add_communication(gpipe(2, 2))
    ranks = list(lowered.ranks)
    ranks[1] = tuple(i for i in ranks[1] if i.op is not Op.SEND)
    with pytest.raises(InvalidArgument, match="partially lowered.*rank 1.*SEND grad"):
        add_communication(lowered.replace(ranks=tuple(ranks)))


def test_missing_work_is_a_schedule_error() -> None:
    p = parse_program("placement 0 1\nmicrobatches 1\nmode eval\nrank 0: F s0 m0\nrank 1:")
    with pytest.raises(ScheduleError, match="F s1 m0 is not on rank 1") as e:
        add_communication(p)
    assert e.value.rank == 1


def test_passes_reject_non_programs() -> None:
    with pytest.raises(InvalidArgument, match="takes a funcpipe.schedule.ir.Program"):
        add_communication("F s0 m0")  # type: ignore[arg-type]


# ------------------------------------------------------------------ split / merge
@pytest.mark.parametrize("program", PROGRAMS, ids=_ids)
def test_split_and_merge_are_inverse(program: Program) -> None:
    if not program.training:
        with pytest.raises(InvalidArgument, match="eval"):
            split_backward(program)
        return
    merged = merge_backward(program)
    assert merge_backward(split_backward(merged)) == merged
    lowered = add_communication(merged)
    assert merge_backward(split_backward(lowered)) == lowered
    assert split_backward(lowered) == add_communication(split_backward(merged))
    check(split_backward(lowered))


def test_split_places_w_after_the_gradient_sends() -> None:
    lowered = add_communication(gpipe(2, 1))
    got = split_backward(lowered, stages=[1])
    assert [str(i) for i in got.ranks[1]] == [
        "RECV act s0>s1 m0 from r0",
        "F s1 m0",
        "I s1 m0",
        "SEND grad s0>s1 m0 to r0",
        "W s1 m0",
    ]
    assert got.ranks[0] == lowered.ranks[0]  # stage 0 not chosen
    assert split_backward(gpipe(1, 1)).ranks == (
        (forward(0, 0), backward_input(0, 0), backward_weight(0, 0)),
    )


def test_merge_keeps_everything_else_in_place() -> None:
    p = parse_program(
        "placement 0\nmicrobatches 2\nrank 0: F s0 m0; F s0 m1; I s0 m0; I s0 m1; W s0 m0; W s0 m1"
    )
    got = merge_backward(p)
    assert [str(i) for i in got.ranks[0]] == ["F s0 m0", "F s0 m1", "B s0 m0", "B s0 m1"]
    check(got)


def test_merge_rejects_unpaired_halves() -> None:
    p = parse_program("placement 0\nmicrobatches 1\nrank 0: F s0 m0; W s0 m0; I s0 m0")
    with pytest.raises(ScheduleError, match="step 1.*no I s0 m0 before it") as e:
        merge_backward(p)
    assert (e.value.rank, e.value.step) == (0, 1)
    p = parse_program("placement 0\nmicrobatches 1\nrank 0: F s0 m0; I s0 m0")
    with pytest.raises(ScheduleError, match="no W s0 m0 after it"):
        merge_backward(p)
    assert merge_backward(p, stages=[]) == p


def test_stage_options_are_validated() -> None:
    for bad in (["0"], [5], 3, "01", [True]):
        with pytest.raises(InvalidArgument, match="stages="):
            split_backward(gpipe(2, 1), stages=bad)  # type: ignore[arg-type]


# ------------------------------------------------------------------ recompute
def test_recompute_goes_right_before_the_backward() -> None:
    p = split_backward(one_f_one_b(2, 2), stages=[0])
    got = add_recompute(p, stages=[0])
    assert [str(i) for i in got.ranks[0]] == [
        "F s0 m0", "F s0 m1", "R s0 m0", "I s0 m0", "W s0 m0", "R s0 m1", "I s0 m1", "W s0 m1",
    ]  # fmt: skip
    assert got.ranks[1] == p.ranks[1]
    check(got)
    assert add_recompute(got, stages=[0]) == got  # already recomputed: left alone
    # commutes with lowering (in a lowered program R goes before the RECVs feeding the backward)
    assert add_recompute(add_communication(p), stages=[0]) == add_communication(got)
    with pytest.raises(InvalidArgument, match="eval"):
        add_recompute(projected(placement=(0,), microbatches=1, training=False), stages=[0])


def test_recompute_lowers_peak_activations() -> None:
    p = one_f_one_b(4, 8)
    assert (
        simulate(add_recompute(p, stages=[0])).peak_activations[0] < simulate(p).peak_activations[0]
    )


# ------------------------------------------------------------------ reduce
def test_reduce_follows_the_last_gradient_contribution() -> None:
    p = split_backward(one_f_one_b(2, 2), stages=[1])
    got = add_reduce(p)
    assert got.ranks[0][-1] == reduce(0, "data")
    assert [str(i) for i in got.ranks[1]][-2:] == ["W s1 m1", "REDUCE s1 data"]
    assert add_reduce(got) == got
    assert strip_communication(got) == p
    # commutes with lowering: after the gradient SENDs that follow the last B
    assert add_reduce(add_communication(p)) == add_communication(got)
    lowered = add_communication(got)
    assert [str(i) for i in lowered.ranks[1]][-3:] == [
        "SEND grad s0>s1 m1 to r0",
        "W s1 m1",
        "REDUCE s1 data",
    ]
    only = add_reduce(p, group="tie:wte", stages=[0])
    assert [i for r in only.ranks for i in r if i.op is Op.REDUCE] == [reduce(0, "tie:wte")]


@pytest.mark.parametrize("program", PROGRAMS, ids=_ids)
def test_lower_with_reduce_builtin_programs(program: Program) -> None:
    if not program.training:
        return
    full = lower(program, reduce=True)
    check(full)
    visited = set().union(*(program.visits(m) for m in range(program.microbatches)))
    reduced = {i.stage for r in full.ranks for i in r if i.op is Op.REDUCE and i.group == "data"}
    assert reduced == visited
    assert strip_communication(full) == program


def test_reduce_after_last_b_not_at_the_end() -> None:
    # GPipe order F F B1 B0 on a single rank with an extra stage: reduce right after its last B
    p = parse_program("placement 0 0\nmicrobatches 1\nrank 0: F s0 m0; F s1 m0; B s1 m0; B s0 m0")
    got = add_reduce(p)
    assert [str(i) for i in got.ranks[0]] == [
        "F s0 m0", "F s1 m0", "B s1 m0", "REDUCE s1 data", "B s0 m0", "REDUCE s0 data",
    ]  # fmt: skip


def test_reduce_sums_chimera_replicas() -> None:
    p = projected(microbatches=4, **CHIMERA)  # type: ignore[arg-type]
    got = add_reduce(p)
    # every stage: its own reduce; then one replica reduce per stage at the end, ordered by owner
    assert [str(i) for i in got.ranks[0]][-2:] == ["REDUCE s0 replica:0", "REDUCE s3 replica:1"]
    assert [str(i) for i in got.ranks[1]][-2:] == ["REDUCE s2 replica:0", "REDUCE s1 replica:1"]
    assert sum(i.op is Op.REDUCE for r in got.ranks for i in r) == 8
    lowered = add_communication(got)
    check(lowered)
    # choosing one replica chooses its replica set
    one = add_reduce(p, stages=[2])
    assert {str(i) for r in one.ranks for i in r if i.op is Op.REDUCE} == {
        "REDUCE s0 data", "REDUCE s2 data", "REDUCE s0 replica:0", "REDUCE s2 replica:0",
    }  # fmt: skip


def test_reduce_sums_idle_chimera_replicas_too() -> None:
    """One microbatch: the up pipeline (s2, s3) is idle. Its replicas get no ``data`` REDUCE
    (no gradient of their own) but join the replica sums, adding zeros, so rank 0 (holding only
    the idle s3 of stage 1) ends with stage 1's whole gradient, and rank 1 with stage 0's."""
    p = projected(microbatches=1, **{**CHIMERA, "entries": (0,)})  # type: ignore[arg-type]
    assert p.visits(0) == {0, 1}
    got = add_reduce(p)
    assert [str(i) for i in got.ranks[0]] == [
        "F s0 m0", "B s0 m0", "REDUCE s0 data", "REDUCE s0 replica:0", "REDUCE s3 replica:1",
    ]  # fmt: skip
    assert [str(i) for i in got.ranks[1]] == [
        "F s1 m0", "B s1 m0", "REDUCE s1 data", "REDUCE s2 replica:0", "REDUCE s1 replica:1",
    ]  # fmt: skip
    check(add_communication(got))
    generated = add_reduce(generate("chimera", ranks=2, microbatches=1))  # the same program
    assert [list(map(str, r)) for r in generated.ranks] == [list(map(str, r)) for r in got.ranks]
    # a replica set none of whose members is visited gets no sum (nothing to sum)
    idle = Program(
        ranks=[[forward(0, 0), backward(0, 0)], []],
        placement=(0, 1, 1),
        microbatches=1,
        edges=(),
        entries=(0,),
        replica_of=(0, 1, 1),
    )
    assert [str(i) for r in add_reduce(idle).ranks for i in r if i.op is Op.REDUCE] == [
        "REDUCE s0 data"
    ]


def test_reduce_errors() -> None:
    with pytest.raises(InvalidArgument, match="group='no spaces'"):
        add_reduce(gpipe(1, 1), group="no spaces")
    with pytest.raises(InvalidArgument, match="eval"):
        add_reduce(projected(placement=(0,), microbatches=1, training=False))
    same_rank = Program(
        ranks=[
            [forward(0, 0), forward(1, 1), backward(1, 1), backward(0, 0)],
            [forward(2, 2), backward(2, 2)],
        ],
        placement=(0, 0, 1),
        microbatches=3,
        edges=(),
        entries=(0, 1, 2),
        replica_of=(0, 0, 0),
    )
    # one replica REDUCE per rank, naming the lowest replica it holds (same-rank ones sum first)
    got = add_reduce(same_rank)
    assert [str(i) for i in got.ranks[0]][-1:] == ["REDUCE s0 replica:0"]
    assert [str(i) for i in got.ranks[1]][-1:] == ["REDUCE s2 replica:0"]
    assert sum(str(i) == "REDUCE s1 replica:0" for r in got.ranks for i in r) == 0
    assert add_reduce(got) == got
    missing = parse_program("placement 0\nmicrobatches 1\nrank 0: F s0 m0")
    with pytest.raises(ScheduleError, match="stage 0 has no B or W on rank 0"):
        add_reduce(missing)


# ------------------------------------------------------------------ strip / lower
def test_strip_removes_all_communication() -> None:
    p = gpipe(3, 2)
    lowered = lower(p, split=True, reduce=True, recompute=[1])
    assert not strip_communication(lowered).lowered
    assert strip_communication(lowered) == add_recompute(split_backward(p), stages=[1])
    assert strip_communication(p) == p


def test_lower_composes_in_order() -> None:
    p = one_f_one_b(4, 8)
    assert lower(p) == add_communication(p)
    got = lower(p, split=[3], recompute=[0], reduce="data")
    want = add_communication(add_reduce(add_recompute(split_backward(p, stages=[3]), stages=[0])))
    assert got == want
    check(got)
    assert lower(p, split=False, reduce=False) == add_communication(p)
    with pytest.raises(InvalidArgument, match="reduce=3"):
        lower(p, reduce=3)  # type: ignore[arg-type]


# ------------------------------------------------------------------ weights after sends
def _gradient_sends(instrs: tuple[Instr, ...], t: int) -> int:
    """The length of the SEND/RECV run right after instrs[t] if it SENDs a gradient of instrs[t]'s
    (stage, microbatch), else 0."""
    i, n = instrs[t], 0
    while t + 1 + n < len(instrs) and instrs[t + 1 + n].op in COMM_OPS:
        n += 1
    run = instrs[t + 1 : t + 1 + n]
    mine = [
        j
        for j in run
        if j.op is Op.SEND
        and j.kind == GRAD
        and j.key[1][1] == i.stage
        and j.microbatch == i.microbatch
    ]
    return n if mine else 0


def _work(program: Program) -> Counter[tuple[Op, int, int]]:
    """The compute work per (stage, microbatch), a B counted as its I and its W."""
    out: Counter[tuple[Op, int, int]] = Counter()
    for instrs in program.ranks:
        for i in instrs:
            if i.op is Op.B:
                out.update([(Op.I, i.stage, i.microbatch), (Op.W, i.stage, i.microbatch)])
            elif i.op not in COMM_OPS and i.op is not Op.REDUCE:
                out[(i.op, i.stage, i.microbatch)] += 1
    return out


def assert_weights_after_sends(lowered: Program, got: Program) -> None:
    """``got`` is ``lowered`` with each B directly followed by SEND/RECVs that send its
    gradient rewritten as I, those SEND/RECVs, W; nothing else differs."""
    check(got)
    check(got, p2p="nccl")
    assert weights_after_sends(got) == got  # idempotent
    assert _work(got) == _work(lowered)
    assert merge_backward(got) == merge_backward(lowered)
    rewritten = set()
    for before, after in zip(lowered.ranks, got.ranks, strict=True):
        t = u = 0  # walk both ranks side by side
        while t < len(before):
            i = before[t]
            n = _gradient_sends(before, t) if i.op is Op.B else 0
            if n:
                s, m = i.stage, i.microbatch
                want = (backward_input(s, m), *before[t + 1 : t + 1 + n], backward_weight(s, m))
                assert after[u : u + n + 2] == want, f"{i} and its {n} SEND(s) became {after[u:]}"
                rewritten.add((s, m))
                t, u = t + 1 + n, u + n + 2
            else:
                assert after[u] == i, f"{i} became {after[u]}"
                t, u = t + 1, u + 1
        assert u == len(after)
    if not rewritten:
        assert got == lowered
    # the simulator sees the split: an I and a W where the B was
    ops = {
        (e.instr.op, e.instr.stage, e.instr.microbatch)
        for r in simulate(got, Costs(f=1, b=1, w=1, full=1.5)).events
        for e in r
    }
    for s, m in rewritten:
        assert {(Op.I, s, m), (Op.W, s, m)} <= ops and (Op.B, s, m) not in ops


def test_weights_after_sends_on_two_stage_1f1b() -> None:
    lowered = add_communication(one_f_one_b(2, 2))
    got = weights_after_sends(lowered)
    assert [str(i) for i in got.ranks[1]] == [
        "RECV act s0>s1 m0 from r0", "RECV act s0>s1 m1 from r0", "F s1 m0",
        "I s1 m0", "SEND grad s0>s1 m0 to r0", "W s1 m0",
        "F s1 m1", "I s1 m1", "SEND grad s0>s1 m1 to r0", "W s1 m1",
    ]  # fmt: skip
    assert got.ranks[0] == lowered.ranks[0]  # stage 0 sends no gradient: its B stay whole
    assert_weights_after_sends(lowered, got)
    # what the simulator sees: the gradient leaves after I (b), no longer after the whole B
    costs = Costs(f=1, b=1, w=2, full=3)
    assert simulate(got, costs).makespan < simulate(lowered, costs).makespan


def test_weights_after_sends_keeps_reduce_after_the_w() -> None:
    lowered = lower(one_f_one_b(2, 2), reduce="data")
    got = weights_after_sends(lowered)
    assert [str(i) for i in got.ranks[1]][-4:] == [
        "I s1 m1",
        "SEND grad s0>s1 m1 to r0",
        "W s1 m1",
        "REDUCE s1 data",
    ]
    assert_weights_after_sends(lowered, got)


def test_weights_after_sends_leaves_split_and_local_backwards_alone() -> None:
    zb = add_communication(generate("zb-h1", ranks=3, microbatches=4))
    assert weights_after_sends(zb) == zb  # every backward already split
    v = add_communication(generate("zbv", ranks=2, microbatches=2))
    merged = merge_backward(v)  # stages 1 and 2 share rank 1: their gradient stays local
    got = weights_after_sends(merged)
    assert [i for i in got.ranks[1] if i.op is Op.B and i.stage == 2]  # nothing to send
    assert not [i for i in got.ranks[1] if i.op is Op.B and i.stage == 1]  # sends to rank 0
    assert_weights_after_sends(merged, got)


def test_weights_after_sends_waits_for_every_gradient_send() -> None:
    """Stage 2 reads stages 0 and 1 (on ranks 0 and 1): its B sends two gradients, then W."""
    lowered = add_communication(projected(microbatches=1, **SKIP))  # type: ignore[arg-type]
    got = weights_after_sends(lowered)
    assert [str(i) for i in got.ranks[2]][-4:] == [
        "I s2 m0",
        "SEND grad s0>s2 m0 to r0",
        "SEND grad s1>s2 m0 to r1",
        "W s2 m0",
    ]
    assert_weights_after_sends(lowered, got)


def test_weights_after_sends_needs_a_lowered_program() -> None:
    compute = one_f_one_b(2, 2)
    with pytest.raises(InvalidArgument, match=r"compute-only.*add_communication\(program\)"):
        weights_after_sends(compute)
    one_rank = gpipe(1, 2)  # no messages at all: nothing to do
    assert weights_after_sends(one_rank) == one_rank
    evaluation = add_communication(projected(placement=(0, 1), microbatches=2, training=False))
    assert weights_after_sends(evaluation) == evaluation
    with pytest.raises(InvalidArgument, match="takes a funcpipe.schedule.ir.Program"):
        weights_after_sends("F s0 m0")  # type: ignore[arg-type]


@given(
    name=st.sampled_from(sorted(GENERATORS)),
    ranks=st.integers(1, 4),
    microbatches=st.integers(1, 8),
    recompute=st.booleans(),
    reduce=st.booleans(),
)
def test_weights_after_sends_on_every_generator(
    name: str, ranks: int, microbatches: int, recompute: bool, reduce: bool
) -> None:
    program = generate(name, ranks=ranks, microbatches=microbatches)
    if not program.training:
        lowered = add_communication(program)
        assert weights_after_sends(lowered) == lowered
        return
    every = range(program.n_stages)
    for compute in (program, merge_backward(program)):  # as generated, and with whole B's
        lowered = lower(compute, recompute=every if recompute else None, reduce=reduce or None)
        assert_weights_after_sends(lowered, weights_after_sends(lowered))


# ------------------------------------------------------------------ random programs (hypothesis)
@st.composite
def random_programs(draw: st.DrawFn) -> Program:
    """Sound compute-only programs over random stage graphs, placements and entries.

    One or two components (two: a Chimera-like second pipeline with its own entry). Each component
    is a DAG with one source in which every other stage has a producer, so a microbatch visits the
    whole component.
    """
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=2))
    edges: list[tuple[int, int]] = []
    sources = []
    base = 0
    for size in sizes:
        sources.append(base)
        for s in range(base + 1, base + size):
            producers = draw(st.sets(st.integers(base, s - 1), min_size=1, max_size=2))
            edges += [(a, s) for a in producers]
        base += size
    n = base
    n_ranks = draw(st.integers(1, min(n, 4)))
    placement = tuple(draw(st.lists(st.integers(0, n_ranks - 1), min_size=n, max_size=n)))
    placement = tuple(r % (max(placement) + 1) for r in placement)
    microbatches = draw(st.integers(1, 4))
    entries = tuple(draw(st.sampled_from(sources)) for _ in range(microbatches))
    training = draw(st.booleans())
    split = frozenset(draw(st.sets(st.integers(0, n - 1)))) if training else frozenset()
    return projected(
        placement=placement,
        microbatches=microbatches,
        edges=tuple(edges),
        entries=entries,
        training=training,
        split=split,
        rng=random.Random(draw(st.integers(0, 2**16))),
    )


@given(random_programs(), st.sampled_from([0.0, 0.5, 3.0]))
def test_lowering_random_programs(program: Program, comm: float) -> None:
    lowered = add_communication(program)
    assert_lowered_well(program, lowered)
    assert add_communication(lowered) is lowered
    # RECVs as late as possible cost nothing: every compute instruction runs at the same time
    costs = Costs(f=1.0, b=2.0, w=1.0, comm=comm)
    before, after = simulate(program, costs), simulate(lowered, costs)
    assert before.makespan == after.makespan

    def spans(tl):  # type: ignore[no-untyped-def]
        return {
            e.instr: (e.start, e.end) for r in tl.events for e in r if e.instr.op not in COMM_OPS
        }

    assert spans(before) == spans(after)


@given(random_programs(), st.data())
def test_passes_commute_with_lowering_on_random_programs(
    program: Program, data: st.DataObject
) -> None:
    if not program.training:
        return
    stages = data.draw(st.sets(st.integers(0, program.n_stages - 1)))
    lowered = add_communication(program)
    assert merge_backward(split_backward(program)) == merge_backward(program)
    assert split_backward(lowered, stages=stages) == add_communication(
        split_backward(program, stages=stages)
    )
    assert add_recompute(lowered, stages=stages) == add_communication(
        add_recompute(program, stages=stages)
    )
    assert add_reduce(lowered, stages=stages) == add_communication(
        add_reduce(program, stages=stages)
    )
    full = lower(program, split=stages, recompute=stages)
    check(full)
    assert full == add_communication(
        add_recompute(split_backward(program, stages=stages), stages=stages)
    )
    reduced = lower(program, split=stages, recompute=stages, reduce="data")
    assert strip_communication(reduced) == strip_communication(full)


@given(random_programs(), st.booleans())
def test_weights_after_sends_on_random_programs(program: Program, recompute: bool) -> None:
    if not program.training:
        return
    every = range(program.n_stages)
    lowered = lower(merge_backward(program), recompute=every if recompute else None)
    assert_weights_after_sends(lowered, weights_after_sends(lowered))


def test_messages_lists_each_cross_rank_edge_once_per_visit() -> None:
    p = projected(microbatches=2, **SKIP)  # type: ignore[arg-type]
    got = messages(p)
    assert len(got) == 3 * 2 * 2
    assert ((ACT, (0, 2), 1), 0, 2) in got
    assert ((GRAD, (0, 2), 1), 2, 0) in got
    sent = add_communication(p).ranks[0]
    assert send(ACT, (0, 2), 1, 2) in [i.join(False) for i in sent if i.op is Op.SEND]
    assert recv(GRAD, (0, 2), 1, 2) in [i.join(False) for i in sent if i.op is Op.RECV]
    assert recompute(0, 0).op is Op.R
