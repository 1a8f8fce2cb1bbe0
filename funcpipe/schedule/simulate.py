"""The simulator: predict a program's timeline, makespan, bubble and peak activations.

Every rank runs its instructions in order. A compute instruction starts when its rank is free and
its inputs exist (see :mod:`funcpipe.schedule.analysis`); it lasts its cost. SEND and RECV cost
the rank nothing: a rank posts them (a group at a time) and goes on; a RECV completes when its data
arrives, which :mod:`funcpipe.schedule.p2p` models (``p2p="gloo"``: ``comm`` after the SEND was
posted; ``p2p="nccl"``: ``comm`` after both ends reached the heads of their pair's stream, one
stream per pair of ranks as funcpipe's communicators give: a process group per pair), and the
compute that reads the data waits for it. In a compute-only program data crossing ranks arrives
``comm`` after it was produced. The same run proves there is no deadlock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.schedule.analysis import Analysis, Dep, analyse, fail
from funcpipe.schedule.ir import COMM_OPS, COMPUTE_OPS, Instr, Op, Program, groups, pairs
from funcpipe.schedule.p2p import PAIR, Network, Why, check_layout, check_p2p
from funcpipe.schedule.pairs import PAIR_RULE, not_independent

__all__ = ["Costs", "Event", "Span", "Timeline", "peak_activations", "peak_memory", "simulate"]

CostValue = float | Sequence[float]


def _check_cost(name: str, value: object, *, where: str = "Costs", what: str = "costs") -> None:
    values = list(value) if isinstance(value, Sequence) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise InvalidArgument(f"{where}({name}={value!r}): {what} are finite numbers >= 0")


@dataclass(frozen=True)
class Costs:
    """Per-stage costs: ``f`` forward, ``b`` input-gradient backward, ``w`` weight-gradient
    backward, ``comm`` the latency of one message, ``reduce`` the time of one REDUCE (a SCATTER
    or a GATHER takes half of it: each moves half an all-reduce's bytes), ``full``
    one full backward B (default ``b + w``; on small stages a B is cheaper than its I and W run
    apart, which a measured ``full`` lets the simulator and ``auto`` see). ``f``, ``b``, ``w`` and
    ``full`` may be one number or one per stage.

    ``f_comm`` and ``b_comm`` (one number or one per stage; default 0) are the communication
    *inside* a stage's forward and input-gradient backward (its expert all-to-alls,
    tensor-parallel collectives), during which that computation waits: alone an F costs
    ``f + f_comm`` (an R too: it runs the forward again), an I ``b + b_comm``, a B
    ``full + b_comm``. An overlapped pair (``&``) of F and B (or I) costs
    ``max(f + b, f_comm + b_comm, f + f_comm, b + b_comm)``: each half's communication
    hides behind the other's computation, bounded below by the compute, the communication
    and each half's own chain (the ideal overlap, with the pieces small; the SMs the
    communication kernels take from the computation are not modelled)."""

    f: CostValue = 1.0
    b: CostValue = 1.0
    w: CostValue = 1.0
    comm: float = 0.0
    reduce: float = 0.0
    full: CostValue | None = None
    f_comm: CostValue = 0.0
    b_comm: CostValue = 0.0

    def __post_init__(self) -> None:
        for name in ("f", "b", "w", "comm", "reduce", "full", "f_comm", "b_comm"):
            value = getattr(self, name)
            if name == "full" and value is None:
                continue
            if name in ("comm", "reduce") and isinstance(value, Sequence):
                raise InvalidArgument(f"Costs({name}={value!r}): {name} is one number")
            _check_cost(name, value)
            if isinstance(value, Sequence):
                object.__setattr__(self, name, tuple(float(v) for v in value))

    @classmethod
    def parse(cls, text: str) -> Costs:
        """``"F,B,W[,COMM]"`` as the CLI takes it, e.g. ``"1,1,1"`` or ``"1,2,1,0.1"``."""
        parts = [p.strip() for p in text.split(",")]
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) not in (3, 4):
            raise InvalidArgument(
                f"costs={text!r}: write F,B,W or F,B,W,COMM as numbers, e.g. '1,1,1' or '1,2,1,0.1'"
            )
        return cls(*values)

    def per_stage(self, name: str, program: Program) -> tuple[float, ...]:
        value = getattr(self, name)
        if name == "full" and value is None:
            b, w = self.per_stage("b", program), self.per_stage("w", program)
            return tuple(x + y for x, y in zip(b, w, strict=True))
        return _per_stage(f"Costs({name}=...)", value, program)


def _per_stage(what: str, value: CostValue, program: Program) -> tuple[float, ...]:
    """One number per stage of ``program`` from one number or one per (unreplicated) stage."""
    n = program.n_stages
    if not isinstance(value, Sequence):
        return (float(value),) * n
    owners = program.replica_of or tuple(range(n))
    if len(value) == n:
        return tuple(float(v) for v in value)
    if set(owners) == set(range(len(value))):
        return tuple(float(value[o]) for o in owners)
    raise InvalidArgument(
        f"{what} has {len(value)} values but the program has {n} stages; "
        "give one value per stage (or one number for all)"
    )


@dataclass(frozen=True, slots=True)
class Event:
    """One executed (or simulated) instruction: its rank, step and time span."""

    rank: int
    step: int
    instr: Instr
    start: float
    end: float


@dataclass(frozen=True, slots=True)
class Span:
    """A collective a stage called during a measured step (an expert all-to-all, a
    tensor-parallel reduction): its rank, name and time span; an overlapped pair shows one
    half's in flight while the other computes."""

    rank: int
    name: str
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The predicted (or measured) run of a program; ``spans[r]``: rank r's collectives inside
    its stages (measured timelines only)."""

    program: Program
    events: tuple[tuple[Event, ...], ...]
    costs: Costs = field(default_factory=Costs)
    spans: tuple[tuple[Span, ...], ...] = ()

    @property
    def makespan(self) -> float:
        return max((e.end for r in self.events for e in r), default=0.0)

    @property
    def busy(self) -> tuple[float, ...]:
        """Time each rank computed (F, B, I, W, R): the union of their spans, so an overlapped
        pair's two halves count once where they overlap (simulated, they span the same
        interval; measured, each its own)."""
        out = []
        for r in self.events:
            total, reach = 0.0, -math.inf
            for a, b in sorted((e.start, e.end) for e in r if e.instr.op in COMPUTE_OPS):
                if b > reach:
                    total += b - max(a, reach)
                    reach = b
            out.append(total)
        return tuple(out)

    @property
    def hidden(self) -> float:
        """The time the overlapped pairs saved under :attr:`costs`: for each pair, its two halves
        run alone less the pair (0 without pairs or without in-stage communication)."""
        price = _Prices(self.costs, self.program)
        total = 0.0
        for instrs in self.program.ranks:
            for x, y in pairs(instrs):
                a, b = instrs[x], instrs[y]
                total += price(a) + price(b) - price.pair(a, b)
        return total

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the ranks' time: ``1 - sum(busy) / (ranks * makespan)``."""
        span = self.makespan
        if span <= 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.events) * span)

    @property
    def peak_activations(self) -> tuple[int, ...]:
        return peak_activations(self.program)

    def stats(self) -> dict[str, object]:
        """The JSON-ready summary the CLI prints."""
        p = self.program
        return {
            "name": p.name,
            "ranks": p.n_ranks,
            "stages": p.n_stages,
            "microbatches": p.microbatches,
            "training": p.training,
            "makespan": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "busy": list(self.busy),
            "pairs": sum(len(pairs(r)) for r in p.ranks),
            "hidden": self.hidden,
            "peak_activations": list(self.peak_activations),
        }


