"""The torch.distributed.pipelining CSV format: reading, writing, round trips, torch's own dumps."""

from __future__ import annotations

import csv
import types
from pathlib import Path

import pytest

from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.schedule.check import check
from funcpipe.schedule.interop import read_csv, write_csv
from funcpipe.schedule.ir import Program, backward, forward, parse_program
from funcpipe.schedule.passes import add_communication, add_recompute, add_reduce, split_backward


def one_f_one_b(p: int, m: int) -> Program:
    ranks = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        instrs = [forward(r, k) for k in range(warm)]
        for k in range(m - warm):
            instrs += [forward(r, warm + k), backward(r, k)]
        instrs += [backward(r, k) for k in range(m - warm, m)]
        ranks.append(instrs)
    return Program(ranks=ranks, placement=range(p), microbatches=m)


# What torch's _dump_csv writes for Schedule1F1B-like order on 2 ranks (csv.writer rows; None
# actions become empty cells), written out by hand from the documented format.
TORCH_TEXT = "0F0,0F1,,0B0,,0B1\r\n,1F0,1B0,1F1,1B1\r\n"


def test_reads_torch_text() -> None:
    p = read_csv(TORCH_TEXT)
    assert p.placement == (0, 1)
    assert p.microbatches == 2
    assert p.training
    assert [str(i) for i in p.ranks[0]] == ["F s0 m0", "F s0 m1", "B s0 m0", "B s0 m1"]
    assert [str(i) for i in p.ranks[1]] == ["F s1 m0", "B s1 m0", "F s1 m1", "B s1 m1"]
    check(p)
    check(add_communication(p))


def test_reads_v_placement_split_backward_and_overlap_cells() -> None:
    text = (
        "0F0,,,3F0,(0F1;3I0)OVERLAP_F_B,3W0,,3F1,3B1,0I0,0W0,0B1\n"
        ",1F0,2F0,,1F1,2I0,2F1,2W0,,2B1,1I0,1W0,1B1\n"
    )
    p = read_csv(text, microbatches=2)
    assert p.placement == (0, 1, 1, 0)
    # the OVERLAP_F_B cell is an overlapped pair: F s0 m1 & I s3 m0
    assert [str(i) for i in p.ranks[0]][1:5] == ["F s3 m0", "F s0 m1", "& I s3 m0", "W s3 m0"]
    check(p)
    assert read_csv(write_csv(p, align=False), microbatches=2).ranks == p.ranks
    assert "(0F1;3I0)OVERLAP_F_B" in write_csv(p)


def test_an_overlap_cell_that_cannot_be_a_sound_pair_runs_its_halves_alone() -> None:
    # B s0 m0 needs B s1 m0, which rank 1 runs after F s1 m1, which needs F s0 m1
    p = read_csv("0F0,(0F1;0B0)OVERLAP_F_B,0B1\n1F0,1F1,1B0,1B1")
    assert [str(i) for i in p.ranks[0]] == ["F s0 m0", "F s0 m1", "B s0 m0", "B s0 m1"]
    check(p)


