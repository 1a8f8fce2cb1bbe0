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

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from funcpipe.errors import InvalidArgument, ScheduleError
from funcpipe.schedule import exact as solver
from funcpipe.schedule.gen_common import check_int, placement_loop, placement_v
from funcpipe.schedule.generators import generate
from funcpipe.schedule.ir import Instr, Program
from funcpipe.schedule.problem import OP_B, OP_F, OP_I, OP_W, OPS, Order, Problem
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


def minimum_activations(*, chunks: int) -> int:
    """The fewest activations any training schedule keeps on a rank holding ``chunks`` stages.

    One microbatch's forward passes through every stage of the rank before the backward of the
    deepest of them, and each activation lives until its own backward, so all ``chunks`` are
    alive at once on every rank.
    """
    return check_int("minimum_activations", "chunks", chunks)


@dataclass(frozen=True)
class _Policy:
    first: str = "alt"  # "I", "F" or "alt": which runs first when both can
    f_order: str = "deep"  # whose F: "deep" (highest stage) | "new" (entry stage first)
    i_order: str = "deep"  # whose I: "deep" (highest stage) | "old" (oldest microbatch)
    alpha: float = 0.0  # a W runs if the gap to the next known arrival >= alpha * W
    wait_i: bool = False  # no F when an I arrives before that F would end


def _policies(v: int) -> list[_Policy]:
    """The policies tried (picked on a grid of sizes, costs and limits: each wins somewhere)."""
    if v == 1:  # one stage per rank: the chunk orders do not matter
        return [
            _Policy(first=first, wait_i=wait, alpha=alpha)
            for alpha in (0.0, 1.0)
            for first in ("alt", "I")
            for wait in (False, True)
        ] + [_Policy(first="F"), _Policy(first="F", wait_i=True)]
    return [
        _Policy(),
        _Policy(wait_i=True),
        _Policy(i_order="old"),
        _Policy(i_order="old", wait_i=True),
        _Policy(f_order="new", wait_i=True),
        _Policy(alpha=1.0),
        _Policy(first="I"),
        _Policy(first="I", wait_i=True),
        _Policy(first="I", i_order="old"),
        _Policy(first="I", i_order="old", wait_i=True),
        _Policy(first="F", i_order="old"),
        _Policy(first="F", wait_i=True),
    ]


# ------------------------------------------------------------------------------ list scheduler
class _Rank:
    """Per-rank state of the list scheduler."""

    def __init__(self, problem: Problem, r: int) -> None:
        self.stages = problem.local(r)
        self.entry = self.stages[0]
        self.free = 0.0
        self.alive = 0.0
        self.cap = problem.cap[r]
        self.weight = problem.weight
        self.after_i = problem.after_i
        self.next_f = dict.fromkeys(self.stages, 0)
        self.next_i = dict.fromkeys(self.stages, 0)
        self.weights: deque[tuple[int, int]] = deque()
        # admitted microbatches in order: [alive memory here, memory of the forwards still to
        # run here, activations alive + forwards to run (to know when it is done)]
        self.admitted: dict[int, list[float]] = {}
        self.out: list[tuple[int, int, int]] = []
        self.last = OP_W  # the last F or I run (for the alternating policy)

    def fits(self, s: int, k: int) -> bool:
        """Whether the activation of stage ``s``, microbatch ``k`` leaves every admitted
        microbatch able to finish, in order, within the cap (the banker's check of the module
        docstring)."""
        need = self.weight(s)
        if self.alive + need > self.cap:
            return False
        if len(self.stages) == 1:
            return True
        suffix = self.alive
        for j, (alive, todo, _) in self.admitted.items():
            if j == k:
                break
            if suffix + todo + need > self.cap:
                return False
            suffix -= alive
        return True

    def admit(self, s: int, k: int) -> None:
        """F of stage ``s``, microbatch ``k`` ran here."""
        w = self.weight(s)
        self.alive += w
        if s == self.entry:
            rest = [self.weight(q) for q in self.stages if q != s]
            self.admitted[k] = [w, sum(rest), 1 + len(rest)]
        else:
            entry = self.admitted[k]
            entry[0] += w
            entry[1] -= w

    def swap(self, s: int, k: int) -> None:
        """I of stage ``s``, microbatch ``k`` ran here: what its W does not need is freed."""
        freed = self.weight(s) - self.after_i(s)
        self.alive -= freed
        self.admitted[k][0] -= freed

    def release(self, s: int, k: int) -> None:
        """W of stage ``s``, microbatch ``k`` ran here."""
        kept = self.after_i(s)
        self.alive -= kept
        entry = self.admitted[k]
        entry[0] -= kept
        entry[2] -= 1
        if entry[2] == 0:
            del self.admitted[k]


