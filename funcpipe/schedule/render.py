"""Pictures and traces of a :class:`~funcpipe.schedule.simulate.Timeline`.

- :func:`draw_timeline`: a PNG/SVG/PDF chart (matplotlib, the optional ``plot`` extra): ranks as
  rows, one colour per instruction kind, microbatch (and stage, with several stages per rank) on
  each block, idle time as gaps, a legend and the bubble fraction in the title.
- :func:`chrome_trace` / :func:`write_chrome_trace`: Chrome trace JSON (open it in
  https://ui.perfetto.dev or chrome://tracing): one process per rank, compute on thread 0,
  communication on thread 1, an arrow per message.
- :func:`ascii_timeline`: one text row per rank for terminals.

Works on simulated timelines and on measured ones (same :class:`Event` values).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.ir import COLLECTIVE_OPS, COMM_OPS, COMPUTE_OPS, Instr, Op, groups
from funcpipe.schedule.simulate import Event, Timeline

__all__ = ["ascii_timeline", "chrome_trace", "draw_timeline", "write_chrome_trace"]

# One colour per kind (colour-blind friendly Tableau tones); comm and REDUCE are greys.
COLOURS: dict[str, str] = {
    "F": "#4C78A8",
    "B": "#F58518",
    "I": "#54A24B",
    "W": "#B279A2",
    "R": "#72B7B2",
    "comm": "#BAB0AC",
    "REDUCE": "#5F5A57",
    "SCATTER": "#79706E",
    "GATHER": "#9D7660",
    "collective": "#E45756",
}
_LABELS = {
    "F": "F forward",
    "B": "B backward",
    "I": "I input grad",
    "W": "W weight grad",
    "R": "R recompute",
    "comm": "RECV posted, data in flight",
    "REDUCE": "REDUCE",
    "SCATTER": "SCATTER (reduce-scatter)",
    "GATHER": "GATHER (all-gather)",
    "collective": "a stage's collective (all-to-all...) in flight",
}
_FORMATS = (".png", ".svg", ".pdf")
_COLLECTIVES = frozenset(op.value for op in COLLECTIVE_OPS)


def _timeline(timeline: object, fn: str) -> Timeline:
    if not isinstance(timeline, Timeline):
        raise InvalidArgument(
            f"{fn} takes a Timeline, got {type(timeline).__name__}; make one with "
            "funcpipe.schedule.simulate.simulate(program)"
        )
    return timeline


def _kind(i: Instr) -> str:
    if i.op in COMPUTE_OPS or i.op in COLLECTIVE_OPS:
        return i.op.value
    return "comm"


def _describe(tl: Timeline) -> str:
    p = tl.program
    chunks = f", {p.chunks} stages per rank" if p.chunks > 1 else ""
    return f"{p.n_ranks} ranks, {p.microbatches} microbatches{chunks}"


# ----------------------------------------------------------------------------- picture
def _mix(colour: str, amount: float) -> str:
    """``colour`` moved ``amount`` (0..1) of the way to white."""
    rgb = [int(colour[k : k + 2], 16) for k in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in rgb)


def _text_colour(colour: str) -> str:
    r, g, b = (int(colour[k : k + 2], 16) for k in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "white"


def draw_timeline(
    timeline: Timeline,
    path: str | os.PathLike[str],
    *,
    title: str | None = None,
    unit: str = "cost units",
) -> Path:
    """Draw ``timeline`` to ``path`` (``.png``, ``.svg`` or ``.pdf``, by suffix); return the path.

    Rows are ranks (rank 0 on top), the x axis is time in ``unit`` (``"s"`` for an executed
    timeline from ``Pipeline.step(..., trace=True)``). Each block is one
    instruction, coloured by kind (F, B, I, W, R; REDUCE dark grey; a RECV as a thin grey band
    along the top of its row from when it was posted to when its data arrived, over whatever the
    rank computed meanwhile, with a tick where each communication group was posted),
    labelled with its microbatch; when a rank holds several stages the label adds the stage and
    later chunks are drawn in lighter tones. Idle time is the light background left uncovered.
    The title ends with the bubble fraction. Needs matplotlib: ``pip install funcpipe[plot]``.
    """
    tl = _timeline(timeline, "draw_timeline")
    out = Path(path)
    if out.suffix.lower() not in _FORMATS:
        raise InvalidArgument(
            f"draw_timeline: path={str(path)!r} must end in one of {', '.join(_FORMATS)}"
        )
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise InvalidArgument(
            "draw_timeline needs matplotlib, which is not installed: pip install funcpipe[plot]"
        ) from None
    program = tl.program
    n = program.n_ranks
    span = max(tl.makespan, 1e-9)
    multi = program.chunks > 1
    chunk_of = {s: k for r in range(n) for k, s in enumerate(program.stages_on(r))}
    width_in = min(max(8.0, 0.3 * span + 2.0), 30.0)
    rows_in = (0.8 if multi else 0.6) * n
    top_in, bottom_in = 0.5, 1.0 if not any(tl.spans) else 1.3  # title; axis label, legend
    height_in = rows_in + top_in + bottom_in
    fig = Figure(figsize=(width_in, height_in), dpi=150)
    FigureCanvasAgg(fig)  # the Agg canvas: no pyplot, no global backend switch
    left = min(0.9 / width_in, 0.15)
    ax = fig.add_axes((left, bottom_in / height_in, 0.985 - left, rows_in / height_in))
    points_per_unit = (ax.get_position().width * width_in * 72) / span
    font = min(8.0, points_per_unit * (0.45 if multi else 0.6))
    height = 0.8
    used: set[str] = set()
    for r, events in enumerate(tl.events):
        ax.broken_barh([(0, span)], (r - height / 2, height), facecolors="#F3F3F3", zorder=0)
        used |= _draw_row(ax, r, events, height, font, points_per_unit, chunk_of if multi else None)
    for r, calls in enumerate(tl.spans):  # the stages' own collectives, above the row
        bars = [(c.start, c.end - c.start) for c in calls if c.end > c.start]
        if bars:
            used.add("collective")
            ax.broken_barh(bars, (r - height / 2 - 0.16, 0.12), facecolors=COLOURS["collective"])
    for r, starts in enumerate(_group_posts(tl)):
        if starts:  # one tick per communication group, where the rank posted it
            ax.vlines(starts, r - height / 2 - 0.14, r - height / 2, colors="#5F5A57", lw=0.6)
    ax.set_ylim(n - 0.5, -0.62)
    ax.set_xlim(0, span)
    ax.set_yticks(range(n))
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_xlabel(f"time ({unit})")
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    heading = title if title is not None else (program.name or "schedule")
    text = f"{heading} — {_describe(tl)} — makespan {tl.makespan:.4g} {unit}, bubble {tl.bubble_fraction:.1%}"
    room = (0.985 - left) * width_in * 72  # points over the axes, which the title centres on
    ax.set_title(text, fontsize=max(6.0, min(10.0, room / (0.6 * len(text)))))
    order = [k for k in COLOURS if k in used]
    handles = [Patch(facecolor=COLOURS[k], label=_LABELS[k]) for k in order]
    if multi:
        handles.append(Patch(facecolor=_mix(COLOURS["F"], 0.45), label="lighter: later chunk"))
    fig.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 0.1 / height_in),
        ncol=min(len(handles), max(3, int(width_in // 1.7))),
        frameon=False,
        fontsize=8,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def _draw_row(
    ax: Any,
    r: int,
    events: Sequence[Event],
    height: float,
    font: float,
    points_per_unit: float,
    chunk_of: Mapping[int, int] | None,
) -> set[str]:
    """Draw rank ``r``'s blocks on ``ax`` (``chunk_of``: each stage's chunk on its rank, when a
    rank holds several, for the lighter tones and the stage in the label); return the kinds
    drawn."""
    multi = chunk_of is not None
    used: set[str] = set()
    heads = {e.step - 1 for e in events if e.instr.joined and e.instr.op in COMPUTE_OPS}
    for e in events:
        kind = _kind(e.instr)
        length = e.end - e.start
        if length <= 0:
            continue
        used.add(kind)
        colour = COLOURS[kind]
        if kind == "comm":
            ax.broken_barh(
                [(e.start, length)], (r - height / 2 - 0.12, 0.12), facecolors=colour, zorder=1
            )
            continue
        if chunk_of is not None and kind not in _COLLECTIVES:
            colour = _mix(colour, min(0.55, 0.45 * chunk_of[e.instr.stage]))
        # an overlapped pair: its halves side by side in the rank's row, top and bottom
        paired = e.instr.op in COMPUTE_OPS and (e.instr.joined or e.step in heads)
        top = e.instr.joined
        ax.broken_barh(
            [(e.start, length)],
            (r - height / 2 + (height / 2 if top else 0), height / 2)
            if paired
            else (r - height / 2, height),
            facecolors=colour,
            edgecolors="white",
            linewidth=0.6,
            zorder=2,
        )
        if kind in _COLLECTIVES or font < 3.5:
            continue
        i = e.instr
        label = f"{i.microbatch}\ns{i.stage}" if multi else str(i.microbatch)
        if font * (0.6 * len(str(i.microbatch)) + 0.2) > points_per_unit * length:
            continue  # does not fit
        ax.text(
            e.start + length / 2,
            r + (0 if not paired else height / 4 if top else -height / 4),
            label,
            ha="center",
            va="center",
            fontsize=font,
            color=_text_colour(colour),
            zorder=3,
            linespacing=0.9,
        )
    return used


def _group_posts(tl: Timeline) -> list[list[float]]:
    """Per rank, when each of its communication groups was posted."""
    out = []
    for r, events in enumerate(tl.events):
        at = {e.step: e.start for e in events}
        out.append([at[g[0]] for g in groups(tl.program.ranks[r]) if g[0] in at])
    return out


# ----------------------------------------------------------------------------- chrome trace
def chrome_trace(timeline: Timeline, *, scale: float = 1000.0) -> dict[str, Any]:
    """The Chrome trace (JSON-ready dict) of ``timeline``.

    One process per rank (``pid`` = rank). Compute instructions and REDUCEs are complete events
    (``ph: "X"``) on thread 0 named like ``"F s0 m3"`` with ``args`` {op, stage, microbatch, step};
    RECVs (from their posting to their data's arrival) are on thread 1 "comm", named with the
    ``+`` of a joined one and with ``args["group"]``, the rank's communication group (0, 1, ...)
    they were posted in, and each message is drawn as a flow arrow from its SEND to its RECV. ``ts``/``dur`` are microseconds: cost units times ``scale`` (default
    1000, so one unit shows as one millisecond).
    """
    tl = _timeline(timeline, "chrome_trace")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise InvalidArgument(f"chrome_trace: scale={scale!r} must be a number > 0 (µs per unit)")
    events: list[dict[str, Any]] = []
    sends: dict[tuple[int, int, tuple[str, tuple[int, int], int]], Event] = {}
    for r in range(tl.program.n_ranks):
        events.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        events.append(
            {"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}}
        )
        for tid, name in ((0, "compute"), (1, "comm"), (2, "overlapped (& second half)")):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}}
            )
    flow = 0
    group_of = {
        (r, t): k
        for r in range(tl.program.n_ranks)
        for k, g in enumerate(groups(tl.program.ranks[r]))
        for t in g
    }
    for rank_events in tl.events:
        for e in rank_events:
            i = e.instr
            args: dict[str, Any] = {"op": i.op.value, "stage": i.stage, "step": e.step}
            if i.op in COLLECTIVE_OPS:
                args["group"] = i.group
            elif i.op in COMPUTE_OPS:
                args["microbatch"] = i.microbatch
            else:
                args.update(microbatch=i.microbatch, kind=i.kind, edge=list(i.edge), peer=i.peer)
                args["group"] = group_of.get((e.rank, e.step), -1)
            if i.op is Op.SEND:
                sends[(e.rank, i.peer, i.key)] = e
                continue
            events.append(
                {
                    "name": str(i) if i.op not in COMM_OPS else _short(i),
                    "cat": _kind(i),
                    "ph": "X",
                    "pid": e.rank,
                    # (the second half of an overlapped pair on a track of its own)
                    "tid": (2 if i.joined else 0) if i.op not in COMM_OPS else 1,
                    "ts": e.start * scale,
                    "dur": (e.end - e.start) * scale,
                    "args": args,
                }
            )
    for calls in tl.spans:  # the stages' own collectives (measured), on the comm track
        for c in calls:
            events.append(
                {
                    "name": c.name,
                    "cat": "collective",
                    "ph": "X",
                    "pid": c.rank,
                    "tid": 1,
                    "ts": c.start * scale,
                    "dur": (c.end - c.start) * scale,
                }
            )
    for rank_events in tl.events:
        for e in rank_events:
            i = e.instr
            if i.op is not Op.RECV:
                continue
            sent = sends.get((i.peer, e.rank, i.key))
            if sent is None:
                continue
            flow += 1
            common = {"name": i.kind, "cat": "message", "id": flow}
            events.append(
                {**common, "ph": "s", "pid": sent.rank, "tid": 1, "ts": sent.start * scale}
            )
            events.append(
                {**common, "ph": "f", "bp": "e", "pid": e.rank, "tid": 1, "ts": e.end * scale}
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "program": tl.program.name,
            "makespan": tl.makespan,
            "bubble_fraction": tl.bubble_fraction,
            "us_per_cost_unit": scale,
        },
    }


def _short(i: Instr) -> str:
    a, b = i.edge
    return f"{'+ ' if i.joined else ''}RECV {i.kind} s{a}>s{b} m{i.microbatch}"


def write_chrome_trace(
    timeline: Timeline, path: str | os.PathLike[str], *, scale: float = 1000.0
) -> Path:
    """Write :func:`chrome_trace` as JSON to ``path`` (open it in https://ui.perfetto.dev)."""
    trace = chrome_trace(timeline, scale=scale)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace))
    return out