def test_comm_cells_are_skipped_or_rejected() -> None:
    text = "0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD\n1RECV_F0,1F0,1B0,1SEND_B0,1UNSHARD"
    p = read_csv(text)
    assert p == read_csv("0F0,0B0\n1F0,1B0")
    with pytest.raises(ScheduleError, match="row 0 \\(rank 0\\), column 1: cell '0SEND_F0'") as e:
        read_csv(text, comms="reject")
    assert (e.value.rank, e.value.step) == (0, 1)
    with pytest.raises(InvalidArgument, match="comms='maybe'"):
        read_csv(text, comms="maybe")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("0F0,0X0", "row 0 \\(rank 0\\), column 1: cannot read cell '0X0'"),
        ("0F0\n1F0, F1", "row 1 \\(rank 1\\), column 1: cannot read cell ' F1'"),
        ("0F0,0B", "column 1: cannot read cell '0B'"),
        ("0F0,(0F1;zz)OVERLAP_F_B", "column 1: cannot read cell"),
        ("0F0\n0B0", "row 1, column 0: cell '0B0' runs stage 0, which row 0"),
        ("0F0\n2F0", "stage\\(s\\) \\[1\\] appear in no cell"),
        ("\n,,\n", "no rows"),
        (",,", "no rows"),
        ("0SEND_F0", "no compute cells"),
    ],
)
def test_malformed_csv_names_row_column_and_cell(text: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        read_csv(text)


def test_microbatches_and_placement_options() -> None:
    p = read_csv("0F0,0B0\n1F0,1B0", microbatches=1, placement=(0, 1))
    assert p.microbatches == 1
    with pytest.raises(ScheduleError, match="microbatches=1 but the CSV uses microbatch 2"):
        read_csv("0F2", microbatches=1)
    with pytest.raises(ScheduleError, match="stage 1 is placed on rank 0"):
        read_csv("0F0\n1F0", placement=(0, 0))
    with pytest.raises(InvalidArgument, match="microbatches=0"):
        read_csv("0F0", microbatches=0)
    # a stage that appears nowhere needs the placement; the program is incomplete but reads
    q = read_csv("0F0\n\n2F0", placement=(0, 1, 2))
    assert q.n_ranks == 3 and not q.training


def test_reads_files(tmp_path: Path) -> None:
    path = tmp_path / "my_sched.csv"
    path.write_text(TORCH_TEXT)
    assert read_csv(path).name == "my_sched"
    assert read_csv(str(path)) == read_csv(path)
    assert read_csv(TORCH_TEXT).name == ""
    with pytest.raises(InvalidArgument, match="cannot read"):
        read_csv(tmp_path / "missing.csv")
    with pytest.raises(InvalidArgument, match="text_or_path=3"):
        read_csv(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (4, 8)])
def test_round_trip(p: int, m: int, split: bool) -> None:
    program = one_f_one_b(p, m)
    if split:
        program = split_backward(program)
    for align in (True, False):
        text = write_csv(program, align=align)
        assert read_csv(text) == program
    # lowered programs write their compute cells only
    assert write_csv(add_reduce(add_communication(program))) == write_csv(program)


def test_aligned_rows_put_idle_steps_in_empty_cells() -> None:
    text = write_csv(one_f_one_b(2, 2))
    assert text == "0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1,\n"
    assert write_csv(one_f_one_b(2, 2), align=False) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    evaluation = parse_program(
        "placement 0 1\nmicrobatches 2\nmode eval\nrank 0: F s0 m0; F s0 m1\nrank 1: F s1 m0; F s1 m1"
    )
    assert write_csv(evaluation) == "0F0,0F1,\n,1F0,1F1\n"
    assert not read_csv(write_csv(evaluation)).training


def test_write_rejects_what_csv_cannot_express() -> None:
    with pytest.raises(InvalidArgument, match="no recompute"):
        write_csv(add_recompute(one_f_one_b(2, 2), stages=[0]))
    skip = Program(ranks=[[forward(0, 0)], [forward(1, 0)], [forward(2, 0)]], placement=(0, 1, 2),
                   microbatches=1, edges=((0, 1), (1, 2), (0, 2)), training=False)  # fmt: skip
    with pytest.raises(InvalidArgument, match="knows only a chain"):
        write_csv(skip)
    chimera = Program(ranks=[[forward(0, 0), forward(3, 1)], [forward(1, 0), forward(2, 1)]],
                      placement=(0, 1, 1, 0), microbatches=2, edges=((0, 1), (2, 3)),
                      entries=(0, 2), training=False)  # fmt: skip
    with pytest.raises(InvalidArgument, match="knows only a chain"):
        write_csv(chimera)
    replicas = Program(ranks=[[forward(0, 0)], [forward(1, 0)]], placement=(0, 1), microbatches=1,
                       replica_of=(0, 0), training=False)  # fmt: skip
    with pytest.raises(InvalidArgument, match="replica_of"):
        write_csv(replicas)
    deadlock = parse_program(
        "placement 0 1\nmicrobatches 1\nrank 0: B s0 m0; F s0 m0\nrank 1: F s1 m0; B s1 m0"
    )
    with pytest.raises(ScheduleError):
        write_csv(deadlock)


