"""Communication groups and NCCL's point-to-point rules (issue 26): the checker's model, the
lowering that satisfies it, and the simulator's view of receives posted early."""

from __future__ import annotations

import json
from collections import defaultdict, deque
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from funcpipe.cli.app import main
from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.schedule.check import check
from funcpipe.schedule.generators import CHUNKS, GENERATORS, generate
from funcpipe.schedule.ir import (
    COMPUTE_OPS,
    Instr,
    Op,
    Program,
    groups,
    parse_program,
    recv,
    send,
)
from funcpipe.schedule.passes import (
    add_communication,
    lower,
    merge_backward,
    messages,
    weights_after_sends,
)
from funcpipe.schedule.simulate import Costs, simulate

# Both ranks SEND before they RECV on the same pair, each message on its own.
SEND_FIRST = """\
placement 0 1
microbatches 2
rank 0
  F s0 m0; SEND act s0>s1 m0 to r1
  F s0 m1; SEND act s0>s1 m1 to r1
  RECV grad s0>s1 m0 from r1; B s0 m0
  RECV grad s0>s1 m1 from r1; B s0 m1
rank 1
  RECV act s0>s1 m0 from r0; F s1 m0; B s1 m0; SEND grad s0>s1 m0 to r0
  RECV act s0>s1 m1 from r0; F s1 m1; B s1 m1; SEND grad s0>s1 m1 to r0
"""

HANG = (
    "rank 0 step 3 `SEND act s0>s1 m1 to r1` and rank 1 step 3 `SEND grad s0>s1 m0 to r0` both "
    "wait on the r0-r1 stream for a RECV queued behind the other's SEND; post them in one group"
)


# ------------------------------------------------------------------ the model, by hand
def test_send_first_on_both_ends_passes_gloo_and_hangs_under_nccl() -> None:
    program = parse_program(SEND_FIRST)
    check(program)  # buffered sends: gloo never blocks a SEND
    check(program, p2p="gloo")
    with pytest.raises(ScheduleError) as info:
        check(program, p2p="nccl")
    e = info.value
    assert HANG in str(e)
    assert (e.rank, e.step) == (0, 3) and str(e.instruction) == "SEND act s0>s1 m1 to r1"
    assert e.rule and "NCCL" in e.rule and "one FIFO stream per pair of ranks" in e.rule
    assert ">> SEND act s0>s1 m1 to r1" in str(e)  # the table marks it
    # the blocked compute instructions are listed too
    assert "rank 0, step 5 (B s0 m0) waits for rank 0, step 4 (RECV grad s0>s1 m0 from r1)" in str(
        e
    )


def test_a_group_lets_the_send_and_the_receive_match_together() -> None:
    rank0 = "SEND act s0>s1 m1 to r1\n  RECV grad s0>s1 m0 from r1"
    grouped_text = SEND_FIRST.replace(
        rank0, "SEND act s0>s1 m1 to r1; + RECV grad s0>s1 m0 from r1"
    )
    grouped = parse_program(grouped_text)
    assert groups(grouped.ranks[0]) == ((1,), (3, 4), (6,))
    check(grouped, p2p="nccl")  # one end grouped is enough: its RECV is active with its SEND
    rank1 = "SEND grad s0>s1 m0 to r0\n  RECV act s0>s1 m1 from r0"
    both = parse_program(grouped_text.replace(rank1, rank1.replace("\n  RECV", "; + RECV")))
    assert both.ranks[1][4] == recv("act", (0, 1), 1, 0, joined=True)
    check(both, p2p="nccl")


def test_receives_first_on_both_ends_hang_under_nccl() -> None:
    text = """\
placement 0 1 0
microbatches 1
mode eval
rank 0: RECV act s1>s2 m0 from r1; F s0 m0; SEND act s0>s1 m0 to r1; F s2 m0
rank 1: RECV act s0>s1 m0 from r0; F s1 m0; SEND act s1>s2 m0 to r0
"""
    check(parse_program(text))
    with pytest.raises(ScheduleError, match="for a SEND queued behind the other's RECV") as info:
        check(parse_program(text), p2p="nccl")
    assert "post the SEND first on one of the ranks" in str(info.value)


