"""Automatic schedules: from per-stage costs and a memory limit to the fastest program found.

:func:`auto` searches compute-only programs for ``ranks`` ranks holding ``chunks`` stages each
(loop or V placement) that keep at most ``max_activations`` activations alive per rank, and
returns the one with the shortest simulated makespan. With ``max_memory`` and ``memory``
instead, the limit is in bytes: each F weighs its stage's bytes (an I frees what its W does
not need, a W or B the rest) in every memory check below, and the problem counted in activations is also list-scheduled at a
few counts per rank, keeping the programs that fit the bytes. Three sources of candidates:

1. **List scheduling** over F, I (input gradient) and W (weight gradient), once per *policy*.
   Time advances event by event; whenever a rank is free it picks among the instructions whose
   inputs have arrived:

   - an I or an F first: always the I (the critical path), always the F (fill the pipe), or
     alternately (after an F the I, after an I the F: 1F1B's rhythm, which ZB-H1 keeps);
   - with several chunks, whose F / I: the deepest stage's, or the oldest microbatch's, or
     (for F) the entry stage's (breadth first, as interleaved 1F1B);
   - optionally, no F when an I will arrive before that F would end (wait for the I);
   - a W only when no F or I can run: whenever the rank would idle (``alpha = 0``) or only if
     the next known arrival leaves room for the whole W (``alpha = 1``). Ws are deferred as
     long as memory allows, so they fill the bubbles of the drain (ZB-H1/H2's idea).

   Memory is never exceeded and the scheduler cannot deadlock: an F runs only if, afterwards,
   every microbatch admitted on the rank can still finish in admission order within the
   limit (a banker's check: the oldest needs its remaining forwards on top of everything
   alive, the next its own on top of what stays alive once the oldest is gone, ...), and
   microbatches enter every rank in order, so the oldest unfinished one can always move on.
2. **The built-in generators** of the same placement class (:data:`BUILTINS`) whose peak
   activations fit the limit: ``auto`` is never worse than any of them.
3. **Local search** from the best few: swap two neighbouring instructions of a rank where
   the first delays the second on a critical path, keep the swap if it stays within the
   limit and shortens (makespan, sum of the ranks' finish times); repeat within a budget of
   evaluations that shrinks with the program's size (16 ranks x 64 microbatches: seconds).

Every timing is the simulator's (:func:`funcpipe.schedule.simulate.simulate`, reimplemented
here without the checks for speed; the winner goes through the real checker and simulator).
On the regular cases the candidates already reach the simulator's lower bound
``work + (p - 1) F`` (ZB-H1/H2/V's shapes emerge from the policies). Where they do not (uneven
stages under a tight limit), ``exact=seconds`` hands the problem to a mixed-integer program
(:mod:`funcpipe.schedule.exact`, SciPy's HiGHS) and keeps its program if it is strictly
shorter; that pays on small problems (tens of instructions per rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.schedule import exact as solver
from funcpipe.schedule.auto_list import _list_schedule, _policies
from funcpipe.schedule.auto_problem import _problem, minimum_activations
from funcpipe.schedule.auto_timing import _fits, _improve, _peak, _timing
from funcpipe.schedule.gen_common import check_int
from funcpipe.schedule.generators import generate
from funcpipe.schedule.ir import Instr, Program
from funcpipe.schedule.problem import OP_B, OP_I, OP_W, OPS, Order, Problem
from funcpipe.schedule.simulate import Costs, simulate

__all__ = ["BUILTINS", "auto", "auto_candidates", "minimum_activations"]

BUILTINS: dict[tuple[str, int], tuple[str, ...]] = {
    ("loop", 1): ("1f1b", "zb-h1", "zb-h2", "gpipe"),
    ("loop", 0): ("interleaved", "looped-bfs"),  # 0: any chunks >= 2, passed to the generator
    ("v", 2): ("zbv", "dualpipev"),
}
"""The built-in generators ``auto`` includes as candidates, per (placement, chunks): with one
chunk per rank, 1F1B, ZB-H1, ZB-H2 and GPipe; with ``chunks >= 2`` in loop placement,
interleaved 1F1B and looped BFS (with the same ``chunks``); with the V placement (2 chunks),
ZB-V and DualPipeV. Chimera is not comparable (replicated stages, two entry points)."""


# ------------------------------------------------------------------------------ the search
def _builtins(problem: Problem) -> list[Program]:
    p, m, v = problem.p, problem.m, problem.v
    if problem.kind == "v":
        return [generate(name, ranks=p, microbatches=m) for name in BUILTINS[("v", 2)]]
    if v == 1:
        return [generate(name, ranks=p, microbatches=m) for name in BUILTINS[("loop", 1)]]
    return [generate(name, ranks=p, microbatches=m, chunks=v) for name in BUILTINS[("loop", 0)]]


_POLISHED = 3  # how many of the best distinct candidates the local search starts from
_STEPS = 600_000  # instructions the local search may time in all (under a second)


def auto(
    *,
    ranks: int,
    microbatches: int,
    chunks: int | None = None,
    placement: str = "loop",
    costs: Costs | None = None,
    max_activations: int | Sequence[int] | None = None,
    exact: float | None = None,
    max_memory: float | Sequence[float] | None = None,
    memory: Any = None,
) -> Program:
    """The fastest compute-only program found for these sizes, costs and memory limit.

    Args:
        ranks, microbatches: ``p`` and ``m``.
        chunks: stages per rank: default 1 with ``placement="loop"`` (any ``chunks >= 1``),
            exactly 2 with ``placement="v"`` (the default there).
        placement: ``"loop"`` (stage ``s`` on rank ``s % ranks``) or ``"v"`` (rank ``r`` holds
            stages ``r`` and ``2p - 1 - r``, as ZB-V).
        costs: per-stage :class:`~funcpipe.schedule.simulate.Costs` (``f``, ``b`` the input
            gradient, ``w`` the weight gradient, ``comm`` the message latency): numbers, or one
            value per stage in model order (as :func:`~funcpipe.measure.profile.profile_stages`
            returns them). Default F = B = W = 1, comm = 0.
        max_activations: the most (stage, microbatch) activations a rank may keep at once,
            counted as :func:`~funcpipe.schedule.simulate.peak_activations` does (a chunk
            stage counts 1): one int for every rank, or one per rank; at least ``chunks``
            (:func:`minimum_activations`). Default: no limit.
        exact: seconds for an exact refinement (:mod:`funcpipe.schedule.exact`: a
            mixed-integer program solved by SciPy's HiGHS, which must be installed): the
            solver's program replaces the heuristic's if it is strictly shorter. A problem
            with more than ``exact.MAX_PAIRS`` instruction pairs skips it with a warning.
            Default None: the heuristic alone.
        max_memory, memory: a limit in bytes instead of a count: ``memory`` gives each
            stage's activation bytes for one microbatch (a
            :class:`~funcpipe.schedule.costs.StageMemory` from
            :func:`~funcpipe.measure.profile.measure_memory`, or one number per stage), and
            ``max_memory`` the most a rank may keep (one number, or one per rank). Each F
            holds its stage's ``max(activation, for_w)`` until its I, then ``for_w`` until its
            W (a B frees it all), so the program keeps ``peak_memory(program, activation,
            for_w)[r] <= max_memory[r]``. Not with ``max_activations``.

    Returns a program named ``"auto"`` that passes :func:`~funcpipe.schedule.check.check`,
    keeps ``peak_activations(program)[r] <= max_activations[r]`` on every rank, and whose
    simulated makespan with ``costs`` is at most that of every built-in generator of the same
    placement class (:data:`BUILTINS`) that fits the limit. With F = B = W and
    ``max_activations = ranks`` (1F1B's peak, one chunk) that is ZB-H1's makespan or better,
    for ``m >= p`` a third of 1F1B's idle time. It may mix full backwards (B) with split ones
    (I then W): an I directly followed by its own W becomes one B on the stages whose
    ``costs.full`` is at least 5% below ``b + w`` (closer is within a cost table's noise).
    Deterministic without ``exact``: the same arguments give the same program (a solver
    stopped by its time budget may return a different one from run to run).
    """
    problem = _problem(
        ranks, microbatches, chunks, placement, costs, max_activations, max_memory, memory
    )
    seconds = _seconds(exact)
    best = _search(problem)[0]
    if seconds is not None:
        best = _refined(problem, best, seconds)
    winner = _program(problem, best[3], "auto")
    if costs is not None and _communicates(costs):
        winner = _paired(problem, winner, costs)
    simulate(winner, Costs() if costs is None else costs)  # the checker's proof, as a last word
    return winner


def _communicates(costs: Costs) -> bool:
    """Whether the stages communicate inside (``Costs.f_comm`` or ``b_comm``): pairs can hide it."""
    values = [costs.f_comm, costs.b_comm]
    return any(any(v) if isinstance(v, Sequence) else v > 0 for v in values)


def _paired(problem: Problem, winner: Program, costs: Costs) -> Program:
    """``winner``, or with overlapped pairs where that is faster under ``costs``: the
    :func:`~funcpipe.schedule.overlap.overlap` pass over it, and DualPipeV and ZB-V with their
    own pairs where they fit the memory limit (a pair keeps its program's order, so its peak
    activations)."""
    from funcpipe.schedule.overlap import overlap

    candidates = [winner, overlap(winner).replace(name="auto")]
    if problem.kind == "v":
        for name in ("dualpipev", "zbv"):
            program = generate(name, ranks=problem.p, microbatches=problem.m, overlap=True)
            order = [[(OPS.index(i.op), i.stage, i.microbatch) for i in x] for x in program.ranks]
            if _fits(problem, order):
                candidates.append(program)
    return min(candidates, key=lambda p: simulate(p, costs).makespan)


def _seconds(exact: object) -> float | None:
    if exact is None:
        return None
    if isinstance(exact, bool) or not isinstance(exact, int | float) or not exact > 0:
        raise InvalidArgument(
            f"auto: exact={exact!r}; give the exact solver's time budget in seconds (a number "
            "> 0), or None for the heuristic alone"
        )
    solver.require("auto")
    return float(exact)


def _refined(problem: Problem, best: Scored, seconds: float) -> Scored:
    """``best``, or the exact solver's program if that is valid and strictly better."""
    order = solver.refine(problem, best[0], time_limit=seconds)
    if order is None:
        return best
    out = best
    cheap = _cheap_backwards(problem)
    for candidate in (order, _merge_backwards(order, cheap)) if cheap else (order,):
        tm = _timing(problem, candidate)
        if tm is None or not _fits(problem, candidate):
            continue
        scored = _score(problem, candidate, "auto")
        if scored[:3] >= out[:3]:
            continue
        try:  # the real checker's word (message order), before it is trusted
            simulate(_program(problem, candidate, "auto"), Costs())
        except ScheduleError:
            continue
        out = scored
    return out


def auto_candidates(
    *,
    ranks: int,
    microbatches: int,
    chunks: int | None = None,
    placement: str = "loop",
    costs: Costs | None = None,
    max_activations: int | Sequence[int] | None = None,
    count: int = 4,
    max_memory: float | Sequence[float] | None = None,
    memory: Any = None,
) -> list[Program]:
    """The ``count`` best distinct programs :func:`auto` considered, best first.

    Same arguments as :func:`auto` (plus ``count``); the first is :func:`auto`'s own program.
    Each passes the checker and keeps the memory limit. A candidate that is exactly a built-in
    generator's program carries that generator's name (``"zb-h1"``, ...), the others are named
    ``"auto"``, ``"auto-2"``, ... For choosing by measurement rather than by the simulator's
    word: time them on the real stages with :func:`funcpipe.measure.tune.fastest`.
    """
    k = check_int("auto_candidates", "count", count)
    problem = _problem(
        ranks, microbatches, chunks, placement, costs, max_activations, max_memory, memory
    )
    out: list[Program] = []
    for n, c in enumerate(_search(problem)[:k]):
        name = c[4] if c[4] != "auto" else ("auto" if n == 0 else f"auto-{n + 1}")
        program = _program(problem, c[3], name)
        simulate(program, Costs() if costs is None else costs)
        out.append(program)
    return out


Scored = tuple[float, float, float, Order, str]  # makespan, sum of finishes, peak, order, origin


def _search(problem: Problem) -> list[Scored]:
    """Every distinct candidate found (list schedules, fitting built-ins, their local-search
    improvements, merged backwards), best first."""
    found = [
        _score(problem, _list_schedule(problem, policy), "auto") for policy in _policies(problem.v)
    ]
    for program in _builtins(problem):
        order = [[(OPS.index(i.op), i.stage, i.microbatch) for i in x] for x in program.ranks]
        if _fits(problem, order):
            found.append(_score(problem, order, program.name or "auto"))
    if any(k < w for k, w in zip(problem.kept, problem.weights, strict=True)):
        # Is that free memory: also the search that keeps it all until W (its programs fit
        # here too), so that what an I frees never makes the heuristic's answer worse
        for c in _search(replace(problem, kept=problem.weights)):
            if _fits(problem, c[3]):
                found.append(_score(problem, c[3], c[4]))
    for counted in _counted(problem):  # a limit in bytes: also what counts find, where it fits
        for policy in _policies(problem.v):  # (the local search below polishes the best)
            order = _list_schedule(counted, policy)
            if _fits(problem, order):
                found.append(_score(problem, order, "auto"))
    found.sort(key=lambda c: c[:3])
    starts: list[Scored] = []
    for c in found:
        if len(starts) < _POLISHED and all(c[3] != d[3] for d in starts):
            starts.append(c)
    budget = max(10, _STEPS // (3 * problem.n * problem.m) // len(starts))
    for start in starts:
        order = [list(x) for x in start[3]]
        _improve(problem, order, budget=budget)
        found.append(_score(problem, order, "auto"))
    cheap = _cheap_backwards(problem)
    if cheap:  # a B cheaper than its I and W apart: where W directly follows its I, one B may do
        found.sort(key=lambda c: c[:3])
        for start in [found[0], *starts]:
            found.append(_score(problem, _merge_backwards(start[3], cheap), "auto"))
    found.sort(key=lambda c: c[:3])  # stable: among equals, the earlier found (named) first
    distinct: list[Scored] = []
    seen: dict[tuple[tuple[tuple[int, int, int], ...], ...], int] = {}
    for c in found:
        key = tuple(tuple(x) for x in c[3])
        if key in seen:
            j = seen[key]  # the same program found twice: keep a built-in's name if it has one
            if distinct[j][4] == "auto" and c[4] != "auto":
                m, total, peak, order, _ = distinct[j]
                distinct[j] = (m, total, peak, order, c[4])
            continue
        seen[key] = len(distinct)
        distinct.append(c)
    return distinct


_COUNTED = (0.0, 0.25, 0.5, 0.75, 1.0)
"""For a limit in bytes, the counted searches tried (see :func:`_counted`)."""


def _counted(problem: Problem) -> list[Problem]:
    """For a limit in bytes: the same problem counted in activations, a few times. Each rank's
    count goes from its limit over its stages' largest weight (``theta = 0``: the programs
    always fit the bytes) to its limit over the smallest (``theta = 1``: they may not); the
    caller keeps the programs that fit. Nothing for a counted problem."""
    if not problem.weights:
        return []
    out: list[Problem] = []
    most = problem.m * problem.v
    for theta in _COUNTED:
        caps = []
        for r, cap in enumerate(problem.cap):
            ws = [problem.weight(s) for s in problem.local(r)]
            lo = most if max(ws) <= 0 else cap / max(ws)
            hi = most if min(ws) <= 0 else cap / min(ws)
            count = int(lo + theta * (hi - lo) + 1e-9)
            caps.append(float(min(most, max(problem.v, count))))
        if all(c.cap != tuple(caps) for c in out):
            out.append(replace(problem, cap=tuple(caps), weights=(), kept=()))
    return out


def _program(problem: Problem, order: Order, name: str) -> Program:
    return Program(
        ranks=tuple(tuple(Instr(OPS[op], s, k) for op, s, k in x) for x in order),
        placement=problem.placement,
        microbatches=problem.m,
        name=name,
    )


_MERGE_MARGIN = 0.05
"""A stage's I and W are merged into one B only where its B is measured this much cheaper
than I + W: cost tables are noisy by a few percent, and a merge chosen on a 1% difference ran
2% slower on the large benchmark model (ZB-H1's split stage 0 against the same program with
B's there, 40 paired steps; docs/benchmarks.md, round 6)."""


def _cheap_backwards(problem: Problem) -> frozenset[int]:
    """The stages whose full backward B costs clearly less than its I and W apart."""
    return frozenset(
        s
        for s, (u, x, y) in enumerate(zip(problem.full, problem.b, problem.w, strict=True))
        if u < (1.0 - _MERGE_MARGIN) * (x + y)
    )


def _merge_backwards(order: Order, stages: frozenset[int]) -> Order:
    """Every I of ``stages`` directly followed by its own W, made one B (same memory, fewer
    instructions)."""
    out: Order = []
    for instrs in order:
        merged: list[tuple[int, int, int]] = []
        t = 0
        while t < len(instrs):
            op, s, k = instrs[t]
            if op == OP_I and s in stages and t + 1 < len(instrs) and instrs[t + 1] == (OP_W, s, k):
                merged.append((OP_B, s, k))
                t += 2
                continue
            merged.append(instrs[t])
            t += 1
        out.append(merged)
    return out


def _score(problem: Problem, order: Order, origin: str) -> Scored:
    """(makespan, sum of the ranks' finish times, peak activations, order, where it came
    from): less is better."""
    tm = _timing(problem, order)
    if tm is None:
        raise ScheduleError(
            "auto: internal error, a candidate program deadlocks; please report it with the "
            "arguments"
        )
    return (tm.makespan, tm.total, max(_peak(x, problem) for x in order), order, origin)
