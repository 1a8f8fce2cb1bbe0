"""The list scheduler of :func:`funcpipe.schedule.auto.auto`: its policies and its loop.

:func:`_list_schedule` advances time event by event and, whenever a rank is free, lets one
:class:`_Policy` pick among the F, I and W whose inputs have arrived, never exceeding the rank's
memory and never deadlocking (the banker's check of :meth:`_Rank.fits`); :func:`_policies` are
the policies tried. The rules are those of the first source of candidates in
:mod:`funcpipe.schedule.auto`'s docstring. Private to ``auto`` (its names keep their underscores).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

from funcpipe.errors import ScheduleError
from funcpipe.schedule.problem import OP_F, OP_I, OP_W, Order, Problem


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
