"""An exact refinement of :func:`funcpipe.schedule.auto.auto`: a mixed-integer program.

``auto`` is a heuristic. Given a time budget and SciPy (its ``milp``, the HiGHS solver), this
module states the same problem exactly and asks the solver for a shorter program than the
heuristic's best:

- every instruction of every rank (F, then I and W for a stage with a weight cost, else one B)
  gets a start time; it ends its duration later;
- an F waits for the previous stage's F of its microbatch, an I (or B) for the next stage's I
  of its microbatch (the last stage's for its own F), plus the message latency when the two
  stages are on different ranks; a W waits for its own I;
- two instructions of one rank never overlap: for each pair whose order is not already implied
  by the dependencies, a binary says which comes first (big-M constraints, M = the heuristic's
  makespan, which also bounds the objective);
- a stage's Fs run in microbatch order, and so do its Is (the order the messages are sent in);
- before each F of a rank, the activations alive (its Fs so far minus its Ws / Bs so far,
  plus this one; each weighted by its stage's memory with ``auto(max_memory=...)``) stay
  within the rank's limit; the count only grows at an F, so that bounds the peak;
- the objective is the makespan.

The solver's start times give each rank's order; the program is timed and checked like every
other candidate and kept only if it is strictly better. A solver that runs out of time returns
the best program it found, if any. The relaxation is weak: on benchmarks/auto_exact.py's grid
V problems of 24 instructions per rank were proved optimal in 10 of 12, of 36 in none within
20 s; the result is then only as good as what the solver found.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from funcpipe.errors import InvalidArgument
from funcpipe.schedule.problem import OP_B, OP_F, OP_I, OP_W, Order, Problem

__all__ = ["MAX_PAIRS", "available", "refine"]


def available() -> bool:
    """SciPy's ``milp`` (SciPy >= 1.9) can be imported."""
    try:
        from scipy.optimize import milp  # noqa: F401
    except ImportError:
        return False
    return True


def require(name: str) -> None:
    """Raise a clear error if the solver is missing."""
    if not available():
        raise InvalidArgument(
            f"{name}: the exact refinement needs SciPy >= 1.9 (scipy.optimize.milp, the HiGHS "
            "solver), which is not installed; `pip install scipy`, or leave exact out"
        )


MAX_PAIRS = 50_000
"""The most instruction pairs (summed over ranks) :func:`refine` states a program for; beyond
that building it takes longer than the solver could use, and HiGHS proves nothing in seconds."""


def pairs_bound(problem: Problem) -> int:
    """An upper bound on the program's binaries: pairs of instructions on one rank."""
    per_stage = [problem.m * (3 if problem.w[s] > 0 else 2) for s in range(problem.n)]
    total = 0
    for r in range(problem.p):
        k = sum(per_stage[s] for s in problem.local(r))
        total += k * (k - 1) // 2
    return total


