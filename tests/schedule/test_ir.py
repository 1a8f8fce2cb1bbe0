"""The IR: instruction text, program text, tables, validation of program facts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from funcpipe.errors import ScheduleError
from funcpipe.schedule.ir import (
    Instr,
    Op,
    Program,
    backward,
    backward_input,
    backward_weight,
    forward,
    parse_instr,
    parse_program,
    recompute,
    recv,
    reduce,
    send,
)

small = st.integers(0, 40)


@st.composite
def instrs(draw: st.DrawFn) -> Instr:
    kind = draw(st.sampled_from(["compute", "comm", "reduce"]))
    if kind == "compute":
        make = draw(
            st.sampled_from([forward, backward, backward_input, backward_weight, recompute])
        )
        return make(draw(small), draw(small))
    if kind == "comm":
        a = draw(small)
        b = draw(st.integers(a + 1, 60))
        make = draw(st.sampled_from([send, recv]))
        kind = draw(st.sampled_from(["act", "grad"]))
        return make(kind, (a, b), draw(small), draw(small), joined=draw(st.booleans()))
    group = draw(st.from_regex(r"[A-Za-z_][\w:.\-]{0,8}", fullmatch=True))
    return reduce(draw(small), group)


@given(instrs())
def test_instruction_text_round_trips(i: Instr) -> None:
    assert parse_instr(str(i)) == i
    assert hash(parse_instr(str(i))) == hash(i)


def test_instruction_forms() -> None:
    assert str(forward(2, 0)) == "F s2 m0"
    assert str(backward_input(1, 3)) == "I s1 m3"
    s = send("act", (0, 1), 3, 1)
    assert str(s) == "SEND act s0>s1 m3 to r1" and s.stage == 0 and s.other == 1
    g = send("grad", (0, 1), 3, 0)
    assert str(g) == "SEND grad s0>s1 m3 to r0" and g.stage == 1 and g.edge == (0, 1)
    r = recv("grad", (0, 1), 3, 1)
    assert r.stage == 0 and r.key == g.key
    assert str(reduce(0, "tie:wte")) == "REDUCE s0 tie:wte"
    assert parse_instr("  F   s1   m2 ") == forward(1, 2)
    assert Op("I") is Op.I


@pytest.mark.parametrize(
    "text",
    [
        "F s1",
        "X s0 m0",
        "SEND act s0>s1 m0 from r1",
        "RECV act s0>s1 m0 to r1",
        "F s-1 m0",
        "",
        "REDUCE s0",
        "+ F s0 m0",
        "+ REDUCE s0 data",
        "++ SEND act s0>s1 m0 to r1",
    ],
)
def test_bad_instruction_text_is_a_schedule_error(text: str) -> None:
    with pytest.raises(ScheduleError, match="cannot parse"):
        parse_instr(text)


def _two_rank_program() -> Program:
    return Program(
        ranks=[
            [forward(0, 0), send("act", (0, 1), 0, 1), recv("grad", (0, 1), 0, 1), backward(0, 0)],
            [recv("act", (0, 1), 0, 0), forward(1, 0), backward(1, 0), send("grad", (0, 1), 0, 0)],
        ],
        placement=[0, 1],
        microbatches=1,
        name="tiny",
    )


def test_program_text_round_trips_and_is_readable() -> None:
    p = _two_rank_program()
    text = p.to_text()
    assert "placement 0 1" in text and "rank 1" in text and "  RECV act s0>s1 m0 from r0" in text
    assert parse_program(text) == p
    table = str(p)
    assert table.splitlines()[0].split() == ["step", "rank", "0", "rank", "1"]
    assert "F s0 m0" in table.splitlines()[1]
    marked = p.table(mark=(1, 2))
    assert ">> B s1 m0" in marked


def test_program_text_accepts_semicolons_comments_and_graph_headers() -> None:
    text = """
    # a skip connection over three stages on two ranks
    placement 0 1 0
    microbatches 1
    edges 0>1 1>2 0>2
    mode eval
    rank 0: F s0 m0 ; F s2 m0   # two on one line
    rank 1
      F s1 m0
    """
    p = parse_program(text)
    assert p.edges == ((0, 1), (0, 2), (1, 2))
    assert p.producers(2) == (0, 1) and p.consumers(0) == (1, 2)
    assert not p.training
    assert p.ranks[0] == (forward(0, 0), forward(2, 0))
    assert parse_program(p.to_text()) == p


def test_chimera_style_entries_and_replicas() -> None:
    p = Program(
        ranks=[[forward(0, 0), forward(3, 1)], [forward(1, 0), forward(2, 1)]],
        placement=[0, 1, 1, 0],
        microbatches=2,
        edges=[(0, 1), (2, 3)],
        entries=[0, 2],
        replica_of=[0, 1, 0, 1],
        training=False,
    )
    assert p.visits(0) == {0, 1} and p.visits(1) == {2, 3}
    assert parse_program(p.to_text()) == p


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("microbatches 1\nrank 0\nF s0 m0", "no 'placement'"),
        ("placement 0\nrank 0\nF s0 m0", "no 'microbatches'"),
        ("placement 0\nmicrobatches x", "whole numbers"),
        ("placement 0\nmicrobatches 1\nbogus 3", "unknown header"),
        ("placement 0\nmicrobatches 1\nrank 0\nF s0 m0\nrank 0", "appears twice"),
        ("placement 0\nmicrobatches 1\nmode fast", "mode"),
        ("placement 0 1\nstages 3\nmicrobatches 1", "placement lists 2"),
        ("placement 0 3\nranks 2\nmicrobatches 1", "rank 3 is used"),
        ("placement 0 1\nmicrobatches 1\nedges 1>0", "earlier stage"),
        ("placement 0 1\nmicrobatches 1\nedges 0-1", "write edges"),
        ("placement 0\nmicrobatches 1\nrank 0\nF s0 m0 x", "line 4"),
        ("placement 0 1\nmicrobatches 2\nentries 0 1", "entries\\[1\\]=1"),
        ("placement 0\nmicrobatches 0", "microbatches=0"),
    ],
)
def test_malformed_program_text_is_a_schedule_error(text: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        parse_program(text)


def test_parse_program_rejects_non_text() -> None:
    with pytest.raises(ScheduleError, match="str"):
        parse_program(b"placement 0")  # type: ignore[arg-type]


def test_program_is_a_hashable_value() -> None:
    a, b = _two_rank_program(), _two_rank_program()
    assert a == b and hash(a) == hash(b)
    assert a.replace(name="other") != a
    assert a.replace(edges=[]).producers(1) == ()


# ------------------------------------------------------------------ communication groups
def test_joined_text_round_trips_and_is_canonical() -> None:
    r = recv("grad", (0, 1), 0, 1, joined=True)
    assert str(r) == "+ RECV grad s0>s1 m0 from r1" and r.joined
    assert parse_instr("+ RECV grad s0>s1 m0 from r1") == r
    assert parse_instr("+RECV grad s0>s1 m0 from r1") == r
    assert r != recv("grad", (0, 1), 0, 1) and r.join(False) == recv("grad", (0, 1), 0, 1)
    assert r.key == recv("grad", (0, 1), 0, 1).key  # the group marker is not part of the message
    # canonical form: only a SEND/RECV carries the group marker; an F, B or I the pair marker
    assert Instr(Op.W, 0, 0, joined=True) == backward_weight(0, 0)
    assert Instr(Op.R, 0, 0, joined=True) == Instr(Op.R, 0, 0)
    assert Instr(Op.REDUCE, 0, group="data", joined=True) == reduce(0, "data")
    with pytest.raises(ScheduleError, match="only a SEND or RECV"):
        backward_weight(0, 0).join()
    with pytest.raises(ScheduleError, match="only a SEND or RECV joins"):
        parse_instr("+ F s0 m0")


def _grouped_program() -> Program:
    return parse_program(
        """
        placement 0 1
        microbatches 2
        rank 0
          F s0 m0; SEND act s0>s1 m0 to r1
          F s0 m1; SEND act s0>s1 m1 to r1; + RECV grad s0>s1 m0 from r1
          B s0 m0; RECV grad s0>s1 m1 from r1; B s0 m1
        rank 1
          RECV act s0>s1 m0 from r0; F s1 m0; B s1 m0
          SEND grad s0>s1 m0 to r0; + RECV act s0>s1 m1 from r0
          F s1 m1; B s1 m1; SEND grad s0>s1 m1 to r0
        """
    )


def test_groups_round_trip_through_the_text_and_show_in_the_table() -> None:
    from funcpipe.schedule.ir import groups

    p = _grouped_program()
    assert p.ranks[0][4] == recv("grad", (0, 1), 0, 1, joined=True)
    assert groups(p.ranks[0]) == ((1,), (3, 4), (6,))
    assert groups(p.ranks[1]) == ((0,), (3, 4), (7,))
    text = p.to_text()
    assert "  + RECV grad s0>s1 m0 from r1" in text
    assert parse_program(text) == p
    rows = str(p).splitlines()
    cells = [c.strip() for c in rows[5].split("  ") if c.strip()]
    assert cells == ["4", "+ RECV grad s0>s1 m0 from r1", "+ RECV act s0>s1 m1 from r0"]
    assert ">> + RECV act s0>s1 m1 from r0" in p.table(mark=(1, 4))


@pytest.mark.parametrize(
    ("rank0", "step", "what"),
    [
        ("+ SEND act s0>s1 m0 to r1; F s0 m0", 0, "first instruction of the rank"),
        ("F s0 m0; + SEND act s0>s1 m0 to r1", 1, "step 0 is F s0 m0"),
    ],
)
def test_a_joined_instruction_must_follow_a_send_or_recv(rank0: str, step: int, what: str) -> None:
    text = f"placement 0 1\nmicrobatches 1\nmode eval\nrank 0: {rank0}\nrank 1: F s1 m0"
    with pytest.raises(ScheduleError, match=f"rank 0, step {step} .*{what}.*drop the '\\+'") as e:
        parse_program(text)
    assert (e.value.rank, e.value.step) == (0, step)
    assert e.value.rule == "a joined SEND/RECV follows a SEND or RECV on the same rank"
    with pytest.raises(ScheduleError, match="after a SEND/RECV"):
        Program(
            ranks=[[forward(0, 0), send("act", (0, 1), 0, 1, joined=True)], [forward(1, 0)]],
            placement=(0, 1),
            microbatches=1,
            training=False,
        )


def test_ir_names_the_instructions() -> None:
    """The instructions live in ``funcpipe.schedule.instr``; ``funcpipe.schedule.ir`` names
    every one of them (the path the package and its users import from)."""
    from funcpipe.schedule import instr, ir

    for name in instr.__all__:
        assert getattr(ir, name) is getattr(instr, name), name
