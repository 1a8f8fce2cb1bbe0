"""The checker: every rule has a program that breaks it, and the error names rank, step and rule."""

from __future__ import annotations

import pytest

from funcpipe.errors import ScheduleError
from funcpipe.schedule.check import check
from funcpipe.schedule.ir import Program, parse_program


def _fill_drain(p: int, m: int) -> str:
    """A lowered GPipe-like program text for p ranks, m microbatches (written out by hand)."""
    lines = [f"placement {' '.join(map(str, range(p)))}", f"microbatches {m}"]
    for r in range(p):
        lines.append(f"rank {r}")
        for k in range(m):
            if r > 0:
                lines.append(f"RECV act s{r - 1}>s{r} m{k} from r{r - 1}")
            lines.append(f"F s{r} m{k}")
            if r < p - 1:
                lines.append(f"SEND act s{r}>s{r + 1} m{k} to r{r + 1}")
        for k in range(m):
            if r < p - 1:
                lines.append(f"RECV grad s{r}>s{r + 1} m{k} from r{r + 1}")
            lines.append(f"B s{r} m{k}")
            if r > 0:
                lines.append(f"SEND grad s{r - 1}>s{r} m{k} to r{r - 1}")
    return "\n".join(lines)


def test_valid_programs_pass() -> None:
    check(parse_program(_fill_drain(3, 4)))
    compute_only = "placement 0 1\nmicrobatches 2\nrank 0: F s0 m0; F s0 m1; B s0 m0; B s0 m1\n"
    compute_only += "rank 1: F s1 m0; B s1 m0; F s1 m1; B s1 m1"
    check(parse_program(compute_only))
    split = (
        "placement 0\nmicrobatches 1\nrank 0: F s0 m0; R s0 m0; I s0 m0; W s0 m0; REDUCE s0 data"
    )
    check(parse_program(split))
    evaluation = "placement 0 1\nmicrobatches 1\nmode eval\nrank 0: F s0 m0\nrank 1: F s1 m0"
    check(parse_program(evaluation))