def test_a_group_joining_two_peers_is_one_batch_per_peer() -> None:
    # rank 1 joins `SEND a` (to rank 2) and `RECV b` (from rank 0) in one group. b comes after
    # rank 2 got d, which rank 1 sends behind `SEND a` on the r1-r2 stream. One batch over both
    # peers (one communicator for all ranks) could not complete, so d would never reach the head;
    # but a batch is one process group's, and funcpipe's layout has one per pair: the group is
    # posted as two batches, one on each pair's stream, and `SEND a` completes on its own.
    text = """\
placement 1 2 0 1
microbatches 2
mode eval
rank 0: RECV act s1>s2 m1 from r2; + RECV act s1>s2 m0 from r2; F s2 m0; SEND act s2>s3 m0 to r1; F s2 m1; SEND act s2>s3 m1 to r1
rank 1: F s0 m0; SEND act s0>s1 m0 to r2; + RECV act s2>s3 m0 from r0; F s0 m1; SEND act s0>s1 m1 to r2; RECV act s2>s3 m1 from r0; F s3 m0; F s3 m1
rank 2: RECV act s0>s1 m0 from r1; + RECV act s0>s1 m1 from r1; F s1 m1; SEND act s1>s2 m1 to r0; F s1 m0; SEND act s1>s2 m0 to r0
"""
    program = parse_program(text)
    check(program)
    check(program, p2p="nccl", layout="pair")
    split = parse_program(text.replace("to r2; + RECV act s2>s3 m0", "to r2; RECV act s2>s3 m0"))
    check(split, p2p="nccl")
    costs = Costs(f=1, comm=0.5)
    same = simulate(program, costs, p2p="nccl").makespan
    assert same == simulate(split, costs, p2p="nccl").makespan
    with pytest.raises(InvalidArgument, match="layout='rank'.*'pair'"):
        check(program, p2p="nccl", layout="rank")


def test_a_group_completes_as_one() -> None:
    # rank 0 reads y0 (act s1>s2 m0) from a group that also sends x1 to rank 1, which rank 1
    # receives only after it sent y0: NCCL completes the group (one kernel) when x1 is through
    text = """\
placement 0 1 0
microbatches 2
mode eval
rank 0: F s0 m0; SEND act s0>s1 m0 to r1; F s0 m1; SEND act s0>s1 m1 to r1; + RECV act s1>s2 m0 from r1; F s2 m0; RECV act s1>s2 m1 from r1; F s2 m1
rank 1: RECV act s0>s1 m0 from r0; F s1 m0; SEND act s1>s2 m0 to r0; RECV act s0>s1 m1 from r0; F s1 m1; SEND act s1>s2 m1 to r0
"""
    program = parse_program(text)
    costs = Costs(f=1, comm=0.5)
    starts = {str(e.instr): e.start for e in simulate(program, costs, p2p="nccl").events[0]}
    # y0 matches at 3.0 (sent at 2.5); x1's RECV reaches the head of rank 1's side only once
    # y0's SEND completed (3.0), so x1 matches at 3.5, and with it the group: F s2 m0 then
    assert starts["F s2 m0"] == 3.5
    assert {str(e.instr): e.start for e in simulate(program, costs).events[0]}["F s2 m0"] == 3.0


def test_collectives_in_a_different_order_are_rejected_naming_both_ranks() -> None:
    text = """\
placement 0 1
microbatches 1
rank 0: F s0 m0; SEND act s0>s1 m0 to r1; + RECV grad s0>s1 m0 from r1; B s0 m0; REDUCE s0 tie:a; REDUCE s0 tie:b
rank 1: RECV act s0>s1 m0 from r0; F s1 m0; B s1 m0; SEND grad s0>s1 m0 to r0; REDUCE s1 tie:b; REDUCE s1 tie:a
"""
    for p2p in ("gloo", "nccl"):
        with pytest.raises(ScheduleError) as info:
            check(parse_program(text), p2p=p2p)
        e = info.value
        assert (e.rank, e.step) == (0, 4)
        assert "rank 0 step 4 `REDUCE s0 tie:a` and rank 1 step 4 `REDUCE s1 tie:b`" in str(
            e
        ) and "issue the REDUCEs in the same order on ranks 0 and 1" in str(e)
        assert e.rule and "same order on every rank of their group" in e.rule
    check(
        parse_program(text.replace("tie:b; REDUCE s1 tie:a", "tie:a; REDUCE s1 tie:b")), p2p="nccl"
    )