def peak_activations(program: Program) -> tuple[int, ...]:
    """Per rank, the most (stage, microbatch) activations alive at once.

    An activation is alive from its F until its last backward (B, or W when the backward is split).
    A stage recomputed with R keeps only its input after F, so it counts from R instead. In an eval
    program an activation dies as soon as every consumer on the same rank ran (it is sent or used).
    """
    recomputed = {(i.stage, i.microbatch) for r in program.ranks for i in r if i.op is Op.R}
    peaks = []
    for instrs in program.ranks:
        live = peak = 0
        for i in instrs:
            key = (i.stage, i.microbatch)
            if (i.op is Op.F and key not in recomputed) or i.op is Op.R:
                live += 1
            elif i.op is Op.B or i.op is Op.W:
                live -= 1
            peak = max(peak, live)
            if not program.training and i.op is Op.F:
                live -= 1  # forward-only: nothing is kept for a backward
        peaks.append(peak)
    return tuple(peaks)


def peak_memory(
    program: Program, activation: CostValue, for_w: CostValue | None = None
) -> tuple[float, ...]:
    """Per rank, the most activation memory the program keeps at once, in the units given.

    ``activation``: what one F of a stage keeps for its backward (bytes of one microbatch), one
    number or one per stage. ``for_w``: what an I leaves for its W (default: all of
    ``activation``, which is :func:`peak_activations` weighted by size; it may be more than
    ``activation``: the gradients I recorded for W come on top of what the graph still holds).
    Walking each rank's instructions in order: F adds ``activation``; B removes it; I removes
    ``activation`` and adds ``for_w``; W removes ``for_w``. A stage recomputed with R counts
    from its R. :func:`funcpipe.measure.profile.measure_memory` measures both on real stages.
    """
    for name, value in (("activation", activation), ("for_w", for_w)):
        if value is not None:
            _check_cost(name, value, where="peak_memory", what="sizes")
    act = _per_stage("peak_memory(activation=...)", activation, program)
    kept = act if for_w is None else _per_stage("peak_memory(for_w=...)", for_w, program)
    recomputed = {(i.stage, i.microbatch) for r in program.ranks for i in r if i.op is Op.R}
    peaks = []
    for instrs in program.ranks:
        live = peak = 0.0
        for i in instrs:
            s = i.stage
            if (i.op is Op.F and (s, i.microbatch) not in recomputed) or i.op is Op.R:
                live += act[s]
            elif i.op is Op.B:
                live -= act[s]
            elif i.op is Op.I:
                live += kept[s] - act[s]
            elif i.op is Op.W:
                live -= kept[s]
            peak = max(peak, live)
            if not program.training and i.op is Op.F:
                live -= act[s]
        peaks.append(peak)
    return tuple(peaks)