def _list_schedule(problem: Problem, policy: _Policy) -> Order:
    p, m, n = problem.p, problem.m, problem.n
    f, b, w, place = problem.f, problem.b, problem.w, problem.placement
    down, up = problem.hops()
    ranks = [_Rank(problem, r) for r in range(p)]
    # when the output of F(s - 1, k) / the input gradient of I(s + 1, k) reaches stage s's rank
    f_in: list[list[float | None]] = [[None] * m for _ in range(n)]
    f_in[0] = [0.0] * m  # the batch is there from the start
    g_in: list[list[float | None]] = [[None] * m for _ in range(n)]
    events: list[tuple[float, int]] = [(0.0, r) for r in range(p)]
    remaining = 3 * n * m
    inf = math.inf

    def run(r: int, t: float, op: int, s: int, k: int) -> None:
        st = ranks[r]
        if op == OP_F:
            end = t + f[s]
            st.next_f[s] += 1
            st.admit(s, k)
            if s + 1 < n:
                f_in[s + 1][k] = end + down[s]
                if place[s + 1] != r:
                    heapq.heappush(events, (end + down[s], place[s + 1]))
            else:
                g_in[s][k] = end  # the loss: the sink's backward may start right away
        elif op == OP_I:
            end = t + b[s]
            st.next_i[s] += 1
            st.swap(s, k)
            st.weights.append((s, k))
            if s > 0:
                g_in[s - 1][k] = end + up[s]
                if place[s - 1] != r:
                    heapq.heappush(events, (end + up[s], place[s - 1]))
        else:
            end = t + w[s]
            st.release(s, k)
        st.out.append((op, s, k))
        if op != OP_W:
            st.last = op
        st.free = end
        heapq.heappush(events, (end, r))

    def decide(r: int, t: float, only_i: bool) -> bool:
        """Run rank ``r``'s next instruction at ``t`` if the policy picks one (with ``only_i``,
        only if it picks an I); whether it ran one."""
        st = ranks[r]
        i_now: list[tuple[tuple[int, int], int, int]] = []
        f_now: list[tuple[tuple[int, int], int, int]] = []
        i_next = f_next = inf
        for s in st.stages:
            k = st.next_i[s]
            if k < st.next_f[s]:
                g = g_in[s][k]
                if g is not None and g <= t:
                    i_now.append(((-s, k) if policy.i_order == "deep" else (k, -s), s, k))
                elif g is not None:
                    i_next = min(i_next, g)
            k = st.next_f[s]
            if k < m:
                a = f_in[s][k]
                if a is not None and st.fits(s, k):
                    if a <= t:
                        f_now.append(((-s, k) if policy.f_order == "deep" else (s, k), s, k))
                    else:
                        f_next = min(f_next, a)
        i_first = st.last != OP_I if policy.first == "alt" else policy.first == "I"
        if i_now and (i_first or not f_now):
            _, s, k = min(i_now)
            run(r, t, OP_I, s, k)
            return True
        if only_i:
            return False
        if f_now:
            _, s, k = min(f_now)
            if not (policy.wait_i and i_next < t + f[s]):
                run(r, t, OP_F, s, k)
                return True
        if st.weights:
            s, k = st.weights[0]
            gap = min(i_next, f_next) - t
            if gap == inf or gap >= policy.alpha * w[s]:
                st.weights.popleft()
                run(r, t, OP_W, s, k)
                return True
        return False  # idle: an arrival (already queued) wakes the rank

    while remaining:
        if not events:
            raise ScheduleError(
                f"auto: internal error, list scheduling stalled ({remaining} instructions left) "
                f"with {policy}; please report it with the arguments"
            )
        # every rank free at the next event time decides; those picking an I go first, so the
        # others know when that gradient arrives
        t, r = heapq.heappop(events)
        due = {r}
        while events and events[0][0] == t:
            due.add(heapq.heappop(events)[1])
        free = [q for q in sorted(due) if ranks[q].free <= t]
        ran = [decide(q, t, True) for q in free]
        remaining -= sum(ran)
        for q, done in zip(free, ran, strict=True):
            if not done:
                remaining -= decide(q, t, False)
    return [st.out for st in ranks]