def test_p2p_is_validated() -> None:
    with pytest.raises(InvalidArgument, match="p2p='mpi'.*'gloo'.*'nccl'"):
        check(parse_program(SEND_FIRST), p2p="mpi")
    with pytest.raises(InvalidArgument, match="p2p="):
        simulate(parse_program(SEND_FIRST), p2p="NCCL")


# ------------------------------------------------------------------ the old lowering hangs
def old_lowering(program: Program) -> Program:
    """funcpipe's lowering before groups: every SEND right after its producer, every RECV
    ungrouped and as late as possible (with the earlier messages of its sender, FIFO)."""
    made: dict[tuple[int, int], list[tuple[tuple[str, tuple[int, int], int], int]]] = defaultdict(
        list
    )
    used: dict[tuple[int, int], list[tuple[tuple[str, tuple[int, int], int], int]]] = defaultdict(
        list
    )
    at = {
        (i.op, i.stage, i.microbatch): (r, t)
        for r, x in enumerate(program.ranks)
        for t, i in enumerate(x)
    }

    def find(*keys: tuple[Op, int, int]) -> tuple[int, int]:
        return next(at[k] for k in keys if k in at)

    for key, src, dst in messages(program):
        kind, (a, b), m = key
        if kind == "act":
            made[find((Op.F, a, m))].append((key, dst))
            used[find((Op.F, b, m))].append((key, src))
        else:
            made[find((Op.B, b, m), (Op.I, b, m))].append((key, dst))
            used[find((Op.B, a, m), (Op.I, a, m))].append((key, src))
    sent: dict[tuple[int, int], deque[tuple[str, tuple[int, int], int]]] = defaultdict(deque)
    for r, instrs in enumerate(program.ranks):
        for t, _ in enumerate(instrs):
            for key, dst in sorted(made.get((r, t), ())):
                sent[(r, dst)].append(key)
    ranks = []
    for r, instrs in enumerate(program.ranks):
        out: list[Instr] = []
        got: set[tuple[str, tuple[int, int], int]] = set()
        for t, i in enumerate(instrs):
            for key, src in sorted(used.get((r, t), ())):
                while key not in got:
                    k = sent[(src, r)].popleft()
                    got.add(k)
                    out.append(recv(k[0], k[1], k[2], src))
            out.append(i)
            out.extend(send(k[0], k[1], k[2], d) for k, d in sorted(made.get((r, t), ())))
        ranks.append(tuple(out))
    return program.replace(ranks=tuple(ranks))


def test_the_old_lowering_of_1f1b_hangs_under_nccl_and_the_new_one_does_not() -> None:
    program = generate("1f1b", ranks=2, microbatches=2)
    old = old_lowering(program)
    check(old)
    assert old == parse_program(SEND_FIRST).replace(name="1f1b")
    with pytest.raises(ScheduleError, match="both wait on the r0-r1 stream"):
        check(old, p2p="nccl")
    new = add_communication(program)
    check(new, p2p="nccl")
    # what makes it safe is the order (both ends post the pair's messages in the order they
    # are sent); the groups only post neighbours together: without them it still runs
    check(_ungrouped(new), p2p="nccl")


def _ungrouped(program: Program) -> Program:
    return program.replace(
        ranks=tuple(tuple(i.join(False) if i.joined else i for i in r) for r in program.ranks)
    )


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_the_old_lowering_hangs_for_all_but_gpipe_and_forward(name: str) -> None:
    hung = []
    for p, m in [(2, 4), (4, 8)]:
        old = old_lowering(generate(name, ranks=p, microbatches=m))
        check(old)
        try:
            check(old, p2p="nccl")
        except ScheduleError as e:
            assert "deadlock" in str(e) and e.rule and "NCCL" in e.rule
            hung.append((p, m))
    assert (hung == []) == (name in ("gpipe", "forward")), hung