class _Prices:
    """What each instruction costs under ``costs`` (see :class:`Costs`)."""

    def __init__(self, costs: Costs, program: Program) -> None:
        self.costs = costs
        self.f, self.b, self.w, self.full, self.f_comm, self.b_comm = (
            costs.per_stage(n, program) for n in ("f", "b", "w", "full", "f_comm", "b_comm")
        )

    def parts(self, i: Instr) -> tuple[float, float]:
        """(compute, communication inside the stage) of a compute instruction."""
        op, s = i.op, i.stage
        if op is Op.F or op is Op.R:
            return self.f[s], self.f_comm[s]
        if op is Op.B:
            return self.full[s], self.b_comm[s]
        if op is Op.I:
            return self.b[s], self.b_comm[s]
        return self.w[s], 0.0

    def __call__(self, i: Instr) -> float:
        op = i.op
        if op is Op.REDUCE:
            return self.costs.reduce
        if op is Op.SCATTER or op is Op.GATHER:
            return self.costs.reduce / 2  # a reduce-scatter or an all-gather: half an all-reduce's
        if op in COMM_OPS:
            return 0.0
        return sum(self.parts(i))

    def pair(self, x: Instr, y: Instr) -> float:
        """An overlapped pair: the ideal overlap of the two halves' compute and communication
        (see :class:`Costs`)."""
        (cx, mx), (cy, my) = self.parts(x), self.parts(y)
        return max(cx + cy, mx + my, cx + mx, cy + my)


