"""``funcpipe schedule`` and ``funcpipe check``, called through ``funcpipe.cli.app.main``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from funcpipe.cli.app import main
from funcpipe.schedule.ir import parse_program

GOOD = """\
# 1F1B on two ranks, compute-only: check lowers it
placement 0 1
microbatches 2
rank 0: F s0 m0; F s0 m1; B s0 m0; B s0 m1
rank 1: F s1 m0; B s1 m0; F s1 m1; B s1 m1
"""

# each rank needs the other's data before it computes what it sends
DEADLOCK = """\
placement 0 1 0
microbatches 1
mode eval
rank 0: RECV act s1>s2 m0 from r1; F s2 m0; F s0 m0; SEND act s0>s1 m0 to r1
rank 1: RECV act s0>s1 m0 from r0; F s1 m0; SEND act s1>s2 m0 to r0
"""


def _generators_ready() -> None:
    generators = pytest.importorskip("funcpipe.schedule.generators")
    if not hasattr(generators, "generate"):
        pytest.skip("funcpipe.schedule.generators.generate is not written yet")


def test_check_valid_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "good.txt"
    path.write_text(GOOD)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "sound" in out and "bubble" in out and "SEND act s0>s1 m0 to r1" in out
    assert main(["check", str(path), "--json", "--costs", "1,2,1,0.5"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["makespan"] == 13.0  # worked out by hand
    assert stats["lowered_by_check"] is True
    assert parse_program(stats["program"]).lowered


def test_check_deadlock_exits_1_naming_the_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "dead.txt"
    path.write_text(DEADLOCK)
    assert main(["check", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "rank 0, step 1" in captured.err and "deadlock" in captured.err
    assert "rank 1, step 1" in captured.err


def test_check_unparsable_and_unsound_files_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("placement 0\nmicrobatches 1\nrank 0: F s0 m0; X s0 m0\n")
    assert main(["check", str(bad)]) == 1
    assert "line 3: cannot parse instruction ' X s0 m0'" in capsys.readouterr().err
    missing = tmp_path / "missing_b.txt"
    missing.write_text("placement 0 1\nmicrobatches 1\nrank 0: F s0 m0; B s0 m0\nrank 1: F s1 m0\n")
    assert main(["check", str(missing)]) == 1
    assert "rank 1" in capsys.readouterr().err


def test_check_reads_torch_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sched.csv"
    path.write_text("0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1\n")
    assert main(["check", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_activations"] == [2, 1]
    path.write_text("0F0,0Q1\n")
    assert main(["check", str(path)]) == 1
    assert "row 0 (rank 0), column 1" in capsys.readouterr().err


def test_bad_arguments_exit_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", str(tmp_path / "nope.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    good = tmp_path / "good.txt"
    good.write_text(GOOD)
    for argv in (
        ["check", str(good), "--costs", "1,x,1"],
        ["schedule", "1f1b", "--ranks", "0", "--microbatches", "4"],
        ["schedule", "1f1b", "--microbatches", "4"],
    ):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "error:" in err and "Traceback" not in err


def test_schedule_json(capsys: pytest.CaptureFixture[str]) -> None:
    _generators_ready()
    assert main(["schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)  # stdout holds the one JSON object only
    assert stats["makespan"] == 33
    assert stats["bubble_fraction"] == pytest.approx(3 / 11)
    assert stats["peak_activations"] == [4, 3, 2, 1]
    program = parse_program(stats["program"])
    assert program.n_ranks == 4 and not program.lowered
    assert (
        main(
            ["schedule", "1f1b", "-p", "2", "-m", "2", "--json", "--lower", "--costs", "1,1,1,0.5"]
        )
        == 0
    )
    lowered = json.loads(capsys.readouterr().out)
    assert parse_program(lowered["program"]).lowered and lowered["lowered"] is True


def test_schedule_text_output_and_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _generators_ready()
    png, trace, text = tmp_path / "s.png", tmp_path / "s.json", tmp_path / "s.txt"
    argv = ["schedule", "gpipe", "--ranks", "2", "--microbatches", "3"]
    assert main([*argv, "--png", str(png), "--trace", str(trace), "--text", str(text)]) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and "rank 1" in out and "peak activations" in out
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 1000
    assert json.loads(trace.read_text())["traceEvents"]
    assert parse_program(text.read_text()).microbatches == 3


def test_schedule_unknown_name_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    _generators_ready()
    assert main(["schedule", "no-such-schedule", "--ranks", "2", "--microbatches", "2"]) == 2
    assert "no-such-schedule" in capsys.readouterr().err


def test_schedule_memory(capsys: pytest.CaptureFixture[str]) -> None:
    from funcpipe.schedule import generate, peak_memory

    argv = ["schedule", "zb-h1", "-p", "2", "-m", "4", "--memory", "160,128"]
    assert main(argv) == 0
    assert "peak memory       320 288  (per rank)" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["peak_memory"]
    assert got == list(peak_memory(generate("zb-h1", ranks=2, microbatches=4), 160, 128))
    with pytest.raises(SystemExit):
        main(["schedule", "1f1b", "-p", "2", "-m", "4", "--memory", "1,-2"])
    assert "--memory='1,-2': write ACTIVATION" in capsys.readouterr().err


def test_schedule_auto_with_a_limit_in_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    from funcpipe.schedule import auto

    sizes = "1,1,1,1,1,1,1,4"
    argv = ["schedule", "auto", "-p", "4", "-m", "16", "--placement", "v"]
    assert main([*argv, "--max-memory", "10,6,6,6", "--stage-memory", sizes, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = auto(
        ranks=4, microbatches=16, placement="v", max_memory=[10, 6, 6, 6], memory=[1.0] * 7 + [4]
    )
    assert parse_program(got["program"]).ranks == want.ranks
    assert got["makespan"] == 104 and got["peak_memory"] == [7, 6, 6, 6]
    assert main([*argv, "--max-memory", "10", "--stage-memory", sizes]) == 0
    assert "peak memory       " in capsys.readouterr().out
    assert main(["schedule", "1f1b", "-p", "2", "-m", "4", "--max-memory", "5"]) == 2
    assert "options of 'auto', not of '1f1b'" in capsys.readouterr().err
    assert main([*argv, "--max-memory", "10"]) == 2
    assert "max_memory needs memory=" in capsys.readouterr().err


# ------------------------------------------------------------------------------ issue 42
@pytest.mark.parametrize(("flag", "name"), [("--png", "t.png"), ("--trace", "t.json"),
                                            ("--text", "t.txt")])  # fmt: skip
def test_an_unwritable_output_path_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, name: str
) -> None:
    """A file where a directory should be (it works as root too, unlike a read-only one): an
    uncaught FileExistsError before."""
    _generators_ready()
    (tmp_path / "notes.txt").write_text("")
    target = tmp_path / "notes.txt" / name
    assert main(["schedule", "1f1b", "-p", "2", "-m", "2", flag, str(target)]) == 2
    err = capsys.readouterr().err
    assert f"funcpipe schedule: error: {flag} {target}: cannot be written" in err, err
    assert f"{tmp_path / 'notes.txt'} is a file, not a directory" in err, err
    assert "a path in a directory you can write" in err, err


def test_check_a_binary_csv_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A binary file given as a torch pipelining CSV: an uncaught UnicodeDecodeError before."""
    path = tmp_path / "schedule.csv"
    path.write_bytes(bytes(range(256)) * 4)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"funcpipe check: error: read_csv: {str(path)!r} is not a text file" in err, err


def test_schedule_overlap_shows_the_pairs_and_what_they_hide(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["schedule", "dualpipev", "-p", "4", "-m", "16", "--stage-comm", "0.5,0.5"]
    assert main([*base, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["pairs"] == 0 and plain["hidden"] == 0 and plain["makespan"] == 134
    trace = tmp_path / "dv.json"
    assert main([*base, "--overlap", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "& B s" in out  # the table shows the pairs
    assert "pairs             90  (overlapped F & B)" in out and "hidden            90" in out
    assert "makespan          111.5" in out
    events = json.loads(trace.read_text())["traceEvents"]
    second = [e for e in events if e.get("ph") == "X" and e["name"].startswith("& ")]
    assert second and all(e["tid"] == 2 for e in second)  # a track of their own
    with pytest.raises(SystemExit):
        main([*base[:-2], "--stage-comm", "x"])
    assert main([*base[:-2], "--stage-comm", "0.5"]) == 2
    assert "--stage-comm 0.5: give two numbers" in capsys.readouterr().err
