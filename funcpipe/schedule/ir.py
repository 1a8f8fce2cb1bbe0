"""The schedule IR: instructions, programs, their text form and their rank x step table.

A :class:`Program` is a value: for every rank a tuple of :class:`Instr`, plus the facts needed to
check it (stage placement, microbatch count, the stage graph). Nothing here imports torch.

Text form of one instruction (``parse_instr(str(i)) == i``)::

    F s2 m0                      forward of stage 2 on microbatch 0
    B s2 m0 / I s2 m0 / W s2 m0  full backward / input-grad only / weight-grad only
    R s2 m0                      recompute the forward of stage 2, microbatch 0, before its backward
    SEND act s0>s1 m3 to r1      send the activation of edge s0>s1 (microbatch 3) to rank 1
    RECV act s0>s1 m3 from r0    receive it
    SEND grad s0>s1 m3 to r0     send the gradient of that edge's data back to the producer's rank
    RECV grad s0>s1 m3 from r1   receive it
    REDUCE s0 data               reduce stage 0's gradients over the group named ``data``
    SCATTER s0 data              reduce-scatter them instead: each data copy keeps its shard
    GATHER s0 data               all-gather stage 0's parameter shards into full parameters
    + RECV grad s0>s1 m3 from r1 posted in one group with the SEND/RECV right before it
    & B s1 m1                    overlapped with the F (or B, I) right before it: a pair

Communication groups: a SEND or RECV with ``joined=True`` (text: a leading ``+ ``) is posted
together with the instruction right before it, which is itself a SEND or RECV. A group is a
maximal run ``i, i+1 (joined), i+2 (joined), ...``; a SEND/RECV without ``joined`` starts a new
group (a lone one is a group of one). Under NCCL a group is posted as one batched operation
(``batch_isend_irecv``), so its members can all match at once; see
:mod:`funcpipe.schedule.analysis` for the rules the checker applies.

Overlapped pairs: an F, B or I with ``joined=True`` (text: a leading ``& ``) runs together with
the compute instruction right before it, one microbatch's forward with another's backward
(DualPipe's F&B): while one half waits on communication (an expert all-to-all, a RECV), the
other computes. A pair is one F and one B or I; the checker proves the two independent
(:mod:`funcpipe.schedule.pairs`).

The instructions (:class:`Op`, :class:`Instr`, their constructors, :func:`parse_instr`,
:func:`groups`) live in :mod:`funcpipe.schedule.instr`; this module holds :class:`Program`, the
text form of a program and its rank x step table, and names both.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from funcpipe.errors import ScheduleError
from funcpipe.schedule.instr import (
    ACT,
    BACKWARD_OPS,
    COLLECTIVE_OPS,
    COMM_OPS,
    COMPUTE_OPS,
    GRAD,
    IN_PROGRAM_PREFIXES,
    PAIR_OPS,
    Instr,
    Op,
    backward,
    backward_input,
    backward_weight,
    forward,
    gather,
    groups,
    in_program,
    keep_groups,
    pairs,
    parse_instr,
    recompute,
    recv,
    reduce,
    scatter,
    send,
)

_T = TypeVar("_T")

__all__ = [
    "ACT",
    "BACKWARD_OPS",
    "COLLECTIVE_OPS",
    "COMM_OPS",
    "COMPUTE_OPS",
    "GRAD",
    "IN_PROGRAM_PREFIXES",
    "PAIR_OPS",
    "Instr",
    "Op",
    "Program",
    "backward",
    "backward_input",
    "backward_weight",
    "chain",
    "format_table",
    "forward",
    "gather",
    "groups",
    "in_program",
    "keep_groups",
    "pairs",
    "parse_instr",
    "parse_program",
    "recompute",
    "recv",
    "reduce",
    "scatter",
    "send",
]


def chain(stages: int) -> tuple[tuple[int, int], ...]:
    """The edges of a chain of ``stages`` stages: ((0, 1), (1, 2), ...)."""
    return tuple((s, s + 1) for s in range(stages - 1))


@dataclass(frozen=True)
class Program:
    """Per-rank instruction tuples plus the facts needed to check them.

    - ``ranks[r]``: the instructions rank ``r`` runs, in order.
    - ``placement[s]``: the rank holding stage ``s`` (a rank may hold several stages: chunks).
    - ``microbatches``: how many microbatches one step processes.
    - ``edges``: the stage graph as (producer, consumer) pairs with producer < consumer; default a
      chain. A stage with no consumer is a sink: the loss is computed after it.
    - ``entries[m]``: the first stage microbatch ``m`` enters; default 0 for all. Microbatch ``m``
      visits every stage reachable from its entry (Chimera sends half the microbatches into a
      second pipeline).
    - ``replica_of[s]``: the stage whose parameters stage ``s`` uses; default itself. Replicas'
      gradients are summed (Chimera holds two replicas of every stage).
    - ``training``: False for forward-only (evaluation) programs.

    A SEND/RECV with ``joined`` must follow a SEND or RECV on its rank (:func:`groups` lists a
    rank's communication groups).
    """

    ranks: tuple[tuple[Instr, ...], ...]
    placement: tuple[int, ...]
    microbatches: int
    edges: tuple[tuple[int, int], ...] | None = None
    training: bool = True
    name: str = ""
    entries: tuple[int, ...] | None = None
    replica_of: tuple[int, ...] | None = None
    _cache: dict[str, object] = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        fix = object.__setattr__
        fix(self, "ranks", tuple(tuple(r) for r in self.ranks))
        fix(self, "placement", tuple(int(r) for r in self.placement))
        n = len(self.placement)
        edges = chain(n) if self.edges is None else tuple((int(a), int(b)) for a, b in self.edges)
        fix(self, "edges", tuple(sorted(set(edges))))
        entries = (0,) * self.microbatches if self.entries is None else tuple(self.entries)
        fix(self, "entries", entries)
        replicas = tuple(range(n)) if self.replica_of is None else tuple(self.replica_of)
        fix(self, "replica_of", replicas)
        self._validate()

    def _validate(self) -> None:
        n, p = len(self.placement), len(self.ranks)
        if n < 1:
            raise ScheduleError("a program needs at least one stage (placement is empty)")
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ScheduleError(f"microbatches={self.microbatches!r}: must be an int >= 1")
        for s, r in enumerate(self.placement):
            if not 0 <= r < p:
                raise ScheduleError(
                    f"placement[{s}]={r}: stage {s} is placed on rank {r} but the program has "
                    f"{p} rank(s) (0..{p - 1}); add a 'rank {r}' section or fix the placement"
                )
        for a, b in self.edges or ():
            if not (0 <= a < b < n):
                raise ScheduleError(
                    f"edge s{a}>s{b}: edges go from an earlier stage to a later one, both in 0..{n - 1}"
                )
        entries = self.entries or ()
        if len(entries) != self.microbatches:
            raise ScheduleError(
                f"entries has {len(entries)} item(s) but microbatches={self.microbatches}: "
                "give one entry stage per microbatch"
            )
        sources = {s for s in range(n) if not self.producers(s)}
        for m, s in enumerate(entries):
            if s not in sources:
                raise ScheduleError(
                    f"entries[{m}]={s}: a microbatch enters at a stage with no producer "
                    f"(the sources are {sorted(sources)})"
                )
        replicas = self.replica_of or ()
        if len(replicas) != n or any(not 0 <= s < n for s in replicas):
            raise ScheduleError(
                f"replica_of={replicas!r}: needs one stage index in 0..{n - 1} per stage"
            )
        for r, instrs in enumerate(self.ranks):
            for t, i in enumerate(instrs):
                if i.joined and i.op in COMPUTE_OPS:
                    _check_pair(r, t, instrs)
                elif i.joined and (t == 0 or instrs[t - 1].op not in COMM_OPS):
                    before = (
                        "it is the first instruction of the rank"
                        if t == 0
                        else (f"step {t - 1} is {instrs[t - 1]}")
                    )
                    raise ScheduleError(
                        f"rank {r}, step {t} ({i}): '+' joins a SEND/RECV to the group of the "
                        f"SEND/RECV right before it, but {before}; drop the '+' (start a new "
                        "group) or move the instruction after a SEND/RECV",
                        rank=r,
                        step=t,
                        instruction=i,
                        rule="a joined SEND/RECV follows a SEND or RECV on the same rank",
                    )

    # ----------------------------------------------------------------- derived facts (cached)
    def _cached(self, name: str, make: Callable[[], _T]) -> _T:
        if name not in self._cache:
            self._cache[name] = make()
        return self._cache[name]  # type: ignore[return-value]

    @property
    def n_ranks(self) -> int:
        return len(self.ranks)

    @property
    def n_stages(self) -> int:
        return len(self.placement)

    @property
    def lowered(self) -> bool:
        """True when the program already holds its SEND/RECV instructions."""
        return any(i.op in COMM_OPS for r in self.ranks for i in r)

    def stages_on(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def producers(self, stage: int) -> tuple[int, ...]:
        table = self._cached(
            "producers",
            lambda: {
                s: tuple(a for a, b in self.edges or () if b == s) for s in range(self.n_stages)
            },
        )
        return table[stage]

    def consumers(self, stage: int) -> tuple[int, ...]:
        table = self._cached(
            "consumers",
            lambda: {
                s: tuple(b for a, b in self.edges or () if a == s) for s in range(self.n_stages)
            },
        )
        return table[stage]

    def visits(self, microbatch: int) -> frozenset[int]:
        """The stages microbatch ``microbatch`` passes through (reachable from its entry)."""

        def make() -> dict[int, frozenset[int]]:
            out: dict[int, frozenset[int]] = {}
            for start in set(self.entries or ()):
                seen, todo = {start}, [start]
                while todo:
                    for c in self.consumers(todo.pop()):
                        if c not in seen:
                            seen.add(c)
                            todo.append(c)
                out[start] = frozenset(seen)
            return out

        table = self._cached("visits", make)
        return table[(self.entries or ())[microbatch]]

    @property
    def chunks(self) -> int:
        """Stages per rank (v), when every rank holds the same number; else the maximum."""
        return max(len(self.stages_on(r)) for r in range(self.n_ranks))

    def replace(self, **changes: object) -> Program:
        """A copy with some fields changed (``ranks=...`` for a pass's output)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    # ----------------------------------------------------------------- text
    def to_text(self) -> str:
        return format_program(self)

    def table(self, *, mark: tuple[int, int] | None = None, window: int | None = None) -> str:
        return format_table(self, mark=mark, window=window)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        head = (
            f"Program(name={self.name!r}, ranks={self.n_ranks}, stages={self.n_stages}, "
            f"microbatches={self.microbatches}, training={self.training})"
        )
        return head + "\n" + self.table()


def _check_pair(r: int, t: int, instrs: Sequence[Instr]) -> None:
    """Step ``t`` of rank ``r`` is the second half of a pair (``&``): the step before it is the
    first half, and the two are one F and one B or I."""
    i = instrs[t]
    first = instrs[t - 1] if t else None
    rule = (
        "an overlapped pair ('&') is an F and a B or I, the second written with '& ' right "
        "after the first"
    )
    if first is None or first.op not in COMPUTE_OPS or first.joined:
        before = (
            "it is the first instruction of the rank"
            if first is None
            else f"step {t - 1} is {first}, "
            + ("itself the second half of a pair" if first.joined else "not a compute instruction")
        )
        raise ScheduleError(
            f"rank {r}, step {t} ({i}): '&' overlaps an F, B or I with the compute instruction "
            f"right before it, but {before}; drop the '&' or move the instruction",
            rank=r,
            step=t,
            instruction=i,
            rule=rule,
        )
    ops = {first.op, i.op}
    if Op.F not in ops or not ops & BACKWARD_OPS:
        raise ScheduleError(
            f"rank {r}, steps {t - 1} and {t}: the pair '{first}' & '{i.join(False)}' is not an "
            "F with a B or I; a pair overlaps one microbatch's forward with another's backward "
            "(DualPipe's F&B): drop the '&'",
            rank=r,
            step=t,
            instruction=i,
            rule=rule,
        )


def format_table(
    program: Program, *, mark: tuple[int, int] | None = None, window: int | None = None
) -> str:
    """The rank x step table: one column per rank, one row per step.

    ``mark=(rank, step)`` flags that cell with ``>>``; ``window`` shows only that many steps either
    side of the marked step.
    """
    cols = [[str(i) for i in r] for r in program.ranks]
    steps = max((len(c) for c in cols), default=0)
    lo, hi = 0, steps
    if mark is not None and window is not None:
        lo, hi = max(0, mark[1] - window), min(steps, mark[1] + window + 1)
    cells = [
        [
            (">> " if mark == (r, t) else "")
            + (cols[r][t] if t < len(cols[r]) else "(end)" if mark == (r, t) else "")
            for r in range(len(cols))
        ]
        for t in range(lo, hi)
    ]
    if mark is not None and mark[1] >= steps:
        cells.append([">> (end)" if r == mark[0] else "" for r in range(len(cols))])
    header = ["step"] + [f"rank {r}" for r in range(len(cols))]
    widths = [max([len(header[0])] + [len(str(t)) for t in range(lo, hi + 1)])]
    widths += [max([len(header[r + 1])] + [len(row[r]) for row in cells]) for r in range(len(cols))]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    if lo > 0:
        lines.append("...")
    for t, row in zip(range(lo, hi + 1), cells, strict=False):
        line = [str(t).ljust(widths[0])] + [
            c.ljust(w) for c, w in zip(row, widths[1:], strict=True)
        ]
        lines.append("  ".join(line).rstrip())
    if hi < steps:
        lines.append("...")
    return "\n".join(lines)


def format_program(program: Program) -> str:
    """The text form of a program; :func:`parse_program` reads it back to an equal program."""
    lines = ["# funcpipe program"]
    if program.name:
        lines.append(f"name {program.name}")
    lines.append(f"ranks {program.n_ranks}")
    lines.append(f"stages {program.n_stages}")
    lines.append("placement " + " ".join(map(str, program.placement)))
    lines.append(f"microbatches {program.microbatches}")
    lines.append("mode " + ("train" if program.training else "eval"))
    if program.edges != chain(program.n_stages):
        lines.append("edges " + " ".join(f"{a}>{b}" for a, b in program.edges or ()))
    if any(e != 0 for e in program.entries or ()):
        lines.append("entries " + " ".join(map(str, program.entries or ())))
    if program.replica_of != tuple(range(program.n_stages)):
        lines.append("replicas " + " ".join(map(str, program.replica_of or ())))
    for r, instrs in enumerate(program.ranks):
        lines.append(f"rank {r}")
        lines.extend(f"  {i}" for i in instrs)
    return "\n".join(lines) + "\n"


_HEADER_KEYS = (
    "name",
    "ranks",
    "stages",
    "placement",
    "microbatches",
    "mode",
    "edges",
    "entries",
    "replicas",
)


def _ints(key: str, values: Sequence[str], lineno: int) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in values)
    except ValueError:
        raise ScheduleError(
            f"line {lineno}: '{key}' takes whole numbers, got {' '.join(values)!r}"
        ) from None


def parse_program(text: str) -> Program:
    """Read a program from its text form.

    Header lines (``key value...``) come first, then one ``rank N`` section per rank with one
    instruction per line (or several on one line separated by ``;``). ``#`` starts a comment.
    Required headers: ``placement`` and ``microbatches``; ``stages`` and ``ranks`` are checked
    against the placement and the sections when given.
    """
    if not isinstance(text, str):
        raise ScheduleError(
            f"parse_program takes the program text (str), got {type(text).__name__}"
        )
    header: dict[str, tuple[str, int]] = {}
    sections: dict[int, list[Instr]] = {}
    current: list[Instr] | None = None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if m := re.fullmatch(r"rank\s+(\d+)\s*:?\s*(.*)", line):
            r = int(m[1])
            if r in sections:
                raise ScheduleError(
                    f"line {lineno}: 'rank {r}' appears twice; merge the two sections"
                )
            current = sections[r] = []
            rest = m[2]
        elif current is None:
            key, _, value = line.partition(" ")
            if key not in _HEADER_KEYS:
                raise ScheduleError(
                    f"line {lineno}: unknown header {key!r}; headers are {', '.join(_HEADER_KEYS)}, "
                    "then 'rank N' sections"
                )
            if key in header:
                raise ScheduleError(f"line {lineno}: header {key!r} given twice")
            header[key] = (value.strip(), lineno)
            continue
        else:
            rest = line
            if line.split(" ", 1)[0] in _HEADER_KEYS:
                raise ScheduleError(
                    f"line {lineno}: header {line.split(' ', 1)[0]!r} inside a rank section; "
                    "headers come before the first 'rank N' line"
                )
        for part in rest.split(";"):
            if part.strip():
                try:
                    current.append(parse_instr(part))
                except ScheduleError as e:
                    raise ScheduleError(f"line {lineno}: {e}") from None
    for key in ("placement", "microbatches"):
        if key not in header:
            raise ScheduleError(f"the program text has no '{key}' header line")
    placement = _ints("placement", header["placement"][0].split(), header["placement"][1])
    (mb,) = _ints(
        "microbatches", header["microbatches"][0].split()[:1] or ["x"], header["microbatches"][1]
    )
    n_ranks = max([*sections, *placement], default=-1) + 1
    if "ranks" in header:
        (declared,) = _ints("ranks", header["ranks"][0].split()[:1] or ["x"], header["ranks"][1])
        if declared < n_ranks:
            raise ScheduleError(
                f"line {header['ranks'][1]}: ranks {declared}, but rank {n_ranks - 1} is used"
            )
        n_ranks = declared
    if "stages" in header:
        (declared,) = _ints("stages", header["stages"][0].split()[:1] or ["x"], header["stages"][1])
        if declared != len(placement):
            raise ScheduleError(
                f"line {header['stages'][1]}: stages {declared}, but placement lists "
                f"{len(placement)} stage(s)"
            )
    mode = header.get("mode", ("train", 0))
    if mode[0] not in ("train", "eval"):
        raise ScheduleError(f"line {mode[1]}: mode {mode[0]!r}; use 'train' or 'eval'")
    edges = None
    if "edges" in header:
        value, lineno = header["edges"]
        parsed = []
        for tok in value.split():
            if not (em := re.fullmatch(r"s?(\d+)>s?(\d+)", tok)):
                raise ScheduleError(f"line {lineno}: edge {tok!r}; write edges as 0>1 1>2 ...")
            parsed.append((int(em[1]), int(em[2])))
        edges = tuple(parsed)
    entries = (
        _ints("entries", header["entries"][0].split(), header["entries"][1])
        if "entries" in header
        else None
    )
    replicas = (
        _ints("replicas", header["replicas"][0].split(), header["replicas"][1])
        if "replicas" in header
        else None
    )
    ranks = tuple(tuple(sections.get(r, ())) for r in range(n_ranks))
    return Program(
        ranks=ranks,
        placement=placement,
        microbatches=mb,
        edges=edges,
        training=mode[0] == "train",
        name=header.get("name", ("", 0))[0],
        entries=entries,
        replica_of=replicas,
    )


def flatten(program: Program) -> Iterable[tuple[int, int, Instr]]:
    """(rank, step, instruction) for every instruction."""
    for r, instrs in enumerate(program.ranks):
        for t, i in enumerate(instrs):
            yield r, t, i
