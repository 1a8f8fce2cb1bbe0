"""Zero-bubble schedules: ZB-H1, ZB-H2, ZB-V (Qi et al., ICLR 2024) and DualPipeV (DeepSeek).

They split the backward into I (input gradient, on the critical path between ranks) and W
(weight gradient, needed by nobody downstream) and move the Ws into what would be idle time.

Numbers in the docstrings are what :func:`funcpipe.schedule.simulate.simulate` measures with its
default costs (F = B = W = 1 per stage: I costs 1, W costs 1; comm = 0); the tests pin them.
``p`` is ``ranks``, ``m`` ``microbatches``. Two bubble measures appear:

- the simulator's ``bubble_fraction`` (idle share up to the global makespan). No schedule can do
  better than ``makespan = work + (p - 1) F`` here: the last rank cannot start before the first
  microbatch crossed ``p - 1`` ranks.
- the paper's measure: a rank's *span* (its last end minus its first start) minus its work. The
  paper removes the optimizer's synchronisation ("post-validation"), so consecutive iterations
  overlap and the start offsets ``r F`` are not idle time. "Zero bubble" means every span equals
  the rank's work.
"""

from __future__ import annotations

from collections import deque

from funcpipe.errors import ScheduleError
from funcpipe.schedule.gen_common import (
    build,
    check_bool,
    check_sizes,
    only_microbatches,
    placement_loop,
    placement_v,
)
from funcpipe.schedule.ir import Instr, Op, Program, backward_input, backward_weight, forward
from funcpipe.schedule.overlap import sound_pairs

__all__ = ["dualpipe_v", "zb_h1", "zb_h2", "zbv"]


def zb_h1(*, ranks: int, microbatches: int) -> Program:
    """ZB-H1: 1F1B's memory, a third of its bubble (stage ``r`` on rank ``r``).

    Rank ``r`` runs ``w = min(p - 1 - r, m)`` warm-up forwards, then pairs (F of the next
    microbatch, I of the oldest), then the remaining Is. The first ``r`` Ws on rank ``r`` are
    deferred (the later ranks, which wait least, postpone most); after that every I is followed
    by the W of the oldest deferred microbatch, and the deferred rest run at the end, where they
    fill the drain.

    - ``m >= p``: makespan ``m(F + B + W) + (p - 1)(F + B - W)``, exactly, for any costs with
      ``W <= min(F, B)`` (the paper's regime); with unit costs ``3m + p - 1``, bubble fraction
      ``(p - 1) / (3m + p - 1)``: the least any schedule can have there, and a third of 1F1B's
      ``(p - 1)(F + B + W)`` idle time per rank.
    - ``m < p``: makespan ``2m + 2p - 1``.
    - peak activations ``min(p, m)`` on every rank (1F1B's peak, now on all ranks).
    """
    p, m = check_sizes("zb_h1", ranks, microbatches)
    program = [_zb_h1_rank(p, m, r) for r in range(p)]
    return build("zb-h1", program, placement_loop(p, 1), m)


def _zb_h1_rank(p: int, m: int, r: int) -> list[Instr]:
    w = min(p - 1 - r, m)
    ops = [forward(r, k) for k in range(w)]
    deferred: deque[int] = deque()

    def grad_input(k: int) -> None:
        ops.append(backward_input(r, k))
        deferred.append(k)
        if k >= r:  # the first r Ws stay deferred
            ops.append(backward_weight(r, deferred.popleft()))

    for i in range(m - w):
        ops.append(forward(r, w + i))
        grad_input(i)
    for k in range(m - w, m):
        grad_input(k)
    return ops + [backward_weight(r, k) for k in deferred]