# ------------------------------------------------------------------------------ fast timing
@dataclass
class _Timing:
    """When every instruction of a compute-only chain program ends, as the simulator says."""

    end: list[list[float]]  # end[r][t]
    f_at: list[list[tuple[int, int]]]  # f_at[s][k]: (rank, step) of F(s, k)
    i_at: list[list[tuple[int, int]]]  # i_at[s][k]: (rank, step) of I or B (s, k)
    makespan: float
    total: float  # sum of the ranks' finish times: breaks ties between equal makespans


def _timing(problem: Problem, order: Order) -> _Timing | None:
    """ASAP timing of per-rank orders, as ``simulate`` computes it (None on deadlock)."""
    n, m = problem.n, problem.m
    f, b, w = problem.f, problem.b, problem.w
    down, up = problem.hops()
    nowhere = (-1, -1)
    f_at = [[nowhere] * m for _ in range(n)]
    i_at = [[nowhere] * m for _ in range(n)]
    end = [[0.0] * len(x) for x in order]
    pc = [0] * len(order)
    clock = [0.0] * len(order)
    waiting: dict[tuple[int, int, int], int] = {}  # (op, stage, microbatch) -> blocked rank
    todo = list(range(len(order)))
    while todo:
        r = todo.pop()
        instrs, ends = order[r], end[r]
        t, now = pc[r], clock[r]
        while t < len(instrs):
            op, s, k = instrs[t]
            if op == OP_F:
                if s > 0:
                    q, u = f_at[s - 1][k]
                    if q < 0:
                        waiting[(OP_F, s - 1, k)] = r
                        break
                    a = end[q][u] + down[s - 1]
                    if a > now:
                        now = a
                now += f[s]
                f_at[s][k] = (r, t)
                if waiting and (OP_F, s, k) in waiting:
                    todo.append(waiting.pop((OP_F, s, k)))
            elif op == OP_W:
                now += w[s]
            else:
                if s + 1 < n:
                    q, u = i_at[s + 1][k]
                    if q < 0:
                        waiting[(OP_I, s + 1, k)] = r
                        break
                    a = end[q][u] + up[s + 1]
                    if a > now:
                        now = a
                now += problem.full[s] if op == OP_B else b[s]
                i_at[s][k] = (r, t)
                if waiting and (OP_I, s, k) in waiting:
                    todo.append(waiting.pop((OP_I, s, k)))
            ends[t] = now
            t += 1
        pc[r], clock[r] = t, now
    if any(t < len(x) for t, x in zip(pc, order, strict=True)):
        return None
    return _Timing(end, f_at, i_at, max(clock), sum(clock))


def _peak(instrs: Sequence[tuple[int, int, int]], problem: Problem | None = None) -> float:
    """A rank's peak memory: each F adds its stage's weight (1 without ``problem``), an I
    keeps of it what the W needs, a W or B frees the rest."""
    live = peak = 0.0
    for op, s, _ in instrs:
        if problem is None:
            live += 1.0 if op == OP_F else 0.0 if op == OP_I else -1.0
        elif op == OP_F:
            live += problem.weight(s)
        elif op == OP_I:
            live -= problem.weight(s) - problem.after_i(s)
        elif op == OP_W:
            live -= problem.after_i(s)
        else:
            live -= problem.weight(s)
        peak = max(peak, live)
    return peak


def _fits(problem: Problem, order: Order) -> bool:
    return all(_peak(x, problem) <= c + 1e-9 for x, c in zip(order, problem.cap, strict=True))


