"""One instruction of the schedule IR: its kinds, its value, its text form, a rank's groups.

:class:`Op` names the kinds, :class:`Instr` is one instruction (``str(i)`` its text form,
:func:`parse_instr` reads it back), :func:`forward` ... :func:`reduce` build them, and
:func:`groups` / :func:`keep_groups` read a rank's communication groups off its instructions.
The text form and the groups are described in :mod:`funcpipe.schedule.ir`, which names all of
this together with :class:`~funcpipe.schedule.ir.Program`. Nothing here imports torch.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from funcpipe.errors import ScheduleError

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
    "backward",
    "backward_input",
    "backward_weight",
    "forward",
    "gather",
    "groups",
    "in_program",
    "keep_groups",
    "pairs",
    "parse_instr",
    "recompute",
    "recv",
    "reduce",
    "scatter",
    "send",
]


class Op(str, enum.Enum):
    """The kinds of instruction."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741  backward to the stage inputs only
    W = "W"  # backward to the stage weights only (after I)
    R = "R"  # recompute a forward whose activations were not kept
    SEND = "SEND"
    RECV = "RECV"
    REDUCE = "REDUCE"
    SCATTER = "SCATTER"  # reduce-scatter (average) a stage's gradients into shards (ZeRO)
    GATHER = "GATHER"  # all-gather a stage's parameter shards into full parameters (ZeRO)

    def __repr__(self) -> str:
        return f"Op.{self.name}"


COMPUTE_OPS = frozenset({Op.F, Op.B, Op.I, Op.W, Op.R})
BACKWARD_OPS = frozenset({Op.B, Op.I})  # the ops that produce input gradients
COMM_OPS = frozenset({Op.SEND, Op.RECV})
COLLECTIVE_OPS = frozenset({Op.REDUCE, Op.SCATTER, Op.GATHER})  # over a named group
PAIR_OPS = frozenset({Op.F, Op.B, Op.I})  # the ops an overlapped pair (``&``) holds
IN_PROGRAM_PREFIXES = ("tie:", "replica:")
ACT = "act"
GRAD = "grad"


def in_program(group: str) -> bool:
    """Whether REDUCE ``group`` meets ranks of this program (ties, replicas) rather than the
    same rank of the program's data-parallel copies (``data``, or any other name)."""
    return group.startswith(IN_PROGRAM_PREFIXES)


@dataclass(frozen=True, slots=True)
class Instr:
    """One instruction of one rank.

    ``stage`` is always a stage held by the rank that runs the instruction. For SEND/RECV,
    ``other`` is the stage at the far end of the edge, ``peer`` the rank holding it and ``kind``
    ``"act"`` (forward activation) or ``"grad"`` (its gradient). REDUCE, SCATTER and GATHER
    use ``group``.
    ``joined`` on a SEND/RECV posts the instruction in one group with the one before it
    (text ``+ ``); on an F, B or I it makes the instruction the second half of an overlapped
    pair with the compute instruction right before it (text ``& ``, see :func:`pair_of`).
    """

    op: Op
    stage: int
    microbatch: int = -1
    kind: str = ""
    other: int = -1
    peer: int = -1
    group: str = ""
    joined: bool = False

    def __post_init__(self) -> None:
        # canonical form: fields an op does not use are blank, so equal text means equal value
        fix = object.__setattr__
        if self.op in COMM_OPS:
            if self.group:
                fix(self, "group", "")
            if self.joined is not True and self.joined is not False:
                fix(self, "joined", bool(self.joined))
            return
        if self.op in COLLECTIVE_OPS:
            blank = {"kind": "", "other": -1, "peer": -1, "joined": False}
            if self.op is not Op.SCATTER or self.microbatch < 0:  # (ZeRO-2's carry one)
                blank["microbatch"] = -1
        else:
            blank = {"kind": "", "other": -1, "peer": -1, "group": ""}
            if self.op not in PAIR_OPS:
                blank["joined"] = False
            elif self.joined is not True and self.joined is not False:
                fix(self, "joined", bool(self.joined))
        for name, value in blank.items():
            if getattr(self, name) != value:
                fix(self, name, value)

    @property
    def edge(self) -> tuple[int, int]:
        """(producer stage, consumer stage) of the data a SEND/RECV moves."""
        if self.op not in COMM_OPS:
            raise ValueError(f"{self} is not a SEND/RECV and has no edge")
        local_produces = (self.op is Op.SEND) == (self.kind == ACT)
        return (self.stage, self.other) if local_produces else (self.other, self.stage)

    @property
    def key(self) -> tuple[str, tuple[int, int], int]:
        """What a SEND/RECV carries: (kind, edge, microbatch); equal on both ends of a message."""
        return (self.kind, self.edge, self.microbatch)

    def __str__(self) -> str:
        if self.op in COMPUTE_OPS:
            paired = "& " if self.joined else ""
            return f"{paired}{self.op.value} s{self.stage} m{self.microbatch}"
        if self.op in COLLECTIVE_OPS:
            mb = f" m{self.microbatch}" if self.microbatch >= 0 else ""
            return f"{self.op.value} s{self.stage}{mb} {self.group}"
        p, c = self.edge
        direction = "to" if self.op is Op.SEND else "from"
        joined = "+ " if self.joined else ""
        return (
            f"{joined}{self.op.value} {self.kind} s{p}>s{c} m{self.microbatch} "
            f"{direction} r{self.peer}"
        )

    def join(self, joined: bool = True) -> Instr:
        """This instruction with ``joined`` set: a SEND/RECV posted in one group with the one
        before it, or an F, B or I overlapped with the compute instruction before it."""
        if self.op not in COMM_OPS and self.op not in PAIR_OPS:
            raise ScheduleError(
                f"{self}: only a SEND or RECV joins a communication group, and only an F, B or I "
                "an overlapped pair",
                instruction=self,
                rule="a group holds SEND and RECV instructions only; a pair an F with a B or I",
            )
        return replace(self, joined=joined)

    def __repr__(self) -> str:
        return f"Instr({str(self)!r})"