# ----------------------------------------------------------------------------- text
_ASCII = {"F": "F", "B": "B", "I": "I", "W": "W", "R": "R", "comm": "."}
_ASCII.update(REDUCE="r", SCATTER="s", GATHER="g")


def ascii_timeline(timeline: Timeline, *, width: int | None = None, show: str = "op") -> str:
    """One text row per rank, one character per time cell, for terminals.

    ``width=None`` gives one cell per cost unit; ``width=N`` squeezes the makespan into N cells.
    A cell shows the instruction running in its middle: with ``show="op"`` its letter (F, B, I, W,
    R; ``r`` REDUCE, ``s`` SCATTER, ``g`` GATHER), with ``show="microbatch"`` the last digit of its microbatch; ``.`` is idle
    (waiting for a RECV's data included: SEND and RECV cost the rank nothing, and their groups
    show, with their ``+``, in the program's table). A last line gives the makespan and the
    bubble fraction.
    """
    tl = _timeline(timeline, "ascii_timeline")
    if show not in ("op", "microbatch"):
        raise InvalidArgument(f"ascii_timeline: show={show!r} must be 'op' or 'microbatch'")
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        raise InvalidArgument(f"ascii_timeline: width={width!r} must be an int >= 1 or None")
    span = tl.makespan
    if width is None:
        cells, unit = max(1, math.ceil(span - 1e-9)), 1.0
    else:
        cells, unit = width, (span / width if span > 0 else 1.0)
    label = max(len(f"rank {tl.program.n_ranks - 1}"), 4)
    lines = []
    for r, events in enumerate(tl.events):
        busy = sorted(
            (e for e in events if e.end > e.start and _kind(e.instr) != "comm"),
            key=lambda e: e.start,
        )
        row = []
        k = 0
        for c in range(cells):
            t = (c + 0.5) * unit
            while k < len(busy) and busy[k].end <= t:
                k += 1
            e = busy[k] if k < len(busy) and busy[k].start <= t else None
            if e is None:
                row.append(".")
            elif show == "microbatch" and e.instr.op not in COLLECTIVE_OPS:
                row.append(str(e.instr.microbatch % 10))
            else:
                row.append(_ASCII[_kind(e.instr)])
        lines.append(f"{f'rank {r}':<{label}} |{''.join(row)}|")
    lines.append(
        f"{'':<{label}}  makespan {span:g}, bubble {tl.bubble_fraction:.1%}, "
        f"{unit:g} unit(s) per character"
    )
    return "\n".join(lines)