# ------------------------------------------------------------------ torch's own schedules
def _torch_schedule(cls_name: str, p: int, m: int, style: str) -> object:
    """Build one of torch's multi-stage schedule classes with duck-typed stages for rank 0.

    The schedule classes compute the whole ``pipeline_order`` (every rank) in their constructor
    from a few stage attributes, so no process group is needed.
    """
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, cls_name, None)
    if cls is None:
        pytest.skip(f"this torch has no {cls_name}")
    n = 2 * p

    def rank_of(s: int) -> int:
        return s % p if style == "loop" else (s if s < p else 2 * p - 1 - s)

    stages = [
        types.SimpleNamespace(
            group_size=p,
            group_rank=0,
            num_stages=n,
            stage_index=s,
            is_first=s == 0,
            is_last=s == n - 1,
            submod=None,
        )
        for s in range(n)
        if rank_of(s) == 0
    ]
    try:
        return cls(stages, n_microbatches=m)
    except Exception as e:  # an API change in torch: the hand-written CSV tests still hold
        pytest.skip(f"{cls_name} needs more than duck-typed stages in this torch: {e!r}")


@pytest.mark.parametrize(
    ("cls_name", "style"),
    [
        ("ScheduleInterleaved1F1B", "loop"),
        ("ScheduleLoopedBFS", "loop"),
        ("ScheduleInterleavedZeroBubble", "loop"),
        ("ScheduleZBVZeroBubble", "v"),
        ("ScheduleDualPipeV", "v"),
    ],
)
def test_torch_generated_schedules_load_and_check(
    cls_name: str, style: str, tmp_path: Path
) -> None:
    p, m = 4, 8
    schedule = _torch_schedule(cls_name, p, m, style)
    path = tmp_path / f"{cls_name}.csv"
    schedule._dump_csv(str(path), format="compute_only")  # type: ignore[attr-defined]
    program = read_csv(path)
    assert program.n_ranks == p and program.n_stages == 2 * p and program.microbatches == m
    if style == "v":
        assert program.placement == (0, 1, 2, 3, 3, 2, 1, 0)
    check(program)
    check(add_communication(program))
    # its compute_comms dump (with SEND/RECV cells) loads as the same compute-only program
    comms = tmp_path / "comms.csv"
    schedule._dump_csv(str(comms), format="compute_comms")  # type: ignore[attr-defined]
    assert read_csv(comms).ranks == program.ranks
    # what funcpipe writes parses with torch's own cell reader and names the same actions
    action = pytest.importorskip("torch.distributed.pipelining.schedules")._Action
    if cls_name != "ScheduleDualPipeV":  # OVERLAP_F_B cells are expanded on reading
        written = list(csv.reader(write_csv(program).splitlines()))
        theirs = [
            [str(a) for a in row if a is not None] for row in schedule.pipeline_order.values()
        ]  # type: ignore[attr-defined]
        ours = [[str(action.from_str(c)) for c in row if c] for row in written]
        assert ours == theirs


def test_a_binary_file_is_refused_naming_it(tmp_path: Path) -> None:
    """Issue 42: an uncaught UnicodeDecodeError."""
    path = tmp_path / "model.csv"
    path.write_bytes(b"0F0,\xf0\x28\x8c\x28" + bytes(range(256)))
    with pytest.raises(InvalidArgument) as e:
        read_csv(path)
    text = str(e.value)
    assert f"read_csv: {str(path)!r} is not a text file" in text, text
    assert "byte 0xf0 at offset 4 is not UTF-8" in text and "_dump_csv" in text, text
    with pytest.raises(InvalidArgument, match="is not a text file"):
        read_csv(str(path))  # a str naming the file reads it the same way