def forward(stage: int, microbatch: int) -> Instr:
    return Instr(Op.F, stage, microbatch)


def backward(stage: int, microbatch: int) -> Instr:
    return Instr(Op.B, stage, microbatch)


def backward_input(stage: int, microbatch: int) -> Instr:
    return Instr(Op.I, stage, microbatch)


def backward_weight(stage: int, microbatch: int) -> Instr:
    return Instr(Op.W, stage, microbatch)


def recompute(stage: int, microbatch: int) -> Instr:
    return Instr(Op.R, stage, microbatch)


def _comm(
    op: Op, kind: str, edge: tuple[int, int], microbatch: int, peer: int, joined: bool = False
) -> Instr:
    if kind not in (ACT, GRAD):
        raise ScheduleError(f"kind={kind!r}: a message carries 'act' or 'grad'")
    producer, consumer = edge
    local_produces = (op is Op.SEND) == (kind == ACT)
    stage, other = (producer, consumer) if local_produces else (consumer, producer)
    return Instr(op, stage, microbatch, kind=kind, other=other, peer=peer, joined=joined)


def send(
    kind: str, edge: tuple[int, int], microbatch: int, peer: int, *, joined: bool = False
) -> Instr:
    """SEND the ``kind`` data of ``edge=(producer, consumer)`` for ``microbatch`` to rank ``peer``
    (``joined=True``: in one group with the SEND/RECV before it)."""
    return _comm(Op.SEND, kind, edge, microbatch, peer, joined)


def recv(
    kind: str, edge: tuple[int, int], microbatch: int, peer: int, *, joined: bool = False
) -> Instr:
    """RECV the ``kind`` data of ``edge=(producer, consumer)`` for ``microbatch`` from ``peer``
    (``joined=True``: in one group with the SEND/RECV before it)."""
    return _comm(Op.RECV, kind, edge, microbatch, peer, joined)


def reduce(stage: int, group: str) -> Instr:
    """REDUCE the gradients of ``stage`` over the group named ``group`` (``data``, ``tie:wte``…)."""
    return Instr(Op.REDUCE, stage, group=group)


def scatter(stage: int, group: str, microbatch: int = -1) -> Instr:
    """SCATTER the gradients of ``stage`` over ``group`` (``data``): reduce-scatter them,
    averaged, so that each data-parallel copy keeps its shard (ZeRO-1; see
    :mod:`funcpipe.schedule.zero`). With ``microbatch`` (ZeRO-2, ``SCATTER s0 m3 data``): what
    the stage's gradients gathered since its previous SCATTER, through that microbatch's,
    added into the shards."""
    return Instr(Op.SCATTER, stage, microbatch, group=group)


def gather(stage: int, group: str) -> Instr:
    """GATHER the parameters of ``stage`` over ``group`` (``data``): all-gather every copy's
    shards into the full parameters the stage computes with (ZeRO-1)."""
    return Instr(Op.GATHER, stage, group=group)