BAD = {
    "stage on the wrong rank": (
        "placement 0 1\nmicrobatches 1\nrank 0: F s0 m0; F s1 m0; B s1 m0; B s0 m0\nrank 1:",
        (0, 1),
        "placed on rank 1",
    ),
    "missing forward": (
        "placement 0\nmicrobatches 2\nrank 0: F s0 m0; B s0 m0; B s0 m1",
        (0, 2),
        "F s0 m1 is missing",
    ),
    "duplicate forward": (
        "placement 0\nmicrobatches 1\nrank 0: F s0 m0; F s0 m0; B s0 m0",
        (0, 1),
        "duplicate",
    ),
    "backward before forward": (
        "placement 0\nmicrobatches 1\nrank 0: B s0 m0; F s0 m0",
        (0, 0),
        "comes later on this rank",
    ),
    "W before I": (
        "placement 0\nmicrobatches 1\nrank 0: F s0 m0; W s0 m0; I s0 m0",
        (0, 1),
        "I s0 m0",
    ),
    "I without W": (
        "placement 0\nmicrobatches 1\nrank 0: F s0 m0; I s0 m0",
        (0, 1),
        "W s0 m0 is missing",
    ),
    "B and I": (
        "placement 0\nmicrobatches 1\nrank 0: F s0 m0; B s0 m0; I s0 m0; W s0 m0",
        (0, 2),
        "has a B and also",
    ),
    "microbatch out of range": (
        "placement 0\nmicrobatches 1\nrank 0: F s0 m0; F s0 m5; B s0 m0",
        (0, 1),
        "microbatch 5 does not exist",
    ),
    "stage out of range": (
        "placement 0\nmicrobatches 1\nrank 0: F s0 m0; F s3 m0",
        (0, 1),
        "stage 3 does not exist",
    ),
    "backward in eval": (
        "placement 0\nmicrobatches 1\nmode eval\nrank 0: F s0 m0; B s0 m0",
        (0, 1),
        "eval",
    ),
    "consumer before producer on one rank": (
        "placement 0 0\nmicrobatches 1\nrank 0: F s1 m0; F s0 m0; B s1 m0; B s0 m0",
        (0, 0),
        "comes later on this rank",
    ),
    "producer backward before consumer backward": (
        "placement 0 0\nmicrobatches 1\nrank 0: F s0 m0; F s1 m0; B s0 m0; B s1 m0",
        (0, 2),
        "input gradient of stage 1",
    ),
    "recompute after backward": (
        "placement 0\nmicrobatches 1\nrank 0: F s0 m0; B s0 m0; R s0 m0",
        (0, 2),
        "R \\(recompute\\)",
    ),
    "reduce before last gradient": (
        "placement 0\nmicrobatches 2\nrank 0: F s0 m0; F s0 m1; B s0 m0; REDUCE s0 data; B s0 m1",
        (0, 3),
        "REDUCE comes after every gradient",
    ),
    "compute-only deadlock": (
        "placement 0 1 0 1\nmicrobatches 1\nmode eval\nrank 0: F s2 m0; F s0 m0\nrank 1: F s1 m0; F s3 m0",
        (0, 0),
        "deadlock",
    ),
    "lowered deadlock": (
        "placement 0 1\nmicrobatches 1\nmode eval\n"
        "rank 0: RECV act s1>s2 m0 from r1; F s0 m0; SEND act s0>s1 m0 to r1; F s2 m0\n"
        "rank 1: RECV act s0>s1 m0 from r0; F s1 m0; SEND act s1>s2 m0 to r0\n"
        "placement 0 1 0",
        None,
        None,
    ),
    "message missing its receive": (
        "placement 0 1\nmicrobatches 1\nmode eval\nrank 0: F s0 m0; SEND act s0>s1 m0 to r1\nrank 1: F s1 m0",
        (1, 1),
        "RECV act s0>s1 m0 is missing",
    ),
    "receive of a message never sent": (
        "placement 0 1\nmicrobatches 1\nmode eval\nrank 0: F s0 m0\nrank 1: RECV act s0>s1 m0 from r0; F s1 m0",
        (0, 1),
        "SEND act s0>s1 m0 is missing",
    ),
    "wrong peer": (
        "placement 0 1 2\nmicrobatches 1\nmode eval\n"
        "rank 0: F s0 m0; SEND act s0>s1 m0 to r2\nrank 1: RECV act s0>s1 m0 from r0; F s1 m0\nrank 2: F s2 m0",
        (0, 1),
        "peer is rank 2",
    ),
    "send to itself": (
        "placement 0 0\nmicrobatches 1\nmode eval\nrank 0: F s0 m0; SEND act s0>s1 m0 to r0; F s1 m0",
        (0, 1),
        "same-rank edges stay local",
    ),
    "message on a non-edge": (
        "placement 0 1\nmicrobatches 1\nmode eval\nedges\n"
        "rank 0: F s0 m0; SEND act s0>s1 m0 to r1\nrank 1: RECV act s0>s1 m0 from r0; F s1 m0",
        (0, 1),
        "not an edge",
    ),
    "messages out of order": (
        "placement 0 1\nmicrobatches 2\nmode eval\n"
        "rank 0: F s0 m0; SEND act s0>s1 m0 to r1; F s0 m1; SEND act s0>s1 m1 to r1\n"
        "rank 1: RECV act s0>s1 m1 from r0; RECV act s0>s1 m0 from r0; F s1 m0; F s1 m1",
        (1, 0),
        "FIFO",
    ),
    "forward without its receive": (
        "placement 0 1\nmicrobatches 1\nmode eval\n"
        "rank 0: F s0 m0; SEND act s0>s1 m0 to r1\nrank 1: F s1 m0; RECV act s0>s1 m0 from r0",
        (1, 0),
        "RECV act s0>s1 m0",
    ),
    "send before its data exists": (
        "placement 0 1\nmicrobatches 1\nmode eval\n"
        "rank 0: SEND act s0>s1 m0 to r1; F s0 m0\nrank 1: RECV act s0>s1 m0 from r0; F s1 m0",
        (0, 0),
        "comes later on this rank",
    ),
    "collective called unevenly": (
        "placement 0 1\nmicrobatches 1\n"
        "rank 0: F s0 m0; B s0 m0; REDUCE s0 tie:x; REDUCE s0 tie:x\nrank 1: F s1 m0; B s1 m0; REDUCE s1 tie:x",
        (1, 2),
        "calls it equally often",
    ),
    "microbatch that never reaches the stage": (
        "placement 0 1\nmicrobatches 2\nmode eval\nedges\nentries 0 1\nrank 0: F s0 m0; F s0 m1\nrank 1: F s1 m1",
        (0, 1),
        "never reaches stage 0",
    ),
}