# ------------------------------------------------------------------ mutations of a lowering
def test_posting_a_receive_after_the_send_behind_it_hangs_unless_grouped() -> None:
    lowered = add_communication(generate("1f1b", ranks=2, microbatches=4))
    one = [str(i) for i in lowered.ranks[1]]
    # rank 1 posts the activation RECV of m1 at once (step 1), before its gradient SEND of m0
    assert one[1] == "RECV act s0>s1 m1 from r0" and one[4] == "SEND grad s0>s1 m0 to r0"
    late = list(lowered.ranks[1])
    late.insert(4, late.pop(1))  # the old place: after the SEND, ungrouped
    moved = lowered.replace(ranks=(lowered.ranks[0], tuple(late)))
    check(moved, p2p="nccl")  # rank 0 still posts SEND act m1 and RECV grad m0 in one group
    split = [list(r) for r in moved.ranks]
    assert str(split[0][4]) == "+ RECV grad s0>s1 m0 from r1"
    split[0][4] = split[0][4].join(False)
    with pytest.raises(ScheduleError) as info:
        check(moved.replace(ranks=tuple(map(tuple, split))), p2p="nccl")
    assert (
        "rank 0 step 3 `SEND act s0>s1 m1 to r1` and rank 1 step 3 `SEND grad s0>s1 m0 to r0` "
        "both wait on the r0-r1 stream for a RECV queued behind the other's SEND"
    ) in str(info.value)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_lowering_runs_without_its_groups_and_its_order_matters(name: str) -> None:
    for ranks, microbatches in [(2, 3), (4, 8)]:
        lowered = add_communication(generate(name, ranks=ranks, microbatches=microbatches))
        check(_ungrouped(lowered), p2p="nccl")


# ------------------------------------------------------------------ early receives
@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_with_the_reference_costs_nccl_adds_no_wait(name: str) -> None:
    """The receives are posted as the reference run sends their data (F 1, B and I 2, W 0):
    run with those costs, no message ever waits for its RECV or for the stream."""
    costs = Costs(f=1, b=2, w=0)
    for ranks, microbatches in [(2, 4), (3, 7), (4, 8), (5, 16)]:
        program = generate(name, ranks=ranks, microbatches=microbatches)
        lowered = add_communication(program)
        want = simulate(program, costs)
        got = simulate(lowered, costs, p2p="nccl")
        assert got.makespan == want.makespan
        starts = {e.instr: e.start for r in want.events for e in r}
        assert all(
            e.start == starts[e.instr] for r in got.events for e in r if e.instr.op in COMPUTE_OPS
        )


# ------------------------------------------------------------------ every generator, lowered
def _variants(program: Program) -> list[Program]:
    """The lowered program, and with recompute + reduce, and with weights after sends."""
    out = [add_communication(program)]
    if program.training:
        every = range(program.n_stages)
        out.append(lower(program, recompute=every, reduce="data"))
        out.append(weights_after_sends(lower(merge_backward(program), reduce="data")))
    return out


def _chunks(name: str) -> list[int | None]:
    return [None] if CHUNKS[name] is not None else [None, 3]


def assert_nccl_sound(program: Program) -> None:
    for lowered in _variants(program):
        check(lowered, p2p="nccl")  # implies gloo: buffered sends only help
        assert parse_program(lowered.to_text()) == lowered


@settings(deadline=None)
@given(
    name=st.sampled_from(sorted(GENERATORS)),
    ranks=st.integers(1, 8),
    microbatches=st.integers(1, 32),
    chunks=st.sampled_from([None, 3]),
)
def test_every_generator_lowers_to_a_program_nccl_accepts(
    name: str, ranks: int, microbatches: int, chunks: int | None
) -> None:
    if CHUNKS[name] is not None:
        chunks = None
    assert_nccl_sound(generate(name, ranks=ranks, microbatches=microbatches, chunks=chunks))


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_every_generator_x_ranks_1_to_8_x_microbatches_1_to_32_passes_nccl(name: str) -> None:
    for ranks in range(1, 9):
        for microbatches in range(1, 33):
            assert_nccl_sound(generate(name, ranks=ranks, microbatches=microbatches))