_COMPUTE_RE = re.compile(r"([FBIWR])\s+s(\d+)\s+m(\d+)")
_PAIRED_RE = re.compile(r"&\s*([FBI])\s+s(\d+)\s+m(\d+)")
_COMM_RE = re.compile(
    r"(\+\s*)?(SEND|RECV)\s+(act|grad)\s+s(\d+)\s*>\s*s(\d+)\s+m(\d+)\s+(to|from)\s+r(\d+)"
)
_REDUCE_RE = re.compile(r"(REDUCE|SCATTER|GATHER)\s+s(\d+)(?:\s+m(\d+))?\s+([A-Za-z_][\w:.\-]*)")
_INSTR_FORMS = (
    "'F s0 m1' (also B, I, W, R), 'SEND act s0>s1 m1 to r1', 'RECV grad s0>s1 m1 from r1', "
    "'REDUCE s0 data' (also SCATTER, GATHER), 'SCATTER s0 m1 data', '+ ' before a SEND/RECV that joins the group of the one before it, and '& ' before an F, B or I overlapped with the one before it"
)


def parse_instr(text: str) -> Instr:
    """Parse the text form of one instruction (the inverse of ``str``)."""
    t = text.strip()
    if m := _COMPUTE_RE.fullmatch(t):
        return Instr(Op(m[1]), int(m[2]), int(m[3]))
    if m := _PAIRED_RE.fullmatch(t):
        return Instr(Op(m[1]), int(m[2]), int(m[3]), joined=True)
    if t.startswith("&"):
        raise ScheduleError(
            f"cannot parse {text!r}: '& ' pairs an F, B or I with the compute instruction before "
            "it (an overlapped pair: 'F s0 m3' then '& B s1 m1'); W, R, SEND, RECV and the "
            "collectives run alone"
        )
    if m := _COMM_RE.fullmatch(t):
        op = Op(m[2])
        want = "to" if op is Op.SEND else "from"
        if m[7] != want:
            raise ScheduleError(
                f"cannot parse {text!r}: a {op.value} names its peer with '{want} rN'"
            )
        return _comm(op, m[3], (int(m[4]), int(m[5])), int(m[6]), int(m[8]), m[1] is not None)
    if t.startswith("+"):
        rest = t[1:].strip()
        if _COMPUTE_RE.fullmatch(rest) or _REDUCE_RE.fullmatch(rest):
            raise ScheduleError(
                f"cannot parse {text!r}: only a SEND or RECV joins a communication group ('+ '); "
                f"write {rest!r} without the '+'"
            )
    if m := _REDUCE_RE.fullmatch(t):
        if m[3] is not None and m[1] != "SCATTER":
            raise ScheduleError(
                f"cannot parse {text!r}: only a SCATTER names a microbatch (ZeRO-2); "
                f"write '{m[1]} s{m[2]} {m[4]}'"
            )
        mb = -1 if m[3] is None else int(m[3])
        return Instr(Op(m[1]), int(m[2]), mb, group=m[4])
    raise ScheduleError(f"cannot parse instruction {text!r}; the forms are {_INSTR_FORMS}")


def groups(instrs: Sequence[Instr]) -> tuple[tuple[int, ...], ...]:
    """The communication groups of one rank's instructions, as tuples of steps, in order.

    A group is a SEND/RECV without ``joined`` followed by the SEND/RECVs joined to it; every
    SEND/RECV is in exactly one group (a lone one in a group of one).
    """
    out: list[list[int]] = []
    for t, i in enumerate(instrs):
        if i.op not in COMM_OPS:
            continue
        if i.joined and out and out[-1][-1] == t - 1:
            out[-1].append(t)
        else:
            out.append([t])
    return tuple(tuple(g) for g in out)


def pairs(instrs: Sequence[Instr]) -> tuple[tuple[int, int], ...]:
    """The overlapped pairs of one rank's instructions: (step of the first half, step of the
    second), in order. The second half is an F, B or I with ``joined`` (text ``& ``) right
    after the compute instruction it is overlapped with; :class:`~funcpipe.schedule.ir.Program`
    checks that a pair is an F with a B or I."""
    return tuple((t - 1, t) for t, i in enumerate(instrs) if i.joined and i.op in PAIR_OPS)


def keep_groups(instrs: Sequence[Instr], keep: Callable[[Instr], bool]) -> tuple[Instr, ...]:
    """The instructions for which ``keep`` is true; what is left of each communication group
    stays one group (a SEND/RECV is joined to the one before it only if both are left of the
    same group), and a pair stays a pair only if both halves are kept."""
    out: list[Instr] = []
    group = -1  # the group of the last instruction kept
    current = -1
    last = -1  # the index in ``instrs`` of the last instruction kept
    for t, i in enumerate(instrs):
        if i.op in COMM_OPS and not i.joined:
            current += 1
        if not keep(i):
            continue
        if i.op in COMM_OPS:
            i = i.join(bool(out) and out[-1].op in COMM_OPS and group == current)
            group = current
        else:
            group = -1
            if i.joined and last != t - 1:  # its other half was dropped: it runs alone
                i = i.join(False)
        out.append(i)
        last = t
    return tuple(out)