def zb_h2(*, ranks: int, microbatches: int) -> Program:
    """ZB-H2: zero bubble (in the paper's measure) for ``2p - 1`` activations per rank.

    Built by list scheduling on unit costs (F = I = W = 1), stage ``r`` on rank ``r``: whenever
    a rank is free it runs, in this order of preference, the I of its oldest microbatch whose
    gradient has arrived, else the forward of its next microbatch if it has arrived and fewer
    than ``2p - 1`` activations are alive on the rank, else its oldest deferred W. That yields
    the paper's shape: ``min(2(p - 1 - r) + 1, m)`` warm-up forwards on rank ``r`` (the extra
    forwards fill the wait for the first gradient), a steady phase of one F, one I and one W
    per microbatch, and Ws pushed to the tail where they fill the drain (a parallelogram
    instead of 1F1B's trapezoid).

    - every rank's span is exactly ``3m`` (its work: zero bubble) for ``m >= 2p - 1``.
    - makespan ``3m + p - 1`` for ``m >= p``: bubble fraction ``(p - 1) / (3m + p - 1)``, the
      least possible here, as ZB-H1 (which shows its bubble in the span measure instead); never
      longer than ZB-H1 for any ``m``.
    - peak activations ``<= 2p - 1`` on every rank (``2p - 1`` once ``m >= 2p - 1``).
    """
    p, m = check_sizes("zb_h2", ranks, microbatches)
    cap = 2 * p - 1
    f_end: list[list[int]] = [[] for _ in range(p)]  # f_end[r][k]: when F(r, k) finishes
    i_end: list[list[int]] = [[] for _ in range(p)]
    deferred: list[deque[int]] = [deque() for _ in range(p)]
    alive = [0] * p
    free = [0] * p
    program: list[list[Instr]] = [[] for _ in range(p)]
    left = 3 * m * p
    for t in range(3 * m * p + 2 * p):  # a generous bound: some rank works at every step
        for r in range(p):
            if free[r] > t:
                continue
            k, nf = len(i_end[r]), len(f_end[r])
            if (
                k < nf
                and f_end[r][k] <= t
                and (r == p - 1 or (k < len(i_end[r + 1]) and i_end[r + 1][k] <= t))
            ):
                program[r].append(backward_input(r, k))
                i_end[r].append(t + 1)
                deferred[r].append(k)
            elif (
                nf < m
                and alive[r] < cap
                and (r == 0 or (nf < len(f_end[r - 1]) and f_end[r - 1][nf] <= t))
            ):
                program[r].append(forward(r, nf))
                f_end[r].append(t + 1)
                alive[r] += 1
            elif deferred[r]:
                program[r].append(backward_weight(r, deferred[r].popleft()))
                alive[r] -= 1
            else:
                continue
            free[r] = t + 1
            left -= 1
        if not left:
            break
    if left:  # cannot happen: the last rank can always run its next F or I
        raise ScheduleError(
            f"zb_h2: internal error, list scheduling stalled for ranks={p}, microbatches={m}"
        )
    return build("zb-h2", program, placement_loop(p, 1), m)


def zbv(*, ranks: int, microbatches: int, overlap: bool = False) -> Program:
    """ZB-V: two chunks per rank in a V, zero bubble in the paper's measure for ``m >= 2p - 1``.

    V placement (:func:`~funcpipe.schedule.generators.placement_v`): rank ``r`` holds stage
    ``a = r`` on the way down and ``b = 2p - 1 - r`` on the way back, so the loss is on rank 0.
    Rank ``r`` runs:

    1. ``2(p - r) - 1`` forwards of ``a``;
    2. ``r`` times: F ``b``, F ``a``;
    3. ``p - r`` times: F ``b``, I ``b``, W ``b``;
    4. steady, until every forward ran: F ``a`` (while any is left), I ``a``, W ``a``,
       F ``b``, I ``b``, W ``b``;
    5. drain: ``r`` times I ``a``, I ``b`` (their Ws deferred); ``p - r`` times I ``a`` and the
       oldest deferred W ``a``; then the deferred Ws of ``b``, then of ``a``.

    For ``m < 2p - 1`` the schedule for ``2p - 1`` microbatches is generated and the extra
    microbatches dropped (sound: see ``only_microbatches``), so every ``m >= 1`` works.

    - ``m >= 2p - 1``: every rank's span is exactly ``6m`` (zero bubble); makespan
      ``6m + p - 1``, bubble fraction ``(p - 1) / (6m + p - 1)``, the least possible here.
    - peak activations: ``2p`` chunk-stage activations on every rank (``m >= 2p - 1``). A chunk
      stage is half a rank's layers, so that is ``p`` in units of one full rank's activations
      (1F1B's unit): 1F1B's rank-0 peak, balanced over all ranks.
    """
    p, m = check_sizes("zbv", ranks, microbatches)
    check_bool("zbv", "overlap", overlap)
    n = max(m, 2 * p - 1)
    program = [_zbv_rank(p, n, r, overlap) for r in range(p)]
    built = build("zbv", only_microbatches(program, m), placement_v(p), m)
    return sound_pairs(built) if overlap else built


def _zbv_rank(p: int, n: int, r: int, overlap: bool) -> list[Instr]:
    a, b = r, 2 * p - 1 - r
    ops: list[Instr] = []
    done = {(a, Op.F): 0, (b, Op.F): 0, (a, Op.I): 0, (b, Op.I): 0, (a, Op.W): 0, (b, Op.W): 0}

    def run(op: Op, stage: int, paired: bool = False) -> None:
        join = paired and overlap and bool(ops) and ops[-1].op is Op.F
        ops.append(Instr(op, stage, done[(stage, op)], joined=join))
        done[(stage, op)] += 1

    for _ in range(2 * (p - r) - 1):
        run(Op.F, a)
    for _ in range(r):
        run(Op.F, b)
        run(Op.F, a)
    for _ in range(p - r):
        run(Op.F, b)
        run(Op.I, b)
        run(Op.W, b)
    while done[(a, Op.F)] < n or done[(b, Op.F)] < done[(a, Op.F)]:
        if done[(a, Op.F)] < n:
            run(Op.F, a)
        run(Op.I, a, paired=True)  # F a & I a
        run(Op.W, a)
        run(Op.F, b)
        run(Op.I, b, paired=True)  # F b & I b
        run(Op.W, b)
    for _ in range(r):
        run(Op.I, a)
        run(Op.I, b)
    for _ in range(p - r):
        run(Op.I, a)
        run(Op.W, a)
    while done[(b, Op.W)] < n:
        run(Op.W, b)
    while done[(a, Op.W)] < n:
        run(Op.W, a)
    return ops