def _ready(
    clock: float, deps: Sequence[Dep], finish: dict[tuple[int, int], float], comm: float
) -> float:
    """When an instruction with these (finished) dependencies can start on a rank free at
    ``clock``."""
    ready = clock
    for d in deps:
        ready = max(ready, finish[(d.rank, d.step)] + (comm if d.message else 0.0))
    return ready


def _deadlock(
    analysis: Analysis,
    pc: list[int],
    finish: dict[tuple[int, int], float],
    net: Network,
    p2p: str,
) -> ScheduleError:
    program = analysis.program
    n = program.n_ranks
    for r in range(n):  # a pair that waits for itself: named as such (pairs.not_independent)
        t = pc[r]
        if t + 1 < len(program.ranks[r]) and program.ranks[r][t + 1].joined:
            itself = not_independent(program.ranks, analysis.deps, analysis.meetings, r, t)
            if itself is not None:
                return fail(program, r, itself[0], PAIR_RULE, itself[1])

    def blocked(r: int) -> tuple[int, int] | None:
        return (r, pc[r]) if pc[r] < len(program.ranks[r]) else None

    lines = []
    chains: list[Why] = []
    for r in range(n):
        t = pc[r]
        if t >= len(program.ranks[r]):
            left = [s for (q, s) in net.posted if q == r and (q, s) not in finish]
            if left:
                lines.append(
                    f"  rank {r} has run every instruction but step {min(left)} "
                    f"({program.ranks[r][min(left)]}) never completes"
                )
                chains.append(net.explain((r, min(left)), blocked))
            continue
        deps = analysis.deps.get((r, t), ())
        if t + 1 < len(program.ranks[r]) and program.ranks[r][t + 1].joined:  # (a pair)
            deps = deps + analysis.deps.get((r, t + 1), ())
        waits = [d for d in deps if (d.rank, d.step) not in finish]
        if waits:
            d = waits[0]
            what = f"waits for rank {d.rank}, step {d.step} ({program.ranks[d.rank][d.step]})"
            if (d.rank, d.step) in net.posted:
                chains.append(net.explain((d.rank, d.step), blocked))
        else:
            members = analysis.meetings.get((r, t), ())
            others = [f"rank {mr} step {mt}" for mr, mt in members if (mr, mt) != (r, t)]
            what = "waits for the other members of its REDUCE group: " + ", ".join(others)
        lines.append(f"  rank {r}, step {t} ({program.ranks[r][t]}) {what}")
    stuck = [(r, pc[r]) for r in range(n) if blocked(r) is not None]
    mark = stuck[0] if stuck else min(x for x in net.posted if x not in finish)
    detail = "deadlock; every unfinished rank is blocked:\n" + "\n".join(lines)
    crossed = net.crossed()
    if crossed is not None:
        chains.insert(0, Why(crossed.headline, chains[0].chain if chains else (), crossed.mark))
    if chains:
        why = next((w for w in chains if w.headline), chains[0])
        if why.headline:
            detail = f"deadlock: {why.headline}\n" + "\n".join(lines)
            mark = why.mark
        detail += "\nwho waits for whom:\n" + "\n".join(why.chain)
    rule = (
        "no deadlock under NCCL's point-to-point rules on funcpipe's communicators (a process "
        "group per pair of ranks): one FIFO stream per pair of ranks, both directions; a group's "
        "messages to one peer hold the head of its rank's side until all of them matched; a "
        "SEND and its RECV match only when both are at the heads"
        if p2p == "nccl"
        else "no deadlock: every rank can always make progress"
    )
    return fail(program, mark[0], mark[1], rule, detail)