# ------------------------------------------------------------------ the simulator's view
EVAL = (
    "placement 0 1\nmicrobatches 2\nmode eval\nrank 0: F s0 m0; F s0 m1\nrank 1: F s1 m0; F s1 m1"
)


def test_a_receive_posted_early_costs_no_wait() -> None:
    compute = parse_program(EVAL)
    early = add_communication(compute)
    assert [str(i) for i in early.ranks[1]] == [
        "RECV act s0>s1 m0 from r0",
        "RECV act s0>s1 m1 from r0",  # posted before F s1 m0: its data arrives meanwhile
        "F s1 m0",
        "F s1 m1",
    ]
    late = parse_program(
        EVAL.replace(
            "rank 0: F s0 m0; F s0 m1",
            "rank 0: F s0 m0; SEND act s0>s1 m0 to r1; F s0 m1; SEND act s0>s1 m1 to r1",
        ).replace(
            "rank 1: F s1 m0; F s1 m1",
            "rank 1: RECV act s0>s1 m0 from r0; F s1 m0; RECV act s0>s1 m1 from r0; F s1 m1",
        )
    )
    costs = Costs(f=1, comm=0.5)
    fast, slow = simulate(early, costs, p2p="nccl"), simulate(late, costs, p2p="nccl")
    spans = {str(e.instr): (e.start, e.end) for e in fast.events[1]}
    # m1's data is sent at 2 and arrives at 2.5, while F s1 m0 runs (1.5 .. 2.5): no wait
    assert spans["RECV act s0>s1 m1 from r0"] == (0.0, 2.5)
    assert spans["F s1 m0"] == (1.5, 2.5) and spans["F s1 m1"] == (2.5, 3.5)
    # posted only after F s1 m0, the receive starts its transfer then: F s1 m1 waits for it
    assert {str(e.instr): e.start for e in slow.events[1]}["F s1 m1"] == 3.0
    assert (fast.makespan, slow.makespan) == (3.5, 4.0)
    # with buffered sends (gloo) the data waits at the receiver: both cost the same
    assert simulate(early, costs).makespan == simulate(late, costs).makespan == 3.5


def test_nccl_timeline_of_every_generator_is_no_faster_than_gloo() -> None:
    costs = Costs(f=1, b=1, w=1, comm=0.25)
    for name in sorted(GENERATORS):
        lowered = add_communication(generate(name, ranks=4, microbatches=8))
        gloo, nccl = simulate(lowered, costs), simulate(lowered, costs, p2p="nccl")
        assert nccl.makespan >= gloo.makespan
        assert gloo.makespan == simulate(generate(name, ranks=4, microbatches=8), costs).makespan


# ------------------------------------------------------------------ the command line
def test_check_p2p_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "send_first.txt"
    bad.write_text(SEND_FIRST)
    assert main(["check", str(bad)]) == 0
    assert "sound under gloo" in capsys.readouterr().out
    assert main(["check", "--p2p", "nccl", str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and HANG in captured.err
    grouped = tmp_path / "grouped.txt"
    grouped.write_text(
        SEND_FIRST.replace("to r1\n  RECV grad s0>s1 m0", "to r1; + RECV grad s0>s1 m0")
    )
    assert main(["check", "--p2p", "nccl", str(grouped)]) == 0
    assert main(["check", "--p2p", "nccl", str(grouped), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["p2p"] == "nccl"
    with pytest.raises(SystemExit) as e:
        main(["check", "--p2p", "mpi", str(grouped)])
    assert e.value.code == 2
    capsys.readouterr()


@pytest.mark.parametrize("name", ["1f1b", "interleaved", "zbv", "chimera"])
def test_schedule_json_gives_a_lowered_program_check_accepts(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["schedule", name, "--ranks", "4", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    lowered = parse_program(out["lowered_program"])
    assert lowered.lowered and any(i.joined for r in lowered.ranks for i in r)
    assert lowered == add_communication(generate(name, ranks=4, microbatches=8))
    path = tmp_path / "lowered.txt"
    path.write_text(out["lowered_program"])
    assert main(["check", "--p2p", "nccl", str(path)]) == 0
    path.write_text(out["program"])  # compute-only: check lowers it first
    assert main(["check", "--p2p", "nccl", str(path)]) == 0