def dualpipe_v(*, ranks: int, microbatches: int, overlap: bool = False) -> Program:
    """DualPipeV: DeepSeek's DualPipe folded into a V on ``p`` ranks (two chunks per rank).

    V placement, rank ``r`` holds ``a = r`` and ``b = 2p - 1 - r``. DualPipe overlaps the
    forward of one chunk with the backward of the other ("F&B"); the IR has no fused
    instruction, so each overlapped pair is written as the F followed by the full B. Rank ``r``
    runs (Ws always taken oldest first from the queue of split backwards):

    1. ``2(p - 1 - r)`` forwards of ``a``;
    2. ``r + 1`` times: F ``a``, F ``b``;
    3. ``p - 1 - r`` times: I ``b``, a W, F ``b``;
    4. ``m - 2p + r + 1`` times: F ``a`` & B ``b``, then F ``b`` & B ``a``;
    5. ``p - 1 - r`` times: B ``b``, then F ``b`` & B ``a``;
    6. ``r + 1`` times: backward ``b``, backward ``a``; the second half of these split into an
       I whose W is deferred (on odd ranks from the ``b`` of iteration ``(r + 1) // 2``, on
       even ranks from the ``a`` of that iteration);
    7. ``p - 1 - r`` times: a W, I ``a``;
    8. ``r + 1`` Ws.

    For ``m < 2p`` the schedule for ``2p`` microbatches is generated and the extra microbatches
    dropped (sound: see ``only_microbatches``), so every ``m >= 1`` works.

    The table's DualPipe bubble ``(p/2 - 1)(F&B + B - 3W)`` assumes F&B costs less than F + B
    (computation hides communication), which the simulator does not model. Measured here, for
    ``m >= 2p``: makespan ``6m + p - 1`` (bubble fraction ``(p - 1) / (6m + p - 1)``, the least
    possible, as ZB-V); rank ``r``'s span is ``6m + p - 1 - r``; peak activations ``2p + 1``
    chunk-stage activations on every rank (``p + 1/2`` full-rank units; the parameters are not
    doubled, unlike two-direction DualPipe).
    """
    p, m = check_sizes("dualpipe_v", ranks, microbatches)
    check_bool("dualpipe_v", "overlap", overlap)
    n = max(m, 2 * p)
    program = [_dualpipe_v_rank(p, n, r, overlap) for r in range(p)]
    built = build("dualpipev", only_microbatches(program, m), placement_v(p), m)
    return sound_pairs(built) if overlap else built


def _dualpipe_v_rank(p: int, n: int, r: int, overlap: bool) -> list[Instr]:
    a, b = r, 2 * p - 1 - r
    ops: list[Instr] = []
    nxt = {(a, Op.F): 0, (b, Op.F): 0, (a, Op.B): 0, (b, Op.B): 0}  # B counts B and I
    weights: deque[tuple[int, int]] = deque()

    def run(stage: int, op: Op, paired: bool = False) -> None:
        key = (stage, Op.F if op is Op.F else Op.B)
        k = nxt[key]
        nxt[key] = k + 1
        join = paired and overlap and ops[-1].op is Op.F
        ops.append(Instr(op, stage, k, joined=join))
        if op is Op.I:
            weights.append((stage, k))

    def weight() -> None:
        if weights:
            stage, k = weights.popleft()
            ops.append(Instr(Op.W, stage, k))

    for _ in range(2 * (p - 1 - r)):
        run(a, Op.F)
    for _ in range(r + 1):
        run(a, Op.F)
        run(b, Op.F)
    for _ in range(p - 1 - r):
        run(b, Op.I)
        weight()
        run(b, Op.F)
    for _ in range(n - 2 * p + r + 1):
        run(a, Op.F)  # F a & B b
        run(b, Op.B, paired=True)
        run(b, Op.F)  # F b & B a
        run(a, Op.B, paired=True)
    for _ in range(p - 1 - r):
        run(b, Op.B)
        run(b, Op.F)  # F b & B a
        run(a, Op.B, paired=True)
    split = False
    for i in range(r + 1):
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        run(b, Op.I if split else Op.B)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        run(a, Op.I if split else Op.B)
    for _ in range(p - 1 - r):
        weight()
        run(a, Op.I)
    for _ in range(r + 1):
        weight()
    return ops