def simulate(
    program: Program, costs: Costs | None = None, *, p2p: str = "gloo", layout: str = PAIR
) -> Timeline:
    """Run ``program`` on the cost model and return its :class:`Timeline`.

    ``p2p`` is the point-to-point model (:mod:`funcpipe.schedule.p2p`): ``"gloo"`` (default:
    a SEND's data arrives ``comm`` after it is posted) or ``"nccl"`` (a message moves only when
    its SEND and RECV are both at the heads of their ranks' sides of the pair's stream, then
    takes ``comm``). Either way a RECV is *posted* where it stands and only the compute
    instruction that reads its data waits, so a RECV posted a step early costs no wait when
    its data arrives during the compute in between. ``layout`` is the communicator layout
    NCCL's rules apply to: :data:`~funcpipe.schedule.p2p.PAIR`, the one funcpipe's transports
    build (a process group per pair of ranks).

    Raises :class:`~funcpipe.errors.ScheduleError` if the program is unsound (including a
    deadlock under the ``p2p`` rules).
    """
    costs = Costs() if costs is None else costs
    if not isinstance(costs, Costs):
        raise InvalidArgument(f"costs={costs!r}: pass a funcpipe.schedule.Costs")
    p2p = check_p2p(p2p, "simulate")
    layout = check_layout(layout, "simulate")
    analysis = analyse(program)
    price = _Prices(costs, program)
    n = program.n_ranks
    pc = [0] * n
    clock = [0.0] * n
    finish: dict[tuple[int, int], float] = {}
    started: dict[tuple[int, int], float] = {}
    arrived: dict[tuple[int, int], float] = {}
    group_at = [{g[0]: g for g in groups(instrs)} for instrs in program.ranks]
    net = Network(analysis, costs.comm, p2p, finish, layout)
    while True:
        progressed = False
        for r in range(n):
            instrs = program.ranks[r]
            while pc[r] < len(instrs):
                t = pc[r]
                i = instrs[t]
                if i.op in COMM_OPS:  # posted at once, never waits
                    steps = group_at[r][t]
                    net.post(r, steps, clock[r])
                    pc[r] += len(steps)
                    progressed = True
                    continue
                ready = clock[r]
                deps = analysis.deps.get((r, t), ())
                paired = t + 1 < len(instrs) and instrs[t + 1].joined and i.op in COMPUTE_OPS
                if paired:
                    deps = deps + analysis.deps.get((r, t + 1), ())
                if any((d.rank, d.step) not in finish for d in deps):
                    break
                if paired:  # both halves' inputs in, then both at once (as the runtime)
                    ready = _ready(ready, deps, finish, costs.comm)
                    end = ready + price.pair(i, instrs[t + 1])
                    started[(r, t)] = started[(r, t + 1)] = ready
                    finish[(r, t)] = finish[(r, t + 1)] = clock[r] = end
                    pc[r] += 2
                    progressed = True
                    continue
                ready = _ready(ready, deps, finish, costs.comm)
                members = analysis.meetings.get((r, t))
                if members:
                    arrived[(r, t)] = ready
                    if any(m not in arrived for m in members):
                        break
                    start = max(arrived[m] for m in members)
                    for mr, mt in members:
                        end = start + price(program.ranks[mr][mt])
                        started[(mr, mt)] = start
                        finish[(mr, mt)] = clock[mr] = end
                        pc[mr] += 1
                    progressed = True
                    continue
                started[(r, t)] = ready
                finish[(r, t)] = clock[r] = ready + price(i)
                pc[r] += 1
                progressed = True
        if net.progress():
            progressed = True
        if all(pc[r] == len(program.ranks[r]) for r in range(n)) and not net.pending:
            break
        if not progressed:
            raise _deadlock(analysis, pc, finish, net, p2p)
    events = tuple(
        tuple(
            Event(
                r, t, i, net.posted[(r, t)] if i.op in COMM_OPS else started[(r, t)], finish[(r, t)]
            )
            for t, i in enumerate(instrs)
        )
        for r, instrs in enumerate(program.ranks)
    )
    return Timeline(program=program, events=events, costs=costs)
