"""Read and write the CSV schedule format of ``torch.distributed.pipelining``.

The format (``_dump_csv`` / ``_load_csv`` of torch's multi-stage schedules, "compute_only"): one
CSV row per rank, one cell per time step, in order. A cell is ``<stage><action><microbatch>``:
``2F0`` (forward of stage 2 on microbatch 0), ``1B2`` (full backward), ``1I3`` (input-gradient
backward), ``0W3`` (weight-gradient backward). An empty cell is an idle step. Stages form a
chain; torch infers the stage-to-rank placement from the rows, and so does :func:`read_csv`.

Beyond compute cells torch writes (in its "compute_comms" dumps) ``3SEND_F1``, ``3RECV_B1``,
``0UNSHARD``, ``0RESHARD``, ``0REDUCE_GRAD`` and ``(0F7;7B3)OVERLAP_F_B``. :func:`read_csv`
reads an ``OVERLAP_F_B`` cell of one F and one B or I as an overlapped pair (``&``, kept where
the checker proves it independent; the halves run alone otherwise), any other as its
sub-actions in order, and :func:`write_csv` writes each pair as one. :func:`read_csv` by
default *skips* communication and FSDP cells (``comms="skip"``): funcpipe derives its own SEND/RECV with
:func:`funcpipe.schedule.passes.add_communication` (FIFO per rank pair) and its own REDUCEs with
:func:`~funcpipe.schedule.passes.add_reduce`, so a compute_comms dump loads as the same
compute-only program. ``comms="reject"`` raises instead.

Nothing here imports torch: the format is read and written with the :mod:`csv` module.
"""

from __future__ import annotations

import csv
import io
import os
import re
from pathlib import Path

from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.schedule.analysis import analyse
from funcpipe.schedule.check import check
from funcpipe.schedule.ir import COMPUTE_OPS, Instr, Op, Program, chain, pairs
from funcpipe.schedule.overlap import sound_pairs

__all__ = ["read_csv", "write_csv"]

_COMPUTE_CELL = re.compile(r"(\d+)([FBIW])(\d+)")
_OTHER_CELL = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)")
_OVERLAP_CELL = re.compile(r"\((.*)\)OVERLAP_F_B")
_CELL_FORMS = (
    "'2F0' (F, B, I or W), '' (idle), '(0F7;7B3)OVERLAP_F_B', or a comm cell like '3SEND_F1'"
)