@pytest.mark.parametrize("name", [k for k, v in BAD.items() if v[1] is not None])
def test_each_rule_is_enforced_with_rank_step_and_rule(name: str) -> None:
    text, (rank, step), match = BAD[name]  # type: ignore[misc]
    program = parse_program(text)
    with pytest.raises(ScheduleError, match=match) as info:
        check(program)
    err = info.value
    assert (err.rank, err.step) == (rank, step), str(err)
    assert err.rule and f"rule: {err.rule}" in str(err)
    assert f"rank {rank}, step {step}" in str(err)
    assert ">> " in str(err)  # the table marks the bad step


def test_header_after_a_rank_section_is_reported() -> None:
    with pytest.raises(ScheduleError, match="headers come before"):
        parse_program(BAD["lowered deadlock"][0])


def test_deadlock_message_lists_every_blocked_rank() -> None:
    text = (
        "placement 0 1 0\nmicrobatches 1\nmode eval\n"
        "rank 0: RECV act s1>s2 m0 from r1; F s2 m0; F s0 m0; SEND act s0>s1 m0 to r1\n"
        "rank 1: RECV act s0>s1 m0 from r0; F s1 m0; SEND act s1>s2 m0 to r0\n"
    )
    with pytest.raises(ScheduleError, match="deadlock") as info:
        check(parse_program(text))
    msg = str(info.value)
    assert "rank 0, step 1 (F s2 m0) waits for rank 0, step 0 (RECV act s1>s2 m0 from r1)" in msg
    assert "rank 1, step 1 (F s1 m0) waits for rank 1, step 0 (RECV act s0>s1 m0 from r0)" in msg
    assert (
        "rank 0 step 0 `RECV act s1>s2 m0 from r1` waits for rank 1 step 2 "
        "`SEND act s1>s2 m0 to r0`, which rank 1 has not posted: rank 1 is stuck at step 1 "
        "`F s1 m0`"
    ) in msg


def test_a_receive_is_posted_where_it_stands() -> None:
    # each rank posts its RECV before it computes and sends: only the F that reads the data
    # waits, so this runs with buffered sends (gloo); on one NCCL stream per pair both RECVs
    # hold the heads and neither SEND behind them can match
    text = (
        "placement 0 1 0\nmicrobatches 1\nmode eval\n"
        "rank 0: RECV act s1>s2 m0 from r1; F s0 m0; SEND act s0>s1 m0 to r1; F s2 m0\n"
        "rank 1: RECV act s0>s1 m0 from r0; F s1 m0; SEND act s1>s2 m0 to r0\n"
    )
    check(parse_program(text))
    with pytest.raises(ScheduleError, match="deadlock") as info:
        check(parse_program(text), p2p="nccl")
    assert (
        "rank 0 step 0 `RECV act s1>s2 m0 from r1` and rank 1 step 0 `RECV act s0>s1 m0 from r0` "
        "both wait on the r0-r1 stream for a SEND queued behind the other's RECV"
    ) in str(info.value)


def test_in_program_collective_meets_and_can_deadlock() -> None:
    ok = (
        "placement 0 1\nmicrobatches 1\n"
        "rank 0: F s0 m0; SEND act s0>s1 m0 to r1; RECV grad s0>s1 m0 from r1; B s0 m0; REDUCE s0 tie:w\n"
        "rank 1: RECV act s0>s1 m0 from r0; F s1 m0; B s1 m0; SEND grad s0>s1 m0 to r0; REDUCE s1 tie:w"
    )
    check(parse_program(ok))
    crossed = (
        "placement 0 1\nmicrobatches 1\n"
        "rank 0: F s0 m0; B s0 m0; REDUCE s0 tie:a; REDUCE s0 tie:b\n"
        "rank 1: F s1 m0; B s1 m0; REDUCE s1 tie:b; REDUCE s1 tie:a\n"
    )
    with pytest.raises(ScheduleError, match="REDUCE group"):
        check(parse_program(crossed))


def test_check_rejects_non_programs() -> None:
    with pytest.raises(ScheduleError, match="Program"):
        check("F s0 m0")  # type: ignore[arg-type]


def test_program_constructor_validates_placement() -> None:
    with pytest.raises(ScheduleError, match="placement\\[1\\]=4"):
        Program(ranks=[[], []], placement=[0, 4], microbatches=1)
