"""Pictures, Chrome traces and ASCII strips of timelines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.ir import COMPUTE_OPS, Op, Program, backward, forward
from funcpipe.schedule.passes import lower, split_backward
from funcpipe.schedule.render import ascii_timeline, chrome_trace, draw_timeline, write_chrome_trace
from funcpipe.schedule.simulate import Costs, Timeline, simulate


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


def v_shape(p: int, m: int) -> Program:
    """GPipe order over a V placement (2 stages per rank) with split backward."""
    n = 2 * p
    placement = tuple(s if s < p else 2 * p - 1 - s for s in range(n))
    ranks: list[list] = [[] for _ in range(p)]  # type: ignore[type-arg]
    for k in range(m):
        for s in range(n):
            ranks[placement[s]].append(forward(s, k))
    for k in range(m):
        for s in reversed(range(n)):
            ranks[placement[s]].append(backward(s, k))
    return split_backward(Program(ranks=ranks, placement=placement, microbatches=m, name="v"))


@pytest.fixture(scope="module")
def lowered_timeline() -> Timeline:
    return simulate(lower(one_f_one_b(4, 8), reduce="data"), Costs(comm=0.25, reduce=0.5))


def test_png_and_svg(tmp_path: Path, lowered_timeline: Timeline) -> None:
    png = draw_timeline(simulate(one_f_one_b(4, 8)), tmp_path / "a.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = draw_timeline(lowered_timeline, tmp_path / "sub" / "b.svg", title="lowered")
    text = svg.read_text()
    assert "<svg" in text
    many = draw_timeline(simulate(v_shape(2, 3)), tmp_path / "v.png")
    assert many.stat().st_size > 1000


def test_draw_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="must end in one of .png"):
        draw_timeline(simulate(one_f_one_b(2, 2)), tmp_path / "a.jpg")
    with pytest.raises(InvalidArgument, match="takes a Timeline"):
        draw_timeline(one_f_one_b(2, 2), tmp_path / "a.png")  # type: ignore[arg-type]


def test_draw_without_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(InvalidArgument, match=r"pip install funcpipe\[plot\]"):
        draw_timeline(simulate(one_f_one_b(2, 2)), tmp_path / "a.png")


def test_chrome_trace_has_one_event_per_compute_instruction(
    tmp_path: Path, lowered_timeline: Timeline
) -> None:
    tl = lowered_timeline
    trace = json.loads(json.dumps(chrome_trace(tl, scale=1000)))
    compute = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in "FBIWR"]
    want = [e for r in tl.events for e in r if e.instr.op in COMPUTE_OPS]
    assert len(compute) == len(want) == 4 * 8 * 2
    by_name = {(e["pid"], e["name"]): e for e in compute}
    for e in want:
        got = by_name[(e.rank, str(e.instr))]
        assert got["tid"] == 0
        assert got["ts"] == pytest.approx(e.start * 1000)
        assert got["dur"] == pytest.approx((e.end - e.start) * 1000)
        assert got["args"]["stage"] == e.instr.stage
        assert got["args"]["microbatch"] == e.instr.microbatch
    assert by_name[(0, "F s0 m3")]["name"] == "F s0 m3"
    # RECVs on the comm thread, one flow arrow (start + finish) per message
    recvs = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "comm"]
    sends = sum(e.instr.op is Op.SEND for r in tl.events for e in r)
    assert len(recvs) == sends == 3 * 8 * 2
    assert sum(e["ph"] in ("s", "f") for e in trace["traceEvents"]) == 2 * sends
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1", "rank 2", "rank 3"}
    path = write_chrome_trace(tl, tmp_path / "t.json", scale=1.0)
    assert json.loads(path.read_text())["traceEvents"][-1]["ph"] == "f"
    with pytest.raises(InvalidArgument, match="scale=0"):
        chrome_trace(tl, scale=0)


def test_ascii_strip() -> None:
    tl = simulate(one_f_one_b(2, 2))
    assert ascii_timeline(tl) == (
        "rank 0 |FF..BB.BB|\n"
        "rank 1 |.FBBFBB..|\n"
        "        makespan 9, bubble 33.3%, 1 unit(s) per character"
    )
    assert ascii_timeline(tl, show="microbatch").splitlines()[1] == "rank 1 |.000111..|"
    assert ascii_timeline(tl, width=4).splitlines()[0] == "rank 0 |F.BB|"
    split = simulate(v_shape(2, 1), Costs(comm=1.0))
    assert set(ascii_timeline(split).splitlines()[0][8:-1]) <= set("FIW.")
    with pytest.raises(InvalidArgument, match="width=0"):
        ascii_timeline(tl, width=0)
    with pytest.raises(InvalidArgument, match="show='x'"):
        ascii_timeline(tl, show="x")