def _source(text_or_path: str | os.PathLike[str]) -> tuple[str, str]:
    """(text, name): a ``Path`` is read; a ``str`` is CSV text unless it names an existing file
    and holds no comma or newline."""
    if isinstance(text_or_path, os.PathLike):
        path = Path(text_or_path)
    elif isinstance(text_or_path, str):
        if "," in text_or_path or "\n" in text_or_path or not os.path.isfile(text_or_path):
            return text_or_path, ""
        path = Path(text_or_path)
    else:
        raise InvalidArgument(
            f"read_csv: text_or_path={text_or_path!r} must be the CSV text (str) or a path"
        )
    try:
        return path.read_text(encoding="utf-8"), path.stem
    except OSError as e:
        raise InvalidArgument(f"read_csv: cannot read {str(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:  # a binary file (issue 42: it escaped uncaught)
        raise InvalidArgument(
            f"read_csv: {str(path)!r} is not a text file: byte 0x{e.object[e.start]:02x} at "
            f"offset {e.start} is not UTF-8 ({e.reason}). Give the CSV schedule that "
            "torch.distributed.pipelining writes (_dump_csv: UTF-8 text, one row of cells per "
            "rank, e.g. '0F0,0F1,0B0')"
        ) from None


def _cell(cell: str, rank: int, column: int, comms: str) -> list[tuple[Op, int, int]]:
    """The compute actions of one cell, as (op, stage, microbatch)."""
    text = cell.strip()
    if not text:
        return []
    if m := _COMPUTE_CELL.fullmatch(text):
        return [(Op(m[2]), int(m[1]), int(m[3]))]
    if m := _OVERLAP_CELL.fullmatch(text):
        out = []
        for part in m[1].split(";"):
            if not _COMPUTE_CELL.fullmatch(part.strip()):
                break
            out += _cell(part, rank, column, comms)
        else:
            return out
    elif _OTHER_CELL.fullmatch(text):
        if comms == "skip":
            return []
        raise ScheduleError(
            f"CSV row {rank} (rank {rank}), column {column}: cell {cell!r} is a communication or "
            "FSDP action; read with comms='skip' to drop them (funcpipe derives its own with "
            "add_communication) or remove them",
            rank=rank,
            step=column,
            instruction=cell,
            rule="a compute-only CSV holds compute cells only",
        )
    raise ScheduleError(
        f"CSV row {rank} (rank {rank}), column {column}: cannot read cell {cell!r}; cells are "
        f"{_CELL_FORMS}",
        rank=rank,
        step=column,
        instruction=cell,
        rule="CSV cells are <stage><F|B|I|W><microbatch>",
    )


def read_csv(
    text_or_path: str | os.PathLike[str],
    *,
    microbatches: int | None = None,
    placement: tuple[int, ...] | list[int] | None = None,
    comms: str = "skip",
) -> Program:
    """Read a torch.distributed.pipelining CSV schedule into a compute-only :class:`Program`.

    - ``text_or_path``: the CSV text, or a path (a ``Path``, or a ``str`` naming an existing file
      that holds no comma or newline). The program is named after the file's stem.
    - ``microbatches``: default the largest microbatch index + 1.
    - ``placement``: stage -> rank; default inferred from the rows (stage s is placed on the rank
      whose row runs it). Needed only when some stage appears in no cell.
    - ``comms``: ``"skip"`` (default) drops communication/FSDP cells; ``"reject"`` raises.

    The stage graph is a chain; the program trains when any B, I or W cell appears, else it is an
    eval program. Trailing empty rows are dropped. Raises :class:`ScheduleError` naming the row,
    column and cell of a malformed cell, or the rule a consistent program breaks.
    """
    if comms not in ("skip", "reject"):
        raise InvalidArgument(f"read_csv: comms={comms!r} must be 'skip' or 'reject'")
    if microbatches is not None and (
        isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1
    ):
        raise InvalidArgument(
            f"read_csv: microbatches={microbatches!r} must be an int >= 1 or None"
        )
    text, name = _source(text_or_path)
    try:
        rows = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as e:
        raise ScheduleError(f"read_csv: the text is not CSV ({e})", rule="CSV syntax") from None
    while rows and not any(c.strip() for c in rows[-1]):
        rows.pop()
    if not rows:
        raise ScheduleError("read_csv: the CSV has no rows; write one row of cells per rank")
    ranks: list[list[Instr]] = []
    seen: dict[int, tuple[int, int, str]] = {}  # stage -> (rank, column, cell) of its first cell
    for r, row in enumerate(rows):
        instrs = []
        for c, cell in enumerate(row):
            acts = _cell(cell, r, c, comms)
            overlapped = _OVERLAP_CELL.fullmatch(cell.strip()) is not None and _pairable(acts)
            for k, (op, stage, mb) in enumerate(acts):
                first = seen.setdefault(stage, (r, c, cell))
                if first[0] != r:
                    raise ScheduleError(
                        f"CSV row {r}, column {c}: cell {cell!r} runs stage {stage}, which row "
                        f"{first[0]} (column {first[1]}, {first[2]!r}) runs too; a stage lives on "
                        "one rank",
                        rank=r,
                        step=c,
                        instruction=cell,
                        rule="a stage lives on one rank",
                    )
                instrs.append(Instr(op, stage, mb, joined=overlapped and k == 1))
        ranks.append(instrs)
    if not seen:
        raise ScheduleError("read_csv: the CSV has no compute cells (like '0F0')")
    top = max(i.microbatch for r in ranks for i in r) + 1
    if microbatches is None:
        microbatches = top
    elif microbatches < top:
        raise ScheduleError(
            f"read_csv: microbatches={microbatches} but the CSV uses microbatch {top - 1}; pass "
            f"microbatches>={top} or leave it out"
        )
    if placement is None:
        missing = [s for s in range(max(seen) + 1) if s not in seen]
        if missing:
            raise ScheduleError(
                f"read_csv: stage(s) {missing} appear in no cell, so their rank is unknown; pass "
                "placement=(rank of stage 0, rank of stage 1, ...)"
            )
        placement = tuple(seen[s][0] for s in range(len(seen)))
    else:
        placement = tuple(placement)
        for s, (r, c, cell) in sorted(seen.items()):
            if s >= len(placement) or placement[s] != r:
                where = (
                    "is not in placement"
                    if s >= len(placement)
                    else f"is placed on rank {placement[s]}"
                )
                raise ScheduleError(
                    f"CSV row {r}, column {c}: cell {cell!r} runs stage {s} on rank {r}, but stage "
                    f"{s} {where}; fix the placement or the row",
                    rank=r,
                    step=c,
                    instruction=cell,
                    rule="every instruction names a stage held by its rank",
                )
    n_ranks = max(len(ranks), max(placement) + 1)
    ranks += [[] for _ in range(n_ranks - len(ranks))]
    training = any(i.op is not Op.F for r in ranks for i in r)
    program = Program(
        ranks=tuple(tuple(r) for r in ranks),
        placement=placement,
        microbatches=microbatches,
        training=training,
        name=name,
    )
    return sound_pairs(program) if any(map(pairs, program.ranks)) else program


def _pairable(acts: list[tuple[Op, int, int]]) -> bool:
    """Whether an OVERLAP_F_B cell's actions make a pair: one F and one B or I."""
    ops = {op for op, _, _ in acts}
    return len(acts) == 2 and Op.F in ops and bool(ops & {Op.B, Op.I})


def _steps(program: Program) -> list[list[int]]:
    """Lockstep time slots: each instruction takes one step and starts after its rank's previous
    one and after the cross-rank data it needs was produced (in an earlier step)."""
    deps = analyse(program).deps
    slots: list[list[int]] = [[] for _ in program.ranks]
    progressed = True
    while progressed:
        progressed = False
        for r, instrs in enumerate(program.ranks):
            while len(slots[r]) < len(instrs):
                t = len(slots[r])
                need = deps.get((r, t), ())
                if any(d.step >= len(slots[d.rank]) for d in need):
                    break
                start = slots[r][-1] + 1 if slots[r] else 0
                start = max([start, *(slots[d.rank][d.step] + 1 for d in need)])
                slots[r].append(start)
                progressed = True
    if any(len(s) < len(i) for s, i in zip(slots, program.ranks, strict=True)):
        check(program)  # raises the deadlock with its rank and step
    return slots


def write_csv(program: Program, *, align: bool = True) -> str:
    """The torch.distributed.pipelining CSV ("compute_only") of ``program``: one row per rank.

    SEND/RECV and REDUCE are left out (torch's lowering, like funcpipe's, derives them), and with
    them their communication groups (``+``): the format has no notion of a group, so
    ``add_communication(read_csv(write_csv(p)))`` regroups them by its own rules. With
    ``align=True`` (default) each instruction sits in its lockstep time step and idle steps are
    empty cells, as torch's own generators write them; ``align=False`` writes the cells back to
    back. Raises :class:`InvalidArgument` when the format cannot express the program: R
    (recompute) instructions, a stage graph that is not a chain (skip edges, several consumers,
    Chimera's second pipeline) or ``replica_of``. Unsound programs raise the
    checker's :class:`ScheduleError` when aligning.
    """
    if not isinstance(program, Program):
        raise InvalidArgument(f"write_csv takes a Program, got {type(program).__name__}")
    what = program.name or "the program"
    if program.edges != chain(program.n_stages):
        raise InvalidArgument(
            f"write_csv: {what} has the stage graph {program.edges}; the torch CSV format knows only "
            f"a chain {chain(program.n_stages)}: no skip edges, several consumers or second pipelines (Chimera)"
        )
    if program.replica_of != tuple(range(program.n_stages)):
        raise InvalidArgument(
            f"write_csv: {what} has replica_of {program.replica_of}; the torch CSV format has no "
            "stage replicas (Chimera)"
        )
    for r, instrs in enumerate(program.ranks):
        for t, i in enumerate(instrs):
            if i.op is Op.R:
                raise InvalidArgument(
                    f"write_csv: rank {r}, step {t} is {i}; the torch CSV format has no recompute "
                    "action: drop the R instructions (strip them, or generate without recompute)"
                )
    compute = program.replace(
        ranks=tuple(tuple(i for i in instrs if i.op in COMPUTE_OPS) for instrs in program.ranks)
    )
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    slots = _steps(compute) if align else [list(range(len(r))) for r in compute.ranks]
    width = max((s[-1] + 1 for s in slots if s), default=0) if align else 0
    for instrs, steps in zip(compute.ranks, slots, strict=True):
        row = [""] * (width if align else len(instrs))
        for t, (i, step) in enumerate(zip(instrs, steps, strict=True)):
            cell = f"{i.stage}{i.op.value}{i.microbatch}"
            if i.joined:  # (written with the first half: its own step stays empty)
                continue
            if t + 1 < len(instrs) and instrs[t + 1].joined:
                j = instrs[t + 1]
                cell = f"({cell};{j.stage}{j.op.value}{j.microbatch})OVERLAP_F_B"
            row[step] = cell
        writer.writerow(row if align else [c for c in row if c])
    return buf.getvalue()