def refine(problem: Problem, incumbent: float, *, time_limit: float) -> Order | None:
    """Per-rank orders from the solver with a makespan at most ``incumbent`` (the heuristic's),
    or None if it found none within ``time_limit`` seconds or the problem is too large
    (:data:`MAX_PAIRS`; a warning says so)."""
    bound = pairs_bound(problem)
    if bound > MAX_PAIRS:
        warnings.warn(
            f"auto: exact refinement skipped: up to {bound} instruction pairs (more than "
            f"{MAX_PAIRS}) is too large a program for the solver; the heuristic's program is "
            "returned (use fewer microbatches or ranks for an exact answer)",
            stacklevel=4,  # the caller of auto
        )
        return None
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    n, m = problem.n, problem.m
    down, up = problem.hops()
    scale = max([*problem.f, *problem.b, *problem.w, *problem.full, problem.comm, 1e-30])
    horizon = incumbent / scale

    # ---- instructions: (op, stage, microbatch), their rank and duration
    split = [problem.w[s] > 0 for s in range(n)]
    instrs: list[tuple[int, int, int]] = []
    for s in range(n):
        for k in range(m):
            instrs.append((OP_F, s, k))
            instrs += [(OP_I, s, k), (OP_W, s, k)] if split[s] else [(OP_B, s, k)]
    index = {x: j for j, x in enumerate(instrs)}
    dur = []
    for op, s, _ in instrs:
        d = {OP_F: problem.f, OP_I: problem.b, OP_W: problem.w, OP_B: problem.full}[op][s]
        dur.append(d / scale)
    rank = [problem.placement[s] for _, s, _ in instrs]
    back = [OP_I if split[s] else OP_B for s in range(n)]  # the op that receives the gradient

    # ---- dependencies: (before, after, lag)
    deps: list[tuple[int, int, float]] = []
    for s in range(n):
        bop = back[s]
        for k in range(m):
            f, g = index[(OP_F, s, k)], index[(bop, s, k)]
            if s > 0:
                deps.append((index[(OP_F, s - 1, k)], f, down[s - 1] / scale))
            if s + 1 < n:
                deps.append((index[(back[s + 1], s + 1, k)], g, up[s + 1] / scale))
            deps.append((f, g, 0.0))
            if split[s]:
                deps.append((g, index[(OP_W, s, k)], 0.0))
            if k > 0:  # messages go in microbatch order
                deps.append((index[(OP_F, s, k - 1)], f, 0.0))
                deps.append((index[(bop, s, k - 1)], g, 0.0))
                if split[s]:
                    deps.append((index[(OP_W, s, k - 1)], index[(OP_W, s, k)], 0.0))
    # what the dependencies already order (transitively): no binary for those pairs
    total = len(instrs)
    succ: list[list[int]] = [[] for _ in range(total)]
    for a, b, _ in deps:
        succ[a].append(b)
    topo = _topological(succ)  # every node before all of its successors
    reach = [0] * total  # bit sets
    for j in reversed(topo):
        bits = 0
        for b in succ[j]:
            bits |= (1 << b) | reach[b]
        reach[j] = bits

    def known(a: int, b: int) -> bool:
        return bool(reach[a] >> b & 1)

    # ---- variables: start times, the makespan, one binary per unordered free pair
    start_of = list(range(total))
    cmax = total
    pairs: list[tuple[int, int]] = []
    by_rank: dict[int, list[int]] = {}
    for j, r in enumerate(rank):
        by_rank.setdefault(r, []).append(j)
    for js in by_rank.values():
        for x, a in enumerate(js):
            for b in js[x + 1 :]:
                if not known(a, b) and not known(b, a):
                    pairs.append((a, b))
    ybase = total + 1
    nvar = ybase + len(pairs)
    pair_var = {pair: ybase + q for q, pair in enumerate(pairs)}

    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lo: list[float] = []
    hi: list[float] = []

    def row(terms: Sequence[tuple[int, float]], low: float, high: float) -> None:
        r = len(lo)
        for c, v in terms:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        lo.append(low)
        hi.append(high)

    inf = np.inf
    for a, b, lag in deps:  # S_b - S_a >= d_a + lag
        row([(start_of[b], 1.0), (start_of[a], -1.0)], dur[a] + lag, inf)
    for j in range(total):  # C - S_j >= d_j
        row([(cmax, 1.0), (start_of[j], -1.0)], dur[j], inf)
    # a rank runs one instruction at a time: the makespan is at least the earliest any of its
    # instructions can start, plus all of its work, plus the least any of them leaves to run
    # after it ends (the linear relaxation of the pair constraints alone does not see this;
    # measured on 2 ranks x 3 microbatches in a V, limit 4: unproved after 2 s without it,
    # proved in 0.3 s with it)
    head = [0.0] * total  # earliest start from the dependencies alone
    lags: list[list[tuple[int, float]]] = [[] for _ in range(total)]
    for a, b, lag in deps:
        lags[a].append((b, lag))
    for a in topo:
        for b, lag in lags[a]:
            head[b] = max(head[b], head[a] + dur[a] + lag)
    tail = [0.0] * total  # the longest chain that must run after an instruction ends
    for a in reversed(topo):
        for b, lag in lags[a]:
            tail[a] = max(tail[a], lag + dur[b] + tail[b])
    for js in by_rank.values():
        least = min(head[j] for j in js) + sum(dur[j] for j in js) + min(tail[j] for j in js)
        row([(cmax, 1.0)], least, inf)
    big = horizon
    for (a, b), y in pair_var.items():
        # y = 1: a first (S_b >= S_a + d_a); y = 0: b first (S_a >= S_b + d_b)
        row([(start_of[b], 1.0), (start_of[a], -1.0), (y, -big)], dur[a] - big, inf)
        row([(start_of[a], 1.0), (start_of[b], -1.0), (y, big)], dur[b], inf)

    # memory: before each F, what the rank's Fs so far hold minus what its Is, Ws and Bs so
    # far freed, plus this F, <= cap (1 per F and W / B with a count; with auto(max_memory=...)
    # an F holds its stage's weight, an I frees what its W does not need, a W the rest)
    def held(op: int, s: int) -> float:
        if op == OP_F:
            return problem.weight(s)
        if op == OP_I:
            return problem.after_i(s) - problem.weight(s)
        if op == OP_W:
            return -problem.after_i(s)
        return -problem.weight(s)  # B

    for r, js in by_rank.items():
        cap = problem.cap[r]
        for j in js:
            if instrs[j][0] != OP_F:
                continue
            terms: list[tuple[int, float]] = []
            const = problem.weight(instrs[j][1])
            for i in js:
                sign = held(instrs[i][0], instrs[i][1])
                if i == j or sign == 0.0:
                    continue
                if known(i, j):
                    const += sign
                elif known(j, i):
                    continue
                elif (i, j) in pair_var:  # y = 1: i first
                    terms.append((pair_var[(i, j)], sign))
                else:  # pair (j, i): y = 1 means j first, so i first is 1 - y
                    const += sign
                    terms.append((pair_var[(j, i)], -sign))
            if terms:
                row(terms, -inf, cap - const)
            elif const > cap + 1e-9:
                return None  # cannot happen for a limit auto accepted; be safe

    a_matrix = coo_array((vals, (rows, cols)), shape=(len(lo), nvar)).tocsr()
    c = np.zeros(nvar)
    c[cmax] = 1.0
    lower = np.zeros(nvar)
    upper = np.full(nvar, horizon)
    upper[ybase:] = 1.0
    integrality = np.zeros(nvar)
    integrality[ybase:] = 1
    res = milp(
        c,
        integrality=integrality,
        bounds=Bounds(lower, upper),
        constraints=LinearConstraint(a_matrix, np.array(lo), np.array(hi)),
        options={"time_limit": time_limit, "disp": False},
    )
    if res.x is None:
        return None
    starts = res.x[:total]
    depth = [0] * total  # longest dependency chain before each (breaks ties in start times)
    for a in topo:
        for b in succ[a]:
            depth[b] = max(depth[b], depth[a] + 1)
    order: Order = [[] for _ in range(problem.p)]
    for j in sorted(range(total), key=lambda j: (round(starts[j], 6), depth[j], j)):
        order[rank[j]].append(instrs[j])
    return order


def _topological(succ: list[list[int]]) -> list[int]:
    """Nodes in topological order (every node before all of its successors)."""
    indeg = [0] * len(succ)
    for bs in succ:
        for b in bs:
            indeg[b] += 1
    ready = [j for j, d in enumerate(indeg) if d == 0]
    out: list[int] = []
    while ready:
        j = ready.pop()
        out.append(j)
        for b in succ[j]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    return out


def solver_info() -> dict[str, Any]:
    """The solver this module would use (for benchmark records)."""
    try:
        import scipy
    except ImportError:
        return {"solver": None}
    return {"solver": "scipy.optimize.milp (HiGHS)", "scipy": scipy.__version__}
