"""How fast and how big a candidate of :func:`funcpipe.schedule.auto.auto` is, and the local
search that shortens it.

:func:`_timing` times per-rank orders as :func:`funcpipe.schedule.simulate.simulate` does,
without its checks (for speed); :func:`_peak` and :func:`_fits` weigh a rank's memory;
:func:`_improve` hill-climbs on swaps of neighbours on a critical path (the third source of
candidates in :mod:`funcpipe.schedule.auto`'s docstring). Private to ``auto`` (its names keep
their underscores).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from funcpipe.schedule.problem import OP_B, OP_F, OP_I, OP_W, Order, Problem


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