def _critical_swaps(problem: Problem, order: Order, tm: _Timing) -> list[tuple[int, int]]:
    """Neighbours (rank, t), (rank, t + 1) on a critical path where t delays t + 1: swapping
    them is the only kind of move that can shorten that path."""
    f, b, w = problem.f, problem.b, problem.w
    down, up = problem.hops()
    r, t = max(
        ((q, len(x) - 1) for q, x in enumerate(order) if x), key=lambda rt: tm.end[rt[0]][rt[1]]
    )
    out = []
    while True:
        op, s, k = order[r][t]
        cost = (f[s], b[s], w[s], problem.full[s])[op]
        start = tm.end[r][t] - cost
        arrive, source = 0.0, None
        if op == OP_F and s > 0:
            source = tm.f_at[s - 1][k]
            arrive = tm.end[source[0]][source[1]] + down[s - 1]
        elif op in (OP_I, OP_B) and s + 1 < problem.n:
            source = tm.i_at[s + 1][k]
            arrive = tm.end[source[0]][source[1]] + up[s + 1]
        before = tm.end[r][t - 1] if t > 0 else 0.0
        if t > 0 and before >= arrive and before >= start - 1e-9 * max(1.0, abs(start)):
            if order[r][t - 1][1:] != (s, k):  # F before its I, I before its W: keep
                out.append((r, t - 1))
            t -= 1
        elif source is not None and arrive > 0:
            r, t = source
        else:
            return out


def _improve(problem: Problem, order: Order, *, budget: int) -> None:
    """Hill-climb on critical swaps while (makespan, sum of the ranks' finish times)
    decreases and every rank stays within its limit; changes ``order`` in place."""
    tm = _timing(problem, order)
    while tm is not None and budget > 0:
        for r, t in _critical_swaps(problem, order, tm):
            budget -= 1
            instrs = order[r]
            instrs[t], instrs[t + 1] = instrs[t + 1], instrs[t]
            if _peak(instrs, problem) <= problem.cap[r] + 1e-9:
                new = _timing(problem, order)
                if new is not None and (new.makespan, new.total) < (tm.makespan, tm.total):
                    tm = new
                    break
            instrs[t], instrs[t + 1] = instrs[t + 1], instrs[t]
            if budget <= 0:
                return
        else:
            return


# ------------------------------------------------------------------------------ the search
def _problem(
    ranks: object,
    microbatches: object,
    chunks: object,
    placement: object,
    costs: object,
    max_activations: object,
    max_memory: object = None,
    memory: object = None,
) -> Problem:
    p = check_int("auto", "ranks", ranks)
    m = check_int("auto", "microbatches", microbatches)
    kind = placement.lower() if isinstance(placement, str) else None
    if kind not in ("loop", "v"):
        raise InvalidArgument(
            f"auto: placement={placement!r}; use 'loop' (stage s on rank s % ranks) or 'v' "
            "(two chunks per rank in a V, as ZB-V)"
        )
    if kind == "v":
        v = 2 if chunks is None else check_int("auto", "chunks", chunks)
        if v != 2:
            raise InvalidArgument(
                f"auto: chunks={chunks!r} with placement='v'; the V placement holds exactly 2 "
                "chunks per rank (pass chunks=2 or leave it out, or use placement='loop')"
            )
        stage_rank = placement_v(p)
    else:
        v = 1 if chunks is None else check_int("auto", "chunks", chunks)
        stage_rank = placement_loop(p, v)
    n = p * v
    if costs is None:
        costs = Costs()
    if not isinstance(costs, Costs):
        raise InvalidArgument(
            f"auto: costs={costs!r}; pass a funcpipe.schedule.Costs (e.g. Costs(f=1, b=2, w=1), "
            "or the result of funcpipe.profile_stages)"
        )
    per: dict[str, tuple[float, ...]] = {}
    for name in ("f", "b", "w", "full"):
        value = getattr(costs, name)
        if value is None:  # full: b + w
            per[name] = tuple(x + y for x, y in zip(per["b"], per["w"], strict=True))
            continue
        if isinstance(value, Sequence):
            if len(value) != n:
                raise InvalidArgument(
                    f"auto: costs.{name} has {len(value)} value(s) but {p} ranks x {v} chunk(s) "
                    f"make {n} stages; give one value per stage (stage s in model order) or one "
                    "number for all"
                )
            per[name] = tuple(float(x) for x in value)
        else:
            per[name] = (float(value),) * n
    least = minimum_activations(chunks=v)
    if max_activations is None:
        cap = (m * v,) * p
    elif isinstance(max_activations, Sequence) and not isinstance(max_activations, str):
        if len(max_activations) != p:
            raise InvalidArgument(
                f"auto: max_activations={list(max_activations)!r} has {len(max_activations)} "
                f"value(s) for ranks={p}; give one limit per rank, or one int for all"
            )
        cap = tuple(
            _limit(x, least, f"max_activations[{r}]") for r, x in enumerate(max_activations)
        )
    else:
        limit = _limit(max_activations, least, "max_activations")
        cap = (limit,) * p
    caps: tuple[float, ...] = tuple(min(c, m * v) for c in cap)
    weights: tuple[float, ...] = ()
    kept: tuple[float, ...] = ()
    if max_memory is not None or memory is not None:
        if max_activations is not None:
            raise InvalidArgument(
                "auto: give max_activations (a count of activations) or max_memory (bytes, with "
                "memory=), not both"
            )
        weights, kept, caps = _memory_limit(max_memory, memory, p, stage_rank)
    return Problem(
        p,
        m,
        v,
        kind,
        stage_rank,
        per["f"],
        per["b"],
        per["w"],
        costs.comm,
        caps,
        per["full"],
        weights,
        kept,
    )


