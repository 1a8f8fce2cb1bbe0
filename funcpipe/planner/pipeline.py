"""The pipeline's time and in-flight activations: closed forms, or the simulator.

Closed forms (``F``, ``I``, ``W`` the bottleneck rank's seconds per microbatch, all its chunks
together; ``B = I + W``; ``p`` ranks, ``m`` microbatches, ``v`` chunks per rank), each equal to
:func:`funcpipe.schedule.simulate`'s makespan on balanced stages (tests/plan pins them):

- ``gpipe``, ``1f1b``: ``(m + p - 1)(F + B)``
- ``interleaved``: ``(m + (p - 1)/v)(F + B)``
- ``zb-h1``: ``m(F + B) + (p - 1)(F + I - W)`` (for ``W <= min(F, I)``)
- ``zb-h2``: ``m(F + B) + (p - 1) F``
- ``zbv``: ``m(F + B) + ((p - 1)(F + max(0, I - F)) + (p - 2) max(0, F - I)) / 2``: exact
  where ``I <= F`` or ``W >= I``, else low (by 30% of the fill for ``I = 2F``, ``W = F/2``; the
  search prices its finalists with the simulator, which has no such gap)
- ``dualpipev``: ``m(F + B) + (p - 1) max(F, F + I - W) / 2``: exact where ``I <= F``, else
  low (by at most 5% of the step for ``m >= 2p``, ``I <= 2F``)

Overlapped pairs (``ClusterLayout(overlap=True)``, :data:`~funcpipe.planner.layout.PAIRING`)
have no closed form: :func:`simulated` prices them, the stages' expert all-to-alls given apart
(``f_comm``, ``i_comm``) as :class:`funcpipe.schedule.Costs` takes them, and the program
generated with ``overlap=True``. A pair of an F and a B (or I) costs the ideal overlap
``max(f + b, f_comm + b_comm, f + f_comm, b + b_comm)``; the generators' fill and drain, where a
pair waits for both halves' inputs, are what a closed form would miss (a steady-state form is
up to 26% low at ``m = 2p``). :func:`pipeline_bound` holds for them too, and is what the search
prunes them by.

:func:`simulated` runs the real program instead, with one cost per stage (uneven stages: the
embedding, the output layer): exactly for ``m <= 3p``, else at ``2p`` and ``3p`` microbatches and
extended linearly (a schedule's steady state adds the same time per microbatch), never below
:func:`pipeline_bound`, a lower bound of any run's makespan that the search prunes by.
:func:`activation_floor` is the same for memory: never above :func:`simulated`'s peaks, cheap
enough to filter every candidate of a search by.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from funcpipe.schedule.generators import generate
from funcpipe.schedule.instr import Op
from funcpipe.schedule.ir import Program
from funcpipe.schedule.simulate import Costs, peak_memory, simulate

__all__ = [
    "MAX_SIMULATED",
    "activation_floor",
    "closed_form",
    "in_flight",
    "live_sets",
    "pipeline_bound",
    "placement",
    "program",
    "simulable",
    "simulated",
]

MAX_SIMULATED = 40_000
"""The largest program :func:`simulated` is asked to run, in ranks x microbatches x chunks
(``p x min(m, 3p) x v``): a few seconds on one core (ZB-H2 at 115 ranks, 39,675: 2 to 4 s).
Larger layouts keep their closed-form price (``Estimate.simulated`` is then ``False``)."""


def simulable(p: int, m: int, v: int, limit: int = MAX_SIMULATED) -> bool:
    """Whether the program of ``p`` ranks, ``m`` microbatches and ``v`` chunks per rank is small
    enough to simulate (``p x min(m, 3p) x v <= limit``: the simulator runs at most ``3p``
    microbatches and extrapolates the rest)."""
    return p * min(m, 3 * p) * v <= limit


def closed_form(schedule: str, p: int, m: int, v: int, f: float, i: float, w: float) -> float:
    """Seconds of the pipeline part of a step (see the module docstring)."""
    work = m * (f + i + w)
    if schedule in ("1f1b", "gpipe"):
        return work + (p - 1) * (f + i + w)
    if schedule == "interleaved":
        return work + (p - 1) / v * (f + i + w)
    if schedule == "zb-h1":
        return work + (p - 1) * max(f + i - w, f)
    if schedule == "zb-h2":
        return work + (p - 1) * f
    if schedule == "zbv":  # exact for I <= F or W >= I (see the module docstring)
        return work + ((p - 1) * (f + max(0.0, i - f)) + max(0, p - 2) * max(0.0, f - i)) / 2
    if schedule == "dualpipev":  # exact for I <= F
        return work + (p - 1) * max(f, f + i - w) / 2
    raise ValueError(schedule)


def in_flight(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """Most (chunk, microbatch) activations rank ``rank`` keeps at once, counted until their W
    (closed forms matching :func:`funcpipe.schedule.peak_activations` of the generated programs
    for ``m >= p``)."""
    if schedule == "gpipe":
        return m * v
    if schedule == "1f1b":
        return min(p - rank, m)
    if schedule == "zb-h1":  # a W runs late: every rank holds p until then
        return min(p, m)
    if schedule == "zb-h2":
        return min(2 * p - 1, m)
    if schedule == "interleaved":
        return min((v - 1) * p + 2 * (p - 1 - rank) + 1, m * v)
    if schedule == "zbv":
        return min(2 * p, 2 * m)
    if schedule == "dualpipev":
        return min(2 * p + 1, m + 1 + rank, 2 * m)
    raise ValueError(schedule)


def placement(schedule: str, p: int, v: int) -> tuple[int, ...]:
    """Rank of each of the ``p * v`` stages (loop, or V for ``zbv`` and ``dualpipev``)."""
    if schedule in ("zbv", "dualpipev"):
        return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
    return tuple(s % p for s in range(p * v))


def pipeline_bound(
    schedule: str,
    place: Sequence[int],
    m: int,
    f: Sequence[float],
    i: Sequence[float],
    w: Sequence[float],
    f_comm: Sequence[float] | None = None,
    i_comm: Sequence[float] | None = None,
) -> float:
    """A lower bound of the simulator's makespan for ``m`` microbatches on stages placed on ranks
    as ``place``, with per-stage costs ``f``, ``i``, ``w`` (no message latency: it is in them).

    Each rank runs its ops one at a time: ``m`` x its stages' ``F + I + W``. Nothing on a rank
    starts before a first microbatch's F has passed the stages below its lowest stage ``s``
    (every op of a stage needs its microbatch's F there), and, where a backward is one B
    (``1f1b``, ``interleaved``, ``gpipe``), a rank's last op is a B whose microbatch must still
    go back through the stages below ``s``; the zero-bubble schedules (and ``dualpipev``) can
    end a rank on a W, which nothing waits for. The largest over the ranks. Unlike the closed
    forms, never above the simulated time (tests/plan pins it on every candidate of a search;
    :func:`simulated`'s extrapolation beyond ``3p`` microbatches is held up to it).

    With overlapped pairs (``f_comm``, ``i_comm``: each stage's communication inside its F and
    its I, apart from ``f`` and ``i``) a rank's ops take at least ``m`` x the largest of its
    stages' ``F + I + W``, ``Fc + Ic``, ``F + Fc`` and ``I + Ic`` (a pair costs at least each
    of those of its two halves, an op alone their sum), and a first F still ``f + f_comm``."""
    ranks = max(place) + 1
    fc = [0.0] * len(f) if f_comm is None else f_comm
    ic = [0.0] * len(i) if i_comm is None else i_comm
    lowest = [len(place)] * ranks
    work = [[0.0] * 4 for _ in range(ranks)]
    for s, r in enumerate(place):
        lowest[r] = min(lowest[r], s)
        if f_comm is None:
            work[r][0] += f[s] + i[s] + w[s]
            continue
        for k, x in enumerate((f[s] + i[s] + w[s], fc[s] + ic[s], f[s] + fc[s], i[s] + ic[s])):
            work[r][k] += x
    split = schedule.startswith("zb") or schedule == "dualpipev"
    best = 0.0
    for r in range(ranks):
        s = lowest[r]
        head = sum(f[:s]) + sum(fc[:s])
        tail = 0.0 if split else sum(i[:s]) + sum(w[:s]) + sum(ic[:s])
        best = max(best, head + m * max(work[r]) + tail)
    return best


@lru_cache(maxsize=64)
def program(schedule: str, p: int, m: int, v: int, overlap: bool = False) -> Program:
    """The generator's program (``overlap``: with its overlapped pairs)."""
    chunks = v if schedule == "interleaved" else None
    return generate(schedule, ranks=p, microbatches=m, chunks=chunks, overlap=overlap)


def simulated(
    schedule: str,
    p: int,
    m: int,
    v: int,
    f: Sequence[float],
    i: Sequence[float],
    w: Sequence[float],
    activation: Sequence[float],
    *,
    f_comm: Sequence[float] | None = None,
    i_comm: Sequence[float] | None = None,
) -> tuple[float, tuple[float, ...]]:
    """(seconds, peak activation bytes per rank) from the simulator, per-stage costs given.
    ``f_comm`` and ``i_comm`` (both or neither): the communication inside each stage's F and I
    (its expert all-to-alls, not in ``f`` and ``i``), hidden in the program's overlapped pairs
    (``generate(..., overlap=True)``; ``Costs(f_comm=, b_comm=)``). Cached: a search prices each
    layout at every sharding level, which changes neither."""
    if (f_comm is None) != (i_comm is None):
        raise ValueError("simulated: give f_comm and i_comm together, or neither")
    comm = None if f_comm is None or i_comm is None else (tuple(f_comm), tuple(i_comm))
    return _simulated(schedule, p, m, v, tuple(f), tuple(i), tuple(w), tuple(activation), comm)


@lru_cache(maxsize=4096)
def _simulated(
    schedule: str,
    p: int,
    m: int,
    v: int,
    f: tuple[float, ...],
    i: tuple[float, ...],
    w: tuple[float, ...],
    activation: tuple[float, ...],
    comm: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
) -> tuple[float, tuple[float, ...]]:
    full = [x + y for x, y in zip(i, w, strict=True)]  # one B per backward: I + W
    costs = Costs(f=list(f), b=list(i), w=list(w), full=full)
    if comm is not None:
        costs = Costs(
            f=list(f), b=list(i), w=list(w), full=full, f_comm=list(comm[0]), b_comm=list(comm[1])
        )
    paired = comm is not None

    def run(mb: int) -> tuple[float, tuple[float, ...]]:
        prog = program(schedule, p, mb, v, paired)
        return simulate(prog, costs).makespan, peak_memory(prog, list(activation))

    if m <= 3 * p:
        return run(m)
    t2, peaks = run(2 * p)
    t3, _ = run(3 * p)
    if schedule == "gpipe":  # keeps every microbatch: its peak grows with m
        peaks = tuple(x * m / (2 * p) for x in peaks)
    # the slope from 2p to 3p can be below the steady state's (zbv's: 3% low on 2 ranks), so
    # the extrapolation is held at or above what any run of the program provably takes
    fc, ic = comm if comm is not None else (None, None)
    low = pipeline_bound(schedule, placement(schedule, p, v), m, f, i, w, fc, ic)
    return max(t3 + (t3 - t2) / p * (m - 3 * p), low), peaks


@lru_cache(maxsize=1024)
def live_sets(
    schedule: str, p: int, m: int, v: int
) -> tuple[tuple[tuple[int, ...], tuple[tuple[int, ...], ...]], ...]:
    """Per rank, ``(stages, counts)``: the rank's stages in order, and every maximal vector of
    how many activations of each of them the program keeps alive at once (alive from F until
    B, or W when the backward is split: :func:`funcpipe.schedule.peak_memory`'s rule). Any
    moment's live bytes are at most one of these vectors' weighted sum, and each vector is a
    moment of the program, so the largest weighted sum is the program's peak for any sizes."""
    prog = program(schedule, p, m, v)
    out = []
    for instrs in prog.ranks:
        stages = tuple(sorted({i.stage for i in instrs if i.op is Op.F}))
        index = {s: k for k, s in enumerate(stages)}
        live = [0] * len(stages)
        seen = set()
        for i in instrs:
            if i.op is Op.F or i.op is Op.R:  # planner programs have no R: F starts a life
                live[index[i.stage]] += 1
                seen.add(tuple(live))  # only a rise can make a new maximum
            elif i.op is Op.B or i.op is Op.W:
                live[index[i.stage]] -= 1
        maximal: list[tuple[int, ...]] = []
        for vec in sorted(seen, key=sum, reverse=True):
            if not any(all(a >= b for a, b in zip(top, vec, strict=True)) for top in maximal):
                maximal.append(vec)
        out.append((stages, tuple(maximal)))
    return tuple(out)


def activation_floor(
    schedule: str, p: int, m: int, v: int, activation: Sequence[float]
) -> tuple[float, ...]:
    """:func:`_activation_floor`, cached (every sharding level of a layout asks the same)."""
    return _activation_floor(schedule, p, m, v, tuple(activation))


@lru_cache(maxsize=4096)
def _activation_floor(
    schedule: str, p: int, m: int, v: int, activation: tuple[float, ...]
) -> tuple[float, ...]:
    """Per rank, a lower bound of :func:`simulated`'s peak activation bytes (``activation``: one
    microbatch's bytes per stage), without simulating time.

    One chunk per rank (``v == 1``): :func:`in_flight` x the stage's bytes, the closed form
    equal to the program's peak count (tests/plan pins it). Several: the most bytes of any
    moment of the program (:func:`live_sets`), where the closed form's ``in_flight`` x the
    largest chunk is above it on uneven chunks (and ``in_flight`` itself is off for some ``m``).
    Beyond ``3p`` microbatches the program of ``2p`` is read, as :func:`simulated` does."""
    if v == 1:
        place = placement(schedule, p, v)
        peaks = [0.0] * p
        for s, r in enumerate(place):
            peaks[r] = max(peaks[r], in_flight(schedule, p, m, v, r) * activation[s])
        return tuple(peaks)
    runs = m if m <= 3 * p else 2 * p
    return tuple(
        max(sum(n * activation[s] for n, s in zip(vec, stages, strict=True)) for vec in vecs)
        for stages, vecs in live_sets(schedule, p, runs, v)
    )