def _memory_limit(
    max_memory: object, memory: object, p: int, placement: Sequence[int]
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...]]:
    """Each stage's weight (what its F holds until its I: max(activation, for_w)), what stays
    from its I to its W (for_w), and each rank's cap, from ``auto(max_memory=...,
    memory=...)``."""
    n = len(placement)
    if memory is None:
        raise InvalidArgument(
            "auto: max_memory needs memory=, each stage's activation bytes in model order (e.g. "
            "funcpipe.measure_memory(stages, params, example))"
        )
    if max_memory is None:
        raise InvalidArgument(
            "auto: memory= is used with max_memory=, the most activation bytes a rank may keep; "
            "pass both (or max_activations alone)"
        )
    if hasattr(memory, "activation") and hasattr(memory, "for_w"):
        act, kept = list(memory.activation), list(memory.for_w)
    elif isinstance(memory, Sequence) and not isinstance(memory, str):
        act = kept = list(memory)
    else:
        raise InvalidArgument(
            f"auto: memory={memory!r}; pass a StageMemory (funcpipe.measure_memory) or "
            "one number of bytes per stage"
        )
    for name, values in (("activation", act), ("for_w", kept)):
        if len(values) != n or not all(_size(x) for x in values):
            raise InvalidArgument(
                f"auto: memory {name}={values!r}; give one number >= 0 per stage ({n} stages, "
                "model order)"
            )
    weights = tuple(max(float(a), float(k)) for a, k in zip(act, kept, strict=True))
    if isinstance(max_memory, Sequence) and not isinstance(max_memory, str):
        limits = list(max_memory)
        if len(limits) != p:
            raise InvalidArgument(
                f"auto: max_memory={limits!r} has {len(limits)} value(s) for ranks={p}; give "
                "one limit per rank, or one number for all"
            )
    else:
        limits = [max_memory] * p
    caps = []
    for r, x in enumerate(limits):
        if not _size(x):
            raise InvalidArgument(f"auto: max_memory={max_memory!r}; a limit is a number >= 0")
        least = sum(weights[s] for s, q in enumerate(placement) if q == r)
        if float(x) < least:
            raise InvalidArgument(
                f"auto: max_memory={max_memory!r} leaves rank {r} {x}, below what any schedule "
                f"needs there: one microbatch through all of its stages keeps {least:g} (each "
                "stage's max(activation, for_w)); pass at least that"
            )
        caps.append(float(x))
    return weights, tuple(float(k) for k in kept), tuple(caps)


def _size(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, int | float) and math.isfinite(x) and x >= 0


def _limit(value: object, least: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(
            f"auto: {name}={value!r}; a limit is a whole number of (stage, microbatch) "
            "activations per rank (as peak_activations counts them)"
        )
    if value < least:
        raise InvalidArgument(
            f"auto: {name}={value!r} is below what any schedule needs: a rank holding {least} "
            f"stage(s) keeps the activation(s) of all {least} alive at once for each "
            f"microbatch, before the first of their backwards; pass {name} >= {least}"
        )
    return value


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
    simulate(winner, Costs() if costs is None else costs)  # the checker's proof, as a last word
    return winner


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
